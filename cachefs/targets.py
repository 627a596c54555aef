"""Storage targets at run time: each target's read-ahead list, its share of the source threads,
and its counters.

Why. A data set spread over storage nodes (cachefs/placement.py says which node each file is
on) is read at the pace of its slowest node. One read-ahead window over the order, as long as
the source threads are many, fills with the slow node's files: they stay in flight for longer,
so they hold most threads, and the window cannot move on past them, so the fast node's files
behind the window wait although threads are idle. After the seed "001" (one prefetch list per
storage node), every target here has

- its own **list**: the order's virtual positions (planner.py) of its items, nearest first;
- its own **concurrency** (`slots`): how many of its files the read-ahead reads at once, and
  its own **queue depth** (`depth`): how far down its list the read-ahead reaches. The
  window (`--lookahead`, by default as many files as `--source-threads` within a quarter of
  the RAM budget) is shared out like the threads: a target with k of the S slots reaches
  k/S of the window's files down its own list, or further where the window every target
  reaches (the planner's, which follows the readers' spread) covers more of its files. A
  file RAM held when the list was built (the head of the epoch, kept from the last one)
  does not count: while the readers go through the head, the read-ahead is already reading
  the files after it, as far as RAM makes room (it frees as the head is read). And the depth
  covers the target's latency tail at the readers' pace: at least as many of its files as
  the readers consume during its p99 latency (share x p99 / seconds per file consumed), so
  that its slowest requests are started early enough (a mean-sized window is passed by
  every request slower than the mean); not with `--lookahead`, which sets the window;
- its own **counters** for `cachefs stats`: items, bytes and requests read from it, mean and
  p99 latency of its requests, requests in flight now, misses and stall seconds of its files.

Sizing (`Targets.size`, Little's law). The readers consume the order at some rate r; a target
holding a share p of the files to read (of the current order's files, those RAM did not hold
when the list was built) must deliver p*r files per second, and with a latency L per
request that takes p*r*L requests in flight. Whatever r is, the threads are best split in
proportion to p*L: every target then delivers its share at the same pace, and no target runs
ahead while another holds the readers up. So `--source-threads` (S) are shared out in
proportion to share x measured latency (an exponential average of its requests' latency;
before any is measured, the mean of the others', or equal), so a target 10x slower than
another with as many items gets about 10x the slots, and a queue as much deeper. Two guards:
every target with items keeps at least a quarter of its share of S by its files to read (at
least 1), so a target whose latency grows only because it is saturated (its requests queue on
the server) cannot starve the others; and the total stays S.

Read costs (`read_costs`). Once every target with files of the current order has
COST_REQUESTS requests timed, each item's cost is its target's average latency (the sizing's)
over the fastest target's: the ranking keeps the next epoch's files by distance over cost
(cachefs/ranking.py `set_read_costs`), so RAM holds what is slowest to read again and the slow
targets deliver fewer files the next epoch.

A request is a call to the source (cachefs/source.py reports each one, `request_started` /
`request_finished`): its latency is timed in the worker thread, so waiting for a free thread is
not counted. Requests of files outside the order's manifest belong to no target.

Lists are rebuilt when the plan changes (`rebuild`: a new order, the next epoch): the current
order's positions, then the next order's, grouped by target with one stable sort of the items'
target numbers (int16: numpy sorts it by radix, a few ms for a million items). Within a list,
`first` is the first entry not yet consumed and `scan` the first the read-ahead has not handled;
both only move forward, until a rebuild or a fetch that found no room (`rescan`).

Pure bookkeeping: no I/O, no trio; the prefetcher (cachefs/prefetch.py) walks the lists and
starts the fetches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cachefs import stats as stats_mod
from cachefs.placement import Placement
from cachefs.planner import Planner
from cachefs.sorted_arrays import index_left

log = logging.getLogger(__name__)

LATENCY_WEIGHT = 0.1  # of each new request's latency in a target's average
FLOOR_FRACTION = 0.25  # of a target's share of the threads by files to read, whatever its latency
SIZE_INTERVAL_S = 0.1  # the slots are shared out again at most this often
COST_REQUESTS = 20  # requests timed on every target before their read costs are compared
# Request latencies: buckets 20 to a decade (12 % wide, for the p99) from 1 us to 1,000 s
BUCKETS_PER_DECADE = 20
MIN_LATENCY_S = 1e-6
LATENCY_BOUNDS_S = tuple(MIN_LATENCY_S * 10 ** (bucket / BUCKETS_PER_DECADE)
                         for bucket in range(1, 9 * BUCKETS_PER_DECADE + 1))


@dataclass(eq=False)
class Target:
    """One storage target: its list, its share of the source threads, its counters."""

    name: str  # the order file's value, or the device MAJOR:MINOR (placement.py)
    from_devices: bool
    # -- the read-ahead list (module docstring)
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # to_read[i]: entries 0..i whose item RAM did not hold when the list was built
    to_read: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    first: int = 0
    scan: int = 0
    items: int = 0  # its items in the current order
    share: float = 0.0  # of the current order's files to read (not held in RAM): rebuild
    inflight_items: int = 0  # read-ahead fetches of its items in flight (the prefetcher's)
    slots: int = 1
    tail_items: int = 0  # its files the readers consume in its p99 latency (sizing)
    window_end: int = 0  # the virtual position its window reached when last walked
    # -- counters
    requests: int = 0
    bytes: int = 0
    in_flight: int = 0  # source requests in flight now
    misses: int = 0
    stall_s: float = 0.0
    batches: int = 0  # demand misses that started a batch (prefetch.py, demand_miss)
    batch_items: int = 0  # items those batches started
    latency: stats_mod.Histogram = field(
        default_factory=lambda: stats_mod.Histogram(LATENCY_BOUNDS_S))
    latency_avg_s: float | None = None  # exponential average, for the sizing

    @property
    def depth(self) -> int:
        """Entries of its list from its first unconsumed one to its window's end."""
        return max(0, index_left(self.positions, self.window_end) - self.first)

    def status(self) -> dict:
        mean_s, p99_s = self.latency.mean_s, self.latency.quantile_s(0.99)
        return {"target": self.name, "by": "device" if self.from_devices else "order",
                "items": self.items, "bytes": self.bytes, "requests": self.requests,
                "mean_latency_s": round(mean_s, 6) if mean_s is not None else None,
                "p99_latency_s": round(p99_s, 6) if p99_s is not None else None,
                "in_flight": self.in_flight, "misses": self.misses,
                "stall_s": round(self.stall_s, 6), "slots": self.slots, "depth": self.depth,
                "batches": self.batches, "batch_items": self.batch_items}


