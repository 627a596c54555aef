"""Daemon side of the order file: notice a newly published file and switch to it.

The trainer publishes by renaming a complete file over the order path (`cachefs.order`), so a
new order shows up as a new file identity (inode, mtime_ns, size) at that path. The watcher:

- watches the order file's directory with inotify (IN_MOVED_TO for a rename into place,
  IN_CLOSE_WRITE for a file written in place), through ctypes so that no extra package is
  needed, and waits on the descriptor with `trio.lowlevel.wait_readable`. It also rechecks once
  a second, in case an event was lost (queue overflow) or the directory was replaced. Where
  inotify is unavailable it polls the path's identity every `poll_interval_s` instead;
- compares the identity with the last one it handled: the same identity is the same file and
  costs nothing, so spurious events and polls are cheap;
- loads the file in a worker thread (parsing and validating 1.28 M items takes a fraction of a
  second, and building the source manifest on first use can take longer), then hands the
  `Order` to `on_order` in the trio thread, so the daemon switches orders between awaits;
- on a bad file records the rejection (reason, time, file identity) for `cachefs stats` and
  `cachefs publish`, logs a warning, and keeps the previous order. An unexpected exception
  from the loader or from `on_order` is a rejection too: the watcher never dies, because the
  mount must keep serving whatever a trainer writes.

This module does not import pyfuse3.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import time
from pathlib import Path
from typing import Callable

import trio

from cachefs.errors import OrderError
from cachefs.order import FileIdentity, Order

log = logging.getLogger(__name__)

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000  # the watch is gone (directory deleted or unmounted)
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_READ_BYTES = 64 * 1024
_RESCAN_S = 1.0  # recheck even without an event: a lost event costs at most this long


class _Inotify:
    """A non-blocking inotify descriptor watching one directory for files landing in it."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, directory: Path) -> "_Inotify | None":
        """The watch, or None when inotify is unavailable (then the caller polls)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init1, add_watch = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError) as err:
            log.info("inotify unavailable (%s); polling the order file", err)
            return None
        init1.argtypes, init1.restype = [ctypes.c_int], ctypes.c_int
        add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        add_watch.restype = ctypes.c_int
        fd = init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.info("inotify_init1 failed (%s); polling the order file",
                     os.strerror(ctypes.get_errno()))
            return None
        if add_watch(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_CLOSE_WRITE) < 0:
            log.info("cannot watch %s with inotify (%s); polling the order file", directory,
                     os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
        return cls(fd)

    async def wait_events(self) -> tuple[set[bytes], bool]:
        """Names of files that landed, and whether the watch was lost (overflow or removal)."""
        await trio.lowlevel.wait_readable(self.fd)
        names: set[bytes] = set()
        lost = False
        while True:
            try:
                data = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errno.EINTR:
                    continue
                raise
            offset = 0
            while offset + _EVENT_HEADER.size <= len(data):
                _wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(data, offset)
                offset += _EVENT_HEADER.size
                names.add(data[offset:offset + length].rstrip(b"\0"))
                offset += length
                if mask & (_IN_Q_OVERFLOW | _IN_IGNORED):
                    lost = True
        return names, lost

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.fd)
        os.close(self.fd)


class OrderWatcher:
    """Keeps the daemon's order in step with the order file; see the module docstring."""

    def __init__(self, order_path: Path, load: Callable[[Path], Order],
                 on_order: Callable[[Order], None], poll_interval_s: float = 0.05):
        self.order_path = Path(order_path)
        self._load = load
        self._on_order = on_order
        self._poll_interval_s = poll_interval_s
        self._handled: FileIdentity | None = None  # last identity loaded or rejected
        self._order: Order | None = None
        self._published_at: float | None = None
        self._rejection: dict | None = None

    @property
    def order(self) -> Order | None:
        return self._order

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled.

        `started` is signalled once the watch is in place (so no later publication is
        missed) and before an existing file is loaded: loading may wait for the source scan,
        and the mount must not wait for it.
        """
        inotify = _Inotify.open(self.order_path.parent)
        try:
            task_status.started()
            await self.check()
            if inotify is not None:
                inotify = await self._follow_inotify(inotify)
            await self._follow_polling()
        finally:
            if inotify is not None:
                inotify.close()

    async def _follow_inotify(self, inotify: _Inotify) -> None:
        """Returns None (after closing the watch) if the watch is lost for good."""
        wanted = os.fsencode(self.order_path.name)
        while True:
            names, lost = set(), False
            with trio.move_on_after(_RESCAN_S):
                names, lost = await inotify.wait_events()
            if lost:
                inotify.close()
                log.info("inotify watch on %s lost; polling the order file",
                         self.order_path.parent)
                await self.check()
                return None
            if not names or wanted in names:  # timeout rescan, or our file landed
                await self.check()

    async def _follow_polling(self) -> None:
        while True:
            await trio.sleep(self._poll_interval_s)
            await self.check()

    async def check(self) -> None:
        """Load the file at the order path if it is not the one handled last."""
        try:
            st = await trio.to_thread.run_sync(os.stat, self.order_path)
        except FileNotFoundError:
            return  # nothing published yet, or removed: the current order stays
        except OSError as err:
            log.warning("cannot stat order file %s: %s", self.order_path, err.strerror)
            return
        identity = FileIdentity.from_stat(st)
        if identity == self._handled:
            return
        self._handled = identity
        try:
            order = await trio.to_thread.run_sync(self._load, self.order_path,
                                                  abandon_on_cancel=True)
        except OrderError as err:
            self._reject(str(err), getattr(err, "file", None) or identity)
            return
        except Exception as err:  # noqa: BLE001 - a loader bug must not stop the watcher
            log.warning("unexpected error loading order file %s", self.order_path,
                        exc_info=True)
            self._reject(f"unexpected error loading the order file: {err!r}", identity)
            return
        loaded = order.file or identity
        self._handled = loaded
        try:
            self._on_order(order)
        except Exception as err:  # noqa: BLE001 - same: keep the previous order, keep watching
            log.warning("switching to order file %s failed", self.order_path, exc_info=True)
            self._reject(f"the daemon could not switch to the order: {err!r}", loaded)
            return
        self._order = order
        self._published_at = time.time()
        log.info("order file %s accepted: epoch %d, %d items for this node (of %d)%s",
                 self.order_path, order.epoch, len(order.current), order.total_length,
                 ", next epoch known" if order.next is not None else "")

    def _reject(self, reason: str, identity: FileIdentity) -> None:
        self._handled = identity
        self._rejection = {"reason": reason, "at": time.time(), "file": identity.to_json()}
        log.warning("order file %s rejected, previous order stays: %s", self.order_path,
                    reason)

    def status(self) -> dict:
        order = None
        if self._order is not None:
            order = dict(self._order.status(), published_at=self._published_at)
        return {"path": str(self.order_path), "order": order,
                "last_rejection": dict(self._rejection) if self._rejection else None}
