"""Source files kept open for the many range reads of one file (samples inside large files).

A block read opens, fstats, preads and closes the file (cachefs/source.py): on a network source
the open and the close are round trips of their own, which for a 4 MiB block cost little, but a
`.npy` of 100 KB rows read by row pays them for every sample: over sshfs with 1 ms per packet,
32 threads read 70 MB/s opening per read and 170 MB/s from one open descriptor. So the range
reads of an order of byte-range items (cachefs/range_cache.py) share one descriptor per file:

- a descriptor is used for at most `hold_s` (the caller's: half the metadata TTL, the age at
  which cachefs re-checks a file's identity anyway, cachefs/freshness.py), then opened again,
  so that a file replaced at the source (renamed over) is seen as soon as a re-check would see
  it; a file changed in place is seen at once, since every read fstats the descriptor. A
  read through a held descriptor is a look at the path as it was when the descriptor was
  opened (a file renamed over since is another): `use` says how long ago that was, and the
  source dates its look by it. A change found by any other look lets the file's descriptor
  go (`let_go`): read on, it brought the old version back into the caches;
- threads use one descriptor at the same time (pread is positional); one that is replaced or
  let go is closed when its last reader is done with it, never under a pread;
- at most `limit` files are held, least recently used let go first, and one not used again
  is let go once its `hold_s` is over (checked at the next use of any, at most every
  `SWEEP_S`): a descriptor kept open keeps a file deleted at the source alive (on NFS, a
  `.nfsXXXX` file that fails the `rm -r` of its directory).

All methods may be called from any thread (one lock, never held across a system call that can
wait on the source: opens and closes happen outside it).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

MAX_HELD_FILES = 64
SWEEP_S = 1.0  # how often held descriptors past their `hold_s` are looked for

T = TypeVar("T")


class _Held:
    __slots__ = ("fd", "opened_s", "users", "retired")

    def __init__(self, fd: int, opened_s: float):
        self.fd = fd
        self.opened_s = opened_s
        self.users = 0
        self.retired = False  # no new user; closed when `users` reaches 0


class HeldFiles:
    def __init__(self, open_fn: Callable[[bytes], int], limit: int = MAX_HELD_FILES):
        self._open = open_fn  # relpath -> a descriptor open for reading
        self._limit = limit
        self._lock = threading.Lock()
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        self._swept_s = time.monotonic()

    def use(self, relpath: bytes, hold_s: float, read: Callable[[int], T]) -> tuple[T, float]:
        """`read(fd)` with the file's held descriptor (opened if none is fresh), in the
        calling thread; returns what it returns, and the seconds since that descriptor was
        opened (module docstring)."""
        held = self._acquire(relpath, hold_s)
        try:
            return read(held.fd), max(0.0, time.monotonic() - held.opened_s)
        finally:
            self._release(held)

    def let_go(self, relpath: bytes) -> None:
        """The file changed at the source: its descriptor is used no more (closed once its
        readers are done with it), and the next read opens the file again."""
        with self._lock:
            held = self._held.pop(relpath, None)
            to_close = self._retire(held) if held is not None else []
        for done in to_close:
            os.close(done.fd)

    def _acquire(self, relpath: bytes, hold_s: float) -> _Held:
        now = time.monotonic()
        to_close: list[_Held] = []
        if now - self._swept_s >= SWEEP_S:
            self._let_go_expired(now, hold_s)
        with self._lock:
            held = self._held.get(relpath)
            if held is not None and now - held.opened_s < hold_s:
                held.users += 1
                self._held.move_to_end(relpath)
                return held
        fd = self._open(relpath)  # outside the lock: a round trip on a network source
        fresh = _Held(fd, now)
        with self._lock:
            held = self._held.get(relpath)
            if held is not None and now - held.opened_s < hold_s:
                # another thread opened it meanwhile: theirs is used, this one closed
                held.users += 1
                to_close.append(fresh)
                fresh = held
            else:
                if held is not None:
                    to_close += self._retire(held)
                self._held[relpath] = fresh
                fresh.users += 1
                while len(self._held) > self._limit:
                    _, oldest = self._held.popitem(last=False)
                    to_close += self._retire(oldest)
        for done in to_close:
            os.close(done.fd)
        return fresh

    def _let_go_expired(self, now: float, hold_s: float) -> None:
        """Let go of every descriptor held for `hold_s` or longer."""
        to_close: list[_Held] = []
        with self._lock:
            self._swept_s = now
            for relpath in [relpath for relpath, held in self._held.items()
                            if now - held.opened_s >= hold_s]:
                to_close += self._retire(self._held.pop(relpath))
        for done in to_close:
            os.close(done.fd)

    def _retire(self, held: _Held) -> list[_Held]:
        """Let go of a descriptor (the lock is held): to close now if nobody uses it."""
        held.retired = True
        return [held] if held.users == 0 else []

    def _release(self, held: _Held) -> None:
        with self._lock:
            held.users -= 1
            close = held.retired and held.users == 0
        if close:
            os.close(held.fd)

    def close_all(self) -> None:
        with self._lock:
            to_close = [held for held in self._held.values() if held.users == 0]
            for held in self._held.values():
                held.retired = True
            self._held.clear()
        for held in to_close:
            os.close(held.fd)