def allocate_slots(total: int, weights: list[float], floors: list[int]) -> list[int]:
    """`total` slots shared in proportion to `weights`, each at least its floor: the largest
    remainder method after fixing at their floor those whose share falls below it. If the
    floors alone exceed `total` (more targets than slots), each gets its floor."""
    count = len(weights)
    if count == 0:
        return []
    if sum(floors) >= total:
        return list(floors)
    fixed = [False] * count
    while True:
        free = total - sum(floor for floor, is_fixed in zip(floors, fixed, strict=True)
                           if is_fixed)
        open_weight = sum(w for w, is_fixed in zip(weights, fixed, strict=True) if not is_fixed)
        open_count = fixed.count(False)
        ideal = [float(floors[i]) if fixed[i]
                 else free * (weights[i] / open_weight if open_weight > 0 else 1 / open_count)
                 for i in range(count)]
        below = [i for i in range(count) if not fixed[i] and ideal[i] < floors[i]]
        if not below:
            break
        for i in below:
            fixed[i] = True
    slots = [max(floors[i], int(ideal[i])) for i in range(count)]
    by_remainder = sorted(range(count), key=lambda i: ideal[i] - int(ideal[i]), reverse=True)
    for i in by_remainder[:max(0, total - sum(slots))]:
        slots[i] += 1
    return slots


