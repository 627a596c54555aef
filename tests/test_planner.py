"""The policy's pure parts: the planner's next-use rule and window, and the RAM tier's room.

No FUSE, no trio: these are the questions the prefetcher and the reader ask, answered directly.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import tracemalloc

import numpy as np
import pytest

from cachefs import stats as stats_mod
from cachefs.cache.ram import BLOCK_OVERHEAD_BYTES, RamBlock, RamTier
from cachefs.inodes import InodeTable
from cachefs.manifest import Manifest
from cachefs.order import Order
from cachefs.planner import JUDGED_POSITIONS, NEVER, SCALAR_ENTRIES, Planner
from cachefs.source import SourceIdentity

MANIFEST = Manifest.from_paths([f"f{i}" for i in range(8)])
IDENTITY = SourceIdentity(100, 1, 1)


def order(epoch, current, next_=None, manifest=MANIFEST) -> Order:
    current = np.asarray(current, np.int64)
    next_ = None if next_ is None else np.asarray(next_, np.int64)
    return Order(epoch=epoch, current=current, next=next_, manifest=manifest, rank=None,
                 world_size=None, total_length=len(current), file=None)


def window(planner: Planner, start: int = 0) -> list[tuple[int, int]]:
    """(position, item) the read-ahead of a single storage target walks (cachefs/targets.py:
    its list is every virtual position), from list index `start` on."""
    positions = np.arange(planner.known_end(), dtype=np.int64)
    return [(position, item)
            for _, position, item in planner.entries(positions, start, planner.window_end())]


def planner_with(current, next_=None, lookahead=100, epoch=1) -> Planner:
    planner = Planner(lookahead)
    assert planner.set_order(order(epoch, current, next_))
    return planner


# -- next use ----------------------------------------------------------------------------------


def test_next_uses_is_next_use_of_every_item():
    planner = planner_with([3, 1, 4, 0], next_=[4, 0, 2, 3])
    planner.consume(3)
    planner.consume(4)
    assert planner.next_uses().tolist() == [planner.next_use(i) for i in range(8)]


def test_a_new_next_epoch_alone_reranks_only_the_items_whose_next_use_changed():
    """Publishing the epoch in force again with another next (a trainer publishing every
    epoch after the plan moved on by itself): only the items consumed so far, and those used
    next epoch first, change rank; any other publication re-ranks every item (None)."""
    planner = planner_with([3, 1, 4, 0], next_=[4, 0, 2, 3])
    assert planner.reranked_items is None
    planner.consume(3)
    assert not planner.set_order(order(1, [3, 1, 4, 0], [0, 5, 3, 4]))
    assert planner.reranked_items.tolist() == [2, 3, 5]  # 3 consumed; 2 and 5 only next
    assert planner.next_use(3) == 4 + 2 and planner.next_use(5) == 4 + 1
    assert planner.set_order(order(2, [0, 5, 3, 4]))
    assert planner.reranked_items is None


def test_next_use_is_position_then_next_order_then_never():
    planner = planner_with([3, 1, 4, 0], next_=[4, 0, 2, 3])
    n = 4
    assert [planner.next_use(i) for i in (3, 1, 4, 0)] == [0, 1, 2, 3]
    assert planner.next_use(2) == n + 2  # only in the next order
    assert planner.next_use(5) == NEVER  # in neither
    planner.consume(3)
    assert planner.next_use(3) == n + 3
    planner.consume(1)
    assert planner.next_use(1) == NEVER  # consumed, absent from the next order
    assert planner.next_use(-1) == NEVER and planner.next_use(99) == NEVER


def test_use_after_read_is_what_consume_makes_next_use():
    """The rank a file read whole takes before its close is reported (the zero-request
    mode, Ranking.read_whole): exactly the next use its consumption will give it."""
    planner = planner_with([5, 6, 7, 5, 1], next_=[7, 5, 6])  # 5 twice: rank padding
    for item in (5, 6, 1, 5, 7, 2):
        expected = planner.use_after_read(item)
        planner.consume(item)
        assert planner.next_use(item) == expected, item
    assert planner.use_after_read(5) == 5 + 1  # consumed twice: its next epoch's use
    assert planner.use_after_read(1) == NEVER and planner.use_after_read(-1) == NEVER


def test_next_use_without_next_order():
    planner = planner_with([2, 0])
    planner.consume(2)
    assert planner.next_use(2) == NEVER
    assert planner.next_use(0) == 1


# -- cursor and window -------------------------------------------------------------------------


def test_cursor_is_lowest_unconsumed_position_under_out_of_order_consumption():
    planner = planner_with([0, 1, 2, 3, 4])
    assert not planner.consume(2)
    assert not planner.consume(1)
    assert planner.cursor == 0  # position 0 still unconsumed
    planner.consume(0)
    assert planner.cursor == 3  # 0, 1, 2 consumed
    planner.consume(4)
    assert planner.cursor == 3
    assert planner.consume(3)  # the last one completes the order
    assert planner.cursor == 5 and planner.consumed_count == 5


def test_the_cursor_is_the_lowest_unconsumed_position_after_every_consumption():
    """The cursor moves a few positions one by one, and a long run of consumed positions a
    stretch at a time (`_advance_cursor`): after every consumption it is the lowest
    unconsumed position, whether the readers consume near it or far ahead of it."""
    rng = np.random.default_rng(3)
    n = 1500
    manifest = Manifest.from_paths([f"f{i:04d}" for i in range(n)])
    planner = Planner(50)
    current = rng.permutation(n)
    assert planner.set_order(order(1, current, manifest=manifest))
    # near the cursor at first, then a run of 700 positions consumed ahead of it
    by_position = [*range(0, 40), *range(41, 741), 40, *rng.permutation(range(741, n))]
    for position in by_position:
        planner.consume(int(current[position]))
        unconsumed = np.flatnonzero(~planner.consumed)
        assert planner.cursor == (unconsumed[0] if len(unconsumed) else n)


@pytest.mark.parametrize("seed", range(4))
def test_a_batch_of_consumptions_is_what_consuming_them_one_by_one_makes(seed):
    """`consume_many` (vectorised: the closes of one batch) takes the same items, completes
    the order at the same one and leaves the same plan as `consume` one item at a time;
    repeats in a batch, items outside the order or the manifest, and -1 included; batches
    both below ARRAY_MIN_ITEMS (item by item) and above (as arrays)."""
    from cachefs.planner import ARRAY_MIN_ITEMS

    rng = np.random.default_rng(seed)
    current = rng.permutation(1000)
    manifest = Manifest.from_paths([f"f{i}" for i in range(1060)])
    batched, single = Planner(50), Planner(50)
    for planner in (batched, single):
        assert planner.set_order(order(1, current, manifest=manifest))
    while batched.consumed_count < len(current):
        size = int(rng.integers(1, 2 * ARRAY_MIN_ITEMS))
        items = rng.choice(np.r_[current, current[:10], [-1, 1050, 1100]], size).tolist()
        expected = (len(items), False)
        for index, item in enumerate(items, 1):
            if single.consume(item):
                expected = (index, True)
                break
        assert batched.consume_many(items) == expected
        assert batched.cursor == single.cursor
        assert batched.consumed_count == single.consumed_count
        assert batched.consumed.tolist() == single.consumed.tolist()
        assert batched.pos_cur.tolist() == single.pos_cur.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_uses_is_the_next_use_of_every_item_through_every_change_of_the_plan(seed):
    """`uses` (what every rank reads) is `next_use` of each item, and NaN for an item in
    neither order, after batches of consumptions of every size (as arrays, and item by item),
    rank padding (an item twice in an order: odd seeds), a new next order published for the
    epoch in force, and epoch switches."""
    from cachefs.planner import ARRAY_MIN_ITEMS

    rng = np.random.default_rng(seed)
    manifest = Manifest.from_paths([f"f{i}" for i in range(300)])

    def padded(count):  # an order of `count` of the manifest's items (odd seeds: 2 repeated)
        chosen = rng.choice(300, count, replace=False)
        return np.r_[chosen, chosen[:2]] if seed % 2 else chosen

    def check(planner):
        in_orders = set(planner.current.tolist()) | set(
            [] if planner.next is None else planner.next.tolist())
        expected = [planner.next_uses()[item] if item in in_orders else np.nan
                    for item in range(300)]
        np.testing.assert_array_equal(planner.uses, expected)
        assert planner.next_holds_current == (planner.next is not None and set(
            planner.current.tolist()) <= set(planner.next.tolist()))

    planner = Planner(20)
    current = padded(200)
    assert planner.set_order(order(1, current, padded(150), manifest=manifest))
    check(planner)
    for switch in range(3):
        republished = False
        while planner.consumed_count < len(planner.current):
            size = int(rng.integers(1, 2 * ARRAY_MIN_ITEMS))
            batch = rng.choice(np.r_[planner.current, [-1, 299, 400]], size).tolist()
            taken, completed = planner.consume_many(batch)
            check(planner)
            if not republished and planner.consumed_count > len(planner.current) // 2:
                # the trainer publishes the epoch in force again, with another next epoch
                assert not planner.set_order(order(planner.epoch, planner.current,
                                                   None if switch == 2 else padded(100),
                                                   manifest=manifest))
                republished = True
                check(planner)
            if completed:
                break
        if not planner.switch_to_next():
            break
        check(planner)


def test_consuming_an_item_twice_or_outside_the_order_changes_nothing():
    planner = planner_with([0, 1, 2])
    planner.consume(1)
    assert not planner.consume(1)
    assert not planner.consume(7)  # in the manifest, not in the order
    assert planner.consumed_count == 1 and planner.cursor == 0


def test_window_skips_consumed_and_next_items_still_unconsumed_in_current():
    planner = planner_with([0, 1, 2, 3], next_=[3, 1, 0, 2], lookahead=6)
    planner.consume(1)
    # window [0, 6): positions 0..3 of current, then next positions 0 and 1 (items 3 and 1).
    # Item 3 is still unconsumed in current (its next use is there): skipped. Item 1 is
    # consumed: its next use is next position 1, virtual position 5.
    assert window(planner) == [(0, 0), (2, 2), (3, 3), (5, 1)]


def test_window_slides_with_the_cursor_and_the_scan_mark():
    planner = planner_with(list(range(8)), lookahead=3)
    assert [p for p, _ in window(planner)] == [0, 1, 2]
    # the prefetcher handled list entries 0 and 1
    assert [p for p, _ in window(planner, start=2)] == [2]
    planner.consume(0)
    planner.consume(1)
    assert planner.cursor == 2
    assert [p for p, _ in window(planner, start=2)] == [2, 3, 4]


def test_window_stops_at_the_end_of_the_known_orders():
    planner = planner_with([0, 1], lookahead=10)
    assert planner.window_end() == 2
    assert planner.item_at(1) == 1 and planner.item_at(2) == -1


def spread_planner(lookahead=8, span=64, files=40_000, ranks=None) -> Planner:
    manifest = Manifest.from_paths([f"f{i:05d}" for i in range(files)])
    planner = Planner(lookahead)
    planner.max_span_items = span
    published = order(1, np.arange(files), manifest=manifest)
    if ranks is not None:
        published = dataclasses.replace(published, ranks=ranks)
    assert planner.set_order(published)
    return planner


def test_readers_spread_over_the_span_stretch_the_window_past_the_highest_read():
    """A DataLoader's workers, each a batch ahead of the last: the window reaches past them."""
    planner = spread_planner()
    for batch_start in (0, 8, 16, 24):  # four workers, a batch of 8 each, two files read
        planner.consume(batch_start)
        planner.consume(batch_start + 1)
    assert planner.cursor == 2 and planner.follows
    assert planner.window_end() == 26 + 24  # the highest read (25) + 1, plus the spread


