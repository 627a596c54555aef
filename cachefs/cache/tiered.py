"""RAM -> SSD -> source: one fetch per block at a time, shared by readers and the prefetcher.

`fetch` is the only way a block gets into RAM. It de-duplicates concurrent requests for the
same block with a dict of in-flight fetches (a reader that asks for a block the prefetcher is
already reading waits for that read), reserves RAM before any I/O so the budget holds with
fetches in flight, tries the SSD tier, then the source, and hands blocks read from the source
to the SSD tier's admission queue.

SSD admission never delays a reader: it happens after the block is in RAM, in worker tasks fed
by a bounded channel; when the channel is full the block is simply not admitted (cache-once
admits something else later). Any SSD error is a warning and a miss, never a failed read
(mountpoint-s3's rule for a multi-level cache). Every SSD call runs through `run_ssd`, the
worker-thread hop the wiring gives (cachefs/threads.py; the simulator's runs them inline).

What it asks of the plan is `BlockRanking` (cachefs/ranking.py implements it): a block's rank,
an item's number in the manifest in force, and a note when the kernel lost a file only it held.
The ranking is built before this cache and never refers to it.

A block read from the source whose identity differs from the one the caller expected means the
file changed: every cached copy of the file is dropped, and `on_source_changed` (the kernel's
attributes and pages of it, fuse_ops) is told, and the new bytes are served.

The kernel's page cache is the fastest tier (cachefs/pagecache.py carries out the stores and
drops): `push` stores blocks held in RAM into it for the kernel to serve without a READ, and
every copy it holds is a RAM-tier block marked `in_kernel`, charged to the budget. When such a
block leaves the tier, the RAM tier has the kernel drop the pages of its file (cachefs/cache/
ram.py, "Kernel copies").
`KernelInodes` is what this module needs to know of the kernel's inodes (fuse_ops's table
implements it): which inode to store into, if the kernel holds one with this file's identity.

In-flight fetches are never cancelled when the plan changes (an epoch switch, a new order): a
reader may be waiting on any of them, and a finished fetch is simply kept or dropped by the
priorities in force when it lands. A fetch is asked for with the file's item number and the
manifest that number indexes; if another manifest came into force meanwhile, the item is
renumbered by path when the block lands (`item_now`, prefetch.py's module docstring), so every
block in RAM carries its item number in the manifest in force.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from cachefs import stats as stats_mod
from cachefs import threads
from cachefs.cache.ram import BlockKey, RamBlock, RamTier, block_count
from cachefs.freshness import NEVER_S, now_s
from cachefs.pagecache import KernelPages
from cachefs.recent import RecentMap
from cachefs.source import BlockData, Source, SourceIdentity

log = logging.getLogger(__name__)

ADMISSION_QUEUE_BLOCKS = 64
SSD_THREADS = 4  # SSD calls in flight at once, and admission workers
# changed files remembered for the admission queue (ADMISSION_QUEUE_BLOCKS blocks at most
# wait there, so far fewer suffice)
CHANGES_REMEMBERED = 4096


@dataclass
class Fetched:
    data: bytes
    identity: SourceIdentity
    origin: int  # stats.ORIGIN_SSD, ORIGIN_PREFETCHED (from source ahead) or ORIGIN_MISS
    from_source: bool
    # freshness.now_s() before the source was asked: its look at the file (`identity`) came
    # after this; NEVER_S for a copy of a version the caller named (the SSD tier's)
    asked_s: float = NEVER_S
    # a read ahead that readers' READs waited for, which return the whole block: their
    # replies give the kernel its pages, and a push of them would store them a second time
    read_whole_on_landing: bool = False


class _Flight:
    __slots__ = ("done", "result", "error", "read_whole")

    def __init__(self):
        self.done = trio.Event()
        self.result: Fetched | None = None
        self.error: OSError | None = None
        # a READ that returns the whole block waits for it (`fetch`'s `read_whole`)
        self.read_whole = False


def block_length(identity: SourceIdentity, block_index: int, block_bytes: int) -> int:
    return max(0, min(block_bytes, identity.size - block_index * block_bytes))


class KernelInodes(Protocol):
    def inode_of(self, relpath: bytes) -> int | None:
        """The inode the kernel knows the file by, if any."""

    def store_target(self, relpath: bytes, identity: SourceIdentity) -> int | None:
        """The inode to store pages of this version of the file into, or None: the kernel
        does not hold the file, or holds other attributes or pages of another version."""


class BlockRanking(Protocol):
    """What the tiered cache asks of the plan (cachefs/ranking.py)."""

    def priority_of(self, item: int, block_index: int, identity: SourceIdentity | None
                    ) -> float | None:
        """The block's rank in RAM (smaller = sooner), None: not to be kept."""

    def item_now(self, relpath: bytes, item: int, manifest) -> tuple[int, object]:
        """`item` of `manifest`, numbered in the manifest in force, with that manifest."""

    def note_kernel_loss(self) -> None:
        """The kernel forgot a file of the manifest that only it held (kernel_forgot)."""