class Targets:
    """The targets of the order in force (module docstring). Counters are kept by target
    name across orders, so that an epoch's publication does not reset them."""

    def __init__(self):
        self.placement: Placement | None = None
        self.manifest = None  # the manifest `placement` is of
        self.all: list[Target] = []  # by target number
        self._by_name: dict[tuple[bool, str], Target] = {}
        self._sized_s = -math.inf
        self._item_of: Callable[[bytes], int] = lambda relpath: -1

    def use(self, manifest, placement: Placement, item_of: Callable[[bytes], int]) -> None:
        """The placement of the order in force: its targets, numbered as it numbers them.
        `item_of(relpath)`: a file's item in `manifest` (the ranking's, which remembers the
        files read ahead lately, so a source request costs no path hashing)."""
        self._item_of = item_of
        if manifest is self.manifest and placement is self.placement:
            return
        self.manifest, self.placement = manifest, placement
        self.all = []
        for number in range(placement.count):
            key = (placement.from_devices, placement.name(number))
            target = self._by_name.get(key)
            if target is None:
                target = self._by_name[key] = Target(key[1], key[0])
            self.all.append(target)
        self._sized_s = -math.inf

    def read_costs(self) -> list[float] | None:
        """Per item of the manifest in force, what reading it from its target costs against
        the cheapest target: the target's request latency over the cheapest one's (1.0 on
        the fastest; the latency is the exponential average the sizing uses, over the last
        few dozen requests, not `cachefs stats`' mean over all). None with fewer than two
        targets holding files of the current order, or before each of those has COST_REQUESTS
        requests timed (a target with none of the current order's files counts 1.0 until
        timed). The ranking keeps the next epoch's files by it (cachefs/ranking.py,
        `set_read_costs`)."""
        if self.placement is None or len(self.all) < 2:
            return None
        timed = [t.latency_avg_s if t.latency_avg_s is not None and t.requests >= COST_REQUESTS
                 else None for t in self.all]
        holding = [latency for latency, t in zip(timed, self.all, strict=True) if t.items]
        if len(holding) < 2 or None in holding:
            return None
        cheapest = max(min(x for x in timed if x is not None), MIN_LATENCY_S)
        by_target = [1.0 if latency is None else max(latency, cheapest) / cheapest
                     for latency in timed]
        # one float object per target, shared by its items' entries (8 bytes an item)
        return [by_target[number] for number in self.placement.ids.tolist()]

    def target_of(self, item: int) -> Target | None:
        """The target of `item` of the manifest in force (None: no order, or no such item)."""
        placement = self.placement
        if placement is None or not 0 <= item < len(placement.ids):
            return None
        return self.all[placement.ids.item(item)]

    # -- the lists -------------------------------------------------------------------------

    def rebuild(self, planner: Planner, held_items: np.ndarray) -> None:
        """Every target's list from the planner's orders (module docstring). `held_items`:
        the items RAM holds now (the head of an epoch kept from the last), which the lists'
        queue depth and the targets' shares do not count."""
        if self.placement is None or not self.all:
            return  # an order over an empty manifest places nothing
        ids = self.placement.ids
        current = planner.current
        parts = [ids[current]]
        orders = [current]
        if planner.next is not None:
            parts.append(ids[planner.next])
            orders.append(planner.next)
        held = np.zeros(len(ids), bool)
        held[held_items] = True
        to_read = ~held[np.concatenate(orders)]  # by virtual position
        by_position = np.concatenate(parts).astype(np.int16)
        counts_current = np.bincount(parts[0], minlength=len(self.all))
        if len(self.all) == 1:
            lists = [np.arange(len(by_position), dtype=np.int64)]
        else:
            grouped = np.argsort(by_position, kind="stable")  # positions ascending per target
            bounds = np.cumsum(np.bincount(by_position, minlength=len(self.all)))[:-1]
            lists = np.split(grouped.astype(np.int64), bounds)
        # a target's share: of the current order's files that RAM does not hold (they are
        # what the targets must deliver), or of all its files if RAM holds every one
        counts_to_read = np.bincount(parts[0][to_read[:len(current)]], minlength=len(self.all))
        shares = (counts_to_read if counts_to_read.sum() else counts_current).tolist()
        total = max(1, sum(shares))
        for target, positions, items, share in zip(self.all, lists, counts_current.tolist(),
                                                   shares, strict=True):
            target.positions = positions
            target.to_read = np.cumsum(to_read[positions], dtype=np.int64)
            target.first = target.scan = 0
            target.items = items
            target.share = share / total
        self._sized_s = -math.inf

    def advance(self, target: Target, planner: Planner) -> None:
        """Move the target's `first` past the entries consumed (the readers' progress)."""
        positions, consumed, cursor = target.positions, planner.consumed, planner.cursor
        first = target.first
        while first < len(positions):
            position = positions[first]
            if position >= cursor and (position >= len(consumed) or not consumed[position]):
                break
            first += 1
        target.first = first
        target.scan = max(target.scan, first)

    def window_end(self, target: Target, planner: Planner, total_slots: int) -> int:
        """The virtual position below which the target's list is read ahead: as far as its
        share of the window reaches down its list (module docstring), or the planner's
        window if further, within the RAM's span."""
        positions, to_read, first = target.positions, target.to_read, target.first
        quota = max(1, round(target.slots * planner.lookahead_items / total_slots),
                    target.tail_items)
        # the entry where `quota` files to read lie ahead of the first unconsumed one
        before = int(to_read[first - 1]) if first else 0
        last = min(index_left(to_read, before + quota), len(positions) - 1)
        own_end = int(positions[last]) + 1 if last >= 0 else 0
        target.window_end = min(max(planner.window_end(), own_end), planner.span_end())
        return target.window_end

    def rescan(self, target: Target) -> None:
        """Walk the target's list again from its first unconsumed entry (a fetch came back
        without room: prefetch.py `_revisit`)."""
        target.scan = target.first

    # -- sizing ------------------------------------------------------------------------------

    def size(self, total_slots: int, now_s: float, s_per_item: float | None) -> None:
        """Share `total_slots` out among the targets, and size their queues for the readers'
        pace, `s_per_item` seconds per file consumed (None: not known yet) (module
        docstring); at most every SIZE_INTERVAL_S."""
        if now_s - self._sized_s < SIZE_INTERVAL_S or not self.all:
            return
        self._sized_s = now_s
        for target in self.all:
            p99_s = target.latency.quantile_s(0.99)
            target.tail_items = (math.ceil(target.share * p99_s / s_per_item)
                                 if p99_s is not None and s_per_item else 0)
        known = [t.latency_avg_s for t in self.all if t.latency_avg_s is not None]
        default_s = sum(known) / len(known) if known else 1.0
        weights = [t.share * (t.latency_avg_s if t.latency_avg_s is not None else default_s)
                   for t in self.all]
        floors = [max(1, int(FLOOR_FRACTION * total_slots * t.share)) for t in self.all]
        for target, slots in zip(self.all, allocate_slots(total_slots, weights, floors),
                                 strict=True):
            target.slots = slots

    # -- counters ----------------------------------------------------------------------------

    def request_started(self, relpath: bytes, item: int | None = None) -> Target | None:
        """A source request for `relpath` starts (cachefs/source.py): its target, if any.
        `item`: its index in the manifest in force, if the caller knows it (else searched)."""
        if self.manifest is None:
            return None
        target = self.target_of(self._item_of(relpath) if item is None else item)
        if target is not None:
            target.in_flight += 1
        return target

    def request_finished(self, target: Target | None, elapsed_s: float, nbytes: int) -> None:
        """The request `request_started` returned `target` for took `elapsed_s` and read
        `nbytes` (an error counts, with 0 bytes: it took the target's time too)."""
        if target is None:
            return
        target.in_flight -= 1
        target.requests += 1
        target.bytes += nbytes
        target.latency.observe(elapsed_s)
        average = target.latency_avg_s
        target.latency_avg_s = (elapsed_s if average is None
                                else average + LATENCY_WEIGHT * (elapsed_s - average))

    def files_read(self, items: list[int], manifest, origin: int, stall_s: float) -> None:
        """Readers are done with files (cachefs/reader.py), each of `origin` and `stall_s`:
        their misses and stalls count in their targets' counters."""
        if (origin != stats_mod.ORIGIN_MISS and stall_s == 0) or manifest is not self.manifest:
            return  # nothing to count (most files: a hit with no wait)
        for item in items:
            target = self.target_of(item)
            if target is None:
                continue
            if origin == stats_mod.ORIGIN_MISS:
                target.misses += 1
            target.stall_s += stall_s

    def status(self) -> list[dict]:
        """`cachefs stats`'s `targets` (man/cachefs-stats.1): the targets of the order in
        force, by target number."""
        return [target.status() for target in self.all]