def test_workers_spread_wider_than_the_span_still_have_the_whole_span_read_ahead():
    """Eight workers with batches of 32, where RAM allows a span of 64, in an epoch of 1,000
    files: the window is the span, and misses read batches (the workers go through the
    order)."""
    planner = spread_planner(files=1000)
    for worker in range(8):
        for index in range(4):
            planner.consume(32 * worker + index)
    assert planner.cursor == 4
    assert planner.window_end() == 4 + 64 and planner.follows


def test_ranks_sharing_the_mount_spread_their_readers_and_still_follow_the_order():
    """Eight ranks interleaved in one order, late in the epoch: their readers lie over 4,000
    positions, more than one rank's 2,048, and still follow the order."""
    planner = spread_planner(files=100_000, ranks=tuple(range(8)))
    for item in range(95_000):
        planner.consume(item)
    for index in range(32):
        planner.consume(95_000 + 137 * index)
    assert planner.window_end() > planner.cursor + 8 and planner.follows


def test_a_reader_off_the_order_does_not_stretch_the_window_nor_read_batches():
    """A reader in another order (a validation pass) consumes all over the epoch: the window
    stays the lookahead past the cursor, and misses read no batches."""
    planner = spread_planner()
    rng = np.random.default_rng(0)
    for item in rng.permutation(40_000)[:40]:
        planner.consume(int(item))
    assert planner.window_end() == planner.cursor + 8
    assert not planner.follows


