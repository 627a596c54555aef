"""Carries out the planner's plan: read ahead the window, re-rank RAM on every consumption.

Design. The planner says which items come next and how soon each is used; the RAM tier keeps
the nearest uses within its budget, ranked by cachefs/ranking.py. This module connects them:

- `run` is one trio task that walks the read-ahead lists of the storage targets
  (cachefs/targets.py: one per target, the order's positions of its items) together, nearest
  position first, and starts a fetch for every item not yet in RAM, as long as (a) its target
  has fewer fetches in flight than its slots and fewer than `source_threads` are in flight in
  all, and (b) RAM has room for it or holds a block used later than it (Cao et al.'s rule:
  prefetch as soon as the block you would displace is needed after the one you fetch). When
  nothing can start it sleeps until something changes: a consumption that moves the window
  (or frees RAM it waits for), a finished fetch, a new order. It walks once a batch of threads
  is free (1/`WALK_BATCH_FRACTION` of them), not at each fetch's end. With one target (files
  on one device, no `targets` in the order) its list is the window over the whole order. The
  lists are read a stretch at a time (`Planner.entry_chunks`), and a file the kernel holds
  whole whose identity is not due for a re-check is gone past with the others of its stretch,
  one array look for all (`_entries_to_walk`, `RamTier.kernel_blocks_of`): in a pass the kernel
  serves from its pages, that is every file.
- `demand_miss(item)` is called by the reader when it must wait for a file of the order: the
  next `--miss-batch` - 1 files of that file's target list start at once (the seed "001"'s
  batched request on a miss).
- `consumed(item)` is called by the reader when a file of the order has been read. It marks
  the position in the planner and gives the item's blocks their new priority: the head of the
  next epoch is kept, anything with no further use (or already on the SSD tier, which serves it
  cheaply, so the tiers stay disjoint) is dropped at once. When the whole order is consumed the
  next order becomes current and every block in RAM is re-ranked; the retained head of the new
  epoch is now the start of its window, with nothing read again.
- `Ranking.priority_of` (cachefs/ranking.py) is the single definition of a block's rank, used
  by the tiered cache when a fetched block lands as well.

Source identities of the order's items are kept in numpy arrays (size, mtime_ns, ino and when
they were seen, on cachefs/freshness.py's clock). A file with nothing cached is fetched in one
source round trip: the fstat of that read is its fresh identity. A file with a copy in RAM or
on the SSD is stat'ed first (the copy is only good for that identity). Either way the identity
is fresh, off the reader's path, so a reader opening a prefetched file needs no round trip to
the source to know its bytes are current: identities the freshness rule calls due for a
refresh are re-checked as the window reaches them, and `known_identity` gives a reader only
one it still trusts.

Item numbers and manifests. An item number is an index into one manifest and means nothing
without it: a new manifest (another data set's order on the same mount, a reordered or longer
file list) renumbers every file, and work in flight still holds the old numbers. So whatever
holds an item number across an await holds its manifest too, and when it resumes with another
manifest in force it either drops its work (a read-ahead fetch: the window of the new order
is walked anew) or renumbers the item by its path (`item_now`: the tiered cache, a reader's
handle). Per-item state (`ItemMeta`, the planner's arrays, the stats' bitmap) is replaced,
sized to the new manifest, when it comes (`set_order`), and identities learnt outside a fetch
are recorded by path, or by the item of the file's RAM block, which is renumbered with every
manifest (`record_identity`). So a late result for an item of an old manifest can
neither index the new arrays out of range nor land in the slot of another file.

Reads begun with no task. Most files of a read-ahead are one source read: unseen (nothing
cached to validate; the read's fstat is the identity) or seen and of one block. Such a file's
read is begun by the walk itself (`_begin_item`, `TieredCache.start_fetch`, `Source.
start_block`, cachefs/read_pool.py `start`), and its landing is handled when the read pool
collects its end (`_first_block_landed`): the same steps as `_fetch_item`'s, in the same
order, with no task. A task for each cost the trio thread its spawn, two trips through the
scheduler and a chain of eight coroutines. A file with more to do (several blocks, a copy to
stat first, no source thread free at once, a read to make again) is read by `_fetch_item`, in
a task of its own, as before; `status()["task_fetches"]` counts those.

Window size: `--lookahead N` items past the furthest item read near the cursor, or
automatically `source_threads` items, at most a quarter of the RAM budget. A longer window
hides no more latency once every source thread is busy, and each window slot taken is a slot
of the next epoch's head not retained. Readers spread over many positions (a DataLoader's
workers each read a batch) stretch the window from the cursor to past the furthest read, up to
a quarter of the RAM budget in all (`planner.max_span_items`); a reader off the order does not
(planner.py, "Readers off the order").

Why this module is over 600 lines: it is one class, whose walk, consumptions and fetches share
the window's state (the items in flight and their targets, the miss batches, the files read
whole and not closed yet); split, each part would reach into the others' sets.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator

import numpy as np
import trio

from cachefs.cache.ram import RamTier, block_count
from cachefs.cache.tiered import TieredCache
from cachefs.config import MISS_BATCH_ITEMS
from cachefs.freshness import Freshness, now_s
from cachefs.item_meta import ItemMeta
from cachefs.placement import Placement
from cachefs.planner import (ARRAY_MIN_ITEMS, NEVER, READERS_SPREAD_ITEMS, SCALAR_ENTRIES,
                             Planner)
from cachefs.range_prefetch import RangePrefetcher
from cachefs.ranking import Ranking
from cachefs.sorted_arrays import index_left
from cachefs.source import Source, SourceIdentity
from cachefs.stats import Stats
from cachefs.targets import Target, Targets

log = logging.getLogger(__name__)

# The walk waits until 1/WALK_BATCH_FRACTION of the source threads are free (8 of 64; one, with
# fewer than 16), then starts files into all of them. In a first epoch over network storage
# every landing read freed one thread and poked a walk, which started one or two files for 118
# us of the trio thread's CPU (a walk every two files); batched, the daemon's CPU a file went
# down 9% in that epoch and 2-3% in the later ones, the speed the same (README, "Slow storage").
WALK_BATCH_FRACTION = 8


class Prefetcher:
    def __init__(self, planner: Planner, ranking: Ranking, tiered: TieredCache, ram: RamTier,
                 source: Source, stats: Stats, freshness: Freshness, targets: Targets, *,
                 block_bytes: int, source_threads: int, lookahead_items: int,
                 miss_batch_items: int = MISS_BATCH_ITEMS, per_target: bool = True,
                 retain_by_cost: bool = True, ranges: RangePrefetcher | None = None):
        self.planner = planner
        self.ranking = ranking
        self.tiered = tiered
        self.ram = ram
        self.source = source
        self.stats = stats
        self.freshness = freshness
        self.targets = targets
        self.block_bytes = block_bytes
        self.max_inflight = source_threads
        self.configured_lookahead = lookahead_items
        self.miss_batch_items = miss_batch_items
        # False: one list for the whole order, whatever the targets (the simulator's baseline)
        self.per_target = per_target
        # False: the next epoch's files are kept by position alone, whatever their targets'
        # speeds (the simulator's baseline; `_price_retention`)
        self.retain_by_cost = retain_by_cost
        # the read-ahead of an order of byte-range items (cachefs/range_prefetch.py): this
        # loop hands it the window while such an order is in force
        self.ranges = ranges
        self.meta = ItemMeta(0)
        # items of the manifest in force being read ahead, and the target each counts in
        self._inflight_items: dict[int, Target] = {}
        # items read by miss batches of this epoch's plan and not consumed yet (demand_miss)
        self._batched: set[int] = set()
        # items a reader has read whole and not closed yet: the zero-request mode consumes a
        # file at its close, reported a few milliseconds later, and in between the walk would
        # read again a file whose demand read found no room in RAM (`read_whole`)
        self._read_whole: set[int] = set()
        self._wake = trio.Event()
        self._room_wait = False  # the last walk stopped for want of RAM (`consumed`)
        self._nursery: trio.Nursery | None = None
        self.prefetch_errors = 0
        # items whose read-ahead ran in a task of its own (`_fetch_item`), not begun without
        # one (`_begin_item`): cachefs stats' prefetch.task_fetches
        self.task_fetches = 0

    def poke(self) -> None:
        self._wake.set()

    # -- events from the order watcher and the reader ---------------------------------------

    def set_order(self, order) -> None:
        was_ranged = self.ranking.ranged
        if self.ranking.use_manifest(order.manifest, order.items):
            # every item number changes meaning: fetches in flight finish on their own and
            # drop their results (_fetch_item), and the state per item starts over
            self._inflight_items = {}
            self.meta = ItemMeta(len(order.manifest))
            self.stats.track_items(len(order.manifest))
        elif self.ranking.ranged != was_ranged:
            # files' fetches in flight stop, and count no more (`_superseded`)
            self._inflight_items = {}
        self.targets.use(order.manifest, self._placement(order), self.ranking.item_of)
        self._recount_inflight()
        started = self.planner.set_order(order)
        if started:
            self.stats.start_epoch(order.epoch)
            self._read_whole = set()
        self._rebuild_targets()
        self._size_window()
        if self.planner.reranked_items is None or self.ranking.ranged:
            self.ranking.rerank_all()
        else:  # a new next epoch only: the few items whose next use changed
            # and those read whole, whose early rank came from the next order replaced:
            # their rank in force until their close (Ranking.read_whole)
            items = np.union1d(self.planner.reranked_items,
                               np.fromiter(self._read_whole, np.int64, len(self._read_whole)))
            self.ranking.rerank_many(items.tolist(), self.meta.size[items].tolist())
        if started and self.ranges is not None and self.ranking.ranged:
            self.ranges.new_epoch()
        self.poke()

    def _size_window(self) -> None:
        """The window from the RAM budget and the mean file size seen so far: `--lookahead`, or
        `source_threads` items, at most a quarter of RAM (an order of byte ranges: up to its
        read-ahead's own number, within an eighth); and the most the window may span when
        readers spread out, as a DataLoader's workers do (planner.max_span_items)."""
        mean_size = (self.ranges.mean_item_bytes() if self.ranges is not None
                     and self.ranking.ranged else self.meta.mean_size(-1))
        if mean_size < 0:
            # No size known yet. Guessing one block per item let a data set of large files
            # (10 blocks each) start with a window of 25 items, ten times the RAM budget's
            # quarter: their blocks evicted each other and were read twice. One item, until
            # the first stat (a round trip later) gives the real mean.
            ram_quarter_items = 1
        else:
            ram_quarter_items = self.ram.budget_bytes // 4 // self.ram.charge_of(mean_size)
        # as many items as the source threads read at once; an order of ranges reads more at
        # once (cachefs/range_prefetch.py), as far as half the span: a sequential reader's
        # spans are read past the window, and with no room left there they came one item
        # each (403 source reads for 400 items in one file, 48 with the window at half)
        automatic = min(self.max_inflight, ram_quarter_items)
        if self.ranges is not None and self.ranking.ranged:
            automatic = max(automatic, min(self.ranges.max_inflight, ram_quarter_items // 2))
        self.planner.lookahead_items = self.configured_lookahead or max(1, automatic)
        # and at most READERS_SPREAD_ITEMS: a reader that does not follow the order (a validation
        # pass in directory order) consumes positions all over the epoch, and with small
        # files a quarter of RAM is most of the epoch: the read-ahead's completions then
        # crowded out that reader's own requests (50,000 one-byte files: 68 s, 23 s without
        # an order)
        self.planner.max_span_items = min(ram_quarter_items, READERS_SPREAD_ITEMS)

    def _recount_inflight(self) -> None:
        """Each fetch in flight counts in the target its item is on under the placement in
        force (a new publication may place items elsewhere)."""
        for target in self.targets.all:
            target.inflight_items = 0
        for item in self._inflight_items:
            now = self.targets.target_of(item)
            if now is not None:
                self._inflight_items[item] = now
                now.inflight_items += 1

    def _rebuild_targets(self) -> None:
        """Every target's list anew, and no miss batch pending. Not for an order of byte
        ranges: its items are no files, and its read-ahead is cachefs/range_prefetch.py's."""
        if not self.ranking.ranged:
            self.targets.rebuild(self.planner, self._held_items())
            self._price_retention()
        self._batched = set()

    def _price_retention(self) -> bool:
        """Give the ranking the items' read costs from the targets' latencies as measured now
        (cachefs/ranking.py `set_read_costs`; unless `retain_by_cost` is off). True if that
        set costs where there were none."""
        if not self.retain_by_cost:
            return False
        unpriced = self.ranking.read_costs is None
        self.ranking.set_read_costs(self.targets.read_costs())
        return unpriced and self.ranking.read_costs is not None

    def _held_items(self) -> np.ndarray:
        """Items of the manifest in force whose first block RAM holds (in the daemon or the
        kernel)."""
        return np.fromiter((block.item for key, block in self.ram.blocks.items()
                            if key[1] == 0 and block.item >= 0), np.int64)

    def _placement(self, order) -> Placement:
        """Where the order's items live: its `targets`, else their devices (placement.py);
        one list for all when per-target read-ahead is off."""
        if not self.per_target:
            return Placement.single(len(order.manifest))
        return (order.targets if order.targets is not None
                else order.manifest.device_placement())

    @property
    def manifest(self):
        return self.ranking.manifest

    def item_of(self, relpath: bytes) -> int:
        return self.ranking.item_of(relpath)

    def known_identity(self, item: int) -> SourceIdentity | None:
        """The item's identity, if still trusted (cachefs/freshness.py)."""
        if item < 0 or self.ranking.manifest is None:
            return None
        return self.meta.trusted_identity(item, self.freshness)

    def record_identity(self, relpath: bytes, identity: SourceIdentity,
                        item: int | None = None, seen_s: float | None = None) -> bool:
        """A fresh identity of `relpath` learnt outside the read-ahead (a reader's open or
        read, a revalidation): recorded in its item of the manifest in force, found by path
        now, so that one learnt across a manifest change lands in its own file's slot.
        `item`: that item, if the caller has it under the manifest in force (a RAM block's,
        renumbered with every new manifest), which saves the search by path. `seen_s`: when
        the source was asked (None: now). False: a look at another version asked before the
        recorded one, not recorded, and neither trusted now (ItemMeta.record)."""
        if item is None:
            item = self.ranking.item_of(relpath)
        return item < 0 or self.meta.record(item, identity, seen_s)

    def _record_checked(self, item: int, identity: SourceIdentity, seen_s: float) -> bool:
        """Record a fresh stat (asked at `seen_s`); if the file changed since we last saw it,
        drop its copies. False: a look at another version asked after it was recorded first
        (ItemMeta.record: neither is trusted now), and this one's copies go instead; the
        read-ahead stops there, and the item is walked again (`_revisit`), to be read at the
        version seen since."""
        known = self.meta.identity(item)
        if not self.meta.record(item, identity, seen_s):
            assert known is not None  # only a known item has a look to lose to
            self.tiered.source_changed(self.ranking.manifest.path(item), known)
            self._revisit(item, 0, None)
            return False
        if known is not None and known != identity:
            self.tiered.source_changed(self.ranking.manifest.path(item), identity)
        return True

    def consumed(self, item: int, size_bytes: int = -1) -> None:
        """A reader has read `item` (`consumed_many` of one)."""
        self.consumed_many([item], [size_bytes])

    def consumed_many(self, items: list[int], sizes_bytes: list[int]) -> int:
        """Readers have read `items`, in this order (the closes of one fanotify batch, in the
        zero-request mode; -1: a file in no manifest); `sizes_bytes`: their sizes as the
        readers saw them, for a file the read-ahead never stat'ed (a reader off the order):
        every block of it is reranked, where a size unknown reranked block 0 only, and its
        other blocks kept the rank of their position, the nearest once the cursor passed it,
        for the rest of the epoch (RAM full of dead blocks, and the read-ahead without room).
        They are consumed up to the one that completes the order, and the next order is
        switched to: returns how many were taken (the caller counts the rest in the new
        epoch, and passes them again). The window is compared and the walk woken once a
        batch: per file, they were a tenth of the zero-request mode's accounting."""
        planner = self.planner
        if not planner.active:
            return len(items)
        window = (planner.cursor, planner.front())
        taken, completed = planner.consume_many(items)
        read, read_sizes = items[:taken], sizes_bytes[:taken]
        if read and min(read) < 0:  # files in no manifest: nothing of theirs is ranked
            pairs = [(item, size) for item, size in zip(read, read_sizes, strict=True)
                     if item >= 0]
            read, read_sizes = [item for item, _ in pairs], [size for _, size in pairs]
        if planner.caught_up:  # read outside the order, consumed as the cursor reached them
            read, read_sizes = read + planner.caught_up, read_sizes + [-1] * len(planner.caught_up)
            planner.caught_up = []
        self._batched.difference_update(read)
        self._read_whole.difference_update(read)
        if self.ranges is not None and self.ranking.ranged:
            for item in read:
                self.ranges.rerank(item)
        elif read:
            sizes = self.meta.size
            # a few files (a reader off the order's, about eight a batch) each by itself:
            # numpy's fixed cost of an index array was most of the look-up
            known_sizes = (sizes[read].tolist() if len(read) >= ARRAY_MIN_ITEMS
                           else [sizes.item(item) for item in read])
            self.ranking.rerank_many(read, [
                known if known >= 0 else size
                for known, size in zip(known_sizes, read_sizes, strict=True)])
        self.ranking.consumed_at(now_s(), len(read))
        if completed and planner.switch_to_next():
            assert planner.epoch is not None  # the switch set it
            self.stats.start_epoch(planner.epoch)
            self.ranking.rerank_all()
            self._rebuild_targets()
            self._read_whole = set()
            if self.ranges is not None and self.ranking.ranged:
                self.ranges.new_epoch()
        # the walk can start something only if the window moved, or RAM may have room now
        # (a reader off the order consumes with neither: a walk per file cost it 5%); with
        # several targets, each reaches its own share past its first unconsumed file
        if (completed or self._room_wait or self.ranking.ranged or len(self.targets.all) > 1
                or window != (planner.cursor, planner.front())):
            self.poke()
        return taken

    def demand_miss(self, item: int, manifest) -> None:
        """A reader waits for `item` of `manifest`, which RAM does not hold (cachefs/reader.py
        calls this before it fetches): read the next `miss_batch_items` - 1 items of the
        item's target list too, at once (the seed "001": a miss requests a batch of the same
        storage node's next items), even past the target's share of the threads. Items of
        the batch already held or in flight count in it, so a second miss on the same file
        starts nothing. A reader that has outrun the read-ahead, or reads outside its window
        (a job resumed in mid-epoch), finds the next files of each target on their way.

        A batch reads ahead beyond the window, by the window's rule (RAM makes room for a file
        only by dropping one used later): it may push out a file kept for the next epoch's
        head, which the window then reads again near the epoch's end. So the files of
        batches not yet read are capped at the window's span, a quarter of the RAM budget;
        with that, the simulator finds no file read twice except with a RAM budget of a few
        dozen files (2 of 160 in one epoch of 15; `--miss-batch 1` turns batches off).
        Readers that do not go through the order (`Planner.follows`: a validation pass in
        directory order) read no batches: the next items of the order are not theirs."""
        planner = self.planner
        if (self.miss_batch_items <= 1 or not planner.active or item < 0 or not planner.follows
                or self.ranking.ranged or manifest is not self.ranking.manifest
                or (manifest.path(item), 0) in self.ram):
            return
        if len(self._batched) >= planner.max_span_items:
            # batches are at their cap (below): a reader off the order misses on every file,
            # and walking the list to find that costs it 15 us a file
            return
        position = planner.next_use(item)
        target = self.targets.target_of(item)
        if position == NEVER or target is None or self._nursery is None:
            return
        start = index_left(target.positions, int(position)) + 1
        wanted = self.miss_batch_items - 1
        started = 0
        # beyond the window's span if need be (that is where a reader outside it reads), but
        # not into the next epoch from this one (the window reads its head); the RAM's room
        # decides, by the same rule as for the window
        end = planner.length if position < planner.length else planner.known_end()
        for _, _, batch_item in planner.entries(target.positions, start, end):
            if wanted == 0:
                break
            wanted -= 1
            if batch_item in self._inflight_items or self._resident(batch_item):
                continue
            # Batches read ahead of the window and take RAM from the head of the next epoch
            # that it keeps: the files of batches not read yet take at most the window's span
            # (a quarter of the RAM budget), or a head file pushed out is read twice an epoch
            if (len(self._batched) >= planner.max_span_items
                    or not self._room_for(self._need_bytes(batch_item),
                                          self.ranking.priority_of(batch_item, 0, None))):
                break
            self._batched.add(batch_item)
            self._start_item(batch_item, target, manifest)
            started += 1
        if started:
            target.batches += 1
            target.batch_items += started

    def read_whole(self, item: int, manifest, size_bytes: int, blocks_served) -> None:
        """A reader has read to the end of `item` of `manifest` (`size_bytes`) and is
        consumed at its close: the walk does not read it again before (the close comes a few
        milliseconds later, and a demand read that found no room in RAM left nothing
        resident; the walk read such files twice an epoch with a RAM budget of a few files),
        and the blocks it was served take the rank they will have once consumed
        (`Ranking.read_whole`)."""
        if item >= 0 and manifest is self.ranking.manifest:
            self._read_whole.add(item)
            self.ranking.read_whole(item, size_bytes, blocks_served)

    def files_read(self, items: list[int], manifest, origin: int, stall_s: float) -> None:
        """Readers are done with `items` of `manifest` (each of the class and stall the stats
        count): counted in their targets (cachefs/targets.py; not with an order of byte
        ranges, whose items are no files)."""
        if not self.ranking.ranged:
            self.targets.files_read(items, manifest, origin, stall_s)

    # -- the read-ahead loop ---------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    self._start_fetches(nursery)
                    await self._wake.wait()
                    self._wake = trio.Event()
            finally:
                # the mount is stopping: nothing starts in the nursery any more
                # (`_hand_to_task`), which closes once its tasks end, and other tasks run
                # before this one leaves it
                self._nursery = None

    def _start_fetches(self, nursery: trio.Nursery) -> None:
        """Walk every target's list (cachefs/targets.py) nearest position first, and start
        fetches while the target has a free slot and the source threads one in all."""
        planner = self.planner
        manifest = self.ranking.manifest
        if not planner.active or manifest is None:
            return
        if self.ranking.ranged:
            if self.ranges is not None:
                self._size_window()
                self.ranges.start_fetches(nursery, self.poke)
            return
        if self.max_inflight - len(self._inflight_items) < max(
                1, self.max_inflight // WALK_BATCH_FRACTION):
            return  # files start a batch at a time (WALK_BATCH_FRACTION)
        # The window depends on file sizes, and at set_order none may be known yet:
        # recompute it as sizes become known.
        self._size_window()
        targets = self.targets
        # queues sized for the latency tail, unless `--lookahead` sets the window (and in the
        # baseline of one list, which sizes its window as the read-ahead before targets did)
        automatic = self.per_target and not self.configured_lookahead
        walked_s = now_s()
        targets.size(self.max_inflight, walked_s, self.ranking.s_per_item if automatic else None)
        if self.ranking.read_costs is None and self._price_retention():
            self.ranking.rerank_all()  # the first epoch: costs are known once measured
        heads: list = []  # (position, target number, index, item, the list's entries)
        for number, target in enumerate(targets.all):
            targets.advance(target, planner)
            if target.inflight_items < target.slots:
                entries = self._entries_to_walk(
                    target, targets.window_end(target, planner, self.max_inflight), walked_s)
                self._push_head(heads, number, entries)
        kernel = self.tiered.kernel is not None
        self._room_wait = False
        while heads:
            if len(self._inflight_items) >= self.max_inflight:
                return
            _, number, index, item, entries = heapq.heappop(heads)
            target = targets.all[number]
            if item in self._inflight_items or item in self._read_whole:
                pass
            elif (missing_block := self._first_missing(item)) is None:  # resident
                identity = self.meta.identity_not_due(item, self.freshness, walked_s)
                if identity is None:
                    # An item kept in RAM (the next epoch's head) has an identity from
                    # the last epoch; without this re-stat off the reader's path, the reader's
                    # open pays a source round trip for every RAM hit (fuse_ops.open).
                    # _fetch_item stats it, finds its blocks resident and pushes them.
                    self._start_item(item, target, manifest)
                elif kernel:
                    self._push(item, identity)  # nothing, if the kernel holds it all
            else:
                # the room for the first block RAM lacks, at its own rank: block 0's nearer
                # rank found room that block 2's fetch then could not take (a file's held
                # block 1 was RAM's farthest), and the walk started the item again, forever
                if not self._room_for(self._need_bytes(item),
                                      self.ranking.priority_of(item, missing_block, None)):
                    self._room_wait = True
                    return  # RAM holds only nearer uses: wait for a consumption
                self._start_item(item, target, manifest)
            target.scan = index + 1
            if target.inflight_items < target.slots:
                self._push_head(heads, number, entries)

    def _entries_to_walk(self, target: Target, end: int, walked_s: float
                         ) -> Iterator[tuple[int, int, int]]:
        """The entries of the target's list (`Planner.entries`) from its `scan` on, below
        position `end`, less the files the kernel holds whole whose identity is not due for a
        re-check at `walked_s`: the walk would find nothing to do for them, and they are gone
        past (`target.scan`) a stretch at a time. In a pass the kernel serves from its pages
        that is every file, and a look at each, block by block, was most of the walk.
        The first SCALAR_ENTRIES entries are looked at one by one: a walk starts about ten
        files, and the numpy work of a stretch was most of its cost (136 us of the trio
        thread's CPU a walk in a DataLoader's first epoch over slow storage)."""
        positions, start = target.positions, target.scan
        stop = index_left(positions, end, start)
        one_by_one = min(stop, start + SCALAR_ENTRIES)
        # the first entries as `Planner.entries` gives them (one by one), below the position
        # of the entry the stretches start at
        first_end = positions.item(one_by_one) if one_by_one < stop else end
        past_idle = 0  # past the last idle entry (below)
        for index, position, item in self.planner.entries(positions, start, first_end):
            if self._idle(item, walked_s):
                past_idle = index + 1
                continue
            target.scan = max(target.scan, past_idle)
            yield index, position, item
        target.scan = max(target.scan, past_idle)
        if one_by_one < stop:
            yield from self._stretches_to_walk(target, one_by_one, end, walked_s)

    def _stretches_to_walk(self, target: Target, start: int, end: int, walked_s: float
                           ) -> Iterator[tuple[int, int, int]]:
        """`_entries_to_walk` from list index `start` on, a stretch (`Planner.entry_chunks`)
        at a time."""
        meta = self.meta
        kernel = self.tiered.kernel is not None
        for indices, positions, items, _ in self.planner.entry_chunks(
                target.positions, start, end):
            if kernel:
                sizes = meta.size[items]
                idle = ((sizes >= 0)
                        & (self.ram.kernel_blocks_of(items) == block_count(sizes, self.block_bytes))
                        & ~meta.refresh_due(items, self.freshness, walked_s))
            else:
                idle = np.zeros(len(items), bool)
            # for each entry, the index past the last idle one before it (or it): the scan goes
            # past an idle entry as past one walked, and no further (an entry not due now,
            # an item of the next order still unread in this one, may be due by the next walk)
            past_idle = np.maximum.accumulate(np.where(idle, indices + 1, 0))
            for at in np.flatnonzero(~idle).tolist():
                # the entries yielded before this one were walked when the walk asks for it
                target.scan = max(target.scan, int(past_idle[at]))
                yield int(indices[at]), int(positions[at]), int(items[at])
            if len(idle):
                target.scan = max(target.scan, int(past_idle[-1]))

    def _idle(self, item: int, walked_s: float) -> bool:
        """One entry's look of `_stretches_to_walk`: the kernel holds the file whole, and its
        identity is not due for a re-check at `walked_s`."""
        if self.tiered.kernel is None:
            return False
        size = self.meta.size.item(item)
        return (size >= 0 and self.ram.kernel_blocks_of_item(item) == block_count(
                    size, self.block_bytes)
                and not self.meta.refresh_due(item, self.freshness, walked_s))

    @staticmethod
    def _push_head(heads: list, number: int, entries) -> None:
        head = next(entries, None)
        if head is not None:
            index, position, item = head
            heapq.heappush(heads, (position, number, index, item, entries))

    def _need_bytes(self, item: int) -> int:
        """RAM to find for the first block of an item about to be read."""
        return min(self._size_estimate(item), self.block_bytes)

    def _start_item(self, item: int, target: Target, manifest) -> None:
        self._inflight_items[item] = target
        target.inflight_items += 1
        try:
            begun = self._begin_item(item, manifest)
        except Exception:  # noqa: BLE001 - one file's read-ahead never ends the mount's
            self._fetch_broke(manifest.path(item))
            self._item_done(item, manifest)
            return
        if not begun and not self._hand_to_task(item, manifest, None):
            self._item_done(item, manifest)

    def _begin_item(self, item: int, manifest) -> bool:
        """`_fetch_item`'s work begun with no task (module docstring, "Reads begun with no
        task"), where the file is one source read: its identity is unknown (nothing cached to
        validate) or known and of one block, and the tiered cache can begin that read now
        (`TieredCache.start_fetch`). False: nothing was begun."""
        if item in self._read_whole:
            return False
        relpath = manifest.path(item)
        identity = self.meta.identity_not_due(item, self.freshness)
        if identity is None:
            if self._needs_stat(relpath):
                return False
            expected_bytes: int | None = self._size_estimate(item)
        elif identity.size > self.block_bytes or self.tiered.holds((relpath, 0), identity):
            return False  # several reads, or none (a push: `_fetch_item`)
        else:
            expected_bytes = None
        self.ranking.remember_item(relpath, item)
        for_current = self._unconsumed(item)
        return self.tiered.start_fetch(
            (relpath, 0), identity, item, manifest, expected_bytes=expected_bytes,
            on_done=lambda fetched, error: self._first_block_landed(
                item, manifest, identity, for_current, fetched, error))

    def _first_block_landed(self, item: int, manifest, identity: SourceIdentity | None,
                            for_current: bool, fetched, error: OSError | None) -> None:
        """The first block of a file begun by `_begin_item` has landed (`fetched`, or the
        OSError of its read): what `_fetch_item` does after its first fetch, and a task of it
        for what is left, if anything is (blocks past the first of a file found longer than a
        block, or a read the source is to make again its own way)."""
        handed_on = False
        try:
            if self._superseded(manifest):
                return
            if error is not None:
                raise error
            if fetched is None:  # a read to make again: the task's fetch does
                handed_on = self._hand_to_task(item, manifest, None)
                return
            if not self._record_checked(item, fetched.identity, fetched.asked_s):
                return
            if identity is None:
                self.poke()  # a size is known: the automatic window may change
            if block_count(fetched.identity.size, self.block_bytes) > 1:
                handed_on = self._hand_to_task(item, manifest, for_current)
            elif self.tiered.kernel is not None and not fetched.read_whole_on_landing:
                # a reader is about to open it; not one whose READs waited for it and return
                # it whole: their replies store its pages (in a first epoch, a fifth of the
                # files, each stored twice)
                self._push(item, fetched.identity)
        except OSError as exc:
            self._fetch_failed(manifest.path(item), exc)
        except Exception:  # noqa: BLE001 - one file's read-ahead never ends the mount's
            self._fetch_broke(manifest.path(item))
        finally:
            if not handed_on:
                self._item_done(item, manifest)

    def _hand_to_task(self, item: int, manifest, for_current: bool | None) -> bool:
        """An item not begun by `_begin_item`, or the rest of one it began, goes to a task of
        `_fetch_item`; not once `run`'s body has ended (the mount is stopping: a read begun
        before lands as the source's pool is collected, after that), when False: the rest is
        not read."""
        if self._nursery is None:
            return False
        self.task_fetches += 1
        self._nursery.start_soon(self._fetch_item, item, manifest, for_current)
        return True

    def _first_missing(self, item: int) -> int | None:
        """The first block of the item RAM does not hold (0 for a file of unknown size);
        None if it holds them all."""
        size = int(self.meta.size[item])
        if size < 0:
            return 0
        relpath = self.ranking.manifest.path(item)
        for block_index in range(block_count(size, self.block_bytes)):
            if (relpath, block_index) not in self.ram:
                return block_index
        return None

    def _resident(self, item: int) -> bool:
        return self._first_missing(item) is None

    def _room_for(self, nbytes: int, priority: float | None) -> bool:
        """Whether the RAM tier can make room for `nbytes` at `priority`, as its `reserve`
        will decide (a block larger than the whole budget never fits: the walk started it
        again and again while `reserve` refused it)."""
        if priority is None or self.ram.charge_of(nbytes) > self.ram.budget_bytes:
            return False
        if self.ram.has_room(nbytes):
            return True
        farthest = self.ram.farthest_priority()
        return farthest is not None and farthest > priority

    def _superseded(self, manifest) -> bool:
        """Work started for `manifest` resumes with another in force: its item numbers mean
        other files now, so it stops (module docstring); or with an order of byte ranges in
        force over the same manifest, whose items are no files (its read-ahead is
        cachefs/range_prefetch.py's)."""
        return manifest is not self.ranking.manifest or self.ranking.ranged

    async def _fetch_item(self, item: int, manifest, for_current: bool | None = None
                          ) -> None:
        """Read ahead one item of `manifest`; after every await it stops if the manifest
        changed (`_superseded`): the new order's window is walked anew, and the tiered cache
        has kept or dropped what landed by the new order's priorities. `for_current`: whether
        it was unconsumed when its read-ahead began (`_first_block_landed`; None: now)."""
        if self._superseded(manifest):
            return  # set_order ran before this task started: not counted in the new set
        relpath = manifest.path(item)
        self.ranking.remember_item(relpath, item)
        # fetched for this epoch's window: if a reader consumes it first (a demand read, or a
        # close reported while this waited), its blocks are not read again for this epoch
        if for_current is None:
            for_current = self._unconsumed(item)
        try:
            if item in self._read_whole:
                return  # a reader read it whole since the walk started this (`read_whole`)
            first_block = 0
            identity = self.meta.identity_not_due(item, self.freshness)
            if identity is None and not self._needs_stat(relpath):
                # Nothing cached to validate: read block 0 at once; the fstat of that read is
                # the fresh identity, so one source round trip does the work of two.
                fetched = await self.tiered.fetch(
                    (relpath, 0), None, item, manifest, demand=False,
                    expected_bytes=self._size_estimate(item))
                if self._superseded(manifest):
                    return
                if fetched is None:
                    self._revisit(item, 0, None)
                    return
                identity, first_block = fetched.identity, 1
                if not self._record_checked(item, identity, fetched.asked_s):
                    return
                self.poke()  # a size is known: the automatic window may change
            elif identity is None:
                asked_s = now_s()
                identity = self.source.identity_of(
                    await self.source.lstat(relpath, background=True))
                if self._superseded(manifest):
                    return
                if not self._record_checked(item, identity, asked_s):
                    return
                self.poke()
            for block_index in range(first_block, block_count(identity.size, self.block_bytes)):
                key = (relpath, block_index)
                if self.tiered.holds(key, identity):
                    continue
                if (for_current and not self._unconsumed(item)) or item in self._read_whole:
                    break  # the window reaches it again as the next epoch's, or a reader has it
                fetched = await self.tiered.fetch(key, identity, item, manifest, demand=False)
                if self._superseded(manifest):
                    return
                if fetched is None:
                    self._revisit(item, block_index, identity)
                    break
                if not self._record_checked(item, fetched.identity, fetched.asked_s):
                    break
                identity = fetched.identity
            else:
                if self.tiered.kernel is not None:
                    self._push(item, identity)  # a reader is about to open it
        except OSError as exc:
            self._fetch_failed(relpath, exc)
        except Exception:  # noqa: BLE001 - one file's read-ahead never ends the mount's
            self._fetch_broke(relpath)
        finally:
            self._item_done(item, manifest)

    def _fetch_failed(self, what, exc: OSError) -> None:
        """A read-ahead of `what` (a file's path, or a block's key) failed: counted; the
        reader will hit the same error on demand and get its errno."""
        self.prefetch_errors += 1
        log.debug("read-ahead of %r failed: %s", what, exc)

    def _fetch_broke(self, what) -> None:
        """A read-ahead of `what` raised what no read should (a bug): counted and logged,
        and the other files' read-ahead goes on (call it in an `except` clause)."""
        self.prefetch_errors += 1
        log.exception("unexpected error reading %r ahead", what)

    def _item_done(self, item: int, manifest) -> None:
        """An item's read-ahead is over: out of the set in flight (unless another manifest
        came into force: it is in no set any more), and the walk told."""
        if not self._superseded(manifest):
            target = self._inflight_items.pop(item, None)
            if target is not None:
                target.inflight_items -= 1
        self.poke()

    # The files of the window are stored into the kernel's page cache (TieredCache.push) as
    # the window reaches them (a file kept in RAM) or as their read lands, so a reader opens
    # them with no READ to send. The daemon keeps its own copy of a pushed file until its
    # reader lets go of it (the kernel may drop pages at any time); then
    # `Ranking.kernel_may_keep` decides which copy stays.

    def _unconsumed(self, item: int) -> bool:
        pos_cur = self.planner.pos_cur
        return item < len(pos_cur) and pos_cur[item] >= 0

    def _push(self, item: int, identity: SourceIdentity) -> None:
        """Store the item's blocks into the kernel's pages, ahead of its reader; not once a
        reader has read it whole, now or when a lookup the push waits for is answered (under
        another manifest by then, the item number means another file, and the push goes
        ahead). The kernel holds such a file from its READs, and a push made its blocks,
        ranked to go first (Ranking.read_whole), the kernel's too: their eviction dropped
        the pages the reader was still reading (a block read twice an epoch in
        tests/test_torch.py, 1 run in 5, by a fetch a demand read had waited for)."""
        if item in self._read_whole:
            return
        manifest = self.ranking.manifest
        self.tiered.push(manifest.path(item), identity,
                         range(block_count(identity.size, self.block_bytes)),
                         still_wanted=lambda: (manifest is not self.ranking.manifest
                                               or item not in self._read_whole))

    def _revisit(self, item: int, block_index: int, identity: SourceIdentity | None) -> None:
        """A fetch came back without reading: if the block is worth keeping, RAM had no room
        after all (it was promised elsewhere between the loop's check and the fetch's
        reservation, e.g. to several files of unknown size started at once), so walk its
        target's list again from its first unconsumed item, or the item would never be read
        ahead. A block not worth
        keeping (its only use is next epoch's and the SSD holds it) is left to the SSD."""
        if self.ranking.priority_of(item, block_index, identity) is not None:
            target = self.targets.target_of(item)
            if target is not None:
                self.targets.rescan(target)

    def _needs_stat(self, relpath: bytes) -> bool:
        """A copy of the file is in RAM or on the SSD: it must be checked against a fresh stat
        before anything is read (reading the source would waste the copy)."""
        key = (relpath, 0)
        ssd = self.tiered.ssd
        return key in self.ram or (ssd is not None and ssd.has_entry(key))

    def _size_estimate(self, item: int) -> int:
        """Bytes to reserve for a file not stat'ed yet: its size last time, else the mean,
        else (no size known yet) a block, within a quarter of the RAM budget: a RAM budget
        smaller than a block could never hold the reservation, and no file was read ahead
        until the readers' own reads made sizes known (the landed block is charged at its
        real size: RamTier.insert)."""
        size = int(self.meta.size[item])
        if size >= 0:
            return size
        return self.meta.mean_size(min(self.block_bytes, self.ram.budget_bytes // 4))

    def read_ahead(self, relpath: bytes, identity: SourceIdentity, item: int, manifest,
                   block_indices) -> None:
        """Fetch the next blocks of a file being read sequentially (no order needed).
        `item`: the file's index in `manifest`, renumbered by the tiered cache if another
        manifest is in force by the time the block is read."""
        if self._nursery is None:
            return
        for block_index in block_indices:
            key = (relpath, block_index)
            if key not in self.tiered.inflight and not self.tiered.holds(key, identity):
                self._nursery.start_soon(self._read_ahead_block, key, identity, item, manifest)

    async def _read_ahead_block(self, key, identity: SourceIdentity, item: int,
                                manifest) -> None:
        try:
            await self.tiered.fetch(key, identity, item, manifest, demand=False)
        except OSError as exc:
            self._fetch_failed(key, exc)
        except Exception:  # noqa: BLE001 - one block's read-ahead never ends the mount's
            self._fetch_broke(key)

    def status(self) -> dict:
        if self.ranges is not None and self.ranking.ranged:
            return self.ranges.status()
        return {"inflight": len(self._inflight_items), "errors": self.prefetch_errors,
                "miss_batch_items": self.miss_batch_items, "task_fetches": self.task_fetches}
