"""Daemon side of the order files: notice newly published files and switch to their order.

A trainer publishes by renaming a complete file into place (`cachefs.order`): without a rank
over the order path itself (the plain file), rank R over ``<stem>.rank<R>.npz`` next to it
(`cachefs.order.rank_order_path`). A new publication shows up as a new file identity (inode,
mtime_ns, size) at one of those paths. The watcher:

- at start, sets aside the order files already there (unless told to resume): they are left
  from an earlier run, whose permutation a new run's trainer does not follow, and reading it
  ahead would fill the RAM tier with blocks marked for a next use that never comes. They are
  listed once, when the watcher is made, which is before the mount appears, so a file
  published to the new mount is never taken for one of them; a set-aside file is loaded once
  it changes (a new identity), like any publication. The daemon does not rename or remove
  them: it may not own the directory, and the trainer's next publication replaces them;
- watches the order file's directory with inotify (IN_MOVED_TO for a rename into place,
  IN_CLOSE_WRITE for a file written in place), through ctypes so that no extra package is
  needed, and waits on the descriptor with `trio.lowlevel.wait_readable`. It also rechecks once
  a second, in case an event was lost (queue overflow) or the directory was replaced. Where
  inotify is unavailable it polls every `poll_interval_s` instead;
- on every check lists the directory (a state directory holds a handful of files: cheap) and
  compares each candidate's identity with the last one it handled for that name: the same
  identity is the same file and costs nothing, so spurious events and polls are cheap. A file
  that disappeared is forgotten (a later merge goes without it), but the order in force stays;
- loads each new file in a worker thread (parsing and validating 1.28 M items takes a fraction
  of a second, and building the source manifest on first use can take longer), checks that a
  rank file holds the rank of its name, and shares the manifest object of an equal manifest
  already held; files that landed together are handled oldest first;
- merges what it holds (`cachefs.order_merge.merge`: the newest publication decides, rank
  files are merged into one order for the node) and hands the result to `on_order` in the trio
  thread, once per check, so the daemon switches orders between awaits and two ranks that
  publish at the same moment cause one switch. What `status` shows is always a state that was
  handed to `on_order`: the files of one check are committed together, after it succeeded;
- on a bad file records the rejection (reason, time, file name and identity; the last
  `REJECTIONS_KEPT`, so that ranks publishing together each find theirs) for `cachefs stats`
  and `cachefs publish`, logs a warning, and keeps that file's previous state: a bad file never
  changes the order in force. An unexpected exception from the loader, the merge or `on_order`
  is a rejection too: the watcher never dies, because the mount must keep serving whatever a
  trainer writes.

This module does not import pyfuse3.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from cachefs import threads
from cachefs.errors import OrderError
from cachefs.manifest import Manifest
from cachefs.order import FileIdentity, Order, rank_of_file_name, rank_order_path
from cachefs.order_merge import PLAIN_IN_FORCE, Publication, check_rank_file, merge, \
    share_manifest

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
REJECTIONS_KEPT = 8  # ranks publishing at the same moment each find their own rejection
# a rejection's reason as recorded: eight of them stay far below an xattr's 64 KiB
REASON_MAX_CHARS = 1000
PUBLICATIONS_SHOWN = 64  # the stats snapshot must stay far below an xattr's 64 KiB


class _Inotify:
    """A non-blocking inotify descriptor watching one directory for files landing in it."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, directory: Path) -> _Inotify | None:
        """The watch, or None when inotify is unavailable (then the caller polls)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init1, add_watch = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError) as err:
            log.info("inotify unavailable (%s); polling the order files", err)
            return None
        init1.argtypes, init1.restype = [ctypes.c_int], ctypes.c_int
        add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        add_watch.restype = ctypes.c_int
        fd = init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.info("inotify_init1 failed (%s); polling the order files",
                     os.strerror(ctypes.get_errno()))
            return None
        if add_watch(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_CLOSE_WRITE) < 0:
            log.info("cannot watch %s with inotify (%s); polling the order files", directory,
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
    """Keeps the daemon's order in step with the order files; see the module docstring."""

    def __init__(self, order_path: Path, load: Callable[[Path], Order],
                 on_order: Callable[[Order], None], poll_interval_s: float = 0.05,
                 resume: bool = False, inotify: bool = True,
                 before_order: Callable[[], Awaitable[None]] | None = None):
        """`inotify=False`: poll, as where inotify is unavailable (scripts/bench_pickup.py
        measures both). `before_order()` is awaited before an order goes in force: the reads
        reported before it was published are counted first (fanotify.CloseWatcher.flushed)."""
        self.order_path = Path(order_path)
        self._use_inotify = inotify
        self.watching: str | None = None  # "inotify" or "polling", once `run` has begun
        self._load = load
        self._on_order = on_order
        self._before_order = before_order
        self._poll_interval_s = poll_interval_s
        self._handled: dict[str, FileIdentity] = {}  # file name -> last identity loaded/rejected
        self._plain: Publication | None = None
        self._by_rank: dict[int, Publication] = {}
        self._sequence = 0  # files accepted so far
        self._order: Order | None = None
        self._published_at: float | None = None
        # held files the order in force leaves out
        self._left_out: dict[FileIdentity | None, str] = {}
        self._rejections: collections.deque[dict] = collections.deque(maxlen=REJECTIONS_KEPT)
        self.rejections_total = 0  # all of them, where `_rejections` keeps the last few
        self._set_aside: dict[str, FileIdentity] = {}  # files left from an earlier run
        if not resume:
            self._set_aside_leftovers()

    def _set_aside_leftovers(self) -> None:
        """Take the order files already there as handled, without loading them."""
        try:
            found = self._list_candidates()
        except OSError:
            return  # no directory (yet), or unreadable: the first check says why
        for name, (_rank, identity) in found.items():
            self._handled[name] = self._set_aside[name] = identity
        if found:
            log.info("order files left from an earlier run set aside (loaded once they change; "
                     "--resume-order adopts them): %s", ", ".join(sorted(found)))

    @property
    def order(self) -> Order | None:
        return self._order

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled.

        `started` is signalled once the watch is in place (so no later publication is
        missed) and before existing files are loaded: loading may wait for the source scan,
        and the mount must not wait for it.
        """
        inotify = _Inotify.open(self.order_path.parent) if self._use_inotify else None
        self.watching = "polling" if inotify is None else "inotify"
        try:
            task_status.started()
            await self.check()
            if inotify is not None:
                await self._follow_inotify(inotify)
                inotify = None  # it returns only when the watch is lost, having closed it
            await self._follow_polling()
        finally:
            if inotify is not None:
                inotify.close()

    def _is_candidate(self, name: str | bytes) -> bool:
        name = os.fsdecode(name)
        return name == self.order_path.name or rank_of_file_name(self.order_path, name) is not None

    async def _follow_inotify(self, inotify: _Inotify) -> None:
        """Returns None (after closing the watch) if the watch is lost for good."""
        while True:
            names: set[bytes] = set()
            lost = False
            with trio.move_on_after(_RESCAN_S):
                names, lost = await inotify.wait_events()
            if lost:
                inotify.close()
                log.info("inotify watch on %s lost; polling the order files",
                         self.order_path.parent)
                self.watching = "polling"
                await self.check()
                return None
            # a timeout rescan, or an order file landed (not a publisher's temporary file)
            if not names or any(self._is_candidate(name) for name in names):
                await self.check()

    async def _follow_polling(self) -> None:
        while True:
            await trio.sleep(self._poll_interval_s)
            await self.check()

    # -- one check -------------------------------------------------------------------------

    async def check(self) -> None:
        """Load the order files that are not the ones handled last, and merge what is held."""
        try:
            found = await threads.run_one(self._list_candidates)
        except FileNotFoundError:
            found = {}  # no directory (yet): nothing published
        except OSError as err:
            log.warning("cannot list the order files in %s: %s", self.order_path.parent,
                        err.strerror)
            return
        self._forget_removed(found)
        landed = sorted((identity.mtime_ns, name, rank, identity)
                        for name, (rank, identity) in found.items()
                        if self._handled.get(name) != identity)
        accepted: list[Publication] = []
        try:
            for _mtime_ns, name, rank, identity in landed:
                publication = await self._load_one(name, rank, identity, accepted)
                if publication is not None:
                    accepted.append(publication)
            if accepted and self._before_order is not None:
                await self._before_order()
        except BaseException:
            # cancelled (unmount) before the merge: files accepted but not committed are
            # loaded again by the next check, if there is one
            for publication in accepted:
                self._handled.pop(self._name(publication).name, None)
            raise
        if accepted:
            self._put_in_force(accepted)

    def _list_candidates(self) -> dict[str, tuple[int | None, FileIdentity]]:
        """name -> (rank of the name or None, identity) of every order file; worker thread."""
        found = {}
        with os.scandir(self.order_path.parent) as entries:
            for entry in entries:
                if entry.name == self.order_path.name:
                    rank = None
                else:
                    rank = rank_of_file_name(self.order_path, entry.name)
                    if rank is None:
                        continue
                try:
                    # a link as itself: its load is refused (order_archive.py `_open_regular`)
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # renamed away since the listing
                except OSError as err:
                    log.warning("cannot stat order file %s: %s", entry.path, err.strerror)
                    continue
                found[entry.name] = (rank, FileIdentity.from_stat(st))
        return found

    def _forget_removed(self, found: dict) -> None:
        """Files deleted since the last check leave the next merge; the order in force stays."""
        for name in [name for name in self._handled if name not in found]:
            identity = self._handled.pop(name)
            if self._set_aside.pop(name, None) == identity:
                continue  # set aside at start and never loaded: nothing to leave out
            rank = rank_of_file_name(self.order_path, name)
            if rank is None:
                self._plain = None
            else:
                self._by_rank.pop(rank, None)
            log.info("order file %s removed: the next merge goes without it",
                     self.order_path.parent / name)

    async def _load_one(self, name: str, rank: int | None, identity: FileIdentity,
                        accepted: list[Publication]) -> Publication | None:
        """The file's accepted publication, or None after recording its rejection.

        `accepted`: the files of this check accepted so far, not committed yet.
        """
        path = self.order_path.parent / name
        manifests = self._held_manifests(accepted)
        try:
            order = await threads.run_abandoning(self._load_checked, path, rank, manifests)
        except OrderError as err:
            self._reject(str(err), getattr(err, "file", None) or identity, name)
            return None
        except Exception as err:  # noqa: BLE001 - a loader bug must not stop the watcher
            log.warning("unexpected error loading order file %s", path, exc_info=True)
            self._reject(f"unexpected error loading the order file: {err!r}", identity, name)
            return None
        # the identity of the file actually read: if another was renamed over it meanwhile,
        # the next check loads that one
        self._handled[name] = order.file or identity
        self._sequence += 1
        return Publication(order, rank, self._sequence)

    def _load_checked(self, path: Path, rank: int | None, manifests: list[Manifest]) -> Order:
        """Load, check a rank file's rank against its name, share the manifest; worker thread."""
        order = self._load(path)
        if rank is not None:
            try:
                check_rank_file(order, self.order_path, rank)
            except OrderError as err:
                err.file = order.file
                raise
        return share_manifest(order, manifests)

    def _held_manifests(self, accepted: list[Publication]) -> list[Manifest]:
        orders = [p.order for p in (self._plain, *self._by_rank.values(), *accepted)
                  if p is not None]
        if self._order is not None:
            orders.append(self._order)
        manifests: list[Manifest] = []
        for order in orders:
            if all(order.manifest is not manifest for manifest in manifests):
                manifests.append(order.manifest)
        return manifests

    def _put_in_force(self, accepted: list[Publication]) -> None:
        """Merge the accepted files with those held; commit all of them, or reject all."""
        plain, by_rank = self._plain, dict(self._by_rank)
        for publication in accepted:
            if publication.rank is None:
                plain = publication
            else:
                by_rank[publication.rank] = publication
        try:
            merged = merge(plain, by_rank)
            assert merged is not None  # there are accepted publications
            self._on_order(merged.order)
        except Exception as err:  # noqa: BLE001 - keep the previous order, keep watching
            log.warning("switching to the order of %s failed", self._names(accepted),
                        exc_info=True)
            for publication in accepted:
                self._reject(f"the daemon could not switch to the order: {err!r}",
                             publication.order.file, self._name(publication).name)
            self._restore()
            return
        self._plain, self._by_rank = plain, by_rank
        self._order, self._published_at = merged.order, time.time()
        left_out = {by_rank[rank].order.file: reason for rank, reason in merged.left_out.items()}
        for rank, reason in merged.left_out.items():
            if self._left_out.get(by_rank[rank].order.file) != reason:
                log.log(logging.INFO if reason == PLAIN_IN_FORCE else logging.WARNING,
                        "order file %s is not merged: %s", self._name(by_rank[rank]), reason)
        self._left_out = left_out
        order = merged.order
        merged_ranks = (f"ranks {', '.join(map(str, order.ranks))} of {order.world_size} "
                        f"merged, " if order.ranks and len(order.ranks) > 1 else "")
        log.info("order of %s in force: epoch %d, %s%d items for this node (of %d)%s",
                 self._names(accepted), order.epoch, merged_ranks, len(order.current),
                 order.total_length, ", next epoch known" if order.next is not None else "")

    def _restore(self) -> None:
        """After a switch that failed part of the way (the read-ahead may hold the new order,
        the planner the old), the order in force is handed over again, so that what the
        daemon works by is what `status` shows; with none, the daemon keeps what it had."""
        if self._order is None:
            return
        try:
            self._on_order(self._order)
        except Exception:  # noqa: BLE001 - the mount serves on, with no read-ahead
            log.exception("putting the previous order back in force failed too")

    def _name(self, publication: Publication) -> Path:
        if publication.rank is None:
            return self.order_path
        return rank_order_path(self.order_path, publication.rank)

    def _names(self, publications: list[Publication]) -> str:
        return ", ".join(str(self._name(publication)) for publication in publications)

    def _reject(self, reason: str, identity: FileIdentity | None, name: str) -> None:
        # kept whole it could fill the stats attribute (64 KiB) that reports it; cut as ASCII,
        # since JSON writes another character as up to 12 (eight reasons of 1,000 emoji in a
        # publisher's key names made `cachefs stats` fail for every user)
        reason = reason.encode("ascii", "backslashreplace").decode("ascii")
        if len(reason) > REASON_MAX_CHARS:
            reason = f"{reason[:REASON_MAX_CHARS]}... ({len(reason)} characters)"
        if identity is not None:
            self._handled[name] = identity
        self.rejections_total += 1
        self._rejections.append({"reason": reason, "at": time.time(), "path": name,
                                 "file": identity.to_json() if identity is not None else None})
        log.warning("order file %s rejected, its previous state stays: %s",
                    self.order_path.parent / name, reason)

    # -- status ----------------------------------------------------------------------------

    def publications(self) -> list[dict]:
        """The last accepted file of each name, plain file first, then by rank."""
        held = ([self._plain] if self._plain is not None else []) + \
            [self._by_rank[rank] for rank in sorted(self._by_rank)]
        in_force = set(self._order.files) if self._order is not None else set()
        listed = []
        for publication in held[:PUBLICATIONS_SHOWN]:
            order = publication.order
            listed.append({
                "path": self._name(publication).name, "rank": order.rank,
                "world_size": order.world_size, "epoch": order.epoch,
                "length": len(order.current), "has_next": order.next is not None,
                "file": order.file.to_json() if order.file is not None else None,
                "in_force": order.file in in_force,
                "left_out": self._left_out.get(order.file),
            })
        return listed

    def status(self) -> dict:
        order = None
        if self._order is not None:
            order = dict(self._order.status(), published_at=self._published_at)
        rejections = [dict(rejection) for rejection in self._rejections]
        set_aside = [{"path": name, "file": identity.to_json()}
                     for name, identity in sorted(self._set_aside.items())
                     if self._handled.get(name) == identity]  # not changed since the start
        return {"path": str(self.order_path), "order": order,
                "last_rejection": rejections[-1] if rejections else None,
                "rejections": rejections, "rejections_total": self.rejections_total,
                "publications": self.publications(),
                "set_aside": set_aside}