def test_readers_back_on_the_order_after_a_pass_off_it_follow_it_again():
    """A validation pass off the order, then the readers in order again: whether they follow
    it is judged by their last consumptions, asked between them (the spread of the recent
    positions is kept from one consumption to the next, and must not outlive it)."""
    planner = spread_planner()
    rng = np.random.default_rng(0)
    for index, item in enumerate(rng.permutation(np.arange(100, 40_000))[:40]):
        planner.consume(int(item))
        # asked at every miss, as a reader's demand misses ask; too few to tell at first
        assert planner.follows == (index < JUDGED_POSITIONS - 1)
    for item in range(32):
        planner.consume(item)
        assert planner.follows == (item == 31)  # the spread spans both passes until then
    assert planner.cursor == 32


def test_a_reader_resumed_mid_epoch_follows_the_order_far_from_the_cursor():
    """Reads in order from the middle of the epoch: no stretch from the cursor, but the miss
    batches that find the reader its next files stay on, and its reads are the order's."""
    planner = spread_planner()
    for item in range(20_000, 20_040):
        planner.consume(item)
    assert planner.cursor == 0 and planner.window_end() == 8
    assert planner.follows and not planner.read_outside(20_040)


def test_readers_of_the_order_spread_wide_late_in_an_epoch_are_not_taken_outside_it():
    """Late in an epoch, beside a pass off the order: a DataLoader worker reading 4,096 files
    past the cursor (8 workers with two batches of 256 in flight each) is the order's reader:
    taken outside, its file would stay unconsumed, and hold the cursor there for the rest of
    the epoch."""
    planner = spread_planner(files=100_000)
    planner.consume_many(list(range(90_000)))
    rng = np.random.default_rng(0)
    for item in rng.permutation(np.arange(90_100, 100_000))[:32].tolist():
        planner.consume(item)
    assert not planner.follows and planner.cursor == 90_000
    assert not planner.read_outside(90_000 + 4096)


def test_a_position_read_outside_the_order_is_consumed_when_the_cursor_reaches_it():
    """A reader of the order taken for one off it (a DataLoader spread wider than the margin):
    its far reads are outside the order, and stay unconsumed only until the cursor reaches
    them; the cursor moves on, and the epoch ends."""
    planner = spread_planner(files=40_000)
    rng = np.random.default_rng(0)
    for item in rng.permutation(np.arange(20_000, 40_000))[:32].tolist():
        planner.consume(item)
    taken_outside = [12_000, 12_001, 30_000]
    assert all(planner.read_outside(item) for item in taken_outside)
    planner.consume_many(list(range(12_000)))
    assert planner.cursor == 12_002 and planner.caught_up == [12_000, 12_001]
    remaining = [item for item in range(12_002, 40_000)
                 if item != 30_000 and not planner.consumed[item]]
    taken, completed = planner.consume_many(remaining)
    assert (taken, completed) == (len(remaining), True)
    assert planner.caught_up[-1] == 30_000 and planner.consumed_count == 40_000


def test_reads_of_a_reader_off_the_order_far_from_the_cursor_are_outside_it():
    """A validation pass: once its consumptions show the readers off the order, a read far
    from the cursor is not the order's (noted where the readers are, not consumed: the
    read-ahead still reads the file at its position), one near it is; readers back on the
    order read nothing outside it."""
    planner = spread_planner()  # 40,000 files: outside is 8,192 past the cursor and further
    far = np.random.default_rng(0).permutation(np.arange(10_000, 40_000)).tolist()
    for item in far[:JUDGED_POSITIONS - 1]:
        planner.consume(item)
        assert not planner.read_outside(far[-1])  # too few to tell
    planner.consume(far[JUDGED_POSITIONS - 1])
    assert not planner.follows
    consumed = planner.consumed_count
    for item in far[JUDGED_POSITIONS:100]:
        assert planner.read_outside(item)
        assert planner.due_item(item) == item  # the order's position is still to be read
    assert planner.consumed_count == consumed
    assert not planner.read_outside(100)  # near the cursor, where the order's readers read
    assert not planner.follows  # the reads outside were noted: still off the order
    for item in range(32):
        planner.consume(item)
    assert planner.cursor == 32
    assert planner.follows and not planner.read_outside(far[-1])


# -- epochs ------------------------------------------------------------------------------------


def test_switch_to_next_makes_next_current_and_resets_consumption():
    planner = planner_with([0, 1, 2], next_=[2, 0, 1], epoch=4)
    serial = planner.epoch_serial
    for item in (0, 1, 2):
        planner.consume(item)
    assert planner.switch_to_next()
    assert planner.epoch == 5 and planner.epoch_serial == serial + 1
    assert list(planner.current) == [2, 0, 1] and planner.next is None
    assert planner.cursor == 0 and planner.consumed_count == 0
    assert [planner.next_use(i) for i in (2, 0, 1)] == [0, 1, 2]
    assert not planner.switch_to_next()  # no next order known
    assert planner.epoch == 5


def test_set_order_with_the_same_epoch_keeps_consumption_and_adds_next():
    planner = planner_with([0, 1, 2, 3], epoch=2)
    planner.consume(0)
    planner.consume(1)
    assert not planner.set_order(order(2, [0, 1, 2, 3], next_=[1, 0, 3, 2]))
    assert planner.consumed_count == 2 and planner.cursor == 2
    assert planner.next_use(0) == 4 + 1  # consumed: its place in the new next order
    assert planner.next_use(2) == 2


def test_set_order_with_a_new_epoch_or_other_current_restarts():
    planner = planner_with([0, 1, 2, 3], epoch=2)
    planner.consume(0)
    assert planner.set_order(order(3, [3, 2, 1, 0]))
    assert planner.consumed_count == 0 and planner.next_use(0) == 3
    planner.consume(3)
    assert planner.set_order(order(3, [0, 1, 2, 3]))  # same epoch, another permutation
    assert planner.consumed_count == 0


