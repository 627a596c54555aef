"""The policy on byte-range items (samples inside packed files), checked with the simulator: the
mount's own objects on virtual time, a memmap-like reader over the zero-request data plane with
the kernel's read-ahead off (cachefs/sim.py)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from cachefs import stats as stats_mod
from cachefs.cache.ram import BLOCK_OVERHEAD_BYTES, PAGE_BYTES
from cachefs.sim import SimConfig, run_script, simulate
from cachefs.sim_ranges import range_content

ITEM_BYTES = 100_000
N = 1000
RAM_BYTES = N * ITEM_BYTES // 4


def classes_add_up(epoch) -> bool:
    return epoch.hits_ram + epoch.hits_ssd + epoch.prefetched + epoch.misses == epoch.reads


@pytest.fixture(scope="module")
def packed():
    """N rows of 100 KB in one file, RAM a quarter of it, a shuffled order each epoch."""
    return simulate(SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=3,
                              latency_s=0.002, ranges_per_file=N))


def test_every_item_is_read_once_per_epoch_with_the_right_bytes(packed):
    assert packed.data_errors == 0
    for epoch in packed.epochs:
        assert epoch.reads == N and classes_add_up(epoch)
        assert (epoch.origins >= 0).all()
    assert packed.max_ram_used_bytes <= packed.ram_budget_bytes


def test_the_next_epochs_head_is_kept_as_items(packed):
    """C/N of the items are hits in epochs 2-3, at the head of the epoch (the retained entries
    hold their own bytes: 100 KB and the bookkeeping each, no neighbours' bytes)."""
    capacity_items = RAM_BYTES // (ITEM_BYTES + BLOCK_OVERHEAD_BYTES)
    window = packed.lookahead_items
    for epoch in packed.epochs[1:]:
        assert epoch.hits_ram >= 0.24 * N
        assert (epoch.origins[:capacity_items - window] == stats_mod.ORIGIN_RAM).all()
        assert np.sum(epoch.ram_hit_positions >= capacity_items) <= window
        assert epoch.boundary_ram_blocks >= capacity_items - window


def test_read_ahead_reads_each_missing_item_once_and_hides_the_source(packed):
    for epoch in packed.epochs:
        assert epoch.refetched_blocks == 0
        fetched = N - epoch.hits_ram
        assert epoch.backend_reads == fetched  # one item per source read (shuffled order)
        # each item's page extent: its bytes and at most two pages of its neighbours'
        assert fetched * ITEM_BYTES <= epoch.backend_bytes <= fetched * (ITEM_BYTES
                                                                        + 2 * PAGE_BYTES)
        assert epoch.misses <= 2 and epoch.stall_s < 0.01  # only the very first item waits


def test_the_drops_within_an_epoch_keep_the_window_so_each_item_is_stored_once():
    """Every 128 consumed items the file's pages go but for the extents of the items pushed
    and not yet read: no item of the window is stored into the kernel's pages a second time
    (dropping the whole file stored about a quarter of the window's bytes again), and the
    reader finds its items' pages (few READs beyond one per item)."""
    config = SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=1,
                       latency_s=0.002, ranges_per_file=N)

    async def script(sim):
        epochs = await sim._epochs()
        return epochs[0], sim.pages.stored_bytes, sim.prefetcher.status()["ranges"]

    epoch, stored_bytes, ranges = run_script(config, script)
    assert len(epoch.completion) == N and ranges["page_drops"] >= N // 128
    # each item's extent once, but for its sentinel page: at most its bytes and two pages
    assert stored_bytes <= N * (ITEM_BYTES + 2 * PAGE_BYTES)
    assert ranges["reads"] <= 1.02 * N


def test_the_pages_of_consumed_items_are_bounded_over_many_files():
    """A shuffle over many files of a few items each: the pages of consumed items go every
    128 consumed items in all files (or a quarter of the RAM budget in their extents). Counted
    per file, none of the 250 files reached 128 in an epoch, and the kernel kept every item's
    pages to the epoch's end: 100 MB beside a RAM budget of 25 MB."""
    config = SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=1,
                       latency_s=0.002, ranges_per_file=4)
    held_bytes: list[int] = []  # the kernel's pages of the mount after each consumption

    async def script(sim):
        cache = sim.prefetcher.ranges.cache
        note = cache.note_consumed

        def noted(relpath: bytes, item: int) -> None:
            note(relpath, item)
            held_bytes.append(PAGE_BYTES * sum(len(pages) for pages in sim.pages.pages.values()))
        cache.note_consumed = noted
        return await sim._epochs()

    epochs = run_script(config, script)
    assert len(epochs[0].completion) == N and len(held_bytes) == N
    assert max(held_bytes) <= RAM_BYTES // 2, max(held_bytes)