class NoKernelInodes:
    """A read path with no kernel data plane: nothing is ever stored."""

    def inode_of(self, relpath: bytes) -> int | None:
        return None

    def store_target(self, relpath: bytes, identity: SourceIdentity) -> int | None:
        return None


class TieredCache:
    def __init__(self, ram: RamTier, source: Source, stats: stats_mod.Stats, block_bytes: int,
                 ranking: BlockRanking, *, ssd=None, run_ssd: threads.RunSync | None = None,
                 kernel: KernelPages | None = None, kernel_inodes: KernelInodes | None = None,
                 on_source_changed: Callable[[bytes, SourceIdentity, float | None], None]
                 | None = None):
        self.ram = ram
        self.source = source
        self.stats = stats
        self.block_bytes = block_bytes
        self.priority_of = ranking.priority_of
        self.item_now = ranking.item_now
        self._ranking = ranking
        self.ssd = ssd
        self._run_ssd = run_ssd if run_ssd is not None else threads.pool(SSD_THREADS)
        self.inflight: dict[BlockKey, _Flight] = {}
        # (relpath, identity) of a file that changed at the source, once its copies are gone
        self._on_source_changed = on_source_changed or (lambda relpath, identity, asked_s: None)
        self.admissions_skipped = 0
        # path -> the version a change was last reported to (`source_changed`): a block of
        # another one still queued for the SSD tier is not admitted (`_admission_worker`)
        self._changed_to: RecentMap[bytes, SourceIdentity] = RecentMap(CHANGES_REMEMBERED)
        self.changes_found = 0  # files found changed, once a version (`source_changed`)
        self.kernel_reclaims = 0  # blocks only the kernel held whose pages it dropped
        self._admit_send, self._admit_recv = trio.open_memory_channel(ADMISSION_QUEUE_BLOCKS)
        self._nursery: trio.Nursery | None = None
        self.kernel = kernel
        self._looking_up: set[bytes] = set()  # files `push` asked the kernel to look up
        self.kernel_inodes: KernelInodes = NoKernelInodes()
        if kernel is not None:
            assert kernel_inodes is not None, "a kernel data plane needs the kernel's inodes"
            self.kernel_inodes = kernel_inodes

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        """SSD admission workers; also the nursery for background tier work."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.ssd is not None:
                async with self._admit_recv:
                    for _ in range(SSD_THREADS):
                        nursery.start_soon(self._admission_worker, self._admit_recv.clone())
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                # the mount is stopping: a change seen now (a read landing late) starts
                # nothing in the nursery, which closes once its tasks end
                self._nursery = None

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, key: BlockKey, identity: SourceIdentity) -> RamBlock | None:
        """The RAM copy of a block, if it belongs to this version of the file. No awaits."""
        block = self._held(key, identity)
        if block is None or block.data is None:
            return None  # a block only the kernel holds, asked for by a READ: its pages went
        return block

    def holds(self, key: BlockKey, identity: SourceIdentity) -> bool:
        """The tier holds this version of the block, in the daemon or the kernel."""
        return self._held(key, identity) is not None

    def _held(self, key: BlockKey, identity: SourceIdentity) -> RamBlock | None:
        """The tier's block, if of this version of the file; one of another is dropped."""
        block = self.ram.get(key)
        if block is not None and block.identity != identity:
            self.ram.drop(key)
            return None
        return block

    async def fetch(self, key: BlockKey, identity: SourceIdentity | None, item: int,
                    manifest, *, demand: bool, expected_bytes: int | None = None,
                    read_whole: bool = False, outside: bool = False) -> Fetched | None:
        """The block's bytes, from SSD or source; kept in RAM if its priority earns room.

        A prefetch (`demand=False`) that finds no room in RAM does no I/O and returns None.
        Without an `identity` the block comes from the source (the SSD tier can only be trusted
        against a known identity), and RAM is reserved for `expected_bytes`. `item`: the
        file's index in `manifest` (-1: in none). `read_whole`: the caller's READs return the
        whole block, so the kernel will hold it (`Fetched.read_whole_on_landing`). `outside`:
        a read not the order's (cachefs/reader.py), served as with no order: its block ranks
        as one of no known future (LRU, displacing no block of the order) until RAM is next
        ranked by the plan, numbered by its item all the same, and no target counts its read.
        """
        while (flight := self.inflight.get(key)) is not None:
            if read_whole:
                flight.read_whole = True
            await flight.done.wait()
            if flight.error is not None:
                raise OSError(flight.error.errno, flight.error.strerror, key[0])
            result = flight.result
            if result is None:
                continue  # a prefetch that found no room: fetch it ourselves
            if identity is not None and result.identity != identity:
                # a fetch of another version (read ahead before the file changed): not the
                # bytes asked for; fetch them ourselves, at the version the source has now
                continue
            if demand and result.from_source:
                # the reader waited for a source read started by someone else: still a stall
                return Fetched(result.data, result.identity, stats_mod.ORIGIN_MISS, True,
                               result.asked_s)
            return result
        flight = _Flight()
        self.inflight[key] = flight
        try:
            flight.result = await self._load(key, identity, item, manifest, demand,
                                             expected_bytes, outside)
            return flight.result
        except OSError as exc:
            flight.error = exc
            raise
        except BaseException:
            flight.error = OSError(errno.EIO, "fetch interrupted")
            raise
        finally:
            self._flight_over(key, flight)

    def start_fetch(self, key: BlockKey, identity: SourceIdentity | None, item: int,
                    manifest, *, expected_bytes: int | None = None,
                    on_done: Callable[[Fetched | None, OSError | None], None]) -> bool:
        """`fetch(demand=False)` of a block only the source can give, begun now with no task
        waiting (`Source.start_block`): `on_done(fetched, error)` is called on the trio thread
        once it has landed, with what `fetch` would return or the OSError it would raise;
        `fetched` None: the source's read is to be made again its own way, by `fetch`. False,
        and nothing begun, where `fetch` has more to do than one source read, or must do
        nothing: the block is in flight already, the SSD tier holds a copy of the file, RAM
        has no room for it, or the source has no thread free now."""
        if (key in self.inflight or (identity is not None and self._ssd_has(key, identity))
                or not self.source.can_start_block()):
            return False  # (no thread: nothing reserved, so nothing evicted, for a read not begun)
        relpath, block_index = key
        item, manifest = self.item_now(relpath, item, manifest)
        reserved, known = self._reserve(key, identity, item, demand=False,
                                        expected_bytes=expected_bytes)
        if not reserved:
            return False
        flight = _Flight()
        asked_s = now_s()

        def landed(block: BlockData | None, error: OSError | None) -> None:
            fetched, held = None, reserved
            try:
                if block is not None:
                    fetched = self._from_source(key, identity, block, False, asked_s)
                    held = 0  # `_keep` keeps or gives back the reservation
                    self._keep(key, fetched, item, manifest, reserved)
            except Exception:  # noqa: BLE001 - as a fetch's: one block's failure, not the mount's
                log.exception("unexpected error keeping a block read ahead: %r", key)
                fetched, error = None, OSError(errno.EIO, "fetch interrupted")
            finally:
                if held:
                    self.ram.unreserve(held)
                flight.result, flight.error = fetched, error
                self._flight_over(key, flight)
            if fetched is not None:
                fetched.read_whole_on_landing = flight.read_whole
            on_done(fetched, error)

        try:
            begun = self.source.start_block(relpath, block_index, self.block_bytes, item=item,
                                            expected_bytes=known or 0,
                                            on_done=landed)
        except BaseException:
            self.ram.unreserve(reserved)
            raise
        if not begun:
            self.ram.unreserve(reserved)
            return False
        self.inflight[key] = flight
        return True

    def _flight_over(self, key: BlockKey, flight: _Flight) -> None:
        """The fetch of `key` has its outcome in `flight`: whoever waits for it is told."""
        del self.inflight[key]
        flight.done.set()

    async def fresh_identity(self, relpath: bytes, *, join_flight: bool = True
                             ) -> tuple[SourceIdentity, bool, float]:
        """The file's identity now, whether that meant waiting for its data, and when the
        source was asked (freshness.now_s()): from a source read of its first block already
        in flight, else from an open and fstat at the source (which also checks that it is
        readable). `join_flight=False`: always from a new open, for a caller that must know
        what the source says after it asked (a read in flight may have looked at the file
        before the version the caller has seen)."""
        flight = self.inflight.get((relpath, 0)) if join_flight else None
        if flight is not None:
            await flight.done.wait()
            if flight.result is not None and flight.result.from_source:
                return flight.result.identity, True, flight.result.asked_s
        asked_s = now_s()
        return await self.source.check_readable(relpath), False, asked_s

    async def _load(self, key: BlockKey, identity: SourceIdentity | None, item: int, manifest,
                    demand: bool, expected_bytes: int | None, outside: bool = False
                    ) -> Fetched | None:
        relpath, block_index = key
        item, manifest = self.item_now(relpath, item, manifest)
        reserved, known = self._reserve(key, identity, item, demand=demand,
                                        expected_bytes=expected_bytes, outside=outside)
        if not demand and not reserved:
            return None
        try:
            fetched = await self._read_ssd(key, identity) if identity else None
            if fetched is None:
                item, manifest = self.item_now(relpath, item, manifest)  # after the await
                fetched = await self._read_source(key, identity, demand,
                                                  -1 if outside else item, known or 0)
        except BaseException:
            if reserved:
                self.ram.unreserve(reserved)
            raise
        self._keep(key, fetched, item, manifest, reserved, outside)
        return fetched

    def _reserve(self, key: BlockKey, identity: SourceIdentity | None, item: int, *,
                 demand: bool, expected_bytes: int | None, outside: bool = False
                 ) -> tuple[int, int | None]:
        """RAM for a block before it is read, if its rank earns it (`fetch`): the bytes
        reserved (0: none), and the block's length if known."""
        # an estimate of 0 (an empty file's last size) is 0, not "unknown": a whole block
        # reserved for it took RAM the walk had not found room for, which evicted the kept
        # head of the next epoch, or failed, and the walk started it again forever
        known = (block_length(identity, key[1], self.block_bytes) if identity
                 else None if expected_bytes is None
                 else min(expected_bytes, self.block_bytes))
        charge = self.ram.charge_of(self.block_bytes if known is None else known)
        if demand and self.ram.reserve_free(charge):
            # a reader waits for it either way: its rank decides only an eviction now, and
            # whether it stays once read (asked then, `_keep`): one rank a block, not two
            return charge, known
        priority = math.inf if outside else self.priority_of(item, key[1], identity)
        return (charge if priority is not None and self.ram.reserve(charge, priority)
                else 0), known

    def _keep(self, key: BlockKey, fetched: Fetched, item: int, manifest, reserved: int,
              outside: bool = False) -> None:
        """A block read has landed: counted if the source gave it, and kept in RAM if its
        rank earns the `reserved` room (else that goes back)."""
        try:
            # the manifest may have changed during the read: the block lands numbered anew
            item, manifest = self.item_now(key[0], item, manifest)
            if fetched.from_source:
                self.stats.source_fetched(item, key, len(fetched.data))
            block = RamBlock(fetched.data, fetched.identity, item, fetched.origin)
            priority = math.inf if outside else self.priority_of(item, key[1], fetched.identity)
            if reserved and priority is not None:
                block.priority = priority
                self.ram.insert(key, block, reserved)
                reserved = 0
        finally:
            if reserved:
                self.ram.unreserve(reserved)

    def _ssd_has(self, key: BlockKey, identity: SourceIdentity) -> bool:
        """The SSD tier holds the block, of this version or another (whose read drops it)."""
        return self.ssd is not None and (self.ssd.contains(key, identity)
                                         or self.ssd.holds_other_version(key, identity))

    async def _read_ssd(self, key: BlockKey, identity: SourceIdentity) -> Fetched | None:
        if self.ssd is None:
            return None
        held = self.ssd.contains(key, identity)  # `_ssd_has`, with the answer kept
        if not held and not self.ssd.holds_other_version(key, identity):
            return None
        # one held of another version is stale (the file changed, perhaps while unmounted):
        # `read` drops and counts it, which frees its budget for the new version's
        try:
            data = await self._run_ssd(self.ssd.read, key, identity)
        except Exception:  # a tier failure is a miss, never a failed read
            log.warning("SSD tier read failed for %r; reading the source", key, exc_info=True)
            self.stats.ssd_errors += 1
            return None
        if not held or data is None:
            return None
        self.stats.ssd_read(len(data))
        return Fetched(data, identity, stats_mod.ORIGIN_SSD, False)

    async def _read_source(self, key: BlockKey, identity: SourceIdentity | None,
                           demand: bool, item: int, expected_bytes: int = 0) -> Fetched:
        """`item`: the file's in the manifest in force now (the source's observer, the
        storage targets, need not search the manifest for it); `expected_bytes`: the
        block's length as last seen (0: unknown), for the source's read pool."""
        relpath, block_index = key
        asked_s = now_s()
        block = await self.source.read_block(relpath, block_index, self.block_bytes,
                                             background=not demand, item=item,
                                             expected_bytes=expected_bytes)
        return self._from_source(key, identity, block, demand, asked_s)

    def _from_source(self, key: BlockKey, identity: SourceIdentity | None, block: BlockData,
                     demand: bool, asked_s: float) -> Fetched:
        """A block the source gave (asked at `asked_s`), for a fetch that expected
        `identity`: a change of the file is acted on, and the block offered to the SSD."""
        if identity is not None and block.identity != identity:
            self.source_changed(key[0], block.identity, asked_s)
        self._queue_admission(key, block.identity, block.data)
        origin = stats_mod.ORIGIN_MISS if demand else stats_mod.ORIGIN_PREFETCHED
        return Fetched(block.data, block.identity, origin, True, asked_s)

    # -- the kernel's page cache ------------------------------------------------------------

    def file_blocks(self, relpath: bytes, identity: SourceIdentity
                    ) -> list[tuple[BlockKey, RamBlock]] | None:
        """Every block of this version of the file, if the tier holds them all (in the
        daemon or the kernel), else None."""
        held = self.ram.blocks
        if identity.size <= self.block_bytes:  # one block: most samples (once per file read)
            key = (relpath, 0)
            block = held.get(key)
            return [(key, block)] if block is not None and block.identity == identity else None
        blocks = []
        for block_index in range(block_count(identity.size, self.block_bytes)):
            key = (relpath, block_index)
            block = held.get(key)
            if block is None or block.identity != identity:
                return None
            blocks.append((key, block))
        return blocks

    def push(self, relpath: bytes, identity: SourceIdentity, block_indices, *,
             looked_up: bool = False, still_wanted: Callable[[], bool] | None = None) -> None:
        """Store blocks the daemon holds into the kernel's page cache, ahead of the reader.
        Nothing if the kernel does not hold the inode with this identity; if it has no inode
        for the file at all (not looked up yet, or forgotten), it is asked to look the file up
        and the push is tried once more after (pagecache.py `look_up`), if `still_wanted()`
        says so then (a reader may have read the file meanwhile)."""
        kernel = self.kernel
        if kernel is None:
            return
        held = self.ram.blocks
        wanted = []
        for block_index in block_indices:
            key = (relpath, block_index)
            block = held.get(key)
            if (block is not None and not block.in_kernel and block.data is not None
                    and block.identity == identity):
                wanted.append((key, block))
        if not wanted:
            return  # the walk's usual case: the kernel has it all, or RAM none of it yet
        inode = self.kernel_inodes.store_target(relpath, identity)
        if inode is None:
            if (not looked_up and kernel.can_look_up and relpath not in self._looking_up
                    and self.kernel_inodes.inode_of(relpath) is None):
                self._looking_up.add(relpath)

                def push_again() -> None:
                    self._looking_up.discard(relpath)
                    if still_wanted is None or still_wanted():
                        self.push(relpath, identity, block_indices, looked_up=True)
                kernel.look_up(relpath, push_again)
            return
        for key, block in wanted:
            self.ram.add_kernel_copy(key, block)
            kernel.store(inode, key[1] * self.block_bytes, block.data)

    def hand_to_kernel(self, relpath: bytes, identity: SourceIdentity,
                       blocks_read: set[int]) -> bool:
        """A reader is done with this file: if the kernel holds all of it (every block was
        pushed to it or returned by a READ, `blocks_read`), the daemon's copy goes (the RAM
        tier charges the kernel's instead). Otherwise False, and the kernel's pages are
        dropped: pages the budget does not count are not left in the kernel."""
        if self.kernel is None:
            return False
        blocks = self.kernel_holds_all(relpath, identity, blocks_read)
        if blocks is None or not self.ram.hand_to_kernel(blocks):
            self.drop_pages(relpath, identity.size)
            return False
        return True

    def keep_pages(self, relpath: bytes, identity: SourceIdentity,
                   blocks_read: set[int]) -> None:
        """A reader is done with a file read again, but not soon: the kernel keeps its pages
        beside the daemon's copy while the budget has free room for them (RamTier.
        keep_kernel_copies), else they are dropped now."""
        if self.kernel is None:
            return
        blocks = self.kernel_holds_all(relpath, identity, blocks_read)
        if blocks is not None and not all(block.data is not None for _, block in blocks):
            # the kernel holds the only copy of some of it (handed over earlier): it stays
            # there, charged as pages; dropping it would lose a file the policy keeps, and
            # keeping it as a duplicate would let `reserve` give it up as one
            return
        if blocks is None or not self.ram.keep_kernel_copies(blocks):
            self.drop_pages(relpath, identity.size)

    def kernel_holds_all(self, relpath: bytes, identity: SourceIdentity,
                         blocks_read: set[int] | frozenset = frozenset()
                         ) -> list[tuple[BlockKey, RamBlock]] | None:
        """Every block of this version of the file, if the kernel holds them all (pushed to
        it, or returned by a READ of the reader done with it: `blocks_read`), else None."""
        blocks = self.file_blocks(relpath, identity)
        if blocks is None:
            return None
        for key, block in blocks:
            if not block.in_kernel and key[1] not in blocks_read:
                return None
        return blocks

    def drop_pages(self, relpath: bytes, size_bytes: int | None = None) -> None:
        """Drop the kernel's pages of a file (the daemon keeps its own copy, if any).
        `size_bytes`: the file's size, if its first block may have left the tier."""
        if self.kernel is not None:
            self.ram.drop_file_pages(relpath, size_bytes)

    def kernel_reclaimed(self, key: BlockKey, identity: SourceIdentity) -> bool:
        """Whether a READ asking for this block shows that the kernel reclaimed pages it held
        alone: page cache is reclaimable (memory pressure, `drop_caches`, and these VMs'
        proactive reclaim, which was seen taking a file's pages within a second of their
        store). Counted, and the ranking told, as for a forgotten inode (`kernel_forgot`);
        the READ is then served from the SSD tier or the source, and counted as that."""
        block = self.ram.get(key)
        if block is None or block.data is not None or block.identity != identity:
            return False
        self.kernel_reclaims += 1
        if block.item >= 0:
            self._ranking.note_kernel_loss()
        return True

    def kernel_forgot(self, relpath: bytes) -> None:
        """The kernel forgot the file's inode, and its pages with it: a loss if only the
        kernel held some of the file (`BlockRanking.note_kernel_loss`)."""
        block = self.ram.get((relpath, 0))
        if block is not None and block.data is None and block.item >= 0:
            self._ranking.note_kernel_loss()
        self.ram.kernel_pages_gone(relpath)

    # -- changes ---------------------------------------------------------------------------

    def source_changed(self, relpath: bytes, identity: SourceIdentity,
                       asked_s: float | None = None) -> None:
        """Drop every cached copy of `relpath` that is not of `identity` (and the source's
        remembered stat of another version), and tell `on_source_changed`. `asked_s`: when
        the look that saw `identity` was asked, if it may land after a look at a newer
        version (a source read: the kernel's inode of that newer version stays, trusted no
        more, cachefs/kernel_invalidation.py); None: a look just asked, or one whose order
        the caller checked."""
        stale = [key for key, block in self.ram.blocks.items()
                 if key[0] == relpath and block.identity != identity]
        for key in stale:
            self.ram.drop(key)
        self.source.distrust_stat(relpath, identity)
        if self._changed_to.get(relpath) != identity:
            # counted and logged here, once a version, whoever found it (a sweep, a lookup or
            # open, the read-ahead, a read): several of them often find one change
            log.info("source file changed: %r", relpath)
            self.changes_found += 1
        self._changed_to.put(relpath, identity)
        if self.ssd is not None and self._nursery is not None:
            # out of the SSD tier's index at once, here (no I/O): a drop that waited its turn
            # in the tier's threads left a read of the old version (a handle opened on it, a
            # read-ahead queued) served from the SSD meanwhile
            forgotten = self.ssd.forget_file(relpath, identity)
            if forgotten:
                self._nursery.start_soon(self._unlink_ssd_entries, relpath, forgotten)
        self._on_source_changed(relpath, identity, asked_s)

    async def _unlink_ssd_entries(self, relpath: bytes, keys: list) -> None:
        try:
            await self._run_ssd(self.ssd.unlink_forgotten, keys)
        except Exception:
            log.warning("SSD tier: could not remove entries of %r", relpath, exc_info=True)

    # -- SSD admission ---------------------------------------------------------------------

    def _queue_admission(self, key: BlockKey, identity: SourceIdentity, data: bytes) -> None:
        if self.ssd is None or not (self.ssd.has_room(len(data))
                                    or self.ssd.holds_other_version(key, identity)):
            return  # full (unless the block replaces its own stale entry: `SsdTier.admit`)
        try:
            self._admit_send.send_nowait((key, identity, data))
        except trio.WouldBlock:
            self.admissions_skipped += 1  # never make a reader wait for the SSD

    async def _admission_worker(self, receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for key, identity, data in receive:
                # A block read before a change was found, admitted after the change took the
                # old version's entries out, stayed in the tier (cache-once), across restarts
                # too: not admitted, and taken out again if the change came while it was
                # being written
                if self._changed_to.get(key[0], identity) != identity:
                    continue
                try:
                    admitted = await self._run_ssd(self.ssd.admit, key, identity, data)
                    current = self._changed_to.get(key[0], identity)
                    if admitted and current != identity:
                        await self._run_ssd(self.ssd.unlink_forgotten,
                                            self.ssd.forget_file(key[0], current))
                        continue
                except Exception:
                    log.warning("SSD tier admission failed for %r", key, exc_info=True)
                    self.stats.ssd_errors += 1
                    continue
                if admitted:
                    self._rerank_admitted(key, identity)

    def _rerank_admitted(self, key: BlockKey, identity: SourceIdentity) -> None:
        """A block consumed before its admission finished was ranked while the SSD did not
        hold it yet, and stayed in RAM for the next epoch as well: the tiers overlapped (the
        simulator saw a third of the retained blocks also on SSD when readers missed). Rank it
        again now that the SSD holds it; `priority_of` drops it if it is only kept for later."""
        block = self.ram.get(key)
        if block is None or block.identity != identity:
            return
        priority = self.priority_of(block.item, key[1], identity)
        if priority is None:
            self.ram.drop(key)
        elif priority != block.priority:
            self.ram.set_priority(key, priority)