def test_the_same_epoch_over_a_longer_manifest_is_a_new_plan_sized_to_it():
    # issue 15, item 3: the same epoch and `current` republished with a longer manifest (a
    # `next` naming its new items) kept `pos_cur` at the old length, and the window indexed it
    # with a new item (IndexError in the prefetcher's run task, which ended the mount)
    planner = planner_with([0, 1], epoch=2, lookahead=10)
    planner.consume(0)
    serial = planner.order_serial
    longer = Manifest.from_paths([f"f{i}" for i in range(8)] + [f"h{i}" for i in range(8)])
    assert planner.set_order(order(2, [0, 1], next_=[12, 9, 0], manifest=longer))
    assert planner.order_serial == serial + 1  # item numbers of open files mean other files
    assert len(planner.pos_cur) == len(planner.pos_next) == 16
    assert window(planner) == [(0, 0), (1, 1), (2, 12), (3, 9)]
    assert planner.next_use(12) == 2
    planner.consume(0)
    assert planner.consume(1) and planner.switch_to_next()
    assert len(planner.pos_cur) == 16 and planner.next_use(12) == 0


def test_the_same_epoch_over_an_equal_manifest_object_keeps_the_plan():
    planner = planner_with([0, 1, 2, 3], epoch=2)
    planner.consume(0)
    equal = Manifest.from_paths([f"f{i}" for i in range(8)])
    assert not planner.set_order(order(2, [0, 1, 2, 3], next_=[3, 2], manifest=equal))
    assert planner.consumed_count == 1


def merged(epoch, slices: dict, next_slices: dict | None = None, world_size=4,
           manifest=MANIFEST) -> Order:
    """The order cachefs.order_merge makes of these ranks' slices (interleaved by position)."""
    ranks = tuple(sorted(slices))
    current = np.stack([np.asarray(slices[r], np.int64) for r in ranks], axis=1).reshape(-1)
    next_ = None
    if next_slices is not None:
        next_ = np.stack([np.asarray(next_slices[r], np.int64) for r in ranks],
                         axis=1).reshape(-1)
    return Order(epoch=epoch, current=current, next=next_, manifest=manifest, rank=ranks[-1],
                 world_size=world_size, total_length=8, file=None, ranks=ranks)


def test_a_rank_joining_keeps_what_was_consumed():
    planner = Planner(100)
    assert planner.set_order(merged(3, {1: [4, 5]}))
    planner.consume(4)
    serials = planner.order_serial, planner.epoch_serial
    # rank 0 publishes the same epoch: the merge interleaves [0, 1] and [4, 5]
    assert not planner.set_order(merged(3, {0: [0, 1], 1: [4, 5]}, {0: [1, 0], 1: [5, 4]}))
    assert (planner.order_serial, planner.epoch_serial) == serials  # open files keep consuming
    assert list(planner.current) == [0, 4, 1, 5]
    assert planner.consumed.tolist() == [False, True, False, False]
    assert planner.consumed_count == 1 and planner.cursor == 0
    assert planner.next_use(4) == 4 + 3  # consumed: its place in the merged next order
    # the array every rank reads, refreshed after the replay (NaN: in neither order)
    np.testing.assert_array_equal(planner.uses, [0, 2, np.nan, np.nan, 7, 3, np.nan, np.nan])
    # the window skips the consumed position; of the next order only item 4 is not ahead
    assert window(planner) == [(0, 0), (2, 1), (3, 5), (7, 4)]
    planner.consume(0)
    assert planner.cursor == 2
    # and a third rank joining later keeps both ranks' progress
    assert not planner.set_order(merged(3, {0: [0, 1], 1: [4, 5], 3: [6, 7]}))
    assert list(planner.current) == [0, 4, 6, 1, 5, 7]
    assert planner.consumed.tolist() == [True, True, False, False, False, False]
    assert planner.cursor == 2 and planner.order_serial == serials[0]


def test_a_rank_joining_after_the_automatic_switch_compares_the_plan():
    planner = Planner(100)
    planner.set_order(merged(3, {0: [0, 1]}, {0: [1, 0]}))
    planner.consume(0)
    assert planner.consume(1) and planner.switch_to_next()  # epoch 4 = rank 0's next slice
    planner.consume(1)
    assert not planner.set_order(merged(4, {0: [1, 0], 2: [6, 7]}))
    assert planner.consumed.tolist() == [True, False, False, False]
    assert planner.epoch == 4


def test_a_rank_joining_carries_padding_repeats_over_once_each():
    planner = Planner(100)
    # rank 1 of 2 over 3 items: [o1, o0 (padding)]; rank 0 reads [o0, o2]
    planner.set_order(merged(0, {1: [6, 5]}, world_size=2))
    planner.consume(6)
    planner.consume(5)
    assert not planner.set_order(merged(0, {0: [5, 7], 1: [6, 5]}, world_size=2))
    assert list(planner.current) == [5, 6, 7, 5]
    # item 5 was read once: one of its two positions, the first, is consumed
    assert planner.consumed.tolist() == [True, True, False, False]
    assert planner.next_use(5) == 3 and planner.cursor == 2
    np.testing.assert_array_equal(planner.uses,
                                  [np.nan] * 5 + [3, NEVER, 2])  # 6 read, in no next order


@pytest.mark.parametrize("change", ["epoch", "world_size", "fewer ranks", "other slice",
                                    "unranked", "manifest"])
def test_any_other_change_of_ranks_is_a_new_plan(change):
    planner = Planner(100)
    planner.set_order(merged(3, {0: [0, 1], 1: [4, 5]}))
    planner.consume(0)
    serial = planner.order_serial
    new = {
        "epoch": merged(4, {0: [0, 1], 1: [4, 5], 2: [2, 3]}),
        "world_size": merged(3, {0: [0, 1], 1: [4, 5], 2: [2, 3]}, world_size=8),
        "fewer ranks": merged(3, {0: [0, 1]}),
        "other slice": merged(3, {0: [1, 0], 1: [4, 5], 2: [2, 3]}),
        "unranked": order(3, [0, 4, 1, 5, 2, 3]),
        "manifest": merged(3, {0: [0, 1], 1: [4, 5], 2: [2, 3]},
                           manifest=Manifest.from_paths([f"g{i}" for i in range(8)])),
    }[change]
    assert planner.set_order(new)
    assert planner.order_serial == serial + 1
    assert planner.consumed_count == 0 and planner.cursor == 0


def test_an_equal_manifest_object_of_another_publication_still_lets_a_rank_join():
    planner = Planner(100)
    planner.set_order(merged(3, {0: [0, 1]}))
    planner.consume(0)
    equal = Manifest.from_paths([f"f{i}" for i in range(8)])
    assert not planner.set_order(merged(3, {0: [0, 1], 1: [4, 5]}, manifest=equal))
    assert planner.consumed_count == 1


