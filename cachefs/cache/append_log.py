"""An append-only file whose writes happen outside the caller's lock.

Why. The SSD tier changes its in-memory index under a `threading.Lock` that the event loop
takes too (`contains`, `has_entry`, `has_room`, `stats` are called on the trio thread). Had a
worker thread appended the index record to disk while holding that lock, the event loop would
wait on the disk. The rule: no lock that the event loop takes is held across I/O. So the tier
only *queues* a record while it holds its lock (`append`, no I/O), which fixes the order of the
records in the file to the order of the changes in memory, and `flush`es after releasing it.

One writer at a time. `flush` writes only while it holds `_write_lock`, which nothing else
takes. A thread that finds the lock taken returns at once and leaves its records to the holder,
which looks at the queue again after releasing the lock; so no thread waits for another's
write, the file gets the records in queue order, and none is left behind. `close` is the only
call that waits for a write in flight.

After a failed write the file may end in a torn record: nothing more is appended (a reader of
the log stops at the first bad record anyway) and `on_error` is told once.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
from collections.abc import Callable


class AppendLog:
    def __init__(self, fd: int, on_error: Callable[[OSError], None]):
        self._fd = fd  # opened with O_APPEND by the caller; closed by `close`
        self._on_error = on_error
        self._queue: collections.deque[bytes] = collections.deque()  # thread-safe appends/pops
        self._write_lock = threading.Lock()  # held across the write; never by the event loop
        self._failed = False

    def append(self, record: bytes) -> None:
        """Queue `record` for the next `flush`. No I/O: callers hold their own lock here."""
        self._queue.append(record)

    def flush(self) -> None:
        """Write what is queued, unless another thread is writing (it writes ours too)."""
        while self._queue:
            if not self._write_lock.acquire(blocking=False):
                return  # the holder checks the queue again after releasing the lock
            try:
                self._write_queued()
            finally:
                self._write_lock.release()

    def close(self) -> None:
        """Wait for a write in flight, drop what is still queued, close the file."""
        with self._write_lock:
            self._queue.clear()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _write_queued(self) -> None:
        batch = []
        while self._queue:
            batch.append(self._queue.popleft())
        if self._fd < 0 or self._failed:
            return
        data = memoryview(b"".join(batch))
        try:
            while data:  # a regular file may take a short write
                written = os.write(self._fd, data)
                if written == 0:
                    raise OSError(errno.EIO, "write returned 0")
                data = data[written:]
        except OSError as exc:
            self._failed = True
            self._on_error(exc)
