"""Where each block should be, under the orders in force: its rank in RAM, and the kernel's keep.

The planner says when each item of the order is used next; this module turns that into what
the tiers ask of a block, and nothing else reads the plan for them:

- `priority_of(item, block_index, identity)` is the single definition of a block's rank in the
  RAM tier (smaller = sooner; None: not worth keeping). A block of no known future ranks
  infinite (LRU among such blocks); one consumed and not read again in the known future, or
  kept only for the next epoch while the SSD tier holds it (the tiers stay disjoint), is not
  kept. The tiered cache ranks every block that lands with it, the prefetcher re-ranks RAM
  on every consumption and new order (`rerank`, `rerank_all`). A block no longer worth
  keeping goes at once; a new rank is set when the RAM tier's order is next read
  (RamTier.defer_ranks): in a pass the kernel serves from its pages nothing reads it before
  the epoch switch, and a push into the eviction heap per consumed block, then a re-rank of
  all of RAM at the switch, were over a third of the daemon's work per file closed (the
  stored rank of a block may therefore be a re-rank behind: whoever needs a rank outside the
  tier asks `priority_of`). One exception, in the
  zero-request mode: the blocks of a file whose READs reached its end take the rank their
  consumption at the close will give them a few milliseconds early (`read_whole`), when RAM
  is full; any re-rank before the close gives them `priority_of`'s again. With storage targets of
  different speeds, the next epoch's files rank by distance over read cost
  (`set_read_costs`), so RAM keeps the files that are slowest to read again.
- Item numbers. An item number is an index into one manifest and means nothing without it
  (prefetch.py's module docstring): this module holds the manifest in force, finds a file's
  item (`item_of`, with the files read ahead lately remembered so an open hashes no path),
  and renumbers an item held across an await (`item_now`). An order of byte-range items
  (cachefs.order_items) numbers its items, not its files: then a file is no item (`item_of`
  is -1, its blocks rank as blocks of no known future) and the RAM tier's range entries
  (cachefs/range_cache.py) carry the item numbers, found again by their ranges whenever the
  table changes (`use_manifest`). A range entry ranks by its item's next use alone, and is
  never kept for the SSD tier's sake (the SSD tier holds blocks, not ranges).
- `kernel_may_keep`: whether the kernel's pages of a file a reader is done with may be its
  only copy, from how soon it is read again at the rate files are consumed, and whether the
  kernel has lost pages it was trusted with (`note_kernel_loss`).

It is built before the tiered cache and the prefetcher, which both ask it (the prefetcher also
tells it of new orders and consumptions): it refers to neither.
"""

from __future__ import annotations

import logging
import math
from array import array

import numpy as np

from cachefs.cache.ram import BlockKey, RamBlock, RamTier, block_count
from cachefs.manifest import Manifest
from cachefs.order_items import Items
from cachefs.planner import ARRAY_MIN_ITEMS, NEVER, Planner
from cachefs.recent import RecentMap
from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)

# A file of the order stays in the kernel's page cache only (no daemon copy) if its next use
# is due within this many seconds (kernel_may_keep): well under the idle age at which these VMs
# reclaim page cache (about 60 s)
KERNEL_KEEP_S = 20.0
RATE_WEIGHT = 0.01  # of each new gap between consumptions in the smoothed rate
MAX_GAP_S = 0.05  # a longer gap between two consumptions counts as this much
# Files read ahead whose manifest index is remembered for their open (RecentMap): a window is
# tens of files, opened within a window's time of their read-ahead.
RECENT_ITEMS = 8192
BLOCK_TIEBREAK = 1e-6  # keeps a file's blocks in order under one item priority
# Re-ranks put off (`rerank`) are listed up to as many as RAM has blocks, and at least this
# many: past that, every block is re-ranked instead (a rebuild), which costs no more
MIN_STALE_ITEMS = 4096