def test_rank_padding_duplicates_are_consumed_once_per_occurrence():
    # DistributedSampler pads by repeating the start: item 5 occurs at positions 0 and 3
    planner = planner_with([5, 6, 7, 5], next_=[7, 5, 6])
    assert planner.next_use(5) == 0
    assert not planner.consume(5)
    assert planner.next_use(5) == 3  # its second occurrence is still to come
    assert planner.cursor == 1
    planner.consume(6)
    planner.consume(7)
    assert planner.consume(5)  # the second occurrence completes the order
    assert planner.next_use(5) == 4 + 1
    assert not planner.consume(5)


def test_window_lists_a_padded_item_once_per_occurrence():
    planner = planner_with([5, 6, 5], lookahead=3)
    assert window(planner) == [(0, 5), (1, 6), (2, 5)]


# -- the RAM tier ------------------------------------------------------------------------------


def block(nbytes, item=0) -> RamBlock:
    return RamBlock(bytes(nbytes), IDENTITY, item, 0)


def fill(ram: RamTier, priorities, nbytes=100) -> list:
    keys = []
    for i, priority in enumerate(priorities):
        key = (b"f%d" % i, 0)
        assert ram.reserve(nbytes, priority)
        b = block(nbytes, i)
        b.priority = priority
        assert ram.insert(key, b, nbytes)
        keys.append(key)
    return keys


def test_ram_evicts_farthest_first_and_only_strictly_farther():
    ram = RamTier(500, block_bytes=4096, block_overhead_bytes=0)
    keys = fill(ram, [3.0, 1.0, 5.0, 2.0, 4.0])
    assert ram.used_bytes == 500
    assert not ram.reserve(100, 5.0)  # equal priority: not strictly farther
    assert len(ram.blocks) == 5 and ram.used_bytes == 500
    assert ram.reserve(200, 2.5)  # evicts 5.0 then 4.0
    assert set(ram.blocks) == {keys[0], keys[1], keys[3]}
    assert ram.used_bytes == 500 and ram.reserved_bytes == 200
    assert not ram.reserve(100, 3.0)  # only 3.0 and nearer left
    assert ram.evictions == 2


def test_ram_charges_each_block_its_bookkeeping():
    """One-byte blocks: the budget holds as many as their bytes and bookkeeping allow, not a
    budget's worth of bytes (issue 13, case 9)."""
    overhead = BLOCK_OVERHEAD_BYTES
    ram = RamTier(10 * (1 + overhead), block_bytes=4096)
    for i in range(20):
        charge = ram.charge_of(1)
        if ram.reserve(charge, math.inf):
            ram.insert((b"f%d" % i, 0), block(1, i), charge)
    assert len(ram.blocks) == 10 and ram.used_bytes == ram.budget_bytes
    assert ram.stats()["bytes"] == 10 * (1 + overhead)


def test_block_overhead_covers_bookkeeping():
    """What a cached one-block file costs the daemon besides its bytes (its RamBlock, key and
    heap entries, its inode table entry with the path, and what its next close is counted by:
    cachefs/reader.py `AloneFile`) is within BLOCK_OVERHEAD_BYTES."""
    from cachefs.reader import AloneFile

    files = 20_000
    root_stat = os.lstat("/")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        inodes, ram = InodeTable(root_stat), RamTier(1 << 40, block_bytes=4096)
        for i in range(files):
            relpath = b"train/class%03d/sample%09d.jpg" % (i % 1000, i)
            # stamped as a mount stamps it: a float of its own (freshness.now_s)
            inode = inodes.remember(relpath, os.lstat("/"), lookup=True, stat_time_s=float(i))
            key = (b"train/class%03d/sample%09d.jpg" % (i % 1000, i), 0)  # its own copy
            charge = ram.charge_of(1)
            assert ram.reserve(charge, math.inf)
            b = RamBlock(b"x", SourceIdentity(1, 1_700_000_000_000_000_000 + i, 10**7 + i),
                         item=i, origin=0)
            assert ram.insert(key, b, charge)
            ram.touch(key, b)  # read again: a second heap entry
            inodes.remember_close(inode, AloneFile((relpath, 0), b))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    per_file = sum(stat.size_diff for stat in after.compare_to(before, "filename")) / files
    assert 200 < per_file <= BLOCK_OVERHEAD_BYTES, per_file


def test_ram_keeps_kernel_pages_twice_only_in_free_room_and_gives_them_up_first():
    """A file read again later, not soon: the kernel's pages stay beside the daemon's copy,
    charged, while the budget has free room, and are dropped (the kernel told) before any
    block is evicted (cachefs/cache/ram.py, "Kernel copies"; issue 13, case 8)."""
    dropped = []
    ram = RamTier(4 * 4096, block_bytes=4096, block_overhead_bytes=0,
                  drop_kernel_pages=dropped.append)
    a, b = fill(ram, [5.0, 6.0], nbytes=100)
    assert ram.keep_kernel_copies([(a, ram.get(a))])
    assert ram.get(a).kept_twice and ram.get(a).in_kernel
    assert ram.used_bytes == 200 + 4096 and ram.kernel_bytes == 4096
    assert ram.keep_kernel_copies([(a, ram.get(a))])  # again: charged once
    assert ram.used_bytes == 200 + 4096
    # room for a block nearer than both: the pages kept twice go, no block is evicted
    assert ram.reserve(3 * 4096, 1.0)
    assert dropped == [a[0]] and a in ram and b in ram and ram.evictions == 0
    assert not ram.get(a).kept_twice and not ram.get(a).in_kernel and ram.kernel_bytes == 0
    assert ram.used_bytes == 200 + 3 * 4096
    # no free room for the pages: nothing changes, the caller drops them
    assert not ram.keep_kernel_copies([(b, ram.get(b))])
    assert not ram.get(b).kept_twice and ram.used_bytes == 200 + 3 * 4096


def test_ram_hand_to_kernel_of_a_block_kept_twice_charges_its_pages_once():
    ram = RamTier(10 * 4096, block_bytes=4096, block_overhead_bytes=0)
    (a,) = fill(ram, [5.0], nbytes=100)
    assert ram.keep_kernel_copies([(a, ram.get(a))])
    assert ram.hand_to_kernel([(a, ram.get(a))])
    assert ram.get(a).data is None and not ram.get(a).kept_twice
    assert ram.used_bytes == 4096 and ram.kernel_bytes == 4096
    ram.drop(a)
    assert ram.used_bytes == 0 and ram.kernel_bytes == 0


