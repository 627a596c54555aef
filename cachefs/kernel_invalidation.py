"""Telling the kernel that a source file changed: its inode retired, its entry and pages dropped.

The read path finds changes wherever it looks at the source (a read's fstat, a sweep, a
reader's check: read_path.build_read_path's `on_source_changed`); this is what the kernel is
then told, so that no open keeps the old version's attributes or pages. It shares the inode
table (cachefs/inodes.py) with the FUSE operations (cachefs/fuse_ops.py), which answer a
retired inode ESTALE, and queues page drops behind the kernel data plane's stores of the same
inode (cachefs/pagecache.py, one FIFO), or runs them in worker threads without one.

The kernel's entry of the name goes too, in a worker thread, and the operations answer ESTALE
only once the entry drops in flight have landed (`entry_drops_landed`): a reader told of the
change who opens the name again then gets the new version. Without the wait, an open with no
OPEN (the zero-request mode) that came before the drop landed took the retired inode from the
kernel's entry again, and its first READ got ESTALE too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyfuse3
import trio

from cachefs import threads
from cachefs.inodes import InodeTable
from cachefs.pagecache import KernelPages
from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)

INVALIDATE_THREADS = 4  # invalidate_inode calls at once, with no kernel data plane
ENTRY_DROP_THREADS = 2  # invalidate_entry calls at once
# an ESTALE waits at most this long for the entry drops in flight: a drop waits for the LOOKUPs
# in the name's directory, which the trio thread answers meanwhile
ENTRY_DROP_WAIT_S = 1.0


def _invalidate_entry(parent_inode: int, name: bytes) -> None:
    """The kernel drops its entry of `name` in the directory, if it holds one (blocking:
    call it in a worker thread)."""
    try:
        pyfuse3.invalidate_entry(parent_inode, name)
    except OSError as exc:  # ENOENT: the kernel holds no entry of the name
        log.debug("invalidate_entry(%d, %r): %s", parent_inode, name, exc)


class KernelInvalidation:
    """Tells the kernel that a file changed at the source: the file's inode is retired
    (cachefs/inodes.py), the kernel's entry of its name is dropped, so that its next lookup
    gets the new version's inode, and so are its pages of the old version.

    The read path's `on_source_changed` (read_path.build_read_path): built before the read path,
    which calls it whichever of its parts finds the change, and sharing the inode table with
    the operations. With the kernel data plane the drop of the pages is queued behind the
    stores already queued for the inode (KernelPages, one FIFO); without, `invalidate_inode`
    runs in a worker thread, never inside a handler (the kernel may hold the inode while it
    waits for us), in the nursery of `run`. The entry's drop (`invalidate_entry`, blocking)
    runs in a worker thread too, in the same nursery: the kernel takes the directory's lock
    for it, which a LOOKUP in it holds until we answer.
    """

    def __init__(self, inodes: InodeTable, kernel: KernelPages | None,
                 invalidate_entry: Callable[[int, bytes], None] = _invalidate_entry):
        self._inodes = inodes
        self._kernel = kernel
        self._invalidate_entry = invalidate_entry
        self._run_sync = threads.pool(INVALIDATE_THREADS)
        self._run_entry_drop = threads.pool(ENTRY_DROP_THREADS)
        self._nursery: trio.Nursery | None = None
        self._entry_drops = 0  # in flight
        self._entry_drops_landed: trio.Event | None = None  # set when none is; None: none is

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                # the mount is stopping: a change seen now (a read landing late) starts
                # nothing in the nursery, which closes once its tasks end
                self._nursery = None

    def source_changed(self, relpath: bytes, identity: SourceIdentity,
                       asked_s: float | None = None) -> None:
        """The source's file is `identity` (seen by a look asked at `asked_s`; None: now).
        The path's inode of another version is retired, unless its stat was asked after that
        look; the kernel drops its entry of the name whenever an inode of another version is
        retired, even where a lookup or a listing has just given the new version one: a
        listing's reply may end before that name, and a retired inode left in the kernel's
        entry was ESTALE to every open with no OPEN (the zero-request mode).

        A look asked before the inode's stat that saw another version (a source read that
        waited for a thread, landing late) may have looked before or after that stat: which
        saw the file later cannot be told (freshness.compare_look). The inode stays the
        path's, but is trusted no more: its stat is asked again at its next use, and the
        kernel's pages of it go (they were served, with no request, as the version the late
        look says the source replaced)."""
        inodes = self._inodes
        inode = inodes.inode_of(relpath)
        if inode is not None and inodes.identity(inode) != identity:
            if asked_s is None or asked_s >= inodes.get(inode).stat_time_s:
                inodes.retire(inode)
            else:
                inodes.distrust(inode)
                self._drop_inode_pages(inode)
        stale = [old for old in inodes.retired_of(relpath) if inodes.identity(old) != identity]
        if not stale:
            return
        parent, _, name = relpath.rpartition(b"/")
        parent_inode = inodes.inode_of(parent)
        if parent_inode is not None and self._nursery is not None:  # None: the mount stops
            if self._entry_drops_landed is None:
                self._entry_drops_landed = trio.Event()
            self._entry_drops += 1
            self._nursery.start_soon(self._drop_entry, parent_inode, name)
        for old in stale:
            self._drop_inode_pages(old)

    def _drop_inode_pages(self, inode: int, keep: list[tuple[int, int]] | None = None
                          ) -> bool:
        """The kernel drops the inode's pages, all or all but `keep` (`drop_pages`); True if
        those stay."""
        if self._kernel is not None:
            # after any store queued before: one FIFO
            return self._kernel.invalidate(inode, keep)
        if self._nursery is not None:
            self._nursery.start_soon(self._invalidate, inode)
        return False

    def drop_pages(self, relpath: bytes, keep: list[tuple[int, int]] | None = None) -> bool:
        """The kernel drops its pages of the file (cachefs/range_cache.py drops those of the
        files whose samples are byte ranges, so that a sample read again is seen again): all,
        or all but the byte extents in `keep` where it can drop a range. True if those stay."""
        inode = self._inodes.inode_of(relpath)
        return inode is not None and self._drop_inode_pages(inode, keep)

    async def entry_drops_landed(self) -> None:
        """Return once the kernel's entries of the names whose inodes were retired are
        dropped, those whose drop is in flight now included (at most ENTRY_DROP_WAIT_S)."""
        landed = self._entry_drops_landed
        if landed is not None:
            with trio.move_on_after(ENTRY_DROP_WAIT_S):
                await landed.wait()

    async def _drop_entry(self, parent_inode: int, name: bytes) -> None:
        try:
            await self._run_entry_drop(self._invalidate_entry, parent_inode, name)
        finally:
            self._entry_drops -= 1
            if self._entry_drops == 0 and self._entry_drops_landed is not None:
                self._entry_drops_landed.set()
                self._entry_drops_landed = None

    async def _invalidate(self, inode: int) -> None:
        try:
            await self._run_sync(pyfuse3.invalidate_inode, inode)
        except OSError as exc:
            log.debug("invalidate_inode(%d): %s", inode, exc)

