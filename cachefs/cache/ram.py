"""The RAM tier: blocks ordered by next use, within a byte budget that is never exceeded.

Each resident block carries a priority: the planner's next use of its item (smaller is
sooner), plus a small fraction by block index so a file's blocks keep their order. A block
outside any order has priority infinity and is evicted before anything with a known future,
least recently used first (that is the "plain cache" of a mount with no order).

Room is made by one rule, `reserve(nbytes, priority)`: evict blocks whose priority is strictly
farther than the one asking (or, between blocks with no known future, less recently used),
farthest first, until the bytes fit; if they do not, the caller
gets False and does not cache (a demand read is then served without being kept). In-flight
fetches reserve their bytes before they start, so resident plus reserved bytes never exceed the
budget.

Priorities change when an item is consumed or an epoch switches. A re-rank may be put off
(`defer_ranks`) until the order is next read: by a `reserve` that must evict, by
`farthest_priority` or by `set_priority`; a `rebuild` gives every priority anew, and the ones
put off are dropped. In a pass the kernel serves from its pages nothing reads the order until
the epoch switches and re-ranks everything, so the re-rank of each consumption (a push into
the heap per block, about a quarter of the daemon's work per file closed) is not done at all.
Nor while the budget has room: a reserve that fits evicts nothing, so no rank is read (a
reader off the order reserves for every file it reads, and settling the re-rank of the file
before it was 3-5% of the daemon's instructions a file in the simulator). Blocks with a known
future are in an eviction heap, which is lazy: every change pushes a new (priority, lru_seq)
tuple, and a popped tuple that no longer matches its block is skipped. The pushes themselves
wait until the heap is next read (`_heaped`, before an eviction): a block read for a reader
and consumed at its close, on a mount with room, was pushed for nothing, a sift through a
heap of every block held (a reader off the order lands one per file). Blocks with no known
future are in an ordered dict, least recently used first, so that using one (`touch`, once per
file read on a mount with no order) is a move, not a push. Those go first, as their priority says.
`rebuild` redoes both when every priority changes at once.

Kernel copies (the data plane, cachefs/pagecache.py). A block whose bytes the kernel's page
cache holds for the mount is marked `in_kernel`: the kernel's pages of a file are a view of the
tier's blocks, never of anything else. A block is held by the daemon (`data`), by the kernel,
or by both. Its charge: its `nbytes` while the daemon holds it, its pages (`nbytes` rounded up
to whole pages) when only the kernel does, and both when both are kept after its reader left
(`kept_twice`). Both hold it, uncharged, between a push (the read-ahead window's files) and the
release of its reader. Then one of three things happens (cachefs/reader.py `_settle_pages`):
the daemon's copy goes (a file read again soon, or never); both stay (`keep_kernel_copies`: a
file read again later, while the budget has free room for its pages); or the kernel's pages
go. Pages kept twice are the first thing `reserve` gives up, before any block is evicted: they
duplicate the daemon's bytes, so dropping them loses nothing, and keeping them while memory is
free spares an invalidation per file read (a reader that does not follow the order, issue
13's case 8, would otherwise pay one per file). Whenever the kernel's pages of a file must go,
`drop_kernel_pages(relpath)` (the mount's: an `invalidate_inode` of the file's inode) is
called, so the kernel holds nothing of the mount's that the budget does not count.

Per item, the tier counts the resident blocks the kernel holds too (`kernel_blocks_of`, an
array by manifest item, kept as blocks come, go and change hands, and made again when a new
manifest numbers the items anew): the read-ahead's walk passes over the files the kernel holds
whole a stretch of its list at a time, where a look at each block was most of its work.

A block knows whether it is resident (`resident`, set as it is inserted and cleared as it
leaves): a close of a file the kernel alone held is counted again from the block alone, with
no look up by key (cachefs/reader.py `AloneFile`). Such a block has no data of its own, never
gets it back (a new block is inserted), and leaves the tier when the kernel's copy goes.

Bookkeeping. Each block also costs the daemon memory of its own: the block, its key, its heap
entries and the inode table's entry of its file (cachefs/inodes.py), about 1 KB in all, which
with one-byte samples outweighs the data a thousandfold. Every block is charged
`block_overhead_bytes` besides its bytes (`BLOCK_OVERHEAD_BYTES` on a mount, measured by
tests/test_planner.py), so the daemon's memory stays within the budget plus a fixed base
however small the samples are.

Invariant: `used_bytes == sum(charge of resident b) + reserved_bytes <= budget_bytes`, where
a block's charge is its bytes or pages plus `block_overhead_bytes`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import mmap
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)

BlockKey = tuple  # (relpath: bytes, block_index: int)
PAGE_BYTES = mmap.PAGESIZE


@dataclass(eq=False, slots=True)
class RamBlock:
    data: bytes | None  # None: only the kernel's page cache holds the bytes
    identity: SourceIdentity
    item: int  # manifest index of the file, -1 if not in the manifest
    origin: int  # stats.ORIGIN_*: how it got here (prefetched from source, or from SSD)
    priority: float = math.inf
    served: bool = False  # returned to a reader at least once since it was loaded
    lru_seq: int = field(default=0)
    in_kernel: bool = False  # the kernel's page cache holds these bytes for the mount
    kept_twice: bool = False  # daemon and kernel copies both kept and charged (module docstring)
    resident: bool = False  # in the tier's `blocks` (module docstring)
    nbytes: int = -1  # the block's length; set from `data` at construction

    def __post_init__(self):
        if self.nbytes < 0:
            assert self.data is not None, "a block without data is made with its nbytes"
            self.nbytes = len(self.data)

    @property
    def held_bytes(self) -> int:
        """Bytes of memory its contents take: the daemon's copy, the kernel's pages, or both
        (kept twice)."""
        if self.data is None:
            return page_bytes(self.nbytes)
        return self.nbytes + page_bytes(self.nbytes) if self.kept_twice else self.nbytes


def block_count(size_bytes, block_bytes: int):
    """Blocks of a file of `size_bytes` (an empty file has one, empty); of each file, for an
    array of sizes."""
    blocks = -(-size_bytes // block_bytes)
    return np.maximum(blocks, 1) if isinstance(blocks, np.ndarray) else max(1, blocks)


def page_bytes(nbytes: int) -> int:
    """The page cache's size for `nbytes` of a file: whole pages."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES



# What a block's bookkeeping costs at most (module docstring), with a margin over the
# ~1 KB measured on CPython 3.11 by tests/test_planner.py::test_block_overhead_covers_bookkeeping
BLOCK_OVERHEAD_BYTES = 1536
# pushes put off into the eviction heap are made by one heapify when they are more than this
# fraction of it: a heapify costs about 2 comparisons a tuple, a push about log2 of the heap
HEAPIFY_FRACTION = 8


class RamTier:
    def __init__(self, budget_bytes: int, *, block_bytes: int,
                 block_overhead_bytes: int = BLOCK_OVERHEAD_BYTES,
                 drop_kernel_pages: Callable[[bytes], None] = lambda relpath: None):
        self.budget_bytes = budget_bytes
        self.block_bytes = block_bytes  # a file's block i holds bytes [i, i+1) * block_bytes
        self.block_overhead_bytes = block_overhead_bytes
        self.resident_bytes = 0
        self.reserved_bytes = 0
        self.blocks: dict[BlockKey, RamBlock] = {}
        self._heap: list[tuple[float, int, BlockKey]] = []  # blocks with a known future
        self._unheaped: list[tuple[float, int, BlockKey]] = []  # pushes not made yet
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # the others, oldest use first
        self._seq = itertools.count()
        self.evictions = 0
        self.kernel_bytes = 0  # pages of the blocks the kernel's page cache holds
        # makes the kernel drop its pages of a file (the data plane; module docstring)
        self._drop_kernel_pages = drop_kernel_pages
        # first blocks of files kept twice, oldest first: what `reserve` gives up first
        self._kept_twice: deque[tuple[BlockKey, RamBlock]] = deque()
        # sets the priorities of a re-rank put off (`defer_ranks`), if there is one
        self._deferred_ranks: Callable[[], None] | None = None
        # per item (a file block's `item`): its blocks resident here that the kernel holds
        # too (`kernel_blocks_of`). A C array, not numpy's: a block's count changes one
        # element at a time, and a numpy element's read and write (a scalar made, an index
        # parsed) were most of the numpy work per file of a reader off the order (perf)
        self._kernel_blocks = array("i")

    @property
    def used_bytes(self) -> int:
        return self.resident_bytes + self.reserved_bytes

    def charge(self, block: RamBlock) -> int:
        """Bytes of the budget a resident block takes."""
        return self.charge_of(block.held_bytes)

    def charge_of(self, held_bytes: int) -> int:
        """Bytes of the budget a block holding `held_bytes` takes: those and its bookkeeping."""
        return held_bytes + self.block_overhead_bytes

    def get(self, key: BlockKey) -> RamBlock | None:
        return self.blocks.get(key)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.blocks

    # -- room ------------------------------------------------------------------------------

    def reserve(self, nbytes: int, priority: float) -> bool:
        """Reserve `nbytes` for a block of `priority`, evicting strictly farther blocks."""
        if self.reserve_free(nbytes):
            return True
        if nbytes > self.budget_bytes:
            return False
        self._settle_ranks()  # only an eviction reads the ranks (module docstring)
        while self.used_bytes + nbytes > self.budget_bytes:
            if self._give_up_kept_twice():
                continue
            victim = self._farthest()
            if victim is None or not _may_displace(priority, victim[1].priority):
                return False
            self._remove(victim[0])
            self.evictions += 1
        self.reserved_bytes += nbytes
        return True

    def reserve_free(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit without evicting anything (no rank needed)."""
        if self.used_bytes + nbytes > self.budget_bytes:
            return False
        self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes
        assert self.reserved_bytes >= 0, "reservation released twice"

    def has_room(self, held_bytes: int) -> bool:
        """Whether a block holding `held_bytes` fits without evicting anything."""
        return self.used_bytes + self.charge_of(held_bytes) <= self.budget_bytes

    def farthest_priority(self) -> float | None:
        self._settle_ranks()
        victim = self._farthest()
        return None if victim is None else victim[1].priority

    def defer_ranks(self, apply: Callable[[], None]) -> None:
        """Priorities have changed, and `apply()` sets them (`set_priority`, `drop`): it is
        called before the order is next read (module docstring), in place of any `apply`
        given before, or never if a `rebuild` comes first."""
        self._deferred_ranks = apply

    def _settle_ranks(self) -> None:
        apply = self._deferred_ranks
        if apply is not None:
            self._deferred_ranks = None
            apply()

    def _farthest(self) -> tuple[BlockKey, RamBlock] | None:
        if self._lru:
            key = next(iter(self._lru))
            return key, self.blocks[key]
        heap = self._heaped()
        while heap:
            neg_priority, seq, key = heap[0]
            block = self.blocks.get(key)
            if block is not None and block.lru_seq == seq and -neg_priority == block.priority:
                return key, block
            heapq.heappop(heap)  # stale tuple: the block changed or left
        return None

    # -- contents --------------------------------------------------------------------------

    def insert(self, key: BlockKey, block: RamBlock, reserved_bytes: int) -> bool:
        """Turn a reservation into a resident block. False (nothing kept) if it cannot fit."""
        self.unreserve(reserved_bytes)
        old = self.blocks.get(key)
        # The kernel asked for part of a block it holds (it dropped some pages): the READ's
        # answer gives them back, so the kernel keeps holding the block, now beside the daemon
        kernel_keeps = old is not None and old.in_kernel and old.identity == block.identity
        if old is not None:
            self._remove(key, notify=not kernel_keeps)
        extra = self.charge(block)
        if not self.reserve(extra, block.priority):
            if kernel_keeps and old is not None:  # (kernel_keeps implies old)
                self.drop_file_pages(key[0], old.identity.size)
            return False
        self.reserved_bytes -= extra
        self.resident_bytes += extra
        self.blocks[key] = block
        block.resident = True
        self._push(key, block)
        if block.in_kernel:
            self._count_in_kernel(key, block, 1)
        elif kernel_keeps:
            self.add_kernel_copy(key, block)
        return True

    def set_priority(self, key: BlockKey, priority: float) -> None:
        self._settle_ranks()  # a re-rank put off before this one must not undo it
        block = self.blocks.get(key)
        if block is not None:
            block.priority = priority
            self._push(key, block)

    def touch(self, key: BlockKey, block: RamBlock) -> None:
        """A block outside any order was used: it becomes the most recently used."""
        if math.isinf(block.priority):
            self._lru.move_to_end(key)

    def drop(self, key: BlockKey) -> None:
        if key in self.blocks:
            self._remove(key)

    def rebuild(self, priority_of: Callable[[BlockKey, RamBlock], float | None]) -> None:
        """Give every block a new priority; `None` drops the block. The heap is made with one
        heapify: a push per block was over a third of an epoch switch's re-rank
        (1,000,000 blocks: 3.7-4.4 s, now 2.6 s)."""
        # nothing pushes while this runs (a removal's drop_file_pages only asks the kernel to
        # drop pages): a `_push` here would compact `self._heap` and lose `heap`'s tuples
        self._deferred_ranks = None  # every priority is given anew
        heap: list[tuple[float, int, BlockKey]] = []
        self._heap, self._unheaped = heap, []
        lru, self._lru = self._lru, OrderedDict()
        seq = self._seq
        # the blocks with no known future first, least recently used first: their order stays
        for key, block in [*((key, self.blocks[key]) for key in lru),
                           *((key, block) for key, block in self.blocks.items()
                             if key not in lru)]:
            if self.blocks.get(key) is not block:
                continue  # left with a sibling whose kernel copy went (drop_file_pages)
            priority = priority_of(key, block)
            if priority is None:
                self._remove(key)
                continue
            block.priority = priority
            if math.isinf(priority):
                self._lru[key] = None
            else:
                block.lru_seq = next(seq)
                heap.append((-priority, block.lru_seq, key))
        heapq.heapify(heap)

    def _push(self, key: BlockKey, block: RamBlock) -> None:
        if math.isinf(block.priority):
            self._lru[key] = None
            self._lru.move_to_end(key)
            return
        self._lru.pop(key, None)
        block.lru_seq = next(self._seq)
        self._unheaped.append((-block.priority, block.lru_seq, key))  # (`_heaped`)
        if len(self._heap) + len(self._unheaped) > 2 * len(self.blocks) + 1024:
            # mostly stale tuples: rebuild from the live blocks
            self._heap = [(-b.priority, b.lru_seq, k) for k, b in self.blocks.items()
                          if not math.isinf(b.priority)]
            self._unheaped = []
            heapq.heapify(self._heap)

    def _heaped(self) -> list[tuple[float, int, BlockKey]]:
        """The eviction heap, with the pushes put off made (module docstring): one by one
        if they are few beside it, else by one heapify of both."""
        pending = self._unheaped
        if pending:
            self._unheaped = []
            heap = self._heap
            if len(pending) * HEAPIFY_FRACTION > len(heap):
                heap.extend(pending)
                heapq.heapify(heap)
            else:
                for entry in pending:
                    heapq.heappush(heap, entry)
        return self._heap

    # -- kernel copies ----------------------------------------------------------------------

    def hand_to_kernel(self, blocks: list[tuple[BlockKey, RamBlock]]) -> bool:
        """The kernel holds a file's bytes (a reader read them whole; `blocks`: all of
        them): the daemon's copies go and the kernel's pages are charged instead. False,
        changing nothing, if the budget has no free room for the pages' rounding (the
        daemon keeps its copies then). All blocks or none: handed over one by one, a last
        block that found no room left the file's earlier blocks in the kernel alone, whose
        pages the caller then dropped, and the file was in neither."""
        handed = [(key, block) for key, block in blocks if block.data is not None]
        if not handed:
            return True  # the kernel's already (a file read again from its pages)
        extra = sum(self.charge_of(page_bytes(block.nbytes)) - self.charge(block)
                    for _, block in handed)
        if self.used_bytes + extra > self.budget_bytes:
            # Only into free room: the hand-over saves the daemon work, never at the price
            # of a block someone will read (a file of the read-ahead window read twice)
            return False
        self.resident_bytes += extra
        for key, block in handed:
            self.add_kernel_copy(key, block)
            block.data, block.kept_twice = None, False
        return True

    def keep_kernel_copies(self, blocks: list[tuple[BlockKey, RamBlock]]) -> bool:
        """A reader is done with a file (`blocks`: all of it, every block in the daemon and
        read or pushed to the kernel) that is read again, but not soon: the kernel keeps its
        pages beside the daemon's copy, both charged, until room is needed (module
        docstring). False, changing nothing, if the budget has no free room for the pages."""
        newly = [(key, block) for key, block in blocks
                 if block.data is not None and not block.kept_twice]
        extra = sum(page_bytes(block.nbytes) for _, block in newly)
        if self.used_bytes + extra > self.budget_bytes:
            return False
        for key, block in newly:
            self.add_kernel_copy(key, block)
            block.kept_twice = True
        self.resident_bytes += extra
        if newly:
            self._kept_twice.append(blocks[0])
            if len(self._kept_twice) > 2 * len(self.blocks) + 1024:
                # mostly files whose blocks left the tier since: keep the live ones
                self._kept_twice = deque((key, block) for key, block in self._kept_twice
                                         if self.blocks.get(key) is block and block.kept_twice)
        return True

    def _give_up_kept_twice(self) -> bool:
        """Drop the kernel's pages of the file kept twice longest; False if there is none."""
        while self._kept_twice:
            key, block = self._kept_twice.popleft()
            if self.blocks.get(key) is block and block.kept_twice:
                self.drop_file_pages(key[0], block.identity.size)
                return True
        return False

    def add_kernel_copy(self, key: BlockKey, block: RamBlock) -> None:
        """The kernel's page cache holds (or is being given) a copy of the block; while the
        daemon keeps its own, that copy is not charged unless kept twice (module docstring)."""
        if not block.in_kernel:
            block.in_kernel = True
            self.kernel_bytes += page_bytes(block.nbytes)
            if self.blocks.get(key) is block:
                self._count_in_kernel(key, block, 1)

    def drop_file_pages(self, relpath: bytes, size_bytes: int | None = None) -> None:
        """Make the kernel drop its pages of a file (there is no dropping a part of them):
        the blocks only it held leave, the others are the daemon's alone. `size_bytes`: the
        file's size, if its first block may have left the tier."""
        self._drop_kernel_pages(relpath)
        self.kernel_pages_gone(relpath, size_bytes)

    def kernel_pages_gone(self, relpath: bytes, size_bytes: int | None = None) -> None:
        """The kernel holds no page of `relpath` any more (dropped, or the inode forgotten).
        `size_bytes`: the file's size, if its first block may have left the tier."""
        if size_bytes is None:
            first = self.blocks.get((relpath, 0))
            if first is None:
                return
            size_bytes = first.identity.size
        for block_index in range(block_count(size_bytes, self.block_bytes)):
            key = (relpath, block_index)
            block = self.blocks.get(key)
            if block is not None:
                self.drop_kernel_copy(key, block)

    def drop_kernel_copy(self, key: BlockKey, block: RamBlock) -> None:
        """The kernel no longer holds the bytes (its pages were or are being dropped)."""
        if not block.in_kernel:
            return
        if block.data is None:
            self._remove(key, notify=False)
            return
        if block.kept_twice:
            self.resident_bytes -= page_bytes(block.nbytes)
            block.kept_twice = False
        block.in_kernel = False
        self.kernel_bytes -= page_bytes(block.nbytes)
        if self.blocks.get(key) is block:
            self._count_in_kernel(key, block, -1)

    def _remove(self, key: BlockKey, notify: bool = True) -> None:
        block = self.blocks.pop(key)
        block.resident = False
        self._lru.pop(key, None)
        self.resident_bytes -= self.charge(block)
        if block.in_kernel:
            self._count_in_kernel(key, block, -1)
            self.kernel_bytes -= page_bytes(block.nbytes)
            if notify:
                self.drop_file_pages(key[0], block.identity.size)

    # -- what the kernel holds, per item ------------------------------------------------------

    def kernel_blocks_of(self, items: np.ndarray) -> np.ndarray:
        """For each of `items` (manifest items, each >= 0): how many of its file's blocks are
        resident here with the kernel holding them too. The read-ahead's walk passes over a
        file the kernel holds whole with one look at this for a whole stretch of its list
        (cachefs/prefetch.py), where a look per block was most of its work in a hot pass."""
        # a view, gone at the return: the array cannot grow while one exists
        counts = np.frombuffer(self._kernel_blocks, np.intc)
        held = np.zeros(len(items), np.intc)
        inside = items < len(counts)
        held[inside] = counts[items[inside]]
        return held

    def kernel_blocks_of_item(self, item: int) -> int:
        """`kernel_blocks_of` one item."""
        counts = self._kernel_blocks
        return counts[item] if item < len(counts) else 0

    def items_renumbered(self) -> None:
        """The blocks' `item` numbers changed (a new manifest, Ranking.use_manifest): the
        counts of `kernel_blocks_of` are made again."""
        self._kernel_blocks = array("i")
        for key, block in self.blocks.items():
            if block.in_kernel:
                self._count_in_kernel(key, block, 1)

    def _count_in_kernel(self, key: BlockKey, block: RamBlock, change: int) -> None:
        """A resident block came to be held by the kernel too (1), or stopped (-1)."""
        item = block.item
        if item < 0 or not isinstance(key[1], int):
            return  # in no manifest, or a range entry (cachefs/range_cache.py): no file block
        counts = self._kernel_blocks
        if item >= len(counts):  # doubled at least, as a list grows: a few copies in all
            grown = max(item + 1, 2 * len(counts))
            counts.frombytes(bytes(counts.itemsize * (grown - len(counts))))
        counts[item] += change

    def stats(self) -> dict:
        return {"bytes": self.resident_bytes, "reserved": self.reserved_bytes,
                "kernel_bytes": self.kernel_bytes,
                "budget": self.budget_bytes, "blocks": len(self.blocks),
                "evictions": self.evictions}


def _may_displace(priority: float, victim_priority: float) -> bool:
    """A block may evict one used strictly later; among blocks with no known future (both
    infinite) the least recently used goes, which makes the tier a plain LRU cache when no
    order is published."""
    return victim_priority > priority or (math.isinf(priority) and math.isinf(victim_priority))