def test_ram_reservation_counts_until_released():
    ram = RamTier(300, block_bytes=4096, block_overhead_bytes=0)
    assert ram.reserve(200, 1.0)
    assert not ram.reserve(200, 0.0)  # reservations cannot be evicted
    ram.unreserve(200)
    assert ram.used_bytes == 0
    assert not ram.reserve(301, 0.0)  # larger than the whole budget


def test_ram_lru_among_blocks_without_known_future():
    ram = RamTier(300, block_bytes=4096, block_overhead_bytes=0)
    a, b, c = fill(ram, [math.inf, math.inf, math.inf])
    ram.touch(a, ram.get(a))  # a becomes the most recently used
    assert ram.reserve(100, math.inf)
    assert b not in ram and a in ram and c in ram
    assert ram.reserve(0, math.inf)


def test_ram_infinite_priority_never_displaces_known_future():
    ram = RamTier(200, block_bytes=4096, block_overhead_bytes=0)
    fill(ram, [7.0, 8.0])
    assert not ram.reserve(100, math.inf)
    assert ram.reserve(100, 6.0)


def test_ram_set_priority_reorders_eviction():
    ram = RamTier(300, block_bytes=4096, block_overhead_bytes=0)
    a, b, c = fill(ram, [1.0, 2.0, 3.0])
    ram.set_priority(a, 10.0)  # consumed: now used last
    assert ram.reserve(100, 5.0)
    assert a not in ram and b in ram and c in ram


def test_ram_rebuild_sets_new_priorities_and_drops_none():
    ram = RamTier(300, block_bytes=4096, block_overhead_bytes=0)
    a, b, c = fill(ram, [1.0, 2.0, 3.0])
    new = {a: None, b: 9.0, c: 0.5}
    ram.rebuild(lambda key, blk: new[key])
    assert a not in ram and ram.resident_bytes == 200
    assert ram.get(b).priority == 9.0
    assert ram.reserve(200, 1.0)  # room left by a, then b (9.0) evicted; c (0.5) stays
    assert c in ram and b not in ram


def test_ram_a_rerank_put_off_is_applied_before_the_order_is_read():
    """`defer_ranks`: applied by whatever reads the order next, undone by no later explicit
    priority, and dropped by a rebuild (which gives every priority anew)."""
    ram = RamTier(300, block_bytes=4096, block_overhead_bytes=0)
    a, b, c = fill(ram, [1.0, 2.0, 3.0])
    applied = []
    ram.defer_ranks(lambda: applied.append(ram.set_priority(a, 9.0)))
    assert ram.get(a).priority == 1.0 and not applied  # put off
    assert ram.reserve(100, 5.0)  # a, 9.0 by then, is the farthest: evicted
    assert a not in ram and b in ram and c in ram and len(applied) == 1
    ram.defer_ranks(lambda: ram.set_priority(b, 9.0))
    ram.set_priority(b, 0.5)  # given after the re-rank put off: it stands
    assert ram.farthest_priority() == 3.0 and ram.get(b).priority == 0.5
    ram.defer_ranks(lambda: pytest.fail("applied after a rebuild"))
    ram.rebuild(lambda key, blk: blk.priority)
    assert ram.farthest_priority() == 3.0


def test_ram_a_reserve_with_room_leaves_a_rerank_put_off():
    """A reserve that fits evicts nothing, so it reads no rank: a re-rank put off waits for
    the reserve that must evict, which applies it first and evicts by it (a reader off the
    order reserves for every file it reads, and settled the re-rank of the one before)."""
    ram = RamTier(400, block_bytes=4096, block_overhead_bytes=0)
    a, b, c = fill(ram, [1.0, 2.0, 3.0])
    applied = []
    ram.defer_ranks(lambda: applied.append(ram.set_priority(a, 9.0)))
    assert ram.reserve(100, 5.0)  # room for it: nothing evicted
    assert not applied and ram.get(a).priority == 1.0
    assert ram.reserve(100, 5.0)  # full: a, 9.0 once applied, is the farthest
    assert len(applied) == 1 and a not in ram and b in ram and c in ram


def ranked_ram(current, next_, ssd=None, ram_blocks=None):
    """A planner with the order (`current`, `next_`), and a RAM tier of `ram_blocks` 100-byte
    blocks (one more than the items, if None) holding one of every item of the manifest
    (f0, f1, ...), ranked by it."""
    from cachefs.ranking import Ranking

    count = len(current)
    manifest = Manifest.from_paths([b"f%d" % i for i in range(count)]).prepare()
    planner = Planner(2)
    planner.set_order(Order(epoch=0, current=np.array(current), next=np.array(next_),
                            manifest=manifest, rank=None, world_size=None, total_length=count,
                            file=None))
    ram = RamTier(100 * (count + 1 if ram_blocks is None else ram_blocks), block_bytes=4096,
                  block_overhead_bytes=0)
    ranking = Ranking(planner, ram, ssd, block_bytes=4096)
    ranking.use_manifest(manifest)
    for item in range(count):
        b = block(100, item)
        b.item, b.priority = item, ranking.priority_of(item, 0, IDENTITY)
        assert ram.reserve(100, b.priority) and ram.insert((manifest.path(item), 0), b, 100)
    return planner, ranking, ram


def test_a_consumption_reranks_its_blocks_when_room_is_next_needed():
    """The consumption's re-rank (Ranking.rerank) is put off; the first reservation after it
    sees the block at its next epoch's rank, the farthest, and evicts it first. So is an
    epoch switch's (Ranking.rerank_all)."""
    planner, ranking, ram = ranked_ram([0, 1, 2], [2, 1, 0], ram_blocks=3)
    planner.consume(0)
    ranking.rerank(0, 100)
    assert ram.get((b"f0", 0)).priority == 0.0  # put off
    # f0's next use is position 2 of the next epoch (5), f2's position 2 of this one: room
    # for a block used between them evicts f0
    assert ram.reserve(100, 2.5)
    assert (b"f0", 0) not in ram and (b"f2", 0) in ram
    planner.consume(1)
    ranking.rerank(1, 100)
    assert ram.farthest_priority() == 3 + 1
    # the epoch switch's re-rank of every block is put off in the same way
    planner.consume(2)
    ranking.rerank(2, 100)
    assert planner.switch_to_next()
    ranking.rerank_all()
    assert ram.get((b"f2", 0)).priority == 2.0  # put off
    # f1 at position 1 of the new epoch (it was at 3 + 1), f2 first
    assert ram.farthest_priority() == 1.0 and ram.get((b"f2", 0)).priority == 0.0


