"""Orders over other manifests published while work is in flight (issue 15, items 1 and 2).

An item number is an index into one manifest. A trainer and a validation sampler publishing
their own data sets' orders on one mount change the manifest under fetches and open files that
hold item numbers of the old one. These run the mount's own read path on the simulator
(`cachefs.sim.run_script`: the real prefetcher, tiered cache and reader over a slow fake source,
on virtual time) through such changes, and check what a reader gets: the daemon keeps running
and every byte is the file's. The last test does the same through a real mount.
"""

from __future__ import annotations

import threading

import numpy as np
import trio

from cachefs.cache.ram import block_count
from cachefs.manifest import Manifest
from cachefs.order import Order
from cachefs.sim import SimConfig, payload, run_script

from conftest import make_flat_dataset

BLOCK_BYTES = 4096
LATENCY_S = 0.002  # per source request: fetches are in flight for this long


def sim_config(sizes) -> SimConfig:
    return SimConfig(sizes_bytes=tuple(sizes), block_bytes=BLOCK_BYTES, ram_bytes=1 << 20,
                     latency_s=LATENCY_S, parallelism=16, lookahead_items=len(sizes))


def order_over(manifest: Manifest, current, next_=None, epoch: int = 1) -> Order:
    current = np.asarray(current, np.int64)
    next_ = None if next_ is None else np.asarray(next_, np.int64)
    return Order(epoch=epoch, current=current, next=next_, manifest=manifest, rank=None,
                 world_size=None, total_length=len(current), file=None)


def expected_bytes(relpath: bytes, size: int) -> bytes:
    return b"".join(payload(relpath, index, min(BLOCK_BYTES, size - index * BLOCK_BYTES))
                    for index in range(block_count(size, BLOCK_BYTES)))


async def read_through(sim, relpath: bytes, offset: int = 0) -> bytes:
    """Open `relpath` as fuse_ops.open does (its item in the manifest in force, no stat of
    its own) and read it from `offset` to the end in kernel-sized requests."""
    prefetcher = sim.prefetcher
    handle = await sim.reader.open(0, relpath, prefetcher.item_of(relpath), None)
    parts = []
    while data := await sim.reader.read(handle, offset, 2 * BLOCK_BYTES):
        parts.append(data)
        offset += len(data)
    sim.reader.release(handle)
    return b"".join(parts)


def check_blocks_numbered_in_force(sim) -> None:
    """Every block in RAM carries its file's item number in the manifest in force."""
    manifest = sim.prefetcher.manifest
    for (relpath, _), block in sim.ram.blocks.items():
        assert block.item == manifest.index_of(relpath), relpath


def test_a_smaller_manifest_while_read_ahead_is_in_flight_keeps_the_daemon_running():
    # issue 15, item 1: the fetches of a 10-file manifest landed after a 2-file one came into
    # force, and indexed its arrays with their old item numbers: IndexError ended the mount
    sizes = [10_000] * 10

    async def script(sim):
        sim.prefetcher.set_order(order_over(sim.manifest, range(10)))
        await trio.sleep(LATENCY_S / 2)  # the read-ahead of all ten is in flight
        assert sim.prefetcher.status()["inflight"] == 10
        small = Manifest.from_paths(sim.paths[8:]).prepare()
        sim.prefetcher.set_order(order_over(small, [1, 0]))
        await trio.sleep(10 * LATENCY_S)  # every fetch of the first order has landed
        check_blocks_numbered_in_force(sim)
        return {relpath: await read_through(sim, relpath) for relpath in sim.paths}

    got = run_script(sim_config(sizes), script)
    assert len(got) == 10
    assert all(data == expected_bytes(relpath, 10_000) for relpath, data in got.items())


def test_a_late_identity_of_a_reordered_manifest_never_serves_a_short_read():
    # issue 15, item 2: the read-ahead's identity of old item 0 (a 4,096-byte file) landed in
    # the slot of new item 0, another file of 10,000 bytes; its open trusted it, and a read at
    # offset 4,096 returned 0 bytes (end of file, for the kernel)
    sizes = [4096, 10_000]

    async def script(sim):
        small, large = sim.paths
        sim.prefetcher.set_order(order_over(sim.manifest, [0]))
        await trio.sleep(LATENCY_S / 2)  # the small file's read-ahead is in flight
        reordered = Manifest.from_paths([large, small]).prepare()
        sim.prefetcher.set_order(order_over(reordered, [1]))
        await trio.sleep(10 * LATENCY_S)
        return sim, large, await read_through(sim, large, offset=4096)

    sim, large, got = run_script(sim_config(sizes), script)
    assert len(got) == 10_000 - 4096
    assert got == expected_bytes(large, 10_000)[4096:]
    check_blocks_numbered_in_force(sim)


def test_a_file_open_across_a_manifest_change_reads_its_own_bytes():
    # a reader's handle holds its item number: its demand reads, identities and read-ahead
    # land in the new manifest's numbering, and its consumption is not charged to the new plan
    sizes = [3 * BLOCK_BYTES, 5 * BLOCK_BYTES, BLOCK_BYTES]

    async def script(sim):
        first, second, third = sim.paths
        sim.prefetcher.set_order(order_over(sim.manifest, [2]))
        handle = await sim.reader.open(0, second, sim.prefetcher.item_of(second), None)
        head = await sim.reader.read(handle, 0, BLOCK_BYTES)
        reordered = Manifest.from_paths([second, third, first]).prepare()  # second: 1 -> 0
        sim.prefetcher.set_order(order_over(reordered, [1, 2]))
        rest = []
        offset = BLOCK_BYTES
        while data := await sim.reader.read(handle, offset, BLOCK_BYTES):
            rest.append(data)
            offset += len(data)
        sim.reader.release(handle)
        await trio.sleep(10 * LATENCY_S)
        check_blocks_numbered_in_force(sim)
        assert sim.planner.consumed_count == 0  # the file was read for the old plan
        return second, head + b"".join(rest)

    second, got = run_script(sim_config(sizes), script)
    assert got == expected_bytes(second, 5 * BLOCK_BYTES)


def test_orders_over_other_manifests_published_while_reading_through_a_mount(tmp_path,
                                                                            mounter):
    """Two data sets' orders (a training and a validation sampler on one mount) published
    one right after the other, with the first one's read-ahead in flight on a slow source,
    while a reader reads: the mount stays up and every byte is the source's."""
    src = tmp_path / "src"
    relpaths = make_flat_dataset(src, 40, 20_000)
    train, validation = relpaths[:30], relpaths[30:]
    mount = mounter(src, "--source-delay-ms", 30, "--source-threads", 8, "--lookahead", 30)
    from cachefs.publish import publish

    failures: list[str] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            for relpath in reversed(relpaths):
                if (mount.mountpoint / relpath).read_bytes() != (src / relpath).read_bytes():
                    failures.append(relpath)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for epoch in range(1, 4):
            publish(mount.mountpoint, epoch, np.arange(len(train)), files=train)
            publish(mount.mountpoint, epoch, np.arange(len(validation))[::-1],
                    files=validation[::-1] + [train[0]])
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert mount.process.poll() is None
    for relpath in relpaths:
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
