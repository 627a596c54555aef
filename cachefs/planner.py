"""The order state and the one rule that drives the RAM tier: an item's next use.

Pure: no I/O, no trio, no FUSE. The prefetcher, the reader and the simulator all ask this
module the same questions, so the policy tested in the simulator is the policy that runs.

The rule (docs/design.md §2, after Cao et al., SIGMETRICS'95): an item's *next use* is
- its position in the current order, if it has not been consumed yet;
- else N + its position in the next order (N = length of the current order);
- else never (infinity).
RAM keeps the blocks with the nearest next uses; the prefetcher fetches the next missing item of
the read-ahead window as soon as the block it would displace is used later. Consumed items not
needed soon lose to everything else and are dropped at once when their next use is never; the
head of the next epoch has the nearest next uses among consumed items, so it is what stays.

Positions are "virtual": 0..N-1 walk the current order, N..N+M-1 the next one. The window is the
virtual range [cursor, max(cursor, front) + max(lookahead, front - cursor)), at most
`max_span_items` long: the cursor is the lowest unconsumed position and the front the highest
position consumed lately near it (plus one; "Readers off the order" below).
One reader in order keeps them together. A DataLoader's workers do not: each reads a batch of
its own, so at any time they read positions spread over workers x batch size, and a window
that followed only the cursor left all but the first worker reading without read-ahead (the
simulator: 70 % misses with 8 workers of 64-file batches). Reaching past the front covers
every worker; the span limit (set from the RAM budget) keeps a stray read far ahead from
pulling in the rest of the epoch.

Readers off the order. A reader that does not follow the order (a validation pass in
directory order, another sampler) consumes positions all over the epoch: the front jumps to
its end at once, and the window stretched to its whole span (2,048 files) for files that
reader was not about to read, costing it the read-ahead's fetches, lookups and stores of
them (`scripts/bench_offorder.py`). So the front counts only where the readers are: it is
the highest position consumed *near* the cursor, and only while at least half of the last
`RECENT_CONSUMPTIONS` positions consumed were near (`window_end`); else the window is the
lookahead past the cursor. Near
is within `READERS_SPREAD_ITEMS` per rank merged into the order (a DataLoader's workers: 8 of
them a batch of 256 apart; ranks sharing a mount interleave their positions), the lookahead,
or an eighth of the rest of the epoch, whichever is most (`_near_items`): a DataLoader's
workers and a reader in order consume near the cursor, and nothing changes for them, while a
reader off the order consumes all over the rest of the epoch, an eighth of it near. (So an
epoch shorter than about twice that distance holds no reader off the order: everything is
near.) Whether the readers go through the order somewhere, together (`follows`: the recent
positions lie within that distance of each other, say a job resumed mid-epoch), decides
whether a miss reads a batch of the next items (cachefs/prefetch.py `demand_miss`). It is
judged once JUDGED_POSITIONS are known: a DataLoader's workers start an epoch a batch apart,
within the near distance, and a reader off a shuffled order reads 8 positions within an eighth
of the epoch of each other four times in a million (8 x 8^-7); judged at 32, each of such a
reader's first 32 misses read a batch of the order's next files (224 files of no use to it).

While they do not, a read of an item far past the cursor is not the order's (`read_outside`):
its position is noted among the recent ones, and nothing else; the item is not consumed,
and the reader serves the file as it would with no order (cachefs/reader.py). Far is
further than readers of the order read, with a margin (`_outside_items`): a reader of the
order taken for one outside it leaves its file unconsumed. That can happen (a DataLoader
spread wider than the margin is judged off the order too), so a position read outside is
consumed when the cursor reaches it (`_advance_cursor`): the readers of the order have read
everything before it, and were not going to stop there for good. A pass off the
order then leaves the plan as the order's readers left it: the read-ahead still reads its
files at their positions for the trainer (consumed, they were skipped, and a trainer running
beside a validation pass missed on each), and it costs the pass about what a pass with no
order costs (1.00x, 1.02x and 1.00x in three runs on 2026-12-02, README), where the consumption, the
re-rank and the early rank of each of its files took a tenth more of the daemon's work per
file (scripts/bench_offorder.py). The nearer ones are
the order's (readers that follow it read there, beside such a pass or not): 8,192 positions per
rank, 4 % of a pass over an epoch of 200,000 files. A verdict is as old as the last
consumption, or as the last OUTSIDE_NOTES reads outside, which are noted together.

The read-ahead walks the window target by target (cachefs/targets.py): each storage target has
a list of the virtual positions of its items, and `entries` yields those of a list that still
have an item to read ahead (`due_items`), nearest first.

Everything is held in numpy arrays indexed by manifest item or by position: an order of
ImageNet's 1.28M items costs a few tens of MB and no per-item Python objects.

Invariants:
- `consumed[p]` is True for exactly `consumed_count` positions, and every position below
  `cursor` is consumed.
- `pos_cur[item]` is the first unconsumed position of `item` in the current order, or -1.
- `uses[item]` is `next_use(item)`, or NaN for an item in neither order: the one read of the
  plan per block rank (cachefs/ranking.py), kept as each consumption changes it. Three arrays
  (`pos_cur`, `pos_next`, a membership mask) read at random by every rank cost three cache
  misses in a busy daemon, where an isolated loop finds them in cache: a rank took 3.6 us on
  the trio thread, and a reader off the order ranks three times a file.
- `pos_cur`, `pos_next` and `uses` are as long as the manifest of `order`: an order over a manifest
  with other paths always starts a new plan (`set_order`), so no item number of one manifest
  indexes the arrays of another.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from cachefs.sorted_arrays import index_left

if TYPE_CHECKING:
    from cachefs.order import Order

log = logging.getLogger(__name__)

NEVER = math.inf
RECENT_CONSUMPTIONS = 32  # positions consumed last, which say where the readers are
JUDGED_POSITIONS = 8  # positions enough to tell whether the readers follow it (module docstring)
# readers that follow the order read this near the cursor at least, per rank: 8 DataLoader
# workers' batches of 256 (also the read-ahead window's span at most, cachefs/prefetch.py)
READERS_SPREAD_ITEMS = 2048
# positions looked at a time, in the read-ahead's lists (`entry_chunks`) and past the cursor
ENTRY_CHUNK = 256
# a batch of fewer items is handled item by item: numpy's fixed cost per call (a few us, and
# np.unique's sort) outweighs the work. A reader off the order closes files about eight to a
# fanotify batch (scripts/bench_offorder.py): in the daemon its consumption took 45 us a batch
# as arrays, 23 item by item. Alone, a consumption takes 1.7 us an item as arrays against 1.45
# item by item in batches of 8, 0.90 against 0.96 in batches of 16, 0.53 against 0.96 of 32
ARRAY_MIN_ITEMS = 16
# `entries` walks this many entries one by one before it takes a chunk at a time, and the
# cursor moves this many positions one by one before a stretch at a time
SCALAR_ENTRIES = 16
# reads outside the order (`read_outside`) noted among the recent positions together, at
# the latest: a reader off the order reads a few files between two batches of closes
OUTSIDE_NOTES = 8
# a read is outside the order only this far past the cursor per rank at least
# (`_outside_items`): twice the readers' spread at full, two batches in flight per worker
# (a DataLoader's default prefetch), and twice that again
OUTSIDE_SPREAD_ITEMS = 4 * READERS_SPREAD_ITEMS


class Planner:
    def __init__(self, lookahead_items: int):
        self.lookahead_items = max(1, lookahead_items)
        self.max_span_items = self.lookahead_items  # the window's length at most
        self.order: Order | None = None  # the order in force, for its manifest and status
        self.epoch: int | None = None
        self.epoch_serial = 0  # bumped at every epoch switch or new order
        self.order_serial = 0  # bumped when a published order replaces the plan
        self.current = np.empty(0, np.int64)
        self.next: np.ndarray | None = None
        self.consumed = np.empty(0, bool)
        self.consumed_count = 0
        self.cursor = 0
        # the positions consumed last, whether each was near the cursor when consumed, how
        # many were, and one past the highest position consumed near it in this epoch: the
        # front, while the near ones are at least half (module docstring, "Readers off the
        # order"); O(1) a consumption, which the zero-request mode accounts for 40k a second
        self._recent: deque[int] = deque(maxlen=RECENT_CONSUMPTIONS)
        self._recent_near: deque[bool] = deque(maxlen=RECENT_CONSUMPTIONS)
        self._near_count = 0
        self._near_max = 0
        # whether the readers follow the order, and where outside it starts, judged as
        # positions are noted (`_judge`): both are asked for every file a reader opens
        self.follows = True
        self._outside_from = 0
        self._outside: list[int] = []  # positions read outside the order, not noted yet
        # by position of the current order: read outside it (module docstring), and the
        # items consumed since as the cursor reached them, for the prefetcher to re-rank
        self._read_outside = bytearray()  # (not numpy's: written an element at a time)
        self.caught_up: list[int] = []
        # the read-ahead of an order of byte ranges (cachefs/range_prefetch.py), which walks
        # one list, `window`, has handled every window position below this
        self.scan = 0
        # after set_order: the items whose next use it changed, or None for every item
        self.reranked_items: np.ndarray | None = None
        self.pos_cur = np.empty(0, np.int64)
        self.pos_next = np.empty(0, np.int64)
        self.uses = np.empty(0, np.float64)  # module docstring, "Invariants"
        # every item of the current order is in the next one too: no consumption leaves an
        # item with no next use (cachefs/ranking.py `rerank_many`)
        self.next_holds_current = False
        self._later_positions: dict[int, list[int]] = {}  # items that occur twice (rank padding)

    # -- order changes ---------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.order is not None

    @property
    def length(self) -> int:
        return len(self.current)

    def set_order(self, order) -> bool:
        """Put a newly accepted order in force; True if a new epoch started.

        Two changes keep the plan's progress, so that publishing does not reset the window:
        - the epoch the planner already switched to by itself (same epoch, same `current`)
          only adds the `next` order, as a trainer that publishes every epoch does;
        - a rank joined the merged order of the node (`_rank_joined`): ranks of one mount
          publish one after another, and what the first ones read before the others
          published stays read. One position per consumed item is marked consumed again.
        Neither bumps `order_serial`: files open during the change keep consuming. Any other
        order is a new plan, and so is any order over a manifest with other paths or other
        byte-range items: item numbers are indices into the manifest (or the item table), and
        every per-item array (`pos_cur`, `pos_next`, `uses`) is sized to it.
        """
        same_epoch = (self.order is not None and order.epoch == self.epoch
                      and order.manifest.same_paths(self.order.manifest)
                      and order.same_items(self.order)
                      and np.array_equal(order.current, self.current))
        joined = not same_epoch and self._rank_joined(order)
        self.order = order
        manifest_len = order.item_count  # byte-range items, or the manifest's files
        self.reranked_items = None
        if joined:
            consumed_items = self.current[self.consumed]
            self._start(order.epoch, order.current, order.next, manifest_len, new_epoch=False)
            self._consume_all(consumed_items)
            return False
        if not same_epoch:
            self.order_serial += 1
            self._start(order.epoch, order.current, order.next, manifest_len)
            return True
        self._judge()  # its ranks weigh in `_near_items`
        # Only the next epoch changed (a trainer publishing each epoch, after the plan moved
        # on to it by itself): an item's next use changed only if it is used next epoch
        # first, having been consumed in this one or not being in it
        empty = np.empty(0, np.int64)
        either_next = np.union1d(self.next if self.next is not None else empty,
                                 order.next if order.next is not None else empty)
        self.reranked_items = np.union1d(self.current[self.consumed],
                                         np.setdiff1d(either_next, self.current))
        self.next = order.next
        self.pos_next = _positions(order.next, manifest_len)
        self._refresh_uses()
        self.scan = self.cursor
        return False

    def _rank_joined(self, order) -> bool:
        """The new order is the plan in force with more ranks' slices merged in.

        Same epoch, world size and manifest; its ranks include the ranks in force, and each of
        those reads the same slice as in the plan (the merge's layout, cachefs.order.Order:
        rank ranks[j] of k is current[j::k]). The plan's `current` is compared, not the old
        order's, since the plan may have moved on to the old order's next epoch by itself.
        """
        old = self.order
        if (old is None or order.epoch != self.epoch or old.ranks is None
                or order.ranks is None or order.world_size != old.world_size
                or not set(old.ranks) <= set(order.ranks)):
            return False
        if not order.manifest.same_paths(old.manifest) or not order.same_items(old):
            return False
        old_k, new_k = len(old.ranks), len(order.ranks)
        if len(self.current) % old_k or len(order.current) % new_k:
            return False
        return all(np.array_equal(self.current[j::old_k],
                                  order.current[order.ranks.index(rank)::new_k])
                   for j, rank in enumerate(old.ranks))

    def _consume_all(self, items: np.ndarray) -> None:
        """Consume each of `items` (repeats included) in the plan, vectorised.

        An item the order holds once is marked at its position in one step; the few that it
        holds more than once (rank padding) go through `consume`, which walks their positions.
        """
        unique, counts = np.unique(items, return_counts=True)
        repeated = np.fromiter(self._later_positions, np.int64, len(self._later_positions))
        simple = (counts == 1) & ~np.isin(unique, repeated)
        positions = self.pos_cur[unique[simple]]
        positions = positions[positions >= 0]
        self.consumed[positions] = True
        self.pos_cur[self.current[positions]] = -1
        self.consumed_count += len(positions)
        for item, count in zip(unique[~simple].tolist(), counts[~simple].tolist(), strict=True):
            for _ in range(count):
                self.consume(item)
        unconsumed = np.flatnonzero(~self.consumed)
        self.cursor = int(unconsumed[0]) if len(unconsumed) else len(self.current)
        self.scan = self.cursor
        # replayed, not read now: the front is the highest position consumed near the cursor
        self._forget_positions()
        near = np.flatnonzero(self.consumed[self.cursor:self.cursor + self._near_items()])
        self._near_max = self.cursor + int(near[-1]) + 1 if len(near) else 0
        self._refresh_uses()

    def _start(self, epoch: int, current: np.ndarray, next_: np.ndarray | None,
               manifest_len: int, new_epoch: bool = True) -> None:
        self.epoch = epoch
        if new_epoch:
            self.epoch_serial += 1
        self.current = current
        self.next = next_
        self.consumed = np.zeros(len(current), bool)
        self._read_outside = bytearray(len(current))
        self.caught_up = []  # numbered by the plan before, perhaps under another manifest
        self.consumed_count = 0
        self.cursor = self.scan = 0
        self._forget_positions()
        self.pos_cur = _positions(current, manifest_len)
        self.pos_next = _positions(next_, manifest_len)
        self._later_positions = _duplicates(current)
        self._refresh_uses()
        log.info("epoch %s%s: %d items in order, next order %s", epoch,
                 "" if new_epoch else " (a rank joined)", len(current),
                 "known" if next_ is not None else "unknown")

    def _refresh_uses(self) -> None:
        """`uses` and `next_holds_current` from the positions, for every item (an order put
        in force; a consumption keeps them itself, item by item)."""
        member = np.zeros(len(self.pos_cur), bool)
        member[self.current] = True
        in_next = np.zeros(len(self.pos_cur), bool)
        if self.next is not None:
            in_next[self.next] = True
        self.next_holds_current = self.next is not None and bool(in_next[self.current].all())
        uses = self.next_uses()
        uses[~(member | in_next)] = np.nan
        self.uses = uses

    def switch_to_next(self) -> bool:
        """The current order is consumed: the next one becomes current. False if none is known."""
        if self.next is None:
            return False
        assert self.epoch is not None  # an order is in force: it set the epoch
        self._start(self.epoch + 1, self.next, None, len(self.pos_cur))
        return True

    # -- questions -------------------------------------------------------------------------

    def item_at(self, position: int) -> int:
        """The item at a virtual position, or -1 beyond the known orders."""
        n = len(self.current)
        if position < n:
            return int(self.current[position])
        if self.next is not None and position - n < len(self.next):
            return int(self.next[position - n])
        return -1

    def next_use(self, item: int) -> float:
        use = self.member_use(item)
        return NEVER if use is None else use

    def member_use(self, item: int) -> float | None:
        """`next_use` of an item of the orders in force; None for one in neither (no known
        future), or with no order."""
        uses = self.uses
        if not 0 <= item < len(uses):
            return None
        use = uses.item(item)
        return None if use != use else use  # NaN: in neither order

    def use_after_read(self, item: int) -> float:
        """The item's next use once the read of it under way is consumed (what `consume`
        will make `next_use`): a later position in this order (rank padding repeats items),
        else its position in the next order, else NEVER."""
        # (`.item`: a Python int, not a numpy scalar; once per file closed)
        if item < 0 or item >= len(self.pos_cur) or self.pos_cur.item(item) < 0:
            return self.next_use(item)
        later = self._later_positions.get(item)
        if later:
            return float(later[0])
        position = self.pos_next.item(item)
        return float(len(self.current) + position) if position >= 0 else NEVER

    def next_uses(self, items: np.ndarray | None = None) -> np.ndarray:
        """`next_use` of `items` (of the manifest's, each a valid index; None: every one), as
        one array."""
        pos_cur = self.pos_cur if items is None else self.pos_cur[items]
        pos_next = self.pos_next if items is None else self.pos_next[items]
        in_next = np.where(pos_next >= 0, len(self.current) + pos_next.astype(float), NEVER)
        return np.where(pos_cur >= 0, pos_cur.astype(float), in_next)

    def window_end(self) -> int:
        # past the front by the lookahead, or by the readers' spread if wider: workers that
        # finish a round of batches jump a spread ahead, and find the next round read ahead
        front = self.front()
        reach = front + max(self.lookahead_items, front - self.cursor)
        return min(reach, self.span_end())

    def front(self) -> int:
        """Where the readers are (module docstring): the furthest read near the cursor if
        most recent reads are near it, else the cursor. With the cursor, all that moves the
        window when a file is consumed: the rest of `window_end` changes only with the
        orders (a consumption compares these two, not the window's end, which took a reader
        off the order a sixth of its consumption's work)."""
        return (max(self.cursor, self._near_max)
                if 2 * self._near_count >= len(self._recent_near) else self.cursor)

    def _judge(self, near_items: int | None = None) -> None:
        """`follows`, whether the readers go through the order together (module docstring):
        the recent positions lie near each other (or there are too few to tell); and where
        reads outside it start. Judged as positions are noted only: the window's size,
        which `_near_items` weighs too, changes with the files' sizes as they become known,
        and a verdict a batch of closes old does as well."""
        recent = self._recent
        if near_items is None:
            near_items = self._near_items()
        self.follows = (len(recent) < JUDGED_POSITIONS
                        or max(recent) - min(recent) < near_items)
        self._outside_from = self.cursor + self._outside_items()

    def read_outside(self, item: int) -> bool:
        """Whether a read of `item` starting now is not the order's (module docstring): the
        readers do not follow the order, and the item's position is far. Its position
        is then noted among the recent ones (with the next consumption, or OUTSIDE_NOTES
        together), and the item is not to be consumed."""
        if self.follows or not 0 <= item < len(self.pos_cur):
            return False
        position = self.pos_cur.item(item)
        if position < self._outside_from:  # not far, or in no order / consumed (-1)
            return False
        self._outside.append(position)
        self._read_outside[position] = 1
        if len(self._outside) >= OUTSIDE_NOTES:
            self._note_positions([])
        return True

    def _near_items(self) -> int:
        """How far past the cursor readers that follow the order read (module docstring)."""
        return max(READERS_SPREAD_ITEMS * self._ranks(), self.lookahead_items,
                   (len(self.current) - self.cursor) // 8)

    def _outside_items(self) -> int:
        """How far past the cursor a read outside the order is (module docstring):
        OUTSIDE_SPREAD_ITEMS per rank, or the lookahead if longer. Not the near distance
        (an eighth of the rest of the epoch, if longer): early in an epoch a pass off the
        order then had an eighth of its files consumed as the order's, a third of what it
        cost over no order; a reader of the order further on is caught up at the cursor."""
        return max(OUTSIDE_SPREAD_ITEMS * self._ranks(), self.lookahead_items)

    def _ranks(self) -> int:
        """The ranks whose readers share the mount (merged into the order), at least one."""
        return len(self.order.ranks) if self.order is not None and self.order.ranks else 1

    def _note_positions(self, positions: list[int]) -> None:
        """Consumptions at `positions`, reported together, after the reads outside the order
        not noted yet (`read_outside`): where the readers are (module docstring). Near is
        judged against the cursor after them: the cursor only moves on, so one near stays
        near."""
        if self._outside:
            positions = self._outside + positions
            self._outside = []
        # below the cursor counts as near: consumed before it moved, by readers at the cursor
        near_items = self._near_items()
        threshold = self.cursor + near_items
        recent, recent_near = self._recent, self._recent_near
        near_count, near_max = self._near_count, self._near_max
        # counted as the deques turn over, not summed again: a reader off the order consumes
        # one file to three at a time
        for position in positions:
            near = position < threshold
            if len(recent_near) == RECENT_CONSUMPTIONS:
                near_count -= recent_near[0]
            recent.append(position)
            recent_near.append(near)
            if near:
                near_count += 1
                near_max = max(near_max, position + 1)
        self._near_count, self._near_max = near_count, near_max
        self._judge(near_items)

    def _forget_positions(self) -> None:
        self._recent.clear()
        self._outside = []
        self._recent_near.clear()
        self._near_count = self._near_max = 0
        self._judge()

    def span_end(self) -> int:
        """The virtual position below which anything may be read ahead: the window's span at
        most past the cursor (the RAM budget's), within the known orders."""
        return min(self.cursor + max(self.lookahead_items, self.max_span_items),
                   self.known_end())

    def known_end(self) -> int:
        """One past the last virtual position of the known orders."""
        return len(self.current) + (len(self.next) if self.next is not None else 0)

    def due_items(self, positions: np.ndarray) -> np.ndarray:
        """The item to read ahead for each of the virtual `positions`, or -1 where there is
        none: the position is consumed, beyond the known orders, or of the next order for an
        item still unconsumed in the current one (its next use is its current position,
        where the read-ahead meets it)."""
        n = len(self.current)
        items = np.full(len(positions), -1, np.int64)
        in_current = positions < n
        current = positions[in_current]
        items[in_current] = np.where(self.consumed[current], -1, self.current[current])
        if self.next is not None:
            in_next = ~in_current & (positions < n + len(self.next))
            next_items = self.next[positions[in_next] - n]
            items[in_next] = np.where(self.pos_cur[next_items] < 0, next_items, -1)
        return items

    def due_item(self, position: int) -> int:
        """`due_items` of one virtual position."""
        n = len(self.current)
        if position < n:
            return -1 if self.consumed.item(position) else self.current.item(position)
        following = self.next
        if following is not None and position - n < len(following):
            item = following.item(position - n)
            return item if self.pos_cur.item(item) < 0 else -1
        return -1

    def window(self) -> Iterator[tuple[int, int]]:
        """(virtual position, item) of the window's positions from `scan` on that have an
        item to read ahead (`due_items`), nearest first: the one list of the read-ahead of an
        order of byte ranges (cachefs/range_prefetch.py)."""
        end = self.window_end()
        positions = np.arange(max(self.scan, self.cursor), end, dtype=np.int64)
        for _, position, item in self.entries(positions, 0, end):
            yield position, item

    def entry_chunks(self, positions: np.ndarray, start: int, end: int
                     ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
        """The entries of `positions` (ascending virtual positions: a target's read-ahead
        list, cachefs/targets.py) from index `start` on, below position `end`, that have an
        item to read ahead (`due_items`), nearest first, a stretch of the list at a time: its
        entries' (indices, virtual positions, items), and the index past the stretch."""
        # not np.searchsorted, which lets go of the GIL: on the trio thread each walk then
        # waited for it back from a store thread, 71 us a search in a DataLoader's first epoch
        # over slow storage (cProfile of the daemon; cachefs/sorted_arrays.py)
        stop = index_left(positions, end, start)
        for chunk_start in range(start, stop, ENTRY_CHUNK):
            chunk_stop = min(chunk_start + ENTRY_CHUNK, stop)
            chunk = positions[chunk_start:chunk_stop]
            items = self.due_items(chunk)
            due = np.flatnonzero(items >= 0)
            yield due + chunk_start, chunk[due], items[due], chunk_stop

    def entries(self, positions: np.ndarray, start: int, end: int
                ) -> Iterator[tuple[int, int, int]]:
        """`entry_chunks`, one (index, virtual position, item) at a time: the first
        SCALAR_ENTRIES entries one by one (`due_item`), the rest a chunk at a time. A demand
        miss wants the next seven items of its target's list, and a chunk's numpy work was
        most of its cost: 113 us of the trio thread's CPU a miss in a DataLoader's first
        epoch over slow storage, where a walk of a few entries one by one takes a tenth."""
        stop = index_left(positions, end, start)
        one_by_one = min(stop, start + SCALAR_ENTRIES)
        for index in range(start, one_by_one):
            position = positions.item(index)
            item = self.due_item(position)
            if item >= 0:
                yield index, position, item
        if one_by_one < stop:
            for indices, virtual, items, _ in self.entry_chunks(positions, one_by_one, end):
                yield from zip(indices.tolist(), virtual.tolist(), items.tolist(),
                               strict=True)

    # -- consumption -----------------------------------------------------------------------

    def consume_many(self, items: list[int]) -> tuple[int, bool]:
        """Readers finished `items`, in this order, reported together (the closes of one
        batch): each is consumed in turn, up to the one that completes the current order.
        Returns how many were taken (all of them, unless one completed the order) and whether
        the last one taken completed it. Where the readers are (`_note_positions`) is judged
        once for the batch, against the cursor after it.

        Vectorised: a consumption was a dozen numpy scalar reads and writes, about a quarter
        of the daemon's work per file closed in a hot pass (scripts/bench_fuse.py). Items the
        order holds more than once (rank padding) go through `consume`, which walks their
        later positions, and so does a batch of fewer than ARRAY_MIN_ITEMS."""
        if self._later_positions or len(items) < ARRAY_MIN_ITEMS:
            return self._consume_each(items)
        batch = np.array(items, np.int64)
        positions = np.full(len(batch), -1, np.int64)
        inside = (batch >= 0) & (batch < len(self.pos_cur))
        positions[inside] = self.pos_cur[batch[inside]]
        found = np.flatnonzero(positions >= 0)
        if len(found) == 0:
            return len(items), False
        _, first = np.unique(batch[found], return_index=True)
        if len(first) < len(found):  # an item closed twice: its first close consumes it
            found = np.sort(found[first])
        left = len(self.current) - self.consumed_count
        completed = len(found) >= left
        if completed:
            found = found[:left]
        taken = int(found[-1]) + 1 if completed else len(items)
        consumed_positions = positions[found]
        self.consumed[consumed_positions] = True
        gone = batch[found]
        self.pos_cur[gone] = -1
        self.uses[gone] = self.next_uses(gone)
        self.consumed_count += len(found)
        self._advance_cursor()
        self._note_positions(consumed_positions.tolist())
        # (positions read outside the order, consumed as the cursor reached them, may end it)
        return taken, completed or self.consumed_count == len(self.current)

    def _consume_each(self, items: list[int]) -> tuple[int, bool]:
        """`consume_many`, one item at a time; where the readers are is noted once."""
        positions: list[int] = []
        taken, completed = len(items), False
        for index, item in enumerate(items):
            position = self._consume_one(item)
            if position >= 0:
                positions.append(position)
                if self.consumed_count == len(self.current):
                    taken, completed = index + 1, True
                    break
        if positions:
            self._note_positions(positions)
        return taken, completed

    def _advance_cursor(self) -> None:
        """Move the cursor past the consumed positions at it: the first SCALAR_ENTRIES one by
        one (readers that follow the order move it a few at a time, and a stretch's numpy
        work was 14 us of the trio thread a move in a DataLoader's first epoch), then a
        stretch at a time; a position read outside the order where it stops is consumed
        there (module docstring), and it moves on."""
        n, consumed = len(self.current), self.consumed
        while True:
            for _ in range(SCALAR_ENTRIES):
                if self.cursor >= n or not consumed.item(self.cursor):
                    break
                self.cursor += 1
            else:
                while self.cursor < n and consumed[self.cursor]:
                    ahead = consumed[self.cursor:self.cursor + ENTRY_CHUNK]
                    gaps = np.flatnonzero(~ahead)
                    self.cursor += int(gaps[0]) if len(gaps) else len(ahead)
            if self.cursor >= n or not self._read_outside[self.cursor]:
                return
            self._catch_up(self.cursor)

    def _catch_up(self, position: int) -> None:
        """Consume the item at `position`, read outside the order, as the cursor reaches it
        (`_advance_cursor`, which then moves on); listed in `caught_up`. The cursor is the
        lowest unconsumed position, so it is the item's first unconsumed one."""
        item = self.current.item(position)
        self._mark_consumed(item, position)
        self.caught_up.append(item)

    def _mark_consumed(self, item: int, position: int) -> None:
        """`item` consumed at `position`, its first unconsumed one (`pos_cur`)."""
        self.consumed[position] = True
        self.consumed_count += 1
        self.uses[item] = self.use_after_read(item)
        later = self._later_positions.get(item)
        self.pos_cur[item] = later.pop(0) if later else -1

    def consume(self, item: int) -> bool:
        """A reader finished `item`. Returns True if that completed the current order."""
        return self._consume_each([item])[1]

    def _consume_one(self, item: int) -> int:
        """Mark `item` consumed at its first unconsumed position, which it returns (-1 if it
        has none: not in the current order, or consumed already). The readers' whereabouts
        are the caller's to note."""
        pos_cur = self.pos_cur
        if item < 0 or item >= len(pos_cur):
            return -1
        position = pos_cur.item(item)
        if position < 0:
            return -1
        self._mark_consumed(item, position)
        if position == self.cursor:  # else the cursor stays, at an unconsumed position
            self._advance_cursor()
        return position

    def status(self) -> dict:
        if self.order is None:
            return {}
        return {"epoch": self.epoch, "length": len(self.current),
                "consumed": self.consumed_count, "cursor": self.cursor,
                "has_next": self.next is not None, "lookahead": self.lookahead_items}


def _positions(order: np.ndarray | None, manifest_len: int) -> np.ndarray:
    """Inverse of an order: item -> its first position in it, -1 where absent."""
    positions = np.full(manifest_len, -1, np.int64)
    if order is not None and len(order):
        # assign in reverse so that the first occurrence of a repeated item wins
        positions[order[::-1]] = np.arange(len(order) - 1, -1, -1, dtype=np.int64)
    return positions


def _duplicates(order: np.ndarray) -> dict[int, list[int]]:
    """Later positions of items that occur more than once (DistributedSampler padding)."""
    if len(order) == 0:
        return {}
    unique, counts = np.unique(order, return_counts=True)
    repeated = unique[counts > 1]
    if len(repeated) == 0:
        return {}
    later: dict[int, list[int]] = {}
    for position in np.nonzero(np.isin(order, repeated))[0]:
        later.setdefault(int(order[position]), []).append(int(position))
    return {item: positions[1:] for item, positions in later.items()}