def test_after_a_store_failed_the_next_drop_takes_the_whole_file():
    """A store the kernel refused (it forgot the inode) leaves the pushed items naming pages it
    does not hold: the next drop within the epoch takes all of the file's pages, so that the
    window is stored again; the drops after it keep the window's pages again."""
    config = SimConfig(items=600, item_bytes=ITEM_BYTES, ram_bytes=600 * ITEM_BYTES // 4,
                       epochs=1, latency_s=0.002, ranges_per_file=600)
    drops: list[bool] = []  # whether each drop within the epoch kept the window's pages

    async def script(sim):
        cache = sim.prefetcher.ranges.cache
        drop, store = cache._drop_file_pages, sim.kernel._store_fn
        failed = []

        def refuse_one(inode: int, offset: int, data) -> None:
            if not failed:
                failed.append(offset)
                raise FileNotFoundError(2, "the kernel forgot the inode")
            store(inode, offset, data)

        def recorded(relpath: bytes, keep):
            drops.append(keep is not None)
            return drop(relpath, keep)
        sim.kernel._store_fn, cache._drop_file_pages = refuse_one, recorded
        return await sim._epochs()

    epochs = run_script(config, script)
    assert len(epochs[0].completion) == 600
    within = drops[:600 // 128]  # the drops every 128 items (the epoch's end drops all)
    assert within[0] is False and all(within[1:]), drops


def test_adjacent_items_are_read_in_one_span():
    """Items in file order (a sequential reader): the window's neighbours share source
    reads of up to 4 MiB."""
    result = simulate(SimConfig(items=400, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES,
                                epochs=1, latency_s=0.002, ranges_per_file=400,
                                shuffle=False))
    epoch = result.epochs[0]
    assert result.data_errors == 0 and epoch.reads == 400
    # one source request per span: far fewer than items
    assert result.source_requests < 400 / 4


def test_the_daemon_data_plane_counts_the_same():
    """No pushes (--data-plane daemon): every page is a READ, items are still consumed by
    their sentinel page and counted once, and the head still kept."""
    result = simulate(SimConfig(items=300, item_bytes=ITEM_BYTES, ram_bytes=300 * ITEM_BYTES // 4,
                                epochs=2, latency_s=0.002, ranges_per_file=300,
                                kernel_cache=False))
    assert result.data_errors == 0
    for epoch in result.epochs:
        assert epoch.reads == 300 and classes_add_up(epoch)
    assert result.epochs[1].hits_ram >= 0.22 * 300


def test_reads_spanning_cached_and_uncached_bytes_are_served_whole():
    """READs at any offset and size over a packed file, some items in RAM, some in flight,
    some not, and the header (no item): every byte is the file's."""
    config = SimConfig(items=200, item_bytes=30_000, ram_bytes=200 * 30_000 // 5, epochs=1,
                       latency_s=0.002, ranges_per_file=200)

    async def script(sim):
        sim.prefetcher.set_order(sim.order(1))
        relpath = sim.paths[0]
        handle = await sim.reader.open(2, relpath, -1, sim.source.identity(relpath))
        size = handle.identity.size
        rng = np.random.default_rng(1)
        wrong = 0
        async with trio.open_nursery() as nursery:
            async def read(offset: int, length: int) -> None:
                nonlocal wrong
                data = await sim.reader.read(handle, offset, length)
                wrong += data != range_content(0, offset, min(offset + length, size))
            for _ in range(400):
                offset = int(rng.integers(0, size))
                length = int(rng.choice([1, 200, PAGE_BYTES, 3 * PAGE_BYTES + 9, 70_000]))
                nursery.start_soon(read, offset, length)
                await trio.sleep(0.0005)
            nursery.start_soon(read, 0, 300)  # the header and the first item's start
        return wrong, size

    wrong, size = run_script(config, script)
    assert wrong == 0
    assert size == 128 + 200 * 30_000


def test_a_page_shared_with_an_item_not_held_is_served_from_the_entry_that_holds_it():
    """An unconsumed item's entry holds its whole pages: a READ of its last page, which it
    shares with a neighbour neither held nor due soon, reads nothing from the source."""
    config = SimConfig(items=200, item_bytes=30_000, ram_bytes=200 * 30_000 // 5, epochs=1,
                       latency_s=0.002, ranges_per_file=200)

    async def script(sim):
        order = sim.order(1)
        sim.prefetcher.set_order(order)
        relpath = sim.paths[0]
        handle = await sim.reader.open(2, relpath, -1, sim.source.identity(relpath))
        await trio.sleep(1)  # the window is read ahead
        positions = np.argsort(order.current)
        held = next(int(item) for item in order.current[:8]  # its file neighbour is due late
                    if item + 1 < len(positions) and positions[item + 1] > 40)
        offset, length = int(sim.items.offset[held]), int(sim.items.length[held])
        page = (offset + length) // PAGE_BYTES  # shared with the neighbour
        requests = sim.source.requests
        data = await sim.reader.read(handle, page * PAGE_BYTES, PAGE_BYTES)
        return (data == range_content(0, page * PAGE_BYTES, (page + 1) * PAGE_BYTES),
                sim.source.requests - requests, (offset + length) % PAGE_BYTES)

    right, source_reads, cut = run_script(config, script)
    assert cut and right  # the page holds both items' bytes, served whole
    assert source_reads == 0


def test_an_item_whose_sentinel_is_never_read_does_not_hold_the_window():
    """A kernel that kept an item's pages (its sentinel is never READ): the readers pass it by,
    it is taken as read, and the read-ahead goes on."""
    config = SimConfig(items=600, item_bytes=ITEM_BYTES, ram_bytes=600 * ITEM_BYTES // 4,
                       epochs=1, latency_s=0.002, ranges_per_file=600)

    async def script(sim):
        order = sim.order(1)
        stuck = int(order.current[10])
        offset, length = int(sim.items.offset[stuck]), int(sim.items.length[stuck])
        pages = range(offset // PAGE_BYTES, -(-(offset + length) // PAGE_BYTES))
        real_invalidate, real_invalidate_range = sim.pages.invalidate, sim.pages.invalidate_range

        def keep_stuck(inode: int) -> None:
            for page in pages:  # the kernel keeps this item's pages, sentinel included
                sim.pages.read_into(inode, page)

        def invalidate_but_keep(inode: int) -> None:
            real_invalidate(inode)
            keep_stuck(inode)

        def invalidate_range_but_keep(inode: int, offset: int, length: int) -> None:
            real_invalidate_range(inode, offset, length)
            keep_stuck(inode)
        sim.pages.invalidate = invalidate_but_keep
        sim.pages.invalidate_range = invalidate_range_but_keep
        invalidate_but_keep(2)
        epochs = await sim._epochs()
        record = next(r for r in sim.stats.epochs if r.epoch == 1)
        return epochs[0], record.reads, sim.prefetcher.status()["ranges"]["caught_up"]

    epoch, reads, caught_up = run_script(config, script)
    assert len(epoch.completion) == 600
    assert reads == 600 and caught_up == 1  # every item counted once, that one too
    assert epoch.stalled_positions().size <= 2  # and the rest read ahead as usual


def test_a_new_item_table_over_the_same_files_is_taken_with_pushed_items():
    """The window pushed items of a 400-item table; an order re-cutting the same files into
    200 items is taken, and so is the next publication of it: the numbers of the items
    pushed under the old table indexed the new one out of range at its first page drop,
    the order was rejected half switched, and every later one of that table too."""
    from cachefs.order import Order
    from cachefs.sim import EpochResult
    from cachefs.sim_ranges import packed as packed_items, read_range_item

    config = SimConfig(items=400, item_bytes=10_000, ranges_per_file=100, ram_bytes=2 << 20,
                       epochs=1, shuffle=False)

    async def script(sim):
        order = sim.order(1)
        sim.prefetcher.set_order(order)
        n = len(order.current)
        result = EpochResult(1, items=order.current, origins=np.full(n, -1, np.int8),
                             stall_by_position=np.zeros(n))
        for position in range(300, 340):
            await read_range_item(sim, int(order.current[position]), position, result)
            await trio.sleep(0.0005)
        assert max(sim.reader._ranges._cache.pushed) >= 200  # numbers the new table lacks
        recut, _ = packed_items(np.full(200, 20_000, np.int64), 50, 128)
        for epoch in (2, 3):
            sim.prefetcher.set_order(Order(
                epoch=epoch, current=np.arange(200), next=None, manifest=sim.manifest,
                rank=None, world_size=None, total_length=200, file=None, items=recut))
            assert sim.planner.epoch == epoch
        return len(sim.prefetcher.ranking.items)

    assert run_script(config, script) == 200


def test_catching_up_an_item_at_an_epochs_end_does_not_consume_the_next_epoch():
    """An item whose sentinel page the kernel held (read before the order came) is never
    READ, and is caught up once the readers are past it; when it is the epoch's last item
    left, that switches to the next epoch, and the catch-up went on there, consuming the new
    epoch's first positions (391 of 400) before any reader read them."""
    from cachefs.range_cache import sentinel_page
    from cachefs.sim import EpochResult
    from cachefs.sim_ranges import read_range_item

    config = SimConfig(items=400, item_bytes=10_000, ranges_per_file=100, ram_bytes=2 << 20,
                       epochs=2)

    async def script(sim):
        order = sim.order(1)  # with the next epoch's permutation
        n = len(order.current)
        stuck = int(order.current[n - 10])
        sim.pages.pages.setdefault(int(sim.items.file[stuck]) + 2, set()).add(sentinel_page(
            int(sim.items.offset[stuck]), int(sim.items.length[stuck])))
        sim.prefetcher.set_order(order)
        result = EpochResult(1, items=order.current, origins=np.full(n, -1, np.int8),
                             stall_by_position=np.zeros(n))
        for position in range(n):
            await read_range_item(sim, int(order.current[position]), position, result)
            await trio.sleep(0.0005)
        return sim.planner.epoch, sim.planner.consumed_count, {
            record.epoch: record.reads for record in sim.stats.epochs}

    epoch, consumed, reads = run_script(config, script)
    assert epoch == 2 and consumed == 0 and reads == {1: 400, 2: 0}


def test_a_failed_read_gives_back_the_ram_it_reserved_for_its_other_spans():
    """One READ over items A, B and C with B in RAM fetches two spans, A and C, each with
    RAM reserved up front; the source fails A's read (EIO): C's reservation is given back
    (it was kept for good, and every such failure shrank --ram-cache)."""
    import errno

    config = SimConfig(items=400, item_bytes=10_000, ranges_per_file=100, ram_bytes=4 << 20,
                       epochs=1, shuffle=False)

    async def script(sim):
        sim.prefetcher.set_order(sim.order(1))
        await trio.sleep(1)
        cache, items = sim.reader._ranges._cache, sim.items
        a, b, c = 390, 391, 392  # far from the window: not in RAM
        relpath = cache.key_of(b)[0]
        identity = sim.source.identity(relpath)
        priority = sim.prefetcher.ranking.priority_of(b, 0, identity)
        await cache.fetch(relpath, [cache.want(b, cache.reserve(b, priority))], identity,
                          demand=True)
        await trio.sleep(1)
        assert cache.key_of(b) in sim.ram and sim.ram.reserved_bytes == 0
        handle = await sim.reader.open(int(items.file[b]) + 2, relpath, -1, identity)
        real = sim.source.read_ranges

        async def failing_once(*args, **kwargs):
            sim.source.read_ranges = real
            raise OSError(errno.EIO, "I/O error")

        sim.source.read_ranges = failing_once
        lo = int(items.offset[a]) // PAGE_BYTES * PAGE_BYTES
        with pytest.raises(OSError):
            await sim.reader.read(handle, lo, int(items.offset[c] + items.length[c]) - lo)
        await trio.sleep(1)
        return sim.ram.reserved_bytes

    assert run_script(config, script) == 0


def test_a_read_during_which_the_item_table_changes_returns_its_own_bytes():
    """A READ waits for the source while an order re-cutting the same files comes in force:
    it returns the bytes it asked for (it placed its items by the new table's offsets, and
    returned 45,056 bytes for 8,192 asked)."""
    from cachefs.order import Order
    from cachefs.sim_ranges import packed as packed_items

    config = SimConfig(items=400, item_bytes=10_000, ranges_per_file=100, ram_bytes=4 << 20,
                       epochs=1, shuffle=False)

    async def script(sim):
        sim.prefetcher.set_order(sim.order(1))
        await trio.sleep(1)
        items = sim.items
        file_index = int(items.file[391])  # an item far from the window: not in RAM
        relpath = sim.paths[file_index]
        handle = await sim.reader.open(file_index + 2, relpath, -1,
                                       sim.source.identity(relpath))
        lo = int(items.offset[391]) // PAGE_BYTES * PAGE_BYTES
        got = {}

        async def read():
            got["data"] = await sim.reader.read(handle, lo, 2 * PAGE_BYTES)

        async def publish():
            await trio.sleep(0.001)  # while the READ waits for the source
            recut, _ = packed_items(np.full(800, 5000, np.int64), 200, 100)
            sim.prefetcher.set_order(Order(
                epoch=1, current=np.arange(800), next=None, manifest=sim.manifest, rank=None,
                world_size=None, total_length=800, file=None, items=recut))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(publish)
        return got["data"], range_content(file_index, lo, lo + 2 * PAGE_BYTES)

    data, expected = run_script(config, script)
    assert len(data) == len(expected) and data == expected


def test_a_range_look_asked_before_the_recorded_one_does_not_replace_it():
    """The identities of packed files follow the rule of cachefs/item_meta.py: a look asked
    before the recorded one (a read in flight across a change) neither replaces it nor
    drops its copies; if it saw another version, neither is trusted until a look asked
    after both."""
    from cachefs.freshness import now_s
    from cachefs.source import SourceIdentity

    config = SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=1,
                       latency_s=0.002, ranges_per_file=N)

    async def script(sim):
        cache = sim.prefetcher.ranges.cache
        relpath = b"not/read/by/the/sim"
        old, new = SourceIdentity(10, 1, 5), SourceIdentity(11, 2, 5)
        asked_s = now_s()
        await trio.sleep(0.01)
        assert cache.record_identity(relpath, new, now_s())
        trusted_new = cache.identity(relpath)
        assert not cache.record_identity(relpath, old, asked_s)  # landed last, asked first
        in_doubt = cache.identity(relpath)
        await trio.sleep(0.01)
        cache.record_identity(relpath, new, now_s())
        return trusted_new, in_doubt, cache.identity(relpath), new

    trusted_new, in_doubt, settled, new = run_script(config, script)
    assert (trusted_new, in_doubt, settled) == (new, None, new)


def test_a_file_whose_pages_went_during_a_read_is_paged_again_by_its_answer():
    """The overdue pass (cachefs/revalidate.py) drops the pages of the files the range cache
    says the kernel may hold (`paged_files`); a drop of all of a file's pages forgets it. A
    READ that waited across such a drop gives the kernel the pages of its answer after it:
    the file is paged again, so a later pass still drops them (forgotten, they were served
    with no request after a change, past --metadata-ttl). A file the kernel holds no inode
    of holds no pages, and is not counted."""
    config = SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=1,
                       latency_s=0.002, ranges_per_file=N)

    async def script(sim):
        cache = sim.prefetcher.ranges.cache
        relpath = sim.paths[0]
        cache.reading(relpath, 0, PAGE_BYTES, True)
        cache.drop_pages(relpath)
        dropped = relpath in cache.paged_files()
        cache.reading(relpath, 0, PAGE_BYTES, False)
        # a file the kernel holds no inode of holds no pages: not counted as paged
        cache.reading(b"not/known/to/the/kernel", 0, PAGE_BYTES, False)
        return dropped, cache.paged_files() == [relpath]

    assert run_script(config, script) == (False, True)