def test_a_consumed_block_not_worth_keeping_goes_at_once():
    """Only the new rank of a consumed block is put off: one with no further use, or kept
    only for the next epoch while the SSD holds it (the tiers stay disjoint), goes at its
    consumption, so that RAM's contents and free room stay true without a read of the order."""

    class Ssd:
        def contains(self, key, identity):
            return key == (b"f1", 0)

    planner, ranking, ram = ranked_ram([0, 1, 2], [1, 2], ssd=Ssd())
    used_bytes = ram.used_bytes
    for item in (0, 1, 2):
        planner.consume(item)
        ranking.rerank(item, 100)
    assert (b"f0", 0) not in ram  # no further use
    assert (b"f1", 0) not in ram  # next epoch's, and on the SSD
    assert (b"f2", 0) in ram and ram.get((b"f2", 0)).priority == 2.0  # its new rank put off
    assert ram.used_bytes == used_bytes - 200
    assert ram.farthest_priority() == 3 + 1  # f2 at position 1 of the next epoch


@pytest.mark.parametrize("batch_items", [1, 3, 8, 16, 20, 100])
def test_a_batch_drops_what_its_items_drop_one_by_one(batch_items):
    """Ranking.rerank_many: a batch of fewer than ARRAY_MIN_ITEMS (16) items is looked at
    item by item, a larger one as arrays; either way the blocks with no further use, and
    those kept only for the next epoch that the SSD tier holds, go at once, and the others
    stay."""

    class Ssd:
        def contains(self, key, identity):
            return key[0] in (b"f3", b"f11")

    count = 100
    # odd files, and f3 and f11 on the SSD
    next_ = np.random.default_rng(0).permutation(np.arange(1, count, 2)).tolist()
    planner, ranking, ram = ranked_ram(list(range(count)), next_, ssd=Ssd())
    items = list(range(count))
    for item in items:
        planner.consume(item)
    for start in range(0, count, batch_items):
        ranking.rerank_many(items[start:start + batch_items],
                            [100] * len(items[start:start + batch_items]))
    kept = sorted(int(path[1:]) for path, _ in ram.blocks)
    assert kept == [item for item in range(1, count, 2) if item not in (3, 11)]


@pytest.mark.parametrize("next_has_all", [True, False])
def test_without_an_ssd_a_consumption_drops_only_what_the_next_order_lacks(next_has_all):
    """With no SSD tier, a consumed block goes at once only if the next order lacks its item
    (no further use); when the next order holds every item of the current one (the usual
    next permutation), `rerank_many` looks at no item's next use, and drops nothing."""
    count = 12
    next_ = list(range(count)) if next_has_all else list(range(0, count, 2))
    planner, ranking, ram = ranked_ram(list(range(count)), next_)
    for start in range(0, count, 5):
        items = list(range(start, min(count, start + 5)))
        for item in items:
            planner.consume(item)
        ranking.rerank_many(items, [100] * len(items))
    kept = sorted(int(path[1:]) for path, _ in ram.blocks)
    assert kept == sorted(next_)  # the items of the next order, and only they


def test_reranks_put_off_past_the_blocks_held_become_one_rebuild():
    """The list of re-ranks put off is bounded (by the blocks RAM holds, and
    MIN_STALE_ITEMS): past it, every block is re-ranked when the order is next read."""
    from cachefs.ranking import MIN_STALE_ITEMS

    count = 8
    planner, ranking, ram = ranked_ram(list(range(count)), list(reversed(range(count))))
    for _ in range(MIN_STALE_ITEMS + 1):  # consumptions reported again and again
        ranking.rerank(0, 100)
    planner.consume(0)
    ranking.rerank(0, 100)
    assert len(ranking._stale_items) <= MIN_STALE_ITEMS
    assert ram.farthest_priority() == count + count - 1  # f0, last of the next epoch


def test_ram_insert_that_no_longer_fits_keeps_nothing():
    ram = RamTier(200, block_bytes=4096, block_overhead_bytes=0)
    assert ram.reserve(100, 5.0)
    fill(ram, [1.0])  # the other 100 bytes, nearer
    big = block(200)
    big.priority = 5.0
    assert not ram.insert((b"big", 0), big, 100)  # arrived larger than reserved
    assert (b"big", 0) not in ram and ram.used_bytes == 100 and ram.reserved_bytes == 0


@pytest.mark.parametrize("seed", range(5))
def test_ram_budget_never_exceeded_under_random_traffic(seed):
    rng = np.random.default_rng(seed)
    ram = RamTier(10_000, block_bytes=4096, block_overhead_bytes=0)
    reserved = []
    for _ in range(2000):
        action = rng.integers(4)
        if action == 0:
            nbytes, priority = int(rng.integers(1, 3000)), float(rng.integers(0, 50))
            if rng.random() < 0.2:
                priority = math.inf
            if ram.reserve(nbytes, priority):
                reserved.append((nbytes, priority))
        elif action == 1 and reserved:
            nbytes, priority = reserved.pop(int(rng.integers(len(reserved))))
            b = block(int(rng.integers(1, nbytes + 1)))
            b.priority = priority
            ram.insert((b"k%d" % rng.integers(100), 0), b, nbytes)
        elif action == 2 and ram.blocks:
            key = list(ram.blocks)[int(rng.integers(len(ram.blocks)))]
            ram.set_priority(key, float(rng.integers(0, 50)))
        elif action == 3 and ram.blocks:
            ram.drop(list(ram.blocks)[int(rng.integers(len(ram.blocks)))])
        assert ram.used_bytes <= ram.budget_bytes
        assert ram.resident_bytes == sum(len(b.data) for b in ram.blocks.values())
        assert ram.reserved_bytes == sum(n for n, _ in reserved)


