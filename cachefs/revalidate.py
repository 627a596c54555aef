"""Keeps the source identities of cached files fresh, in batches, off the readers' path.

The freshness contract (man/cachefs-mount.1, "Changed source files"): a source file's identity
(size, modification time, inode number) is trusted for `--metadata-ttl` seconds after it was
checked; a file whose bytes the mount holds (the RAM tier, or the kernel's page cache for it)
is served only while its identity is trusted, and a change found drops every cached copy and
the kernel's attributes and pages of the file before another open can keep them.

Where the checks happen, so that an open waits for none of them:
- the read-ahead re-checks the files of the order before the reader gets to them (prefetch.py);
- this task re-checks every other file the RAM tier holds a block of once its identity is
  due for a refresh (`Freshness.refresh_due`, half a TTL old): every quarter of a TTL it
  collects them, the longest unseen first, and lstats them in batches of `BATCH_FILES` (or
  split evenly over the calls, when fewer are due), one worker-thread hop per batch (not one
  per file, and none on an open), `SWEEP_CALLS` batches at once; and every file open
  now (`open_files`): a reader holding a large file open (an HDF5 or LMDB file, a memory-mapped
  array, a tar shard) is served its blocks from RAM, from the SSD tier, or by the kernel from
  its READs' pages, while RAM may hold no block of it or only later ones (its first block
  the least recently used, and evicted first): a sweep that looked at files by their first
  block in RAM, and at no open file in the keep-cache mode, served such a reader the old
  version after a change for as long as it kept the file open;
- in the keep-cache mode, an open of a cached file whose identity has expired anyway (this
  task fell behind, or the TTL is 0) checks it itself, one source round trip (fuse_ops.open,
  reader.Reader.open). The zero-request mode has no open: there the sweeps are the contract
  for what RAM holds, every max(TTL / 4, MIN_INTERVAL_S) seconds, and a READ of a file
  whose version was last seen over a TTL ago checks it, the first one or one of a file held
  open (what the SSD tier serves; fuse_ops.Operations._read_without_open).

Overdue: when the sweeps fall behind (a source slow to answer lstats, many files held), what
RAM holds is still checked before it is served (a READ of a file whose version was not seen
within the TTL checks the source first), but the kernel's pages are read with no request at
all in the zero-request mode. So every GUARD_FRACTION of a TTL (at least every
MIN_INTERVAL_S) `drop_overdue_pages` has the kernel drop the pages of every file whose version
will not have been seen at the source within the TTL by the next such pass (less
MIN_INTERVAL_S, the contract's margin): the reader's next READ then comes, and checks. A file
is seen by any look at it: a lookup, a sweep's lstat, and the read-ahead's read of its bytes
(InodeTable.confirm), so the pages of a file read ahead an epoch after its lookup are not
dropped; and no pages are stored for a file not seen within the TTL (InodeTable.store_target).
The pages of a file of byte-range items are the range cache's, which RAM does not count
(cachefs/range_cache.py `paged_files`): all of them go too.
While the sweeps keep up this drops nothing: they see each file by three quarters of a TTL,
and this pass drops at fifteen sixteenths. The keep-cache mode needs no such pass: there an
open of a file not seen within the TTL checks it (above).

Cost: about 2 x (files held) / TTL lstats a second; the default TTL (60 s, as gcsfuse's stat
cache) keeps that small for data sets that do not change while mounted, which is what cachefs
expects of a training set.
"""

from __future__ import annotations

import errno
import logging
import operator
from collections.abc import Callable, Iterable

import trio

from cachefs.cache.ram import RamTier
from cachefs.freshness import Freshness, now_s
from cachefs.recent import RecentMap
from cachefs.source import Source, SourceIdentity

log = logging.getLogger(__name__)

BATCH_FILES = 512  # lstats per worker-thread hop
# batches in flight at once: one after the other, 200,000 files held over a source answering
# an lstat in 0.5 ms took 100 s a sweep, past the TTL the sweeps keep (module docstring)
SWEEP_CALLS = 4
REPORTED_FILES = 4096  # changes remembered, not to report one twice (`_apply`)
MIN_INTERVAL_S = 0.25
GUARD_FRACTION = 1 / 16  # of the TTL: how often overdue pages are dropped (module docstring)
GONE = SourceIdentity(-1, 0, 0)  # the identity of a file the source no longer has
# what an lstat fails with for a file gone (or out of the daemon's reach: the copies go, as
# a reader would get this error); any other error is the source's, and is asked again
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM})


