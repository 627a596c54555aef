"""pyfuse3.Operations for cachefs: a thin adapter from kernel requests to the package.

Every handler is wrapped once (`_guarded`) so that whatever goes wrong becomes a FUSEError:
pyfuse3 ends the whole mount on any other exception (an ExceptionGroup from a nursery
included), and one bad file must never take the mount down. The errno map (docs/design.md §8):
source OSError -> its errno; cachefs errors -> their errno; anything unexpected -> logged with
its traceback, EIO. Write-like operations answer EROFS (the mount is also made with `ro`, so
the kernel usually answers them itself).

Attributes and entries are cached by the kernel for `kernel_timeout_s` (the data set is
read-only while mounted), so a walk over 100k files reaches the daemon once per file.

The kernel's page cache serves cached bytes (cachefs/pagecache.py, reader.py): an open is
answered with keep_cache when the pages the kernel may hold of the file are of the version
opened (`InodeEntry.page_identity`), and then a file the kernel holds whole is read with no
READ. An open that must drop the kernel's pages (a first open, or the file changed) first
waits for stores already queued for the inode, so no store of older bytes lands after it.
In the keep-cache mode, opening a cached file revalidates its source identity when the one we
know is no longer trusted (cachefs/freshness.py; cachefs/revalidate.py keeps that rare); a
changed file drops its cached copies and the kernel's pages (cachefs/kernel_invalidation.py,
which the read path calls, whichever of its parts finds the change).

An inode is one version of a file (cachefs/inodes.py): a change found retires the file's
inode, and every request on a retired inode but its release and forget is answered ESTALE.
So is the request that found the change on the inode (an open, a GETATTR, a READ): the kernel
meets the ESTALE of an open or stat with a lookup anew, which gives the new version an inode
of its own, and a reader with the old version open gets the bytes of that version or ESTALE,
never a mix of two.

What the handlers touch: the source (metadata, directories, extended attributes), the inode
table, the kernel data plane, and of the read path and the control channel only their public
methods (`Reader`, `Control`).

The zero-request mode (`decide_mode`, mount.py decides before the first OPEN is answered): OPEN
is answered ENOSYS, after which the kernel sends no OPEN or RELEASE on this connection and
keeps every file's pages across opens, so a file it holds costs the daemon no request at all.
READs of pages it does not hold come with the inode instead of a handle (a patched pyfuse3,
scripts/patches/), and are served through a handle made at the first of them (`_without_open`);
what was read, and when, the daemon learns from close events (cachefs/fanotify.py, `closed`).
Where the kernel reports closes by file handle, only in marked directories, a directory is
marked before the kernel learns of any file in it: before a LOOKUP in it is answered, and
before it is opened for a listing (`_closes_reported`).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3
import trio

from cachefs import errors, threads
from cachefs.ctrl import Control
from cachefs.dirs import DirListings, Listing
from cachefs.freshness import NEVER_S, Freshness
from cachefs.inodes import ROOT_INODE, InodeTable, PackedStat
from cachefs.pagecache import KernelPages
from cachefs.reader import AloneFile, OpenFile, Reader
from cachefs.source import Source, SourceIdentity

log = logging.getLogger(__name__)

# A directory's fanotify mark resolves its path through this mount: should that need requests
# that cannot be served while every FUSE task waits for the mark, a request waits this long
# and is answered anyway (closes in that directory may go unreported until the mark lands)
MARK_WAIT_S = 1.0
# marks made at once, each holding a thread (one left behind, until it lands): marks that never
# land take these and no thread of the others that may hang (an order file's load)
MARK_THREADS = 4
# entries of a listing whose item numbers are searched at once (`_listed_item`): a search of
# 256 paths costs 0.5 us a path, of 25 (a READDIRPLUS reply) 3.5, of one 8
LISTED_ITEMS = 256


@dataclass
class _ListedItems:
    """The item numbers of entries [start, start + len(items)) of a listing, under an item
    numbering (Reader.item_numbering)."""
    listing: Listing
    numbering: int
    start: int
    items: list[int]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITE_OPS = ("setattr", "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link",
              "write", "create", "setxattr", "removexattr", "fsync", "fsyncdir")


def _guarded(handler):
    """Map every exception of a handler to a FUSEError; log the unexpected ones."""

    name = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self, *args):
        self.requests[name] += 1
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except errors.CachefsError as exc:
            log.warning("%s: %s", handler.__name__, exc)
            if isinstance(exc, errors.StaleFileError):
                # the reader hears of the change once the kernel's entry of the name is gone,
                # so an open after it looks the name up anew (cachefs/kernel_invalidation.py);
                # no handler that raises this runs while the kernel holds the name's directory
                await self.entry_drops_landed()
            raise pyfuse3.FUSEError(exc.errno_value) from None
        except Exception:  # noqa: BLE001 - the mount must survive anything
            log.exception("unexpected error in %s%r", handler.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


# the attributes a reply copies from the source's stat: those the inode table keeps, but the
# source's inode and device numbers (the inode number is ours)
_STAT_FIELDS = tuple((index, name) for index, name in enumerate(PackedStat.FIELDS)
                     if name not in ("st_ino", "st_dev"))


async def _nothing_in_flight() -> None:
    return None


async def _read_only(self, *args):
    raise pyfuse3.FUSEError(errno.EROFS)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, source: Source, reader: Reader, control: Control, inodes: InodeTable,
                 kernel: KernelPages | None, freshness: Freshness, *, kernel_timeout_s: float,
                 entry_drops_landed: Callable[[], Awaitable[None]] = _nothing_in_flight):
        super().__init__()
        self.source = source
        self.reader = reader
        self.control = control
        self.kernel = kernel
        self.kernel_timeout_s = kernel_timeout_s
        # returns once the kernel's entries of names whose inodes were retired are dropped
        # (KernelInvalidation.entry_drops_landed)
        self.entry_drops_landed = entry_drops_landed
        self.freshness = freshness
        self.inodes = inodes
        # requests answered, by handler (`cachefs stats`: fuse_requests); FORGET's not counted
        self.requests: collections.Counter[str] = collections.Counter()
        self._files: dict[int, OpenFile] = {}
        # open directories: fh -> relpath; their listings, one per directory, in _listings
        self._dirs: dict[int, tuple[bytes, Listing]] = {}  # fh -> directory, its listing
        # fh -> the item numbers of a stretch of its listing's entries (`_listed_items`)
        self._dir_items: dict[int, _ListedItems] = {}
        self._listings = DirListings(source, freshness)
        self._next_fh = 1
        self.no_open = False  # the zero-request mode is on (decide_mode)
        # Set once the mode is decided (mount.py): no OPEN is answered before, so no file is
        # opened with a handle that a READ of the zero-request mode (an inode where the
        # handle would be) could be mistaken for.
        self.mode_decided = trio.Event()
        # the zero-request mode's handles, by inode: made at a file's first READ, released
        # when a close of it is reported
        self._without_open: dict[int, OpenFile] = {}
        # by inode, the check of a file held open in progress (`_check_held_open`)
        self._held_checks: dict[int, trio.Event] = {}
        # closes reported by file handle (decide_mode): marks a directory, given its relpath,
        # in a worker thread; the directories marked or being marked, by inode
        self._mark_directory: Callable[[bytes], None] | None = None
        self._marked_dirs: dict[int, trio.Event] = {}
        self._mark_limiter = trio.CapacityLimiter(MARK_THREADS)

    # -- attributes ------------------------------------------------------------------------

    def _attrs(self, inode: int, st: os.stat_result | PackedStat) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = inode
        attrs.generation = 0
        attrs.entry_timeout = self.kernel_timeout_s
        attrs.attr_timeout = self.kernel_timeout_s
        values = PackedStat.of(st).values()  # one unpack, not a property call per field
        for index, name in _STAT_FIELDS:
            setattr(attrs, name, values[index])
        return attrs

    def _entry(self, inode: int):
        try:
            return self.inodes.get(inode)
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    @_guarded
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._entry(parent_inode)  # ENOENT for a parent we do not know
        await self._closes_reported(parent_inode, parent.relpath)
        relpath = self.inodes.child_path(parent_inode, name)
        # a file just read ahead is answered from the fstat of that read: no round trip;
        # not from a look asked before its inode was distrusted (InodeTable.distrust)
        known = self.inodes.entry_of(relpath)
        st, stat_time_s = await self.source.lstat_recent(
            relpath, self.freshness, NEVER_S if known is None else known.distrusted_s)
        inode = self._remember(relpath, st, lookup=True, stat_time_s=stat_time_s)
        # the table's stat: a newer one than the memo's stays there (InodeTable.remember)
        return self._attrs(inode, self.inodes.get(inode).stat)

    def _remember(self, relpath: bytes, st, *, lookup: bool, stat_time_s: float) -> int:
        """`InodeTable.remember`; if that retired the file's inode (a new version), the
        read path drops the old version's copies."""
        known = self.inodes.inode_of(relpath)
        inode = self.inodes.remember(relpath, st, lookup=lookup, stat_time_s=stat_time_s)
        if known is not None and inode != known:
            self.reader.source_changed(relpath, self.source.identity_of(st))
        return inode

    @_guarded
    async def getattr(self, inode, ctx=None):
        entry = self._live_entry(inode)
        if not self.freshness.trusted(entry.stat_time_s):
            st, stat_time_s = await self.source.lstat_recent(entry.relpath, self.freshness,
                                                             entry.distrusted_s)
            entry = self._live_entry(inode)  # not retired while the source was asked
            if stat.S_ISREG(entry.stat.st_mode):  # a directory stays one inode (inodes.py)
                self._check_told(inode, self.source.identity_of(st), self.inodes.identity(inode))
            self.inodes.update_stat(inode, st, stat_time_s)
        return self._attrs(inode, entry.stat)

    def _live_entry(self, inode: int):
        """The entry of an inode that is not retired; ESTALE for one that is."""
        entry = self._entry(inode)
        if entry.retired:
            raise errors.StaleFileError(f"{entry.relpath!r} changed in the source")
        return entry

    def forget(self, inode_list):
        for inode, count in inode_list:
            relpath = self.inodes.forget(inode, count)
            if relpath is not None:  # the kernel's pages of it went with the inode
                self.reader.kernel_forgot(relpath)

    @_guarded
    async def readlink(self, inode, ctx):
        return await self.source.readlink(self._entry(inode).relpath)

    @_guarded
    async def statfs(self, ctx):
        vfs = await self.source.statvfs()
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(out, name, getattr(vfs, name))
        return out

    # -- directories -----------------------------------------------------------------------

    @_guarded
    async def opendir(self, inode, ctx):
        relpath = self._entry(inode).relpath
        await self._closes_reported(inode, relpath)  # its READDIRPLUS makes inodes
        listing = await self._listings.open(relpath)
        fh = self._new_fh()
        self._dirs[fh] = (relpath, listing)
        return fh

    @_guarded
    async def readdir(self, fh, start_id, token):
        if fh not in self._dirs:
            raise pyfuse3.FUSEError(errno.EBADF)
        parent, listing = self._dirs[fh]
        if start_id == 0 and not self.freshness.trusted(listing.listed_at_s):
            # a rewind of a handle whose listing is past the TTL (rewinddir: the directory
            # as it is now); only a read from the start, whose offsets no earlier reply
            # handed out. A listing that fails now leaves the handle its own.
            try:
                listing = await self._listings.reopened(parent)
            except OSError as exc:
                log.debug("relisting %r for a rewind failed: %s", parent, exc)
            else:
                if fh in self._dirs:  # not released meanwhile
                    self._dirs[fh] = (parent, listing)
        entries, listed_at_s = listing.entries, listing.listed_at_s
        numbering = self.reader.item_numbering
        for index in range(start_id, len(entries)):
            name, st = entries[index]
            relpath = parent + b"/" + name if parent else name
            inode = self._remember(relpath, st, lookup=False, stat_time_s=listed_at_s)
            # a read of the file before the kernel knew it (the read-ahead's, in a first
            # epoch) saw it later than the listing: the new inode is trusted from that look
            # (a lookup's stat is that look already: Source.lstat_recent)
            look = self.source.recent_look(relpath)
            if look is not None:
                self.inodes.confirm(relpath, *look)
            entry = self.inodes.get(inode)
            if entry.numbering != numbering and stat.S_ISREG(st.st_mode):
                # the item number `_item_of` would search for at the file's first READ
                entry.numbering = numbering
                entry.manifest_index = self._listed_item(fh, parent, listing, index, numbering)
            # the entry's stat, which a newer one than the listing's may have kept
            if not pyfuse3.readdir_reply(token, name, self._attrs(inode, entry.stat),
                                         index + 1):
                break
            self.inodes.add_lookup(inode)  # readdirplus: the kernel now holds a reference

    def _listed_item(self, fh: int, parent: bytes, listing: Listing, index: int,
                     numbering: int) -> int:
        """The item number of entry `index` of the listing, searched for LISTED_ITEMS
        entries at once (a reply holds a few dozen; one search per file was 333 of the 8,028
        Python opcodes a file of a reader off the order, in the simulator's read path)."""
        listed = self._dir_items.get(fh)
        if (listed is None or listed.listing is not listing or listed.numbering != numbering
                or not listed.start <= index < listed.start + len(listed.items)):
            entries = listing.entries[index:index + LISTED_ITEMS]
            items = self.reader.items_of([parent + b"/" + name if parent else name
                                          for name, _ in entries])
            listed = self._dir_items[fh] = _ListedItems(listing, numbering, index, items)
        return listed.items[index - listed.start]

    async def releasedir(self, fh):
        self._dir_items.pop(fh, None)
        opened = self._dirs.pop(fh, None)
        if opened is not None:
            self._listings.close(opened[0])

    # -- files -----------------------------------------------------------------------------

    @_guarded
    async def open(self, inode, flags, ctx):
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        await self.mode_decided.wait()
        if self.no_open:
            # the kernel stops sending OPEN and RELEASE for this connection from now on
            raise pyfuse3.FUSEError(errno.ENOSYS)
        entry = self._live_entry(inode)
        if not stat.S_ISREG(entry.stat.st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR if stat.S_ISDIR(entry.stat.st_mode)
                                    else errno.EINVAL)
        entry.open_handles += 1  # from here on, nothing is pushed to the inode (inodes.py)
        try:
            return await self._open(inode, entry)
        except BaseException:
            entry.open_handles -= 1
            raise

    async def _open(self, inode: int, entry) -> pyfuse3.FileInfo:
        item = self._item_of(entry)
        given = self.source.identity_of(entry.stat)  # what the kernel was told of the file
        recent = self.freshness.trusted(entry.checked_s)  # its bytes' (inodes.py)
        pages_of = entry.page_identity if self.kernel is not None else None
        handle = await self.reader.open(inode, entry.relpath, item, given if recent else None,
                                        pages_of)
        self._check_told(inode, handle.identity, given)
        if not handle.kernel_whole and self.kernel is not None:
            # The kernel drops the inode's pages when this open is answered: stores of the
            # pages of another version still queued must land before that, not after.
            # So must those queued before a change found at this open or lately, which has
            # already set page_identity to None (the drop of the old pages queued behind them).
            if entry.page_identity != handle.identity and (
                    entry.page_identity is not None or self.kernel.dropped_lately(inode)):
                await self.kernel.drain(inode)
            entry.page_identity = handle.identity
        self._live_entry(inode)  # not retired while the source or the kernel was waited for
        fh = self._new_fh()
        self._files[fh] = handle
        return pyfuse3.FileInfo(fh=fh, keep_cache=handle.kernel_whole)

    def _check_told(self, inode: int, identity: SourceIdentity, told: SourceIdentity) -> None:
        """The source's file is `identity`; the inode is the version `told`. If the file
        changed since, the inode is retired, the read path drops the old version's copies, and
        the request that found it is answered ESTALE (module docstring)."""
        if identity != told:
            relpath = self.inodes.get(inode).relpath
            self.inodes.retire(inode)
            self.reader.source_changed(relpath, identity)
            raise errors.StaleFileError(f"{relpath!r} changed in the source")

    def _item_of(self, entry) -> int:
        """The file's index in the order's manifest, searched once per item numbering."""
        numbering = self.reader.item_numbering
        if entry.numbering != numbering:
            entry.numbering = numbering
            entry.manifest_index = self.reader.item_of(entry.relpath)
        return entry.manifest_index

    @_guarded
    async def read(self, fh, offset, size):
        if self.no_open:
            entry = self._live_entry(fh)
            # from its arrival, before the file is checked at the source (reader.waiting)
            with self.reader.waiting(entry.relpath, offset, size):
                unopened = await self._read_without_open(fh, entry)
                unopened.reads_in_flight += 1
                try:
                    return await self.reader.read(unopened, offset, size)
                finally:
                    unopened.reads_in_flight -= 1
                    if unopened.close_seen and not unopened.reads_in_flight:
                        self._account_late_close(unopened)
        handle = self._files.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        # a change found since the open: ESTALE, as in the zero-request mode, not bytes of the
        # old version a fetch in flight at the change put in RAM after its drop
        self._live_entry(handle.inode)
        with self.reader.waiting(handle.relpath, offset, size):
            return await self.reader.read(handle, offset, size)

    def open_files(self) -> list[bytes]:
        """The files open now, with an OPEN (the keep-cache mode) or without one (the
        zero-request mode, until their close is reported): their reads may be served from
        RAM blocks past the first, from the SSD tier, or by the kernel from their READs'
        pages, so the sweeps re-check them whatever RAM holds (revalidate.py)."""
        return [handle.relpath
                for handle in (*self._files.values(), *self._without_open.values())]

    async def _read_without_open(self, inode: int, entry) -> OpenFile:
        """The handle of a READ that came with no OPEN: `fh` is the inode (patched pyfuse3);
        `entry`: its `_live_entry`, just looked up by the READ.
        The first READ of a file whose version was last seen at the source over a TTL ago
        (InodeEntry.checked_s) checks the source, as an open would (`_open`;
        Reader.checked_handle_without_open), and so does a later READ of the file held open
        once its version was last seen that long ago."""
        handle = self._without_open.get(inode)
        if handle is not None:
            if not self.freshness.trusted(entry.checked_s):
                await self._check_held_open(inode, handle)
            return handle
        item = self._item_of(entry)
        told = self.inodes.identity(inode)
        if self.freshness.trusted(entry.checked_s):
            handle = self.reader.handle_without_open(inode, entry.relpath, item, told)
        else:
            handle = await self.reader.checked_handle_without_open(inode, entry.relpath, item,
                                                                   told)
            # not retired while the source was asked: a change found meanwhile (a lookup of
            # a newer version) is not this look's to report, which may be of an older one
            self._live_entry(inode)
            self._check_told(inode, handle.identity, told)
            made = self._without_open.get(inode)
            if made is not None:
                return made  # another READ of the file made one while this one checked
        self._without_open[inode] = handle
        return handle

    async def _check_held_open(self, inode: int, handle: OpenFile) -> None:
        """A READ of a file held open whose version was not seen at the source within the
        TTL since (the sweeps fell behind): checked as its first READ was, before RAM serves
        it more of the version it was opened at (revalidate.py, "Overdue"); ESTALE if it
        changed. One check at a time per file: the READs that come meanwhile (the kernel's
        read-ahead sends several) wait for its outcome, and ask again only if it left the
        file unseen (it failed, or landed past the TTL)."""
        while (pending := self._held_checks.get(inode)) is not None:
            await pending.wait()
            if self.freshness.trusted(self._live_entry(inode).checked_s):
                return
        pending = self._held_checks[inode] = trio.Event()
        try:
            identity = await self.reader.fresh_identity(handle)
        finally:
            del self._held_checks[inode]
            pending.set()
        self._live_entry(inode)  # not retired meanwhile (as for a first READ)
        self._check_told(inode, identity, self.inodes.identity(inode))

    def decide_mode(self, no_open: bool,
                    mark_directory: Callable[[bytes], None] | None = None) -> None:
        """Answer OPEN with ENOSYS from now on (the zero-request mode; module docstring), or
        normally; OPENs waiting for the decision go on. `mark_directory(relpath)`: closes are
        reported only in directories marked with it, the root's already (cachefs/fanotify.py).
        """
        self.no_open = no_open
        if no_open and mark_directory is not None:
            self._mark_directory = mark_directory
            self._marked_dirs[ROOT_INODE] = trio.Event()
            self._marked_dirs[ROOT_INODE].set()
        self.mode_decided.set()

    async def _closes_reported(self, dir_inode: int, relpath: bytes) -> None:
        """Return once the kernel reports the closes of files in this directory, if it
        reports them by directory (decide_mode): the first caller marks it (module
        docstring). Requests that come before the mode is decided wait for it."""
        if not self.mode_decided.is_set():
            await self.mode_decided.wait()
        if self._mark_directory is None:
            return
        marked = self._marked_dirs.get(dir_inode)
        if marked is not None:
            if not marked.is_set():
                with trio.move_on_after(MARK_WAIT_S):
                    await marked.wait()
            return
        marked = self._marked_dirs[dir_inode] = trio.Event()
        try:
            with trio.move_on_after(MARK_WAIT_S) as waited:
                await threads.run_abandoning(self._mark_directory, relpath,
                                             limiter=self._mark_limiter)
            if waited.cancelled_caught:
                log.warning("marking %r for close events takes over %.0f s; answering without "
                            "it", relpath, MARK_WAIT_S)
        except OSError as exc:
            log.warning("closes in %r are not reported (reads there are not counted): %s",
                        relpath, exc)
        finally:
            marked.set()

    def closed(self, inodes: list[int]) -> None:
        """Files were closed (fanotify, in the zero-request mode): account for each, as a
        RELEASE would, whether READs came for it or the kernel's pages served it all; the
        batch's files in one go (`Reader.closed`). A file the reader counted before as one the
        kernel served alone, and still is (`Reader.still_alone`: most closes of a pass the
        kernel serves from its pages), is counted from its block, with no look at its entry
        (cachefs/inodes.py `close_tokens`); a file with READs of its own has a handle.

        Never raises: the close watcher calls it on the trio thread with `run_sync_soon`,
        where an exception ends the trio run, and the mount with it."""
        try:
            self._account_closes(inodes)
        except Exception:  # noqa: BLE001 - the mount goes on; the next batch is counted
            log.exception("unexpected error accounting for %d closed files", len(inodes))

    def _account_closes(self, inodes: list[int]) -> None:
        tokens = self.reader.still_alone(self.inodes.close_tokens(inodes))
        closes: list[OpenFile | AloneFile | tuple] = []
        for inode, token in zip(inodes, tokens, strict=True):
            if token is not None and inode not in self._without_open:
                closes.append(token)
                continue
            try:
                close = self._closed_one(inode)
            except Exception:  # noqa: BLE001 - one file's accounting must not end all others'
                log.exception("unexpected error accounting for the close of inode %d", inode)
                continue
            if close is not None:
                closes.append(close)
        self._counted(closes)

    def _counted(self, closes: list) -> None:
        """`Reader.closed` of a batch of closes; the files it counted from their one block
        have their next close counted from it (cachefs/inodes.py `close_tokens`)."""
        for inode, token in self.reader.closed(closes):
            self.inodes.remember_close(inode, token)

    def _account_late_close(self, handle: OpenFile) -> None:
        """A close reported while READs of the handle waited (`_closed_one`), counted now
        that the last of them has ended; never raises (the READ it ends is answered)."""
        try:
            close = self._closed_handle(handle)
            if close is not None:
                self._counted([close])
        except Exception:  # noqa: BLE001 - the READ's bytes are good; the next close counts
            log.exception("unexpected error accounting for the close of %r", handle.relpath)

    def _closed_one(self, inode: int) -> OpenFile | tuple | None:
        """A close of `inode` as `Reader.closed` takes it: the handle its READs used, else
        (inode, relpath, item, identity) of a regular file still known; None if neither. A
        handle a READ still waits in (the kernel's read-ahead sends READs that no reader waits
        for, and the reader may close the file first) is counted when the last of them ends
        (`read`): counted now, the READ's bytes, wait and miss went nowhere."""
        handle = self._without_open.pop(inode, None)
        if handle is not None:
            if handle.reads_in_flight:
                handle.close_seen = True
                return None
            return self._closed_handle(handle)
        try:
            entry = self.inodes.get(inode)
        except KeyError:
            return None  # forgotten since; nothing of it is held
        if not stat.S_ISREG(entry.stat.st_mode) or entry.retired:
            return None  # a retired version's copies went with it: nothing was served
        return (inode, entry.relpath, self._item_of(entry),
                self.source.identity_of(entry.stat))

    def _closed_handle(self, handle: OpenFile) -> OpenFile | None:
        """The handle of a close, as `Reader.closed` takes it; None if it was counted here."""
        if self.inodes.inode_of(handle.relpath) == handle.inode:
            return handle
        # retired (or forgotten) since its READs: counted, with nothing to settle (as
        # `release` of a retired inode's handle), and on its own, out of the batch
        self.reader.release(handle, last=False)
        return None

    @_guarded
    async def release(self, fh):
        handle = self._files.pop(fh, None)
        if handle is not None:
            entry = self.inodes.get(handle.inode)  # the kernel holds the inode while it is open
            entry.open_handles -= 1
            # a retired inode's pages went with its version's copies: nothing to settle, and
            # settling by path would drop the new version's (Reader.release)
            self.reader.release(handle, last=entry.open_handles == 0 and not entry.retired)

    async def flush(self, fh):
        # Nothing to flush on a read-only mount; ENOSYS makes the kernel stop sending FLUSH
        # on every close (one request fewer per file).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    # -- extended attributes -----------------------------------------------------------------

    @_guarded
    async def getxattr(self, inode, name, ctx):
        if inode == ROOT_INODE:
            value = self.control.get(name, ctx.uid)
            if value is not None:
                return value
        try:
            return await self.source.getxattr(self._entry(inode).relpath, name)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            raise

    @_guarded
    async def listxattr(self, inode, ctx):
        names = await self.source.listxattr(self._entry(inode).relpath)
        return [os.fsencode(name) for name in names]


for _name in _WRITE_OPS:
    setattr(Operations, _name, _read_only)