class Ranking:
    def __init__(self, planner: Planner, ram: RamTier, ssd, *, block_bytes: int):
        self.planner = planner
        self.ram = ram
        self.ssd = ssd
        self.block_bytes = block_bytes
        self._manifest: Manifest | None = None
        self._items: Items | None = None  # the order's byte-range items, if it has them
        # relpath -> manifest index of files read ahead or looked up lately: an open finds its
        # item without hashing the path (Manifest.index_of was about 5% of the daemon's busy
        # main thread), and a file read outside the read-ahead is hashed once, not at its
        # READ, its close and its fetch each
        self._recent_items: RecentMap[bytes, int] = RecentMap(RECENT_ITEMS)
        # changes whenever item numbers change meaning: another manifest, or its items
        # switched between files and byte ranges (an item number found before is stale)
        self.numbering = 0
        # seconds between consumptions, smoothed (kernel_may_keep); None until two are seen
        self._s_per_item: float | None = None
        self._last_consumed_s: float | None = None
        self.kernel_losses = 0  # files of the order lost with the kernel's pages
        # per item of the manifest in force, its read cost against the cheapest storage
        # target's (cachefs/targets.py `read_costs`); None: all alike
        self._read_costs: list[float] | None = None
        # items whose re-rank is put off (`rerank`), with their sizes; or every block's
        # (`rerank_all`), which includes theirs
        self._stale_items = array("q")
        self._stale_sizes = array("q")
        self._all_stale = False

    # -- the order in force ------------------------------------------------------------------

    @property
    def manifest(self):
        return self._manifest

    @property
    def items(self) -> Items | None:
        """The byte-range items of the order in force (None: its items are files)."""
        return self._items

    @property
    def ranged(self) -> bool:
        """The plan's items are byte ranges of files (cachefs.order_items), not files."""
        return self._items is not None

    def use_manifest(self, manifest, items: Items | None = None) -> bool:
        """The manifest and byte-range items (None: the items are the files) of a new order;
        True if the manifest is another one than before, whose item numbers mean other files.
        If either changed, blocks in RAM learn their item numbers under them."""
        changed = manifest is not self._manifest
        same_items = (items is self._items if items is None or self._items is None
                      else items.same_ranges(self._items))
        self._manifest, self._items = manifest, items
        if changed:
            self._read_costs = None  # numbered by the old manifest's items
        if changed or not same_items:
            if self._stale_items:  # numbered as no item is now: every block, by its new number
                self.rerank_all()
            self.numbering += 1
            self._recent_items.clear()
            for key, block in self.ram.blocks.items():
                block.item = self._item_of_key(key)
            self.ram.items_renumbered()
        return changed

    def _item_of_key(self, key: BlockKey) -> int:
        """The item number, in the order in force, of a RAM block or range entry."""
        assert self._manifest is not None
        relpath, where = key
        if isinstance(where, tuple):  # a range entry: (offset, length) (range_cache.RangeKey)
            if self._items is None:
                return -1
            return self._items.find(self._manifest.index_of(relpath), where[0], where[1])
        return -1 if self._items is not None else self._manifest.index_of(relpath)

    def consumed_at(self, now_s: float, count: int = 1) -> None:
        """`count` files of the order were consumed at `now_s` (the closes of one batch, in
        the zero-request mode): the rate of consumption (for kernel_may_keep), each counted
        as a gap of an equal share of the time since the last."""
        if count < 1:
            return
        if self._last_consumed_s is not None:
            # a pause (validation, a checkpoint, the trainer between epochs) is not the rate
            gap_s = min(now_s - self._last_consumed_s, MAX_GAP_S) / count
            # `count` steps of the smoothing, each toward the same gap, in one
            self._s_per_item = (gap_s if self._s_per_item is None
                                else gap_s + (1 - RATE_WEIGHT) ** count
                                * (self._s_per_item - gap_s))
        self._last_consumed_s = now_s

    def set_read_costs(self, costs: list[float] | None) -> None:
        """What reading each item again costs, against the cheapest storage target (None: the
        same for all). The next epoch's files are then kept by their distance into it divided
        by their cost: RAM holds what saves the most source time per slot-position it is
        held (a file on a target 5x slower is kept 5x further into the next epoch), not
        only its head. The current epoch's files rank by position alone: they are all read
        anyway. Blocks ranked before keep their rank until re-ranked: the prefetcher sets the
        costs as it rebuilds the targets' lists (a published order, before the blocks whose
        next use it changes are re-ranked; an epoch switch, when no next epoch is known yet,
        so no rank depends on them)."""
        self._read_costs = costs

    @property
    def read_costs(self) -> list[float] | None:
        return self._read_costs

    @property
    def s_per_item(self) -> float | None:
        """Seconds between consumptions, smoothed (None until two are seen): the readers'
        pace, as `kernel_may_keep` and the storage targets' queues use it."""
        return self._s_per_item

    # -- ranking ---------------------------------------------------------------------------

    def priority_of(self, item: int, block_index: int, identity: SourceIdentity | None
                    ) -> float | None:
        """A block's rank in RAM (smaller = sooner), or None if it should not be kept."""
        use = self._use_of(item)
        if use is None:
            return math.inf  # no known future: plain LRU among such blocks
        return self._ranked(item, block_index, identity, use)

    def _use_of(self, item: int) -> float | None:
        """The item's next use, or None if it has no known future (no order, or in none)."""
        return self.planner.member_use(item)

    def _ranked(self, item: int, block_index: int, identity: SourceIdentity | None,
                use: float) -> float | None:
        """`priority_of` for an item of the orders whose next use is `use`."""
        if use == NEVER:
            return None  # consumed and not read again in the known future
        if self._items is not None:
            return use  # a range entry: one per item, never on the SSD tier
        length = self.planner.length
        if use >= length:
            if self._on_ssd(item, block_index, identity):
                return None  # retained only for the next epoch, and the SSD tier has it
            costs = self._read_costs
            if costs is not None and item < len(costs):
                # kept for the next epoch: by distance over read cost (`set_read_costs`)
                use = length + (use - length) / costs[item]
        return use + block_index * BLOCK_TIEBREAK

    def _on_ssd(self, item: int, block_index: int, identity: SourceIdentity | None) -> bool:
        if self.ssd is None or identity is None:
            return False
        assert self._manifest is not None  # item is in the orders (`_use_of`)
        return self.ssd.contains((self._manifest.path(item), block_index), identity)

    def rerank(self, item: int, size_bytes: int) -> None:
        """`rerank_many` of one item."""
        self.rerank_many([item], [size_bytes])

    def rerank_many(self, items: list[int], sizes_bytes: list[int]) -> None:
        """New priorities for the blocks of `items` (of `sizes_bytes`, -1 if unknown), all
        consumed at once. Blocks no longer worth keeping go now, so that what RAM holds and
        has free stays true, and the tiers disjoint; the others' new rank is set when the RAM
        tier's order is next read (RamTier.defer_ranks). The next uses of a batch are read as
        one array (per item, numpy scalars were most of a re-rank); a batch of a few items,
        item by item (a reader off the order closes files about eight to a batch, and the
        arrays' fixed cost was most of its consumption)."""
        if not items:
            return
        planner = self.planner
        # a trainer that publishes the next epoch's permutation leaves nothing to drop here
        # unless an SSD tier serves the next epoch (`_doomed`): the look at each item's next
        # use was two fifths of a consumption for a reader off the order (scripts/bench_offorder.py)
        if planner.active and (self.ssd is not None or not planner.next_holds_current):
            if len(items) < ARRAY_MIN_ITEMS:
                doomed = [item for item in items
                          if (use := self._use_of(item)) is not None and self._doomed(use)]
            else:
                batch = np.array(items, np.int64)
                batch = batch[(batch >= 0) & (batch < len(planner.uses))]
                uses = planner.uses[batch]
                members = ~np.isnan(uses)
                doomed = batch[members][self._doomed(uses[members])].tolist()
            if doomed:
                sizes_of = dict(zip(items, sizes_bytes, strict=True))
                for item in doomed:
                    self._rerank_item(item, sizes_of[item], drops_only=True)
        if len(self._stale_items) + len(items) > max(len(self.ram.blocks), MIN_STALE_ITEMS):
            self.rerank_all()  # a rebuild costs no more, and holds no list of them
        elif not self._all_stale:  # else ranked with all the others
            self._stale_items.extend(items)
            self._stale_sizes.extend(sizes_bytes)
            self.ram.defer_ranks(self._rerank_stale)

    def _doomed(self, uses):
        """Whether `_ranked` may say None for a block of this next use (a float, or an array
        of them): no use, or, with an SSD tier, the next epoch's only (the tier may serve it
        then; `_rerank_item` looks at each block)."""
        doomed = uses == NEVER
        if self.ssd is not None:
            doomed = doomed | (uses >= self.planner.length)
        return doomed

    def _rerank_stale(self) -> None:
        """The re-ranks put off (`rerank`, `rerank_all`), with the items' next uses as the plan
        has them now (a later consumption, or a new order, ranks them as `priority_of` would
        by then)."""
        if self._all_stale:
            self._all_stale = False
            self._rerank_all_now()
            return
        items, sizes_bytes = self._stale_items.tolist(), self._stale_sizes.tolist()
        del self._stale_items[:], self._stale_sizes[:]
        for item, size_bytes in zip(items, sizes_bytes, strict=True):
            self._rerank_item(item, size_bytes)

    def _rerank_item(self, item: int, size_bytes: int, drops_only: bool = False) -> None:
        """`priority_of` for each block of the item RAM holds: None drops it; else it takes
        the rank (unless `drops_only`)."""
        assert self._manifest is not None  # use_manifest forgets the items of another
        relpath = self._manifest.path(item)
        ram = self.ram
        use = self._use_of(item)
        for block_index in range(block_count(max(size_bytes, 0), self.block_bytes)):
            key = (relpath, block_index)
            block = ram.get(key)
            if block is None:
                continue
            priority = (math.inf if use is None
                        else self._ranked(item, block_index, block.identity, use))
            if priority is None:
                ram.drop(key)
            elif not drops_only:
                ram.set_priority(key, priority)

    def read_whole(self, item: int, size_bytes: int, blocks_served) -> None:
        """A reader has read to the end of `item` (of `size_bytes`), and is consumed at its
        close, reported a few milliseconds later (the zero-request mode): the blocks its READs
        asked for (`blocks_served`; the kernel sends a file's READs in parallel, and the one
        that reaches its end may be answered before the others) take the rank they will
        have then, and one with no further use is the first to go, but stays until room is
        needed. Until then they held their near rank, and with a RAM tier of a few files
        the read-ahead found no room, and a demand read gave up the next epoch's head for
        them (0 RAM hits in an epoch where 3 were the bound). Blocks the kernel holds too
        keep their rank: the eviction of one drops the file's pages, and a reader that reads
        them again (an image decoder seeking back) would send READs that read it again from
        the source."""
        ram = self.ram
        if ram.has_room(min(max(size_bytes, 0), self.block_bytes)):
            return  # room for the next such block: no rank decides what goes before the close
        if self._use_of(item) is None:
            return  # in no order
        assert self._manifest is not None  # an order is in force
        relpath = self._manifest.path(item)
        use = self.planner.use_after_read(item)
        for block_index in blocks_served:
            key = (relpath, block_index)
            block = ram.get(key)
            if block is not None and not block.in_kernel:
                priority = self._ranked(item, block_index, block.identity, use)
                ram.set_priority(key, math.inf if priority is None else priority)

    def rerank_all(self) -> None:
        """Every block's `priority_of`, set when the RAM tier's order is next read
        (RamTier.defer_ranks): in a pass the kernel serves from its pages, nothing reads it,
        and an epoch switch re-ranked all of RAM for nothing (a tenth of the daemon's work per
        file closed, with 10,000 files)."""
        del self._stale_items[:], self._stale_sizes[:]  # ranked with all the others
        self._all_stale = True
        self.ram.defer_ranks(self._rerank_stale)

    def _rerank_all_now(self) -> None:
        """`rerank_all`'s, with the items' next uses (NaN: in neither order) read once as a
        list (numpy scalars per block cost 5x more)."""
        if not self.planner.active:
            self.ram.rebuild(lambda key, block: math.inf)
            return
        uses = self.planner.uses.tolist()

        def priority(key: BlockKey, block) -> float | None:
            item = block.item
            if item < 0 or item >= len(uses) or (use := uses[item]) != use:
                return math.inf
            return self._ranked(item, key[1], block.identity, use)
        self.ram.rebuild(priority)

    # -- item numbers ------------------------------------------------------------------------

    def item_of(self, relpath: bytes) -> int:
        """The file's index in the manifest in force; -1 if it has none, or if the order's
        items are byte ranges (a file is then no item: cachefs/range_read.py reads its items)."""
        if self._manifest is None or self.ranged:
            return -1
        item = self._recent_items.get(relpath)
        if item is None:
            item = self._manifest.index_of(relpath)
            self._recent_items.put(relpath, item)
        return item

    def items_of(self, relpaths: list[bytes]) -> list[int]:
        """`item_of` of each path, in one vectorised search of the manifest (the files of a
        directory listing, opened next; fuse_ops.Operations._listed_item). Not kept among
        the recent items: a listing can run far ahead of the opens."""
        if self._manifest is None or self.ranged or not relpaths:
            return [-1] * len(relpaths)
        return self._manifest.lookup(np.array(relpaths, dtype=bytes)).tolist()

    def remember_item(self, relpath: bytes, item: int) -> None:
        """`relpath` is `item` of the manifest in force, and is read ahead: its open is near."""
        self._recent_items.put(relpath, item)

    def item_now(self, relpath: bytes, item: int, manifest) -> tuple[int, object]:
        """`item`, an index into `manifest`, as numbered in the manifest in force, with that
        manifest: unchanged while `manifest` is in force, else found again by its path (-1:
        the new manifest does not have it). Asked after an await by whatever held the
        number across it (prefetch.py's module docstring)."""
        if self.ranged:
            return -1, self._manifest  # a file is no item of an order of byte ranges
        if manifest is self._manifest:
            return item, manifest
        return self.item_of(relpath), self._manifest

    # -- the kernel's page cache ------------------------------------------------------------

    def kernel_may_keep(self, item: int, first: RamBlock | None) -> bool:
        """Whether the kernel's pages of a file a reader is done with may be its only copy
        (the daemon's goes): yes for a file with no known future (LRU among such files, as
        the RAM tier ranks them), and for one read again within KERNEL_KEEP_S at the rate
        files are being consumed, the next epoch's head included, as long as the kernel has
        never lost pages it was trusted with. Page cache is reclaimable (memory pressure,
        `drop_caches`, these VMs' idle-page reclaim, hence the time limit): once the kernel
        has lost a file kept this way (`note_kernel_loss`), the daemon keeps its own copy of
        every file of the order (the next epoch's head, and a file read again just after an
        epoch switched), and the kernel's pages are kept beside it or dropped, so that the
        head the policy keeps across the epoch boundary survives.
        `first`: the file's first block in the RAM tier (None: not held), ranked as the plan
        has it now (`priority_of`: not kept, no copy is left to the kernel alone)."""
        if first is None:
            return False
        use = self._use_of(first.item)
        if use is None:
            return True  # no known future: ranked last among such blocks (LRU)
        if self._s_per_item is None or self.kernel_losses or item < 0:
            return False
        # the distance in files from the plan, not from the rank: a next-epoch file's rank
        # is its distance divided by its read cost (`set_read_costs`). Asked before the
        # rank: most files a reader is done with are read again far later (a reader off
        # the order's: all but a few), and ranking each of them was a tenth of its close
        distance = use if item == first.item else self.planner.next_use(item)
        if distance == NEVER or (distance - self.planner.cursor) * self._s_per_item > KERNEL_KEEP_S:
            return False
        return self._ranked(first.item, 0, first.identity, use) is not None

    def note_kernel_loss(self) -> None:
        """The kernel lost pages of a file of the manifest that only it held: it forgot the
        inode (`drop_caches`, inode reclaim), or a READ came for them (reclaimed: memory
        pressure, or these VMs' proactive reclaim, which takes pages of a physical region
        gone cold as a whole, so even pages stored a moment ago; traced with ftrace, the
        `mm_filemap_delete_from_page_cache` event from `kdamond`). Such a machine would take
        the next epoch's head too, so the daemon keeps its own copy of the order's files from
        then on (`kernel_may_keep`)."""
        if not self.kernel_losses:
            log.info("the kernel lost pages of files of the order that only it held: the "
                     "daemon keeps its own copy of the order's files from now on")
        self.kernel_losses += 1