class Revalidator:
    def __init__(self, source: Source, ram: RamTier, inodes, freshness: Freshness, *,
                 record_identity: Callable[[bytes, SourceIdentity, int | None, float], bool],
                 source_changed: Callable[[bytes, SourceIdentity], None],
                 open_files: Callable[[], Iterable[bytes]] = tuple,
                 serves_without_open: Callable[[], bool] = lambda: False,
                 range_files: Callable[[], Iterable[bytes]] = tuple,
                 drop_range_pages: Callable[[bytes], bool] = lambda relpath: True):
        """`record_identity(relpath, identity, item, asked_s)`: a fresh identity, for the
        read-ahead (Prefetcher.record_identity; `item`: the file's, if known, else None;
        `asked_s`: when the source was asked; False: not recorded, an older look than one
        recorded since);
        `source_changed(relpath, identity)`: the file changed, its cached copies go
        (Reader.source_changed); `open_files()`: the files being read with no open
        (module docstring; fuse_ops.Operations.read_without_open); `serves_without_open()`:
        the zero-request mode is on, where overdue pages are dropped (module docstring);
        `range_files()`: the files of byte-range items whose pages the kernel may hold, which
        RAM does not count, and `drop_range_pages(relpath)` has the kernel drop them, but
        those of READs waiting for their answer, False if it left them to the next pass
        (RangeCache.paged_files, RangeCache.drop_overdue_pages)."""
        self.source = source
        self.ram = ram
        self.inodes = inodes
        self.freshness = freshness
        self._record_identity = record_identity
        self._source_changed = source_changed
        self._open_files = open_files
        self._serves_without_open = serves_without_open
        self._range_files = range_files
        self._drop_range_pages = drop_range_pages
        # the new version each file was last reported changed to: a file read with no open
        # keeps the old version in the inode table until the kernel stats it again, and
        # every sweep until then found the same change (and dropped its copies again)
        self._reported: RecentMap[bytes, SourceIdentity] = RecentMap(REPORTED_FILES)
        self.sweeps = 0
        self.checked = 0
        self.overdue_files = 0  # files whose pages `drop_overdue_pages` had dropped

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._guard_pages)
            task_status.started()
            # with a TTL of 0 opens check their file in the keep-cache mode; the zero-request
            # mode has no open to check at, so the sweeps run as often as they may
            interval_s = max(MIN_INTERVAL_S, self.freshness.ttl_s / 4)
            while True:
                await trio.sleep(interval_s)
                try:
                    await self.sweep()
                except Exception:  # noqa: BLE001 - the next sweep asks again; the mount goes on
                    log.exception("unexpected error re-checking the cached files")

    async def _guard_pages(self) -> None:
        """`drop_overdue_pages` in the zero-request mode, beside the sweeps, however long one
        of them takes (module docstring)."""
        interval_s = max(MIN_INTERVAL_S, self.freshness.ttl_s * GUARD_FRACTION)
        while True:
            await trio.sleep(interval_s)
            if self._serves_without_open():
                self.drop_overdue_pages(now_s() + interval_s - MIN_INTERVAL_S)

    def drop_overdue_pages(self, at_s: float) -> int:
        """The kernel drops its pages of every file whose version the freshness rule will not
        trust at `at_s` (module docstring); how many files."""
        # each of a file's blocks in the kernel looks at its entry, and the rule is one float
        # comparison: 200,000 blocks held, half in the kernel, took 50-56 ms a pass on the
        # trio thread, and 290 with a set of the files looked at and a call per stamp
        oldest_trusted_s = self.freshness.oldest_trusted_s(at_s)
        entry_of = self.inodes.entry_of
        overdue: dict[bytes, int] = {}
        if self.ram.kernel_bytes:  # else the kernel holds no page the RAM tier counts
            for (relpath, _), block in self.ram.blocks.items():  # no await: the dict stays
                if block.in_kernel:
                    entry = entry_of(relpath)
                    if entry is not None and entry.checked_s < oldest_trusted_s:
                        overdue[relpath] = block.identity.size
        for relpath, size_bytes in overdue.items():
            self.ram.drop_file_pages(relpath, size_bytes)
        # a file of byte-range items: the kernel holds pages of its items that RAM does not
        # count (cachefs/range_cache.py), all read with no request but for each sentinel
        for relpath in self._range_files():
            entry = entry_of(relpath)
            if (entry is not None and entry.checked_s < oldest_trusted_s
                    and self._drop_range_pages(relpath)):
                overdue[relpath] = 0
        if overdue:
            log.info("%d files not seen at the source within --metadata-ttl (the re-checks "
                     "fall behind): the kernel's pages of them dropped", len(overdue))
        self.overdue_files += len(overdue)
        return len(overdue)

    def _due(self) -> list[bytes]:
        """Files the RAM tier holds a block of, files open, and files of byte-range items
        the kernel may hold pages of, whose identity is due for a refresh. A file the kernel
        has no inode for is skipped: the lookup that must come before its open stats it."""
        at_s = now_s()
        due = []
        held = [relpath for relpath, _ in list(self.ram.blocks)]
        # and files of byte-range items whose pages the kernel may hold with none of their
        # items left in RAM: unchecked, `drop_overdue_pages` dropped them a TTL on, sweeps
        # keeping up or not
        for relpath in dict.fromkeys([*held, *self._open_files(), *self._range_files()]):
            entry = self.inodes.entry_of(relpath)
            if entry is not None and self.freshness.refresh_due(entry.checked_s, at_s=at_s):
                due.append((entry.checked_s, relpath))
        # the longest unseen first: a sweep that falls behind leaves the most recently seen
        # to `drop_overdue_pages`, which comes to them last
        due.sort(key=operator.itemgetter(0))
        return [relpath for _, relpath in due]

    async def sweep(self) -> None:
        due = self._due()
        # a few hundred files due go to every call at once, not to one in a single batch:
        # each call's lstats are one after the other, a round trip each on a network source
        batch_files = min(BATCH_FILES, max(1, -(-len(due) // SWEEP_CALLS)))
        batches = iter(range(0, len(due), batch_files))

        async def check_batches() -> None:
            for start in batches:  # shared: each batch goes to whichever call is free
                asked_s = now_s()
                results = await self.source.lstat_many(due[start:start + batch_files])
                for relpath, st in results:
                    self._apply(relpath, st, asked_s)

        async with trio.open_nursery() as nursery:
            for _ in range(min(SWEEP_CALLS, -(-len(due) // batch_files))):
                nursery.start_soon(check_batches)
        self.sweeps += 1
        self.checked += len(due)

    def _apply(self, relpath: bytes, st, asked_s: float) -> None:
        """Record one fresh stat; a file that changed or went loses its cached copies (those
        of RAM, or the kernel's pages of a file being read with no open, which RAM may not
        hold: what it was told of the file is what its pages are of)."""
        block = self.ram.get((relpath, 0))
        inode = self.inodes.inode_of(relpath)
        if inode is not None and asked_s < self.inodes.get(inode).stat_time_s:
            # the kernel's inode of the file is of a look asked after this one (a lookup, or
            # a reader's check that found a change and gave the new version this inode): an
            # older look says nothing new, and taken for a change it retired the current
            # inode (ESTALE for its reader) and dropped the current version's copies
            return
        told = None if inode is None else self.source.identity_of(self.inodes.get(inode).stat)
        if isinstance(st, OSError):
            if st.errno not in GONE_ERRNOS:
                # a failure of the source, not of the file (EIO, a timeout, a stale NFS
                # handle): its copies stay, and the next sweep asks again
                log.debug("could not re-check %r: %s", relpath, st)
                return
            identity = GONE
        else:
            identity = self.source.identity_of(st)
            # the block's item is the file's in the manifest in force: no search by path
            # (the sweep checks every file RAM holds, often more than the recent-items memory)
            if not self._record_identity(relpath, identity,
                                         None if block is None else block.item, asked_s):
                # a look at another version asked after this lstat landed first (a reader's
                # check, ItemMeta.record): this one neither renews what the kernel was told
                # nor drops the other version's copies
                return
            if inode is not None and told == identity:
                # still the version the kernel was given: trusted for another TTL. A changed
                # one is not recorded here: the inode table holds what the kernel was told,
                # and the kernel learns the new version by its next lookup or stat
                # (kernel_invalidation.KernelInvalidation)
                self.inodes.update_stat(inode, st, asked_s)
        known = block.identity if block is not None else told
        if known is not None and known != identity:
            if block is None and self._reported.get(relpath) == identity:
                return  # told already: the kernel is told the new version at its next stat
            self._reported.put(relpath, identity)
            self._source_changed(relpath, identity)

    def status(self) -> dict:
        return {"sweeps": self.sweeps, "checked": self.checked,
                "overdue_files": self.overdue_files}
