"""Close events of the files read through the mount, from fanotify(7): the zero-request mode's
accounting.

Why. In the zero-request mode (man/cachefs-mount.1, "Kernel page cache") the daemon answers
OPEN with ENOSYS, the kernel stops sending OPEN and RELEASE, and a file whose pages it holds is
read with no request at all. The daemon still has to know what was read (consumption moves the
read-ahead window; hits and stalls are what `cachefs stats` reports), and the kernel tells it:
a fanotify group with `FAN_CLOSE_NOWRITE` gets one event per file closed, from any process.

Two ways to be told, the cheaper first (`open_close_events` picks):

- By file handle (`FAN_REPORT_FID`, Linux 6.8 or later on FUSE, whose fsid is zero). An event
  carries the file's handle, which for FUSE is its node id (fs/fuse/inode.c, fuse_encode_fh:
  the daemon's own inode number) and generation: no fd is opened, stat'ed and closed per
  event, which cost the daemon about 13 us of its CPU per file read on a 2-core machine (the
  hot pass of scripts/bench_fuse.py). Such a group may only mark inodes, not the mount, so
  every directory is marked with `FAN_EVENT_ON_CHILD` (its files' closes are reported) before
  the kernel learns of any file in it: fuse_ops marks a directory (`mark_directory`) before it
  answers a LOOKUP in it or opens it for a listing (READDIRPLUS makes inodes too). A mark
  holds the directory's inode, so the kernel does not forget a marked directory. A file's
  inode is not held: a close whose inode the kernel forgot before the event was taken (memory
  reclaim, within microseconds of the close) is not counted.
- With an fd per event (`FAN_MARK_MOUNT`), where handles are refused (ENODEV: older kernels).
  The inode number is the fstat(2) of the event's fd; an open fd pins the inode, so the kernel
  cannot forget it before the daemon has looked it up; the fd is opened with FMODE_NONOTIFY, so
  closing it makes no event of its own, and in no_open mode opening it sends no request.

One thread reads events in batches (a read of the fanotify fd returns as many as fit in the
buffer; the thread waits `GATHER_S` between reads, so that a batch holds many) and hands each
batch of inode numbers to `deliver`; the batch's fds (if any) are closed when it returns.
By handle, `deliver` returns at once and the trio thread accounts for the batch when it can:
fanotify merges the queued events of one file, so the kernel's queue must not wait on the
trio thread (`close_delivery`); with fds, it returns once the batch is accounted.
Before a new order goes in force, the order watcher has the thread hand over at once what the
kernel has queued (`flushed`), so the closes of one epoch's last files count in it.
Directories report nothing (no FAN_ONDIR). Two closes of one file within a batch's gathering
(two readers of the same file at once) are one event, and count as one read.

fanotify needs CAP_SYS_ADMIN: `open_close_events` raises OSError without it (EPERM), and the
mount runs in the keep-cache mode instead. Overflowed queues (FAN_Q_OVERFLOW) are counted:
what they lost is counted as not read.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

import trio

from cachefs.threads import start_thread

log = logging.getLogger(__name__)

FAN_CLOSE_NOWRITE = 0x00000010
FAN_Q_OVERFLOW = 0x00004000
FAN_EVENT_ON_CHILD = 0x08000000
FAN_CLASS_NOTIF = 0x00000000
FAN_CLOEXEC = 0x00000001
FAN_UNLIMITED_QUEUE = 0x00000010
FAN_UNLIMITED_MARKS = 0x00000020
FAN_REPORT_FID = 0x00000200
FAN_MARK_ADD = 0x00000001
FAN_MARK_MOUNT = 0x00000010
FAN_EVENT_INFO_TYPE_FID = 1
FILEID_INO64_GEN = 0x81  # fuse_encode_fh's handle of an inode without its parent
AT_FDCWD = -100
FAN_NOFD = -1
# struct fanotify_event_metadata: event_len u32, vers u8, reserved u8, metadata_len u16,
# mask u64 (aligned), fd s32, pid s32
_METADATA = struct.Struct("=IBBHQii")
# struct fanotify_event_info_fid: info_type u8, pad u8, len u16, fsid (2 x s32), then a
# struct file_handle: handle_bytes u32, handle_type s32, f_handle; FUSE's f_handle starts with
# the node id's high and low 32 bits, each a u32 in host order
_INFO_FID = struct.Struct("=BBHiiIi")
_NODE_ID = struct.Struct("=II")
# why a handle group cannot mark a FUSE directory: no FAN_REPORT_FID (EINVAL), a zero fsid
# before Linux 6.8 (ENODEV), no file handles (EOPNOTSUPP), another fsid (EXDEV)
_NO_HANDLES = (errno.EINVAL, errno.ENODEV, errno.EOPNOTSUPP, errno.EXDEV)
DIRECTORY_MASK = FAN_CLOSE_NOWRITE | FAN_EVENT_ON_CHILD  # a directory's files' closes
BUFFER_BYTES = 256 * 1024
# After each batch the thread waits this long before reading the next: closes then come in
# batches of hundreds, not one wake-up of this thread and of the trio thread per file (the hot
# pass of scripts/bench_fuse.py: the daemon's system time 0.2 -> 0.04 s per 50,000 files)
GATHER_S = 0.002
# `flushed` gives up after this long: a watcher thread stuck (it never is, but a new order must
# not wait on it) only leaves a late close to count in the new epoch, as before it existed
FLUSH_WAIT_S = 1.0
# ... and reads at most this many batches for it: readers closing files all the while (a pass
# the kernel serves from its pages, 50,000 files a second) would keep its queue from emptying
FLUSH_BATCHES = 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]


def _init(flags: int = 0) -> int:
    fd = _libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE | flags,
                             os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_init: {os.strerror(err)}")
    return fd


def _mark(fd: int, flags: int, mask: int, path: bytes) -> None:
    if _libc.fanotify_mark(fd, FAN_MARK_ADD | flags, mask, AT_FDCWD, path) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_mark {os.fsdecode(path)}: {os.strerror(err)}")


def check_available() -> None:
    """Raise OSError if this process may not use fanotify (EPERM: no CAP_SYS_ADMIN)."""
    os.close(_init())


def open_close_events(mountpoint: bytes, by_handle: bool = True) -> tuple[int, Marker | None]:
    """A fanotify fd that reports every close (read-only) of a file on the mount, and, if it
    reports them by file handle, the `Marker` of its directories (the mount point's marked
    already; None: an fd per event, module docstring). `by_handle=False`: the fd way
    without trying the other. Blocking: the marks resolve the mount point through the mount."""
    if by_handle:
        fd = _init(FAN_REPORT_FID | FAN_UNLIMITED_MARKS)
        marker = Marker(fd)
        try:
            marker.mark(0, DIRECTORY_MASK, mountpoint)
            return fd, marker
        except OSError as exc:
            marker.close()
            os.close(fd)
            if exc.errno not in _NO_HANDLES:
                raise
            log.info("close events by file handle refused (%s): one fd per event", exc.strerror)
    fd = _init()
    marker = Marker(fd)
    try:
        marker.mark(FAN_MARK_MOUNT, FAN_CLOSE_NOWRITE, mountpoint)
    except OSError:
        os.close(fd)
        raise
    finally:
        marker.close()
    return fd, None


class Marker:
    """Adds marks to a fanotify group from a child process, one at a time.

    Why a process. Marking resolves a path through the mount, and a FUSE daemon that asks its
    own mount a question waits in the kernel for its own answer (statfs, with FAN_REPORT_FID,
    for the fsid; LOOKUPs for the path). Killed in that instant, the daemon cannot exit: its
    waiting thread holds /dev/fuse open, so the connection is never aborted and nothing ever
    answers. A child that waits instead is released when the killed daemon's /dev/fuse closes
    (the child does not hold it), and ends when its stdin does.
    """

    def __init__(self, fd: int):
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._process = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
             "from cachefs.fanotify import serve_marks; serve_marks(int(sys.argv[2]))",
             package_parent, str(fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,))
        self._lock = threading.Lock()

    def mark(self, flags: int, mask: int, path: bytes) -> None:
        """fanotify_mark(FAN_MARK_ADD | flags, mask, path) in the child; raises its OSError."""
        assert self._process.stdin is not None and self._process.stdout is not None
        with self._lock:
            try:
                self._process.stdin.write(b"%d %d %s\n" % (flags, mask, path.hex().encode()))
                self._process.stdin.flush()
                reply = self._process.stdout.readline()
            except OSError as exc:
                raise OSError(errno.EIO, f"the fanotify marking process: {exc}") from None
        if not reply:
            raise OSError(errno.EIO, "the fanotify marking process ended")
        err = int(reply)
        if err:
            raise OSError(err, f"fanotify_mark {os.fsdecode(path)}: {os.strerror(err)}")

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def serve_marks(fd: int) -> None:
    """The marking process (`Marker`): a line "FLAGS MASK PATH-IN-HEX" in, a line with 0 or
    the errno out, until stdin ends."""
    for line in sys.stdin.buffer:
        flags, mask, path = line.split()
        try:
            _mark(fd, int(flags), int(mask), bytes.fromhex(path.decode()))
            reply = 0
        except OSError as exc:
            reply = exc.errno or errno.EIO
        try:
            sys.stdout.write(f"{reply}\n")
            sys.stdout.flush()
        except OSError:  # the daemon is gone (killed): nobody to answer
            return


def close_delivery(trio_token: trio.lowlevel.TrioToken,
                   closed: Callable[[list[int]], None], *, by_handle: bool
                   ) -> Callable[[list[int]], None]:
    """How the close watcher's thread hands a batch of closes to `closed` on the trio thread.

    By file handle (no fd per event), at once: the thread goes back to the kernel's queue
    while the batch waits its turn. fanotify merges the queued events of one file into one, so
    a queue left to grow while the thread waited on a busy trio thread lost a close of every
    file read again before its first close was taken: about 0.2% of them in the hot pass of
    scripts/bench_fuse.py (111-150 of 70,000 closes never counted; 0-3 with this). With an fd
    per event, once the batch is accounted: the fds pin the inodes until then, and batches
    piling up would hold fds without bound."""
    if by_handle:
        return lambda inodes: trio_token.run_sync_soon(closed, inodes)
    return lambda inodes: trio.from_thread.run_sync(closed, inodes, trio_token=trio_token)


class CloseWatcher:
    """The thread that turns close events into batches of inode numbers for `deliver`."""

    def __init__(self, fd: int, marker: Marker | None, deliver: Callable[[list[int]], None]):
        self._fd = fd
        self._marker = marker
        self.by_handle = marker is not None  # events carry file handles (open_close_events)
        # called in this thread with a batch of inode numbers; the batch's fds are closed
        # when it returns (module docstring)
        self._deliver = deliver
        self._thread: threading.Thread | None = None
        self._stop_read, self._stop_write = os.pipe()
        # `flushed`: a byte in the pipe per request, its (trio token, event) in the deque
        self._flush_read, self._flush_write = os.pipe()
        # a flush never blocks the trio thread, even with the thread gone (`flushed`)
        os.set_blocking(self._flush_write, False)
        self._flush_waiters: collections.deque[tuple[trio.lowlevel.TrioToken, trio.Event]] = \
            collections.deque()
        self.events = 0
        self.overflows = 0

    def start(self) -> None:
        self._thread = start_thread(self._work, "cachefs-closes")

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_write, b"x")
            self._thread.join(5.0)
            self._thread = None
        if self._marker is not None:
            self._marker.close()
        for fd in (self._fd, self._stop_read, self._stop_write, self._flush_read,
                   self._flush_write):
            os.close(fd)

    async def flushed(self) -> bool:
        """Return once every close the kernel has queued by now is handed to `deliver`, in
        a batch ahead of this call's answer, so accounted before it (at most FLUSH_WAIT_S).
        The order watcher calls it before it puts a new order in force: a trainer publishes
        the next epoch's order once its readers have closed the last files of this one, and a
        close still queued then was counted in the new epoch, as a read of the file's place
        in it (the file was read ahead there, dropped as consumed, and read again). False:
        not answered in time."""
        if self._thread is None:
            return True
        if not self._thread.is_alive():
            return False  # it ended (logged): no close is counted any more
        answered = trio.Event()
        self._flush_waiters.append((trio.lowlevel.current_trio_token(), answered))
        try:
            os.write(self._flush_write, b"x")
        except OSError:  # stopped meanwhile (unmounting): nothing more will be counted
            return False
        with trio.move_on_after(FLUSH_WAIT_S):
            await answered.wait()
        if not answered.is_set():
            log.warning("the close events reported before a new order were not all counted "
                        "in %.0f s: a few may count in its epoch", FLUSH_WAIT_S)
        return answered.is_set()

    def _work(self) -> None:
        import select

        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_read, select.POLLIN)
        poller.register(self._flush_read, select.POLLIN)
        queued = select.poll()  # the kernel's queue alone, looked at without waiting
        queued.register(self._fd, select.POLLIN)
        interrupts = select.poll()  # what ends a wait between batches: a flush, the stop
        interrupts.register(self._stop_read, select.POLLIN)
        interrupts.register(self._flush_read, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_read in ready:
                return
            if self._flush_read in ready:
                os.read(self._flush_read, 4096)  # then the waiters: each has written its byte
                waiters = [self._flush_waiters.popleft() for _ in range(len(self._flush_waiters))]
                for _ in range(FLUSH_BATCHES):
                    if not queued.poll(0):
                        break
                    if not self._take_batch():
                        return
                for token, answered in waiters:
                    try:
                        token.run_sync_soon(answered.set)  # after the batches handed over
                    except trio.RunFinishedError:
                        pass
                continue
            if not self._take_batch():
                return
            # let the next closes gather: one wake-up per file read costs the machine more
            # than the reads' accounting coming this much later (a flush does not wait)
            interrupts.poll(GATHER_S * 1000)

    def _take_batch(self) -> bool:
        """Read a batch of events and hand it to `deliver`; False once nothing more will come
        (the fanotify fd failed, or the trio loop is gone)."""
        try:
            buffer = os.read(self._fd, BUFFER_BYTES)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                return True
            log.error("fanotify read failed: %s; close events are lost from now on", exc)
            return False
        fds, inodes = self._parse(buffer)
        try:
            if inodes:
                self._deliver(inodes)
        except trio.RunFinishedError:  # the trio loop is gone (unmounting)
            return False
        except Exception:  # noqa: BLE001 - this batch is lost; the next ones are counted
            log.exception("unexpected error handing over %d closes; they are not counted",
                          len(inodes))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def mark_directory(self, path: bytes) -> None:
        """Report the closes of the files in the directory at `path` (by-handle events; a
        blocking call: the path is resolved through the mount). Raises OSError."""
        assert self._marker is not None, "directories are marked only for by-handle events"
        self._marker.mark(0, DIRECTORY_MASK, path)

    def _parse(self, buffer: bytes) -> tuple[list[int], list[int]]:
        """The events' fds (for the caller to close) and their files' inode numbers."""
        fds: list[int] = []
        inodes: list[int] = []
        offset = 0
        while offset + _METADATA.size <= len(buffer):
            event_len, _vers, _reserved, meta_len, mask, fd, _pid = \
                _METADATA.unpack_from(buffer, offset)
            info_at, offset = offset + meta_len, offset + event_len
            if mask & FAN_Q_OVERFLOW:
                self.overflows += 1
            if self.by_handle:
                if info_at + _INFO_FID.size + _NODE_ID.size <= offset:
                    info_type, _pad, _len, _fsid0, _fsid1, handle_bytes, handle_type = \
                        _INFO_FID.unpack_from(buffer, info_at)
                    if (info_type == FAN_EVENT_INFO_TYPE_FID and handle_type == FILEID_INO64_GEN
                            and handle_bytes >= _NODE_ID.size):
                        high, low = _NODE_ID.unpack_from(buffer, info_at + _INFO_FID.size)
                        inodes.append(high << 32 | low)
                continue
            if fd == FAN_NOFD or fd < 0:
                continue
            fds.append(fd)
            try:
                inodes.append(os.fstat(fd).st_ino)
            except OSError:
                pass
        self.events += len(inodes)
        return fds, inodes
