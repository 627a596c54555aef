"""Close events of the files read through the mount, from fanotify(7): the zero-request mode's
accounting.

Why. In the zero-request mode (man/cachefs-mount.1, "Kernel page cache") the daemon answers
OPEN with ENOSYS, the kernel stops sending OPEN and RELEASE, and a file whose pages it holds is
read with no request at all. The daemon still has to know what was read (consumption moves the
read-ahead window; hits and stalls are what `cachefs stats` reports), and the kernel tells it:
a fanotify group marked on the mount (`FAN_MARK_MOUNT`) with `FAN_CLOSE_NOWRITE` gets one event
per file closed, from any process.

How. One thread reads events in batches (a read of the fanotify fd returns as many as fit in
the buffer), takes the inode number of each event's file with fstat(2) (it is the daemon's own
inode number: the kernel's attributes come from the daemon, and in no_open mode the fd the
kernel opens for the event sends no request), and hands the batch to `deliver`, which returns
once the trio thread has accounted for it; only then are the fds closed. An open fd pins the
inode: the kernel cannot forget it (FORGET) before the daemon has looked it up. The fd the
kernel gives us is opened with FMODE_NONOTIFY, so closing it makes no event of its own.
Directories report nothing (no FAN_ONDIR).

fanotify needs CAP_SYS_ADMIN: `open_close_events` raises OSError without it (EPERM), and the
mount runs in the keep-cache mode instead. Overflowed queues (FAN_Q_OVERFLOW) are counted:
what they lost is counted as not read.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

FAN_CLOSE_NOWRITE = 0x00000010
FAN_Q_OVERFLOW = 0x00004000
FAN_CLASS_NOTIF = 0x00000000
FAN_CLOEXEC = 0x00000001
FAN_UNLIMITED_QUEUE = 0x00000010
FAN_MARK_ADD = 0x00000001
FAN_MARK_MOUNT = 0x00000010
AT_FDCWD = -100
FAN_NOFD = -1
# struct fanotify_event_metadata: event_len u32, vers u8, reserved u8, metadata_len u16,
# mask u64 (aligned), fd s32, pid s32
_METADATA = struct.Struct("=IBBHQii")
BUFFER_BYTES = 256 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]


def _init() -> int:
    fd = _libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE,
                             os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_init: {os.strerror(err)}")
    return fd


def check_available() -> None:
    """Raise OSError if this process may not use fanotify (EPERM: no CAP_SYS_ADMIN)."""
    os.close(_init())


def open_close_events(mountpoint: bytes) -> int:
    """A fanotify fd that reports every close (read-only) of a file on the mount."""
    fd = _init()
    if _libc.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_CLOSE_NOWRITE, AT_FDCWD,
                           mountpoint) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"fanotify_mark {os.fsdecode(mountpoint)}: {os.strerror(err)}")
    return fd


class CloseWatcher:
    """The thread that turns close events into batches of inode numbers for `deliver`."""

    def __init__(self, fd: int, deliver: Callable[[list[int]], None]):
        self._fd = fd
        # called in this thread with a batch of inode numbers; returns once they are accounted
        self._deliver = deliver
        self._thread: threading.Thread | None = None
        self._stop_read, self._stop_write = os.pipe()
        self.events = 0
        self.overflows = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="cachefs-fanotify",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_write, b"x")
            self._thread.join(5.0)
            self._thread = None
        for fd in (self._fd, self._stop_read, self._stop_write):
            os.close(fd)

    def _work(self) -> None:
        import select

        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_read, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_read in ready:
                return
            try:
                buffer = os.read(self._fd, BUFFER_BYTES)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                log.error("fanotify read failed: %s; close events are lost from now on", exc)
                return
            fds, inodes = self._parse(buffer)
            try:
                if inodes:
                    self._deliver(inodes)
            except Exception:  # noqa: BLE001 - the trio loop is gone (unmounting)
                return
            finally:
                for fd in fds:
                    os.close(fd)

    def _parse(self, buffer: bytes) -> tuple[list[int], list[int]]:
        """The events' fds (for the caller to close) and their files' inode numbers."""
        fds, inodes = [], []
        offset = 0
        while offset + _METADATA.size <= len(buffer):
            event_len, _vers, _reserved, _meta_len, mask, fd, _pid = \
                _METADATA.unpack_from(buffer, offset)
            offset += event_len
            if mask & FAN_Q_OVERFLOW:
                self.overflows += 1
            if fd == FAN_NOFD or fd < 0:
                continue
            fds.append(fd)
            try:
                inodes.append(os.fstat(fd).st_ino)
            except OSError:
                pass
        self.events += len(inodes)
        return fds, inodes
