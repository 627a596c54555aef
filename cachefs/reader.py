"""read(handle, offset, size): split into blocks, take each from RAM or fetch it, assemble.

The hot path is a RAM hit: it never awaits (no thread, no scheduling), so hits are served even
while other requests wait on the source. A miss awaits the tiered cache's single-flight fetch;
the time a reader spends waiting on the source is its stall.

Consumption (docs/design.md §2): a file of the order is consumed when its last byte has been
returned to a reader, or when a handle that read from it is released, whichever comes first.
The prefetcher is told, and moves the window. Each handle is classified once, at release,
into the stats' per-epoch counters (see stats.py for the classes).

A reader that must wait for the first block of a file of the order (a demand miss: it outran
the read-ahead, or reads outside its window) tells the prefetcher first, which starts a batch of
the next files of that file's storage target (prefetch.py `demand_miss`); at release, its miss
and stall are counted in its target too (cachefs/targets.py).

A read that is not the order's (`Planner.read_outside`: the readers do not follow the order,
and the file's position is far past the cursor; a validation pass in directory order) is served and
counted as with no order (`OpenFile.outside`): its blocks land ranked as blocks of no known
future (TieredCache.fetch), the kernel keeps its pages alone at the close, its storage target
counts nothing, and the file is not consumed (no miss batch, no early rank once read whole).
The plan's work per file was a tenth of the daemon's for such a reader
(scripts/bench_offorder.py), and the files are not its readers' until they reach them.

A file read sequentially (block n right after block n-1) gets its next blocks read ahead even
without an order, so large files (shards, HDF5, .npy) stream at source bandwidth; those of the
next blocks already in RAM are stored into the kernel's page cache ahead of the reader.

The kernel's page cache (cachefs/pagecache.py). `open` lets the kernel keep the pages it holds
of the file (keep_cache) when they are of the version being opened and the whole file
(`kernel_whole`: every block is a kernel copy in the RAM tier); otherwise the kernel drops them
and the reader's READs come to the daemon. A kept file is read with no READ reaching the
daemon, so its hits are counted at open (each block classified as a READ would have been) and
its consumption at release: the stats of a pass are the same whichever way the bytes went. In
the zero-request mode there is no open: `handle_without_open` serves the READs that come, and
`closed` counts the batch of closes fanotify reports: a file the kernel served whole, and
one whose pages it dropped a moment before (KernelPages.dropped_lately): the daemon forgets a
block (evicted, or the file changed) before the drop of its pages lands, and a reader that
opened the file meanwhile read those pages with no READ. A file only the kernel held (its
usual close in a pass the kernel serves from its pages) is counted with no handle at all
(`KernelRead`): it has nothing to settle. Once counted so, a later close of such a file of
one block is counted from its block alone (`AloneFile`, kept by the inode table until the
file's attributes change): while the block is resident it is still the one only the kernel
holds, which a reader was served, and the close is a RAM hit; a batch's runs of them are
counted together. Looking at each file (its inode entry and stat, its block by key and the
block's identity: a cache miss per object, the readers' copies evicting them between two
closes of a file) was about 18 us of the trio thread's 20 per close in a hot pass.
At release the kernel's copy is settled (`_settle_pages`, `Ranking.kernel_may_keep`): a
file the kernel holds whole whose next use is soon, or unknown (no order: LRU among such
files), stays in the kernel only, and the daemon's copy goes; any other file's pages are
dropped, so that the kernel holds nothing the RAM budget does not count and nothing it may lose
before it is needed (a file of the order is pushed again when the window reaches it).

A file whose samples are byte-range items of the order in force (cachefs.order_items) is read
by item instead (cachefs/range_read.py): its READs go there, and its opens and closes count
nothing, since the stats count items, not the file.

The reader's public methods are all that fuse_ops touches of the read path; it is built with
the others by cachefs/read_path.py.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from cachefs import errors
from cachefs import stats as stats_mod
from cachefs.cache.ram import BlockKey, RamBlock, block_count
from cachefs.cache.tiered import TieredCache
from cachefs.freshness import now_s
from cachefs.planner import Planner
from cachefs.prefetch import Prefetcher
from cachefs.range_read import RangeReader
from cachefs.ranking import Ranking
from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class OpenFile:
    inode: int
    relpath: bytes
    identity: SourceIdentity
    item: int  # manifest index, -1 if the file is in no manifest
    # the manifest `item` indexes (the one in force at open): a fetch renumbers the item if
    # another is in force by then (prefetch.py's module docstring)
    manifest: object = None
    origin: int = stats_mod.ORIGIN_RAM  # costliest origin of any block served so far
    stall_s: float = 0.0
    bytes_served: int = 0
    read_called: bool = False
    consumed: bool = False
    next_block: int = 0  # the block a sequential reader asks for next
    # the epoch record in force when the file was consumed: consuming the last item of an
    # order switches the epoch, and the file must still count in the epoch that read it
    epoch_record: stats_mod.EpochStats | None = None
    # the planner's order serial at open: a new order published while the file was open
    # (its RELEASE can come after the trainer's next publish) must not be charged for it;
    # the automatic switch to the next order is no new order (a worker may open the next
    # epoch's first file while another finishes this epoch's last)
    order_serial: int = -1
    # The kernel holds the whole file at this open (its pages are of this version, and no READ
    # needs to come): the open keeps them (keep_cache). Only then: pages of part of a file
    # would let a reader read with no READ that the daemon could count.
    kernel_whole: bool = False
    # consumed at release only, not at the READ of its last byte: the zero-request mode's
    # handles, whose reader may read the file again from the kernel's pages, which the
    # consumption may drop (a READ then comes, and the file is read from the source twice)
    consume_at_release: bool = False
    # blocks READs of this handle asked for whole (added as the READ that completes one
    # starts, before its fetch lands): the kernel holds their pages once answered (with the
    # blocks pushed to it, the whole file, when the reader is done: `_settle_pages`)
    blocks_read: set = field(default_factory=set)
    # of the blocks READs asked for in part so far, the extents they covered: block index ->
    # merged [lo, hi) byte ranges; a block covered whole moves to `blocks_read`
    blocks_partly_read: dict = field(default_factory=dict)
    # a READ of this handle found pages gone that only the kernel held (reclaimed: the file
    # counts as the miss it became, and in `kernel_reclaimed`)
    kernel_reclaimed: bool = False
    # the zero-request mode's handles: READs of it not answered yet, and whether its close
    # was reported meanwhile (it is released when the last of them ends: fuse_ops `read`)
    reads_in_flight: int = 0
    close_seen: bool = False
    outside: bool = False  # not the order's read (Planner.read_outside): never consumed

    @property
    def size_bytes(self) -> int:
        return self.identity.size


@dataclass(eq=False, slots=True)
class KernelRead:
    """Closes of files only the kernel held, whole, with no READ (the zero-request mode's
    usual close in a pass the kernel serves from its pages), next to each other in their
    batch and of one origin: what their accounting needs. Such files have nothing to settle,
    and no handle is made for them: one file's (`Reader.closed_without_reads`), or a run of
    files counted from their blocks (`AloneFile`), counted together."""
    items: list[int]
    sizes_bytes: list[int]
    origin: int  # where their blocks came from (`_served`)
    relpath: bytes = b""  # the one file's, for the log
    # (epoch record, files, bytes): how many of the files counted in which epoch, the one in
    # force at its consumption (`OpenFile.epoch_record`; the order's end may split a run)
    counted: list = field(default_factory=list)


@dataclass(eq=False, slots=True)
class AloneFile:
    """A file of one block only the kernel holds, which a reader was served: its next close
    counts from the block alone while it is resident (module docstring; `Reader.still_alone`)."""
    key: BlockKey
    block: RamBlock


class Reader:
    def __init__(self, planner: Planner, ranking: Ranking, tiered: TieredCache,
                 prefetcher: Prefetcher, stats: stats_mod.Stats, *, block_bytes: int,
                 sequential_blocks: int, ranges: RangeReader | None = None):
        self._planner = planner
        self._ranking = ranking
        self._tiered = tiered
        self._prefetcher = prefetcher
        self._stats = stats
        self.block_bytes = block_bytes
        self.sequential_blocks = sequential_blocks
        self.kernel_opens = 0  # opens of files the kernel held whole (no READ needed)
        self.alone_closes = 0  # of those, closes counted from their blocks (`AloneFile`)
        self._ranges = ranges  # files whose samples are byte ranges (module docstring)

    # -- what fuse_ops asks besides reads ---------------------------------------------------

    @property
    def manifest(self):
        """The manifest in force: item numbers index it (prefetch.py's module docstring)."""
        return self._ranking.manifest

    @property
    def item_numbering(self) -> int:
        """What an item number found by `item_of` is valid under (Ranking.numbering)."""
        return self._ranking.numbering

    def item_of(self, relpath: bytes) -> int:
        """The file's index in the manifest in force; -1 if it is in none."""
        return self._ranking.item_of(relpath)

    def items_of(self, relpaths: list[bytes]) -> list[int]:
        """`item_of` of each path, in one search."""
        return self._ranking.items_of(relpaths)

    def source_changed(self, relpath: bytes, identity: SourceIdentity) -> None:
        """The source's file is now `identity`: every cached copy of another version goes."""
        self._tiered.source_changed(relpath, identity)

    def kernel_forgot(self, relpath: bytes) -> None:
        """The kernel forgot the file's inode, and with it its pages of the file."""
        self._tiered.kernel_forgot(relpath)

    # -- files -------------------------------------------------------------------------------

    async def open(self, inode: int, relpath: bytes, item: int,
                   recent: SourceIdentity | None, pages_of: SourceIdentity | None = None
                   ) -> OpenFile:
        """A handle on one file, with its current source identity.

        The identity is the one the prefetcher saw, if still trusted (cachefs/freshness.py),
        else `recent` (the caller's stat, if still trusted), else fresh from the source: the
        read of the file's first block if one is in flight, or an open and fstat. Waiting for
        the source here is a stall like any other. Waiting for the file's data in flight makes
        it a miss; a RAM hit that only needed a fresh stat stays a RAM hit.

        `pages_of`: the version of the file whose pages the kernel may hold (None: none). The
        kernel keeps them if they are of the version opened (see the module docstring).
        """
        # the handle takes the epoch and order of the open, not those after a wait
        handle = OpenFile(inode, relpath, None, item,  # type: ignore[arg-type]
                          self._ranking.manifest, epoch_record=self._stats.current,
                          order_serial=self._planner.order_serial,
                          outside=self._planner.read_outside(item))
        await self._settle_identity(handle, recent)
        if pages_of is not None and pages_of == handle.identity:
            blocks = self._tiered.kernel_holds_all(handle.relpath, handle.identity)
            if blocks is not None:
                self._kept_whole(handle, blocks)
        return handle

    async def _settle_identity(self, handle: OpenFile, recent: SourceIdentity | None) -> None:
        """Give the handle its file's identity: the prefetcher's if still trusted, else
        `recent`, else fresh from the source (`open`); the wait for the source is a stall,
        and a miss if it waited for the file's data."""
        known = self._prefetcher.known_identity(handle.item)
        disagree = known is not None and recent is not None and known != recent
        if disagree:
            # two versions, both checked within the TTL (the read-ahead's, and one a listing
            # gave the kernel since): which is newer only the source can say, asked now (a
            # read-ahead in flight may have looked before the listing). Taking the
            # read-ahead's dropped the newer one's copies, and failed the open if the
            # sizes differed
            known = recent = None
        known = known or recent
        if known is not None:
            handle.identity = known
            return
        # not read ahead (or its identity is stale): the batch of its target starts now
        if not handle.outside:
            self._prefetcher.demand_miss(handle.item, handle.manifest)
        handle.identity = await self.fresh_identity(handle, join_flight=not disagree)

    async def fresh_identity(self, handle: OpenFile, *, join_flight: bool = False
                             ) -> SourceIdentity:
        """The handle's file's identity at the source now (TieredCache.fresh_identity),
        recorded for the read-ahead; the wait is the reader's stall, and a miss if it waited
        for the file's data. By default not from a read in flight, which may have been asked
        before the TTL, or before the inode was distrusted: the check of a READ of a file held
        open past a TTL unseen (fuse_ops.Operations._read_without_open) asks anew."""
        started_s = now_s()
        identity, waited_for_data, asked_s = await self._tiered.fresh_identity(
            handle.relpath, join_flight=join_flight)
        handle.stall_s += now_s() - started_s
        if waited_for_data:
            handle.origin = stats_mod.ORIGIN_MISS
        self._prefetcher.record_identity(handle.relpath, identity, seen_s=asked_s)
        return identity

    async def checked_handle_without_open(self, inode: int, relpath: bytes, item: int,
                                          told: SourceIdentity) -> OpenFile:
        """`handle_without_open` for the first READ of a file the kernel was told of longer
        than a TTL ago: its identity checked as an open checks it (`open`). The zero-request
        mode has no open, and the sweeps (cachefs/revalidate.py) re-check only the files RAM
        holds: without this a file served from the SSD tier, whose attributes the kernel
        keeps for `--kernel-timeout`, was served past `--metadata-ttl` after it changed. The
        handle's `identity` may differ from `told` (the caller decides)."""
        handle = self.handle_without_open(inode, relpath, item, told)
        await self._settle_identity(handle, None)
        return handle

    def _kept_whole(self, handle: OpenFile, blocks: list) -> None:
        """The kernel holds the whole file (`blocks`): the handle is served from its pages,
        each block counted as a READ would count it."""
        handle.kernel_whole = True
        handle.origin = max(handle.origin, self._served_whole(blocks))

    def _served_whole(self, blocks: list) -> int:
        """Every block of a file the kernel held whole reached a reader from its pages (an
        open it kept, or a close with no READ): each counted as a READ would count it; where
        the costliest came from."""
        self.kernel_opens += 1
        origin = stats_mod.ORIGIN_RAM
        for key, block in blocks:
            origin = max(origin, self._served(key, block))
        return origin

    def handle_without_open(self, inode: int, relpath: bytes, item: int,
                            identity: SourceIdentity) -> OpenFile:
        """A handle for reads that came with no OPEN (the zero-request mode, fuse_ops): the
        file's last known identity; its READs check it against the source's as they read."""
        return OpenFile(inode, relpath, identity, item, self._ranking.manifest,
                        epoch_record=self._stats.current,
                        order_serial=self._planner.order_serial, consume_at_release=True,
                        outside=self._planner.read_outside(item))

    def still_alone(self, tokens: list) -> list:
        """Of `tokens` (an `AloneFile` or None, by close), each whose close still counts from
        it (its block is resident), else None; none while the order has byte-range items
        (their files' closes count nothing)."""
        if self._ranking.items is not None:
            return [None] * len(tokens)
        return [token if token is not None and token.block.resident else None
                for token in tokens]

    def closed(self, closes: list) -> list[tuple[int, AloneFile]]:
        """Files were closed, in this order (one fanotify batch, the zero-request mode):
        each is the handle its READs used, an `AloneFile` `still_alone`, or (inode, relpath,
        item, identity) of a file no READ reached. A file only the kernel held whole is
        counted without a handle (`KernelRead`, with the files next to it counted from their
        blocks); the batch is released as one (`release_many`), its consumption one step of
        the planner, in the batch's order. Returns (inode, `AloneFile`) of the files whose
        next close counts from their block."""
        released: list[OpenFile | KernelRead] = []
        alone: list[tuple[int, AloneFile]] = []
        ram = self._tiered.ram
        run: KernelRead | None = None  # of the closes counted from their blocks, in a row
        for close in closes:
            if isinstance(close, AloneFile):
                self.kernel_opens += 1
                self.alone_closes += 1
                if run is None:
                    run = KernelRead([], [], stats_mod.ORIGIN_RAM)
                    released.append(run)
                item = close.block.item  # (counted as in no manifest if read outside)
                run.items.append(-1 if self._planner.read_outside(item) else item)
                run.sizes_bytes.append(close.block.nbytes)
                ram.touch(close.key, close.block)
                continue
            run = None
            if isinstance(close, OpenFile):
                released.append(close)
                continue
            try:
                read = self.closed_without_reads(*close)
            except Exception:  # noqa: BLE001 - one file's accounting must not end others'
                log.exception("unexpected error accounting for the close of %r", close[1])
                continue
            if read is not None:
                released.append(read)
                if isinstance(read, KernelRead) and close[3].size <= self.block_bytes:
                    # its one block was served (`_served_whole`): a RAM hit from now on
                    key = (close[1], 0)
                    alone.append((close[0], AloneFile(key, ram.blocks[key])))
        self.release_many(released)
        return alone

    def closed_without_reads(self, inode: int, relpath: bytes, item: int,
                             identity: SourceIdentity) -> OpenFile | KernelRead | None:
        """A file was opened and closed with no READ reaching the daemon (the zero-request
        mode): what to release for it (`release_many`) if it was read from the kernel's pages,
        which held the whole file, or held it until a moment ago; None if nothing was read
        (an open for a stat, or a mapping never touched). A file of byte-range items counts
        nothing at its close: its items were counted as they were read, and its pages are
        dropped every few items.

        A file only the kernel held, whole, is its `KernelRead`, counted with no handle. Such
        a file is settled: both ways out of `_settle_pages` leave it as it is (hand_to_kernel
        has nothing to hand; keep_pages keeps the kernel's only copy), and it is counted in
        this batch, before anything else can move it. In a pass the kernel serves from its
        pages it is every file, and a handle for it (made, then released) was over a quarter
        of the daemon's work per close."""
        if self._ranged_file(relpath):
            return None
        if identity.size == 0:
            return self.handle_without_open(inode, relpath, item, identity)
        blocks = self._tiered.kernel_holds_all(relpath, identity)
        if blocks is not None:
            for _, block in blocks:
                if block.data is not None:
                    break  # the daemon holds a copy too: a handle settles the two
            else:
                return KernelRead([-1 if self._planner.read_outside(item) else item],
                                  [identity.size], self._served_whole(blocks), relpath)
        handle = self.handle_without_open(inode, relpath, item, identity)
        if blocks is not None:
            self._kept_whole(handle, blocks)
            return handle
        return handle if self._kernel_dropped_lately(handle) else None

    def waiting(self, relpath: bytes, offset: int, size: int) -> contextlib.AbstractContextManager:
        """Held while a READ of [offset, offset + size) waits (RangeReader.waiting)."""
        return (contextlib.nullcontext() if self._ranges is None
                else self._ranges.waiting(relpath, offset, size))

    def _ranged_file(self, relpath: bytes) -> bool:
        """Its samples are byte-range items of the order in force (module docstring)."""
        return self._ranges is not None and self._ranges.file_of(relpath) >= 0

    def _kernel_dropped_lately(self, handle: OpenFile) -> bool:
        """The kernel's pages of the file were dropped a moment ago, and a reader closed it with
        no READ: it read them before they went (module docstring), served whole from RAM."""
        kernel = self._tiered.kernel
        if kernel is None or not kernel.dropped_lately(handle.inode):
            return False
        handle.kernel_whole = True
        self.kernel_opens += 1
        return True

    def _served(self, key, block) -> int:
        """A block of the tier reaches a reader (a READ, or the kernel's pages): where it came
        from, for the class its file counts in (its costliest block's), once per load (stats)."""
        block.served, origin = True, stats_mod.ORIGIN_RAM if block.served else block.origin
        self._tiered.ram.touch(key, block)
        return origin

    async def read(self, handle: OpenFile, offset: int, size: int) -> bytes:
        handle.read_called = True
        if self._ranges is not None:
            file_index = self._ranges.file_of(handle.relpath)
            if file_index >= 0:
                data = await self._ranges.read(handle.relpath, handle.identity, file_index,
                                               offset, size)
                handle.bytes_served += len(data)
                return data
        block_bytes = self.block_bytes
        identity = handle.identity  # the version the inode is: the only one served
        end = min(offset + size, identity.size)
        if offset >= end:
            if not handle.consume_at_release:
                self._consume(handle)
            return b""
        parts: list[bytes] = []
        for block_index in range(offset // block_bytes, (end - 1) // block_bytes + 1):
            start = block_index * block_bytes
            _note_read(handle, block_index, max(offset, start) - start, min(end - start,
                       block_bytes), min(block_bytes, identity.size - start))
            data = await self._block(handle, block_index)
            lo, hi = max(offset, start) - start, min(end, start + len(data)) - start
            parts.append(data if (lo, hi) == (0, len(data)) else data[lo:hi])
        result = parts[0] if len(parts) == 1 else b"".join(parts)
        handle.bytes_served += len(result)
        if end >= identity.size and not handle.outside and self._read_through(handle):
            # every block read whole, not only the end: a reader that reads the end first
            # (a zip-format torch.load, an np.load of an npz, a Parquet footer) had its file
            # consumed and its blocks dropped at that first READ, and every READ after it
            # read its block again from the source
            if handle.consume_at_release:
                self._prefetcher.read_whole(handle.item, handle.manifest, identity.size,
                                            handle.blocks_read)
            else:
                self._consume(handle)
        self._read_ahead(handle, offset // block_bytes, (end - 1) // block_bytes)
        return result

    def _read_through(self, handle: OpenFile) -> bool:
        """Every block of the handle's version was read: returned by its READs, or, in the
        zero-request mode, held by the kernel, whose pages the reader reads with no READ (a
        block pushed ahead of it). Only there: that mode consumes the file at its close and
        now only gives the blocks their rank after it (`Prefetcher.read_whole`, which keeps
        the kernel's blocks' rank); without it, a file whose earlier blocks were pushed never
        counted as read whole, and the walk read its READ blocks again once RAM let them go.
        The keep-cache mode consumes at once, which would drop pages the reader may not have
        read yet."""
        identity = handle.identity
        count = block_count(identity.size, self.block_bytes)
        if len(handle.blocks_read) == count:
            return True
        if not handle.consume_at_release:
            return False
        ram = self._tiered.ram
        for block_index in range(count):
            if block_index not in handle.blocks_read:
                block = ram.get((handle.relpath, block_index))
                if block is None or not block.in_kernel or block.identity != identity:
                    return False
        return True

    async def _block(self, handle: OpenFile, block_index: int) -> bytes:
        """The block's bytes of the handle's version; StaleFileError if the source holds
        another. Never the other's, even of the same size with nothing served yet: the kernel
        may hold pages of the handle's version that the reader has read or will read (pushed
        ahead, or left by an earlier reader), and the two would mix (cachefs/inodes.py)."""
        key = (handle.relpath, block_index)
        block = self._tiered.lookup(key, handle.identity)  # a block with data, or None
        if block is not None and block.data is not None:  # the hot path: no await
            handle.origin = max(handle.origin, self._served(key, block))
            return block.data
        if self._tiered.kernel_reclaimed(key, handle.identity):
            handle.kernel_reclaimed = True
        if block_index == 0 and not handle.outside:
            # the reader has caught up with the read-ahead of this file's target, or is
            # outside its window: a batch of that target's next files starts with this one
            self._prefetcher.demand_miss(handle.item, handle.manifest)
        # the one clock (freshness.py), so that the simulator's virtual clock measures stalls too
        started_s = now_s()
        fetched = await self._tiered.fetch(key, handle.identity, handle.item, handle.manifest,
                                          demand=True, outside=handle.outside,
                                          read_whole=block_index in handle.blocks_read)
        assert fetched is not None  # only a prefetch (demand=False) may come back empty
        if fetched.origin == stats_mod.ORIGIN_MISS:
            handle.stall_s += now_s() - started_s
        handle.origin = max(handle.origin, fetched.origin)
        cached = self._tiered.ram.get(key)
        if cached is not None:
            cached.served = True
        if fetched.identity != handle.identity:
            self._prefetcher.record_identity(handle.relpath, fetched.identity,
                                             seen_s=fetched.asked_s)
            # One handle, one version: the handle keeps the one the inode is, and its every
            # read fails from now on rather than mix two (errors.StaleFileError); the tier
            # has had the kernel told (TieredCache.source_changed)
            raise errors.StaleFileError(
                f"{handle.relpath!r} changed in the source while it was read")
        return fetched.data

    def _read_ahead(self, handle: OpenFile, first_block: int, last_block: int) -> None:
        sequential = first_block in (handle.next_block, handle.next_block - 1)
        handle.next_block = last_block + 1
        if not sequential or last_block == 0 or self.sequential_blocks == 0:
            return
        total = block_count(handle.identity.size, self.block_bytes)
        wanted = range(last_block + 1, min(total, last_block + 1 + self.sequential_blocks))
        self._prefetcher.read_ahead(handle.relpath, handle.identity, handle.item,
                                   handle.manifest, wanted)
        # those already in RAM go to the kernel's pages: the reader finds them there
        self._tiered.push(handle.relpath, handle.identity, wanted)

    def _consume(self, handle: OpenFile) -> None:
        self._consume_many([handle])

    def _consume_many(self, released: list[OpenFile | KernelRead]) -> None:
        """The files of `released` were read, in this order, in one step of the planner: each
        counts in the epoch that consumed it (its `epoch_record`)."""
        # the same plan: the item numbers are those the handle holds (a manifest with other
        # paths is always a new plan, planner.set_order); else the order it was read for was
        # replaced while it was open: it counts in the epoch it was opened in and consumes
        # nothing of the new order (a KernelRead is numbered by the plan of now)
        serial = self._planner.order_serial
        pending: list[tuple[OpenFile | KernelRead, int]] = []  # and a run's first file left
        for file in released:
            if isinstance(file, KernelRead):
                pending.append((file, 0))
            elif not file.consumed:
                file.consumed = True
                if file.order_serial == serial and not file.outside:
                    pending.append((file, 0))
        # the last file of an order ends its epoch, and the files after it count in the next
        while pending:
            record = self._stats.current
            items: list[int] = []
            sizes_bytes: list[int] = []
            for file, start in pending:
                if isinstance(file, KernelRead):
                    items += file.items[start:]
                    sizes_bytes += file.sizes_bytes[start:]
                else:
                    items.append(file.item)
                    sizes_bytes.append(file.size_bytes)
            left = self._prefetcher.consumed_many(items, sizes_bytes)
            rest: list[tuple[OpenFile | KernelRead, int]] = []
            for file, start in pending:
                if left == 0:
                    rest.append((file, start))
                elif isinstance(file, KernelRead):
                    stop = min(len(file.items), start + left)
                    file.counted.append((record, stop - start,
                                         sum(file.sizes_bytes[start:stop])))
                    left -= stop - start
                    if stop < len(file.items):
                        rest.append((file, stop))
                else:
                    file.epoch_record = record
                    left -= 1
            pending = rest

    def release(self, handle: OpenFile, last: bool = True) -> None:
        """The reader let go of `handle`; `last`: no other handle of the file is open."""
        self.release_many([handle], last)

    def release_many(self, released: list[OpenFile | KernelRead], last: bool = True) -> None:
        """Readers let go of `released`, in this order (the closes of one fanotify batch):
        handles, and files only the kernel held (`closed`); `last`: no other handle of their
        files is open."""
        done: list[OpenFile | KernelRead] = []
        for file in released:
            if isinstance(file, KernelRead):
                done.append(file)
                continue
            if self._ranged_file(file.relpath):
                # its items were counted as they were read (module docstring); the wait of its
                # open (a check of the source) was no item's, and is the epoch's all the same
                if file.stall_s:
                    self._stats.stalled(file.stall_s)
                continue
            if file.kernel_whole:
                # the kernel served what no READ asked for: the whole file, as far as we can
                # tell (a reader that opens a file and reads nothing is counted as reading it)
                file.bytes_served = max(file.bytes_served, file.identity.size)
            elif not file.read_called and file.identity.size != 0:
                continue
            done.append(file)
        # an empty file is read whole by its open (the kernel sends no READ for it): left
        # unconsumed, its position held the cursor, and the read-ahead and the epoch's end
        # with it, for the rest of the order
        self._consume_many([file for file in done if isinstance(file, KernelRead)
                            or file.bytes_served or file.identity.size == 0])
        manifest = self._ranking.manifest
        for file in done:
            try:
                # served whole, no wait, nothing to settle: counted on its own (given a handle's
                # names, stall and manifest, it cost a hot pass 8% more instructions a close)
                if isinstance(file, KernelRead):
                    for record, files, nbytes in file.counted:
                        self._stats.file_read(file.origin, 0.0, nbytes, record=record,
                                              files=files)
                    self._prefetcher.files_read(file.items, manifest, file.origin, 0.0)
                    continue
                self._stats.file_read(file.origin, file.stall_s, file.bytes_served,
                                      record=file.epoch_record,
                                      kernel_reclaimed=file.kernel_reclaimed)
                self._prefetcher.files_read([-1 if file.outside else file.item], file.manifest,
                                            file.origin, file.stall_s)
                if last:
                    self._settle_pages(file)
            except Exception:  # noqa: BLE001 - one file's accounting must not end the others'
                log.exception("unexpected error accounting for the read of %r", file.relpath)

    def _settle_pages(self, handle: OpenFile) -> None:
        """What the kernel keeps of a file the last reader let go (module docstring)."""
        # its rank as the plan has it now: the tier's may be a re-rank behind (put off until
        # room is needed, RamTier.defer_ranks), and settling that here re-ranked all of RAM
        # after every epoch switch, in a pass the kernel serves from its pages
        first = self._tiered.ram.get((handle.relpath, 0))
        if handle.outside or self._ranking.kernel_may_keep(handle.item, first):
            self._tiered.hand_to_kernel(handle.relpath, handle.identity, handle.blocks_read)
        elif handle.read_called or handle.kernel_whole:
            self._tiered.keep_pages(handle.relpath, handle.identity, handle.blocks_read)


def _note_read(handle: OpenFile, block_index: int, lo: int, hi: int, block_len: int) -> None:
    """A READ of the handle asks for bytes [lo, hi) of a block of `block_len` bytes: once its
    READs have covered it whole, the block is read (`blocks_read`). A block read in part
    stays the daemon's: the kernel holds only the pages asked for (and its read-ahead's), and
    handing it over made the next read of the file read it again from the source and count
    a page loss the kernel never had."""
    if block_index in handle.blocks_read:
        return
    if lo == 0 and hi >= block_len:  # the usual case: one READ asks for the whole block
        handle.blocks_read.add(block_index)
        return
    merged: list[tuple[int, int]] = []
    for extent_lo, extent_hi in sorted([*handle.blocks_partly_read.get(block_index, ()),
                                        (lo, hi)]):
        if merged and extent_lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], extent_hi))
        else:
            merged.append((extent_lo, extent_hi))
    if merged[0][0] == 0 and merged[0][1] >= block_len:
        handle.blocks_read.add(block_index)
        handle.blocks_partly_read.pop(block_index, None)
    else:
        handle.blocks_partly_read[block_index] = merged
