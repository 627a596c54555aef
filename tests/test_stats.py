"""Stats: the refetch counter keeps its meaning with bounded memory (issue 15, item 11)."""

from __future__ import annotations

import tracemalloc

from cachefs.stats import MIN_REFETCH_WINDOW_BLOCKS, Stats, refetch_window_blocks

NO_ITEM = -1  # a read with no order in force, or of a file outside the manifest


def read_source(stats: Stats, n: int, block: int = 0, item: int = NO_ITEM) -> None:
    stats.source_fetched(item, (b"train/class%03d/img%08d.jpg" % (n % 1000, n), block), 1000)


def test_reads_with_no_order_do_not_grow_memory():
    stats = Stats()
    tracemalloc.start()
    try:
        for n in range(2 * MIN_REFETCH_WINDOW_BLOCKS):
            read_source(stats, n)
        filled_bytes = tracemalloc.get_traced_memory()[0]
        for n in range(2 * MIN_REFETCH_WINDOW_BLOCKS, 300_000):
            read_source(stats, n)
        grown_bytes = tracemalloc.get_traced_memory()[0] - filled_bytes
    finally:
        tracemalloc.stop()
    assert grown_bytes < 2_000_000  # 170,000 more distinct blocks: 27 MB before the fix
    assert stats.current.backend_reads == 300_000 and stats.current.refetched_blocks == 0


def test_refetches_are_counted_within_the_window_and_for_every_first_block():
    stats = Stats(refetch_window_blocks=100)
    stats.track_items(1000)
    for n in range(50):
        read_source(stats, n, block=1)
        read_source(stats, n, block=0, item=n)
    for n in range(50):  # a second read of each, 50 or fewer distinct blocks later
        read_source(stats, n, block=1)
    assert stats.current.refetched_blocks == 50
    for n in range(1000, 1200):  # 200 other blocks push the first ones out of the window
        read_source(stats, n, block=1)
    read_source(stats, 0, block=1)
    assert stats.current.refetched_blocks == 50
    for n in range(50):  # block 0 of the manifest's items is remembered for the whole epoch
        read_source(stats, n, block=0, item=n)
    assert stats.current.refetched_blocks == 100


def test_window_is_twice_the_ram_tier_in_blocks_with_a_floor():
    assert (refetch_window_blocks(ram_bytes=1 << 30, block_bytes=1 << 22)
            == MIN_REFETCH_WINDOW_BLOCKS)
    assert refetch_window_blocks(ram_bytes=64 << 30, block_bytes=1 << 17) == 1 << 20


def test_the_stats_attribute_fits_an_order_merged_from_hundreds_of_rank_files(tmp_path):
    """1,200 rank files merged into one order listed every file's identity and rank: the
    attribute grew past the 64 KiB the kernel lets a program read, and `cachefs stats` and
    `cachefs publish` failed for every user until the files were removed. The first few are
    shown now, with how many there are."""
    import json

    from cachefs.ctrl import ORDER_LISTS_SHOWN, XATTR_SIZE_MAX, Control

    files = [{"size": 10_000 + rank, "mtime_ns": 1_796_000_000_000_000_000 + rank,
              "ino": 5_000_000 + rank} for rank in range(1200)]
    snapshot = {"version": 1, "epochs": [{"epoch": 0}],
                "order": {"epoch": 0, "ranks": list(range(1200)), "files": files}}
    data = Control(lambda: json.loads(json.dumps(snapshot)), tmp_path / "order.npz",
                   lambda request: {}).stats_json()
    assert len(data) <= XATTR_SIZE_MAX
    order = json.loads(data)["order"]
    assert order["files"] == files[:ORDER_LISTS_SHOWN] and order["files_total"] == 1200
    assert order["ranks"] == list(range(ORDER_LISTS_SHOWN)) and order["ranks_total"] == 1200