def test_the_overdue_pass_keeps_the_pages_of_a_read_waiting_for_its_answer():
    """The overdue pass (cachefs/revalidate.py) drops the pages of a file not seen at the
    source within the TTL, but those of a READ waiting for its answer (from its arrival,
    `Reader.waiting`): dropped too, they went the moment the answer landed, before the reader
    had them, and with every READ slower than the pass's interval the reader asked again for
    good (tests/test_overdue.py, the daemon on one CPU). Where the kernel cannot drop a range,
    the file is left to the next pass; with no READ waiting, every page goes."""
    config = SimConfig(items=N, item_bytes=ITEM_BYTES, ram_bytes=RAM_BYTES, epochs=1,
                       latency_s=0.002, ranges_per_file=N)

    async def script(sim):
        sim.prefetcher.set_order(sim.order(1))
        cache = sim.prefetcher.ranges.cache
        relpath = sim.paths[0]
        drops = []

        def drop_file_pages(path: bytes, keep) -> bool:
            drops.append((path, keep))
            return keep is not None

        cache._drop_file_pages = drop_file_pages
        with sim.reader.waiting(relpath, 5 * PAGE_BYTES + 100, PAGE_BYTES):
            dropped = [cache.drop_overdue_pages(relpath)]
            range_fn, sim.kernel._invalidate_range_fn = sim.kernel._invalidate_range_fn, None
            dropped.append(cache.drop_overdue_pages(relpath))  # a kernel that drops no range
            sim.kernel._invalidate_range_fn = range_fn
        dropped.append(cache.drop_overdue_pages(relpath))
        return dropped, drops, relpath in cache.paged_files()

    dropped, drops, paged = run_script(config, script)
    kept = [(5 * PAGE_BYTES, 6 * PAGE_BYTES), (6 * PAGE_BYTES, 7 * PAGE_BYTES)]
    assert dropped == [True, False, True]
    assert drops == [(drops[0][0], kept), (drops[0][0], None)]
    assert not paged  # every page went