@pytest.mark.parametrize("seed", range(3))
def test_ram_counts_per_item_the_blocks_the_kernel_holds_under_random_traffic(seed):
    """`kernel_blocks_of` (the walk passes over a file on it, cachefs/prefetch.py) stays
    what the resident blocks say, whichever way a block comes, goes, is handed to the
    kernel, loses its kernel copy or is numbered anew; and a block says whether it is
    resident (`resident`: a close of a file only the kernel holds is counted from the block
    alone, cachefs/reader.py `AloneFile`), and one only the kernel held leaves with the
    kernel's copy."""
    rng = np.random.default_rng(seed)
    ram = RamTier(30 * 4096, block_bytes=4096, block_overhead_bytes=0)
    items = np.arange(12)
    made: list[tuple] = []  # every block inserted, with its key
    alone: list[tuple] = []  # blocks seen resident with only the kernel holding them

    def counted() -> list:
        counts = [0] * len(items)
        for held in ram.blocks.values():
            if held.in_kernel and held.item >= 0:
                counts[held.item] += 1
        return counts

    for _ in range(3000):
        action, file = int(rng.integers(7)), int(rng.integers(10))
        key = (b"f%d" % file, int(rng.integers(3)))
        held = ram.get(key)
        if action == 0:
            new = block(int(rng.integers(1, 4096)), item=file if file < 8 else -1)
            new.priority = float(rng.integers(0, 50))
            if ram.reserve(ram.charge(new), new.priority):
                ram.insert(key, new, ram.charge(new))
                made.append((key, new))
        elif action == 1 and held is not None:
            ram.add_kernel_copy(key, held)
        elif action == 2 and held is not None:
            ram.drop_kernel_copy(key, held)
        elif action == 3 and held is not None:
            ram.hand_to_kernel([(key, held)])
        elif action == 4 and held is not None:
            ram.keep_kernel_copies([(key, held)])
        elif action == 5:
            ram.drop_file_pages(key[0], 3 * 4096) if rng.random() < 0.5 else ram.drop(key)
        elif action == 6 and rng.random() < 0.05:  # a new manifest numbers the files anew
            for held in ram.blocks.values():
                held.item = (held.item + 3) % len(items) if held.item >= 0 else -1
            ram.items_renumbered()
        if (held := ram.get(key)) is not None and held.in_kernel and held.data is None:
            alone.append((key, held))
        assert ram.kernel_blocks_of(items).tolist() == counted()
        assert [ram.kernel_blocks_of_item(item) for item in items.tolist()] == counted()
        assert all(made_block.resident == (ram.get(made_key) is made_block)
                   for made_key, made_block in made[-50:])
        for _, kernel_alone in alone[-50:]:
            assert not kernel_alone.resident or (kernel_alone.in_kernel
                                                 and kernel_alone.data is None)
    assert len(alone) > 100 and any(not kernel_alone.resident for _, kernel_alone in alone)


def test_ram_hands_a_file_to_the_kernel_whole_or_not_at_all():
    """Handed over block by block, a last block whose page rounding found no room left the
    earlier blocks in the kernel alone; the caller then dropped the file's pages, and the
    file was in neither copy. Now nothing changes unless all of it fits."""
    ram = RamTier(10**9, block_bytes=8192, block_overhead_bytes=0)
    identity = SourceIdentity(2 * 8192 + 100, 1, 1)
    blocks = []
    for index, nbytes in enumerate((8192, 8192, 100)):
        block = RamBlock(bytes(nbytes), identity, 5, stats_mod.ORIGIN_PREFETCHED)
        block.priority = 1.0
        assert ram.reserve(ram.charge(block), block.priority)
        ram.insert((b"f", index), block, ram.charge(block))
        blocks.append(((b"f", index), block))
    ram.budget_bytes = ram.used_bytes + 1000  # no room for the last block's 4 KiB page
    assert not ram.hand_to_kernel(blocks)
    assert all(block.data is not None for _, block in blocks)
    ram.budget_bytes += 4096
    assert ram.hand_to_kernel(blocks)
    assert all(block.data is None for _, block in blocks)


def test_item_identities_keep_the_look_asked_last_and_doubt_a_conflict():
    """Looks at a file land in any order, each seen somewhere between its ask and its landing
    (cachefs/item_meta.py). One asked before the recorded one changes nothing; if it saw
    another version, neither is trusted until a look asked after both settles it."""
    from cachefs.freshness import NEVER_S
    from cachefs.item_meta import ItemMeta
    from cachefs.source import SourceIdentity

    old, new = SourceIdentity(10, 1, 5), SourceIdentity(11, 2, 5)
    meta = ItemMeta(3)
    assert meta.record(0, new, seen_s=2.0)
    assert meta.record(0, new, seen_s=1.0)  # the same version, asked earlier: nothing new
    assert (meta.identity(0), meta.seen_s[0]) == (new, 2.0)
    assert not meta.record(0, old, seen_s=1.0)  # the read-ahead's look, asked before
    assert (meta.identity(0), meta.seen_s[0]) == (new, NEVER_S)  # in doubt: not trusted
    assert not meta.record(0, old, seen_s=1.5)  # another look asked before: still in doubt
    assert meta.seen_s[0] == NEVER_S
    assert meta.record(0, new, seen_s=3.0)  # asked after both: settled
    assert (meta.identity(0), meta.seen_s[0]) == (new, 3.0)
    assert not meta.record(0, old, seen_s=NEVER_S)  # an SSD copy of the old version:
    assert (meta.identity(0), meta.seen_s[0]) == (new, 3.0)  # no look at the source, no doubt
    assert not meta.record(0, old, seen_s=3.0)  # asked at the same time: which is newer?
    assert meta.seen_s[0] == NEVER_S
    assert meta.record(1, old, seen_s=NEVER_S)  # unknown: any look is news
    assert meta.mean_size(0) == (11 + 10) // 2


def test_entries_walked_one_by_one_are_those_of_the_chunks():
    """`entries` walks its first entries one by one (`due_item`, the demand miss's few) and
    the rest by chunks (`due_items`): both give the same entries, whatever was consumed, in
    either order, within any end."""
    rng = np.random.default_rng(7)
    n = 300
    planner = Planner(32)
    manifest = Manifest.from_paths([f"f{i:03d}" for i in range(n)])
    assert planner.set_order(order(1, rng.permutation(n), rng.permutation(n), manifest))
    for item in rng.permutation(n)[:170].tolist():
        planner.consume(item)  # some at the cursor, most beyond it
    # a target's list: every third virtual position, past the known orders too
    positions = np.arange(0, 2 * n + 40, 3, dtype=np.int64)
    longest = 0
    for start, end in [(0, 2 * n + 40), (5, 100), (50, 2 * n), (190, 2 * n + 40), (0, 10)]:
        chunked = [(index, position, item)
                   for indices, virtual, items, _ in planner.entry_chunks(positions, start, end)
                   for index, position, item in zip(indices.tolist(), virtual.tolist(),
                                                    items.tolist(), strict=True)]
        assert list(planner.entries(positions, start, end)) == chunked, (start, end)
        longest = max(longest, len(chunked))
    assert longest > SCALAR_ENTRIES  # a walk went on past the entries taken one by one
