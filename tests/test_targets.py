"""Storage targets (issue 17): the order file's `targets`, the st_dev default, one read-ahead
list per target with its share of the source threads, the batch on a demand miss, and the
per-target counters of `cachefs stats`.

The policy (per-target lists against one window) is checked with the simulator; the rest on
real mounts, through the kernel, as a user sees it.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cachefs import order
from cachefs.stats_table import format_targets
from cachefs.errors import OrderError
from cachefs.manifest import Manifest, scan_source
from cachefs.placement import MAX_TARGETS, OTHER_DEVICES, Placement
from cachefs.planner import Planner
from cachefs.publish import publish
from cachefs.sim import SimConfig, simulate
from cachefs.stats import Histogram
from cachefs.targets import COST_REQUESTS, LATENCY_BOUNDS_S, Targets, allocate_slots
from conftest import epoch_record, make_flat_dataset, run_cachefs

TARGET_KEYS = {"target", "by", "items", "bytes", "requests", "mean_latency_s", "p99_latency_s",
               "in_flight", "misses", "stall_s", "slots", "depth", "batches", "batch_items"}


def wait_for(condition, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# -- the order file's `targets` ----------------------------------------------------------------


@pytest.fixture
def source_manifest() -> Manifest:
    return Manifest.from_paths([f"d/f{i:02d}" for i in range(12)]).prepare()


def test_targets_round_trip_as_one_number_per_manifest_item(tmp_path, source_manifest):
    targets = np.array([7, 3] * 6, np.uint8)
    order.write_order_file(tmp_path / "o.npz", epoch=0, current=order.permutation(12, 0, 0),
                           targets=targets)
    loaded = order.load_order(tmp_path / "o.npz", source_manifest)
    assert not loaded.targets.from_devices
    assert loaded.targets.keys.tolist() == [3, 7]  # numbered in increasing order of value
    assert loaded.targets.ids.tolist() == [1, 0] * 6
    assert [loaded.targets.name(n) for n in range(2)] == ["3", "7"]
    assert loaded.status()["targets"] == "order"


@pytest.mark.parametrize("targets, message", [
    ([0] * 11, "targets has 11 entries but the manifest has 12 files"),
    ([0] * 11 + [-1], r"targets\[11\] = -1 is negative"),
    ([0] * 11 + [65536], r"targets\[11\] = 65536 is out of range; targets are 0..65535"),
    ([0.5] * 12, "targets must be an integer array, got dtype float64"),
    ([[0] * 12], "targets must be a 1-D integer array"),
])
def test_bad_targets_are_rejected_by_the_loader_with_the_reason(tmp_path, source_manifest,
                                                                 targets, message):
    # written by hand, as a framework without our code would: only the loader checks it
    path = tmp_path / "o.npz"
    with open(path, "wb") as f:
        np.savez(f, version=1, epoch=0, current=np.arange(12), targets=np.array(targets))
    with pytest.raises(OrderError, match=message):
        order.load_order(path, source_manifest)


def test_at_most_64_distinct_targets_and_writing_checks_first(tmp_path):
    files = [f"f{i}" for i in range(MAX_TARGETS + 1)]
    with pytest.raises(OrderError, match="targets has 65 distinct values; at most 64"):
        order.write_order_file(tmp_path / "o.npz", epoch=0, current=[0], files=files,
                               targets=np.arange(len(files)))
    assert not (tmp_path / "o.npz").exists()
    order.write_order_file(tmp_path / "o.npz", epoch=0, current=[0], files=files,
                           targets=np.arange(len(files)) % MAX_TARGETS)


def test_a_trainers_list_takes_each_files_device_from_the_source_listing(tmp_path):
    source = Manifest(np.array([b"a", b"b", b"c"]), devices=np.array([5, 9, 5]))
    order.write_order_file(tmp_path / "o.npz", epoch=0, current=[0, 1], files=["c", "b"])
    loaded = order.load_order(tmp_path / "o.npz", source)
    assert loaded.targets is None
    placement = loaded.manifest.device_placement()
    assert placement.from_devices and placement.keys.tolist() == [5, 9]
    assert placement.ids.tolist() == [0, 1]  # "c" on device 5, "b" on device 9


def test_scan_records_the_device_of_each_files_directory(tmp_path):
    make_flat_dataset(tmp_path / "src", 5, 100)
    manifest = scan_source(tmp_path / "src")
    assert manifest.devices.tolist() == [os.stat(tmp_path / "src").st_dev] * 5


def test_devices_beyond_64_share_one_target_the_busiest_keep_theirs():
    devices = np.concatenate([np.repeat(np.arange(70), 2), np.full(10, 69)])
    placement = Placement.of_devices(devices)
    assert placement.count == MAX_TARGETS
    assert int(placement.keys[-1]) == OTHER_DEVICES and placement.name(MAX_TARGETS - 1) == "other"
    assert placement.keys[placement.ids[-1]] == 69  # the device with the most files keeps its own
    assert (np.bincount(placement.ids) > 0).all()


# -- sizing ------------------------------------------------------------------------------------


def test_slots_follow_share_times_latency_with_floors_and_add_up():
    # equal shares, one target 10x slower: about 10x the slots, within a quarter of its share
    assert allocate_slots(32, [0.5 * 0.002, 0.5 * 0.020], [4, 4]) == [4, 28]
    assert allocate_slots(33, [1.0, 1.0, 1.0], [1, 1, 1]) == [11, 11, 11]
    assert sum(allocate_slots(32, [0.1, 0.2, 0.7], [1, 1, 1])) == 32
    assert allocate_slots(2, [1.0, 1.0, 1.0], [1, 1, 1]) == [1, 1, 1]  # more targets than slots


MANIFEST_2 = Manifest.from_paths([f"f{i}" for i in range(8)]).prepare()


def _two_targets(held_items=()) -> Targets:
    """MANIFEST_2's 8 files in order, even items on target 0, odd on 1; RAM holding
    `held_items`."""
    targets = Targets()
    targets.use(MANIFEST_2, Placement.of_targets(np.arange(8) % 2), MANIFEST_2.index_of)
    planner = Planner(32)
    planner.set_order(order.Order(epoch=0, current=np.arange(8), next=None, manifest=MANIFEST_2,
                                  rank=None, world_size=None, total_length=8, file=None))
    targets.rebuild(planner, np.asarray(held_items, np.int64))
    return targets


def test_a_target_measured_slower_gets_more_slots():
    targets = _two_targets()
    assert [t.positions.tolist() for t in targets.all] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for relpath, latency_s in ((b"f0", 0.001), (b"f1", 0.010)):  # on targets 0 and 1
        for _ in range(20):
            targets.request_finished(targets.request_started(relpath), latency_s, 1000)
    targets.size(32, now_s=0.0, s_per_item=0.001)
    fast, slow = targets.all
    assert (fast.slots, slow.slots) == (4, 28)
    # the queue covers its p99 latency at the readers' pace: half the files, 1 ms apart
    assert slow.tail_items == math.ceil(0.5 * slow.latency.quantile_s(0.99) / 0.001) >= 5
    assert fast.tail_items < slow.tail_items
    assert slow.requests == 20 and slow.bytes == 20_000 and slow.in_flight == 0
    assert slow.status()["mean_latency_s"] == pytest.approx(0.010)


def test_read_costs_are_latencies_over_the_fastest_once_every_target_is_timed():
    targets = _two_targets()
    assert targets.read_costs() is None  # nothing timed yet
    for _ in range(COST_REQUESTS):
        targets.request_finished(targets.request_started(b"f0"), 0.002, 1000)
    assert targets.read_costs() is None  # target 1 not timed yet
    for _ in range(COST_REQUESTS):
        targets.request_finished(targets.request_started(b"f1"), 0.008, 1000)
    assert targets.read_costs() == pytest.approx([1.0, 4.0] * 4)  # per item, by its target
    single = Targets()
    single.use(MANIFEST_2, Placement.single(8), MANIFEST_2.index_of)
    for _ in range(COST_REQUESTS):
        single.request_finished(single.request_started(b"f0"), 0.002, 1000)
    assert single.read_costs() is None  # one target: no file costs more than another


def test_a_targets_share_counts_the_files_it_must_deliver_not_those_ram_holds():
    assert [t.share for t in _two_targets().all] == [0.5, 0.5]
    # RAM holds three of target 1's four files: target 0 has 4 of the 5 files to read
    assert [t.share for t in _two_targets(held_items=[1, 3, 5]).all] == [0.8, 0.2]
    assert [t.share for t in _two_targets(held_items=range(8)).all] == [0.5, 0.5]  # all held



def test_latency_histogram_p99_is_a_bucket_edge_above_it():
    histogram = Histogram(LATENCY_BOUNDS_S)
    assert histogram.mean_s is None and histogram.quantile_s(0.99) is None
    for _ in range(990):
        histogram.observe(0.001)
    for _ in range(10):
        histogram.observe(0.050)
    assert histogram.mean_s == pytest.approx((990 * 0.001 + 10 * 0.050) / 1000)
    assert 0.001 <= histogram.quantile_s(0.99) <= 0.00113
    assert 0.050 <= histogram.quantile_s(0.999) <= 0.0565
    histogram.observe(5000.0)  # past the last bound: counted, and the quantile is that bound
    assert histogram.quantile_s(1.0) == LATENCY_BOUNDS_S[-1] == pytest.approx(1000.0)


# -- the policy, on the simulator ---------------------------------------------------------------

N_SIM = 2000
SIM = dict(items=N_SIM, item_bytes=110_000, ram_bytes=N_SIM * 110_000 // 4, epochs=2,
           latency_s=0.002, parallelism=32, consume_s=0.0005)


def test_per_target_lists_beat_one_window_when_a_target_is_10x_slower():
    """Two targets with as many files each, one 10x slower, 32 source threads in all: one
    window of 32 files fills with the slow target's files and the readers wait; one list per
    target, with the threads shared by latency, nearly stops the stalls."""
    one_window = simulate(SimConfig(**SIM, target_latencies_s=(0.002, 0.020), per_target=False))
    per_target = simulate(SimConfig(**SIM, target_latencies_s=(0.002, 0.020)))
    for window_epoch, target_epoch in zip(one_window.epochs, per_target.epochs, strict=True):
        assert target_epoch.stall_s < 0.5 * window_epoch.stall_s, (window_epoch.row(),
                                                                 target_epoch.row())
        assert target_epoch.wall_s < window_epoch.wall_s
        assert target_epoch.refetched_blocks == 0
    fast, slow = per_target.targets
    assert slow["slots"] > 5 * fast["slots"] and fast["slots"] + slow["slots"] == 32
    assert slow["mean_latency_s"] == pytest.approx(0.020)
    assert fast["items"] == slow["items"] == N_SIM // 2
    assert per_target.data_errors == 0


def test_the_next_epochs_files_kept_are_the_slow_targets_and_later_epochs_read_less_of_it():
    """A slow server that serves 8 requests at once (its latency grows with the queue, as a
    saturated sshfs or NFS server's does) and a 4x faster one, the source the bottleneck:
    keeping the next epoch's files by distance over read cost keeps mostly the slow server's,
    so each later epoch reads fewer files from it and ends sooner; RAM hits stay C/N."""
    config = dict(SIM, epochs=2, consume_s=0.00005, target_latencies_s=(0.004, 0.016),
                  target_parallelism=(8, 8))
    by_head = simulate(SimConfig(**config, retain_by_cost=False))
    by_cost = simulate(SimConfig(**config))
    head_2, cost_2 = by_head.epochs[1], by_cost.epochs[1]
    assert cost_2.hits_ram == pytest.approx(head_2.hits_ram, rel=0.02)
    assert cost_2.hits_ram >= 0.95 * SIM["ram_bytes"] / SIM["item_bytes"]
    assert cost_2.refetched_blocks == 0 and by_cost.data_errors == 0
    # every file is read once in epoch 1, then epoch 2's misses of RAM
    slow_reads = [result.targets[1]["requests"] - N_SIM // 2 for result in (by_head, by_cost)]
    assert slow_reads[1] < 0.9 * slow_reads[0], slow_reads  # 0.80-0.84 in five runs
    assert cost_2.wall_s < 0.95 * head_2.wall_s, (head_2.row(), cost_2.row())

@pytest.mark.parametrize("miss_batch", [1, 8])
def test_a_miss_outside_the_window_reads_a_batch_of_its_target(miss_batch):
    """A job resumed in mid-epoch reads past the window (its cursor stays at 0): every file is
    a miss without batches; with a batch of k, one miss per k files of each target."""
    result = simulate(SimConfig(**SIM, target_latencies_s=(0.002, 0.006), skip_items=N_SIM // 2,
                                miss_batch_items=miss_batch))
    first = result.epochs[0]
    read = N_SIM - N_SIM // 2
    assert first.reads == read and first.refetched_blocks == 0
    assert first.misses == pytest.approx(read / miss_batch, rel=0.05)
    assert first.prefetched == read - first.misses  # the batches' files
    batches = sum(target["batches"] for target in result.targets)
    assert (batches == 0) == (miss_batch == 1)


# -- real mounts -------------------------------------------------------------------------------


def test_order_file_targets_in_a_mount_and_a_bad_file_keeps_the_order(tmp_path, mounter):
    src = tmp_path / "src"
    relpaths = make_flat_dataset(src, 12, 20_000)
    mount = mounter(src)
    current = order.permutation(12, 0, 0)
    publish(mount.mountpoint, 0, current, targets=np.arange(12) % 3 + 10)
    for index in current:
        assert (mount.mountpoint / relpaths[index]).read_bytes() == \
            (src / relpaths[index]).read_bytes()
    epoch_record(mount, 0, reads=12)
    stats = mount.stats()
    assert stats["order"]["targets"] == "order"
    assert [(t["target"], t["by"], t["items"]) for t in stats["targets"]] == \
        [("10", "order", 4), ("11", "order", 4), ("12", "order", 4)]
    assert all(t["requests"] >= 4 and t["bytes"] >= 4 * 10_000 for t in stats["targets"])
    # publish() checks before writing, against the daemon's manifest
    with pytest.raises(OrderError, match="targets has 5 entries but the manifest has 12 files"):
        publish(mount.mountpoint, 1, order.permutation(12, 0, 1), targets=[0] * 5)
    # a file written by hand reaches the daemon, which rejects it and keeps the order
    temporary = mount.order_file.with_name(".bad.npz")
    with open(temporary, "wb") as f:
        np.savez(f, version=1, epoch=1, current=order.permutation(12, 0, 1),
                 targets=np.full(12, 70_000))
    os.replace(temporary, mount.order_file)
    rejection = wait_for(lambda: mount.stats()["last_rejection"], "the rejection")
    assert "targets[0] = 70000 is out of range" in rejection["reason"]
    stats = mount.stats()
    assert stats["order"]["epoch"] == 0 and stats["order"]["consumed"] == 12
    assert [t["target"] for t in stats["targets"]] == ["10", "11", "12"]


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs mounted at tmp_path/src/remote: a second device under one source directory."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "src" / "remote"
    point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_without_targets_each_device_under_the_source_is_a_target(tmp_path, tmpfs, mounter):
    src = tmp_path / "src"
    local = make_flat_dataset(src / "local", 6, 20_000)
    remote = make_flat_dataset(tmpfs, 9, 20_000)
    relpaths = sorted([f"local/{p}" for p in local] + [f"remote/{p}" for p in remote],
                      key=os.fsencode)
    mount = mounter(src)
    current = order.permutation(15, 1, 0)
    publish(mount.mountpoint, 0, current)
    for index in current:
        assert (mount.mountpoint / relpaths[index]).read_bytes() == \
            (src / relpaths[index]).read_bytes()
    epoch_record(mount, 0, reads=15)
    stats = mount.stats()
    assert stats["order"]["targets"] == "device"

    def name(path: Path) -> str:
        device = os.stat(path).st_dev
        return f"{os.major(device)}:{os.minor(device)}"

    by_name = {t["target"]: t for t in stats["targets"]}
    assert set(by_name) == {name(src / "local"), name(tmpfs)}
    assert by_name[name(src / "local")]["items"] == 6 and by_name[name(tmpfs)]["items"] == 9
    assert all(t["by"] == "device" and t["requests"] >= t["items"] for t in stats["targets"])
    table = run_cachefs("stats", mount.mountpoint)
    assert table.returncode == 0
    assert f"{name(tmpfs):>8} device        9" in table.stdout


def test_a_demand_miss_reads_the_next_files_of_its_target_in_one_batch(tmp_path, mounter):
    src = tmp_path / "src"
    relpaths = make_flat_dataset(src, 40, 50_000, vary=False)
    # a window of one file, spanning at most a quarter of a RAM budget of 20 files: the
    # window stays among the first positions, and only the batch reaches past the miss
    mount = mounter(src, "--lookahead", 1, "--ram-cache", "1MiB", "--block-size", "64K",
                    "--miss-batch", 4)
    current = order.permutation(40, 2, 0)
    publish(mount.mountpoint, 0, current)
    # a reader that starts at position 20 (a job resumed in mid-epoch)
    first = relpaths[current[20]]
    assert (mount.mountpoint / first).read_bytes() == (src / first).read_bytes()
    epoch_record(mount, 0, reads=1)  # its close counted (the kernel reports it after close())
    target = wait_for(lambda: (t := mount.stats()["targets"][0])["batches"]
                      and t["in_flight"] == 0 and t, "the batch")
    assert (target["batches"], target["batch_items"]) == (1, 3)
    assert target["requests"] >= 1 + 3  # the miss and the batch (and the window's)
    assert target["misses"] == 1
    for position in (21, 22, 23):  # the batch: read ahead, no miss
        relpath = relpaths[current[position]]
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
    record = epoch_record(mount, 0, reads=4)
    assert (record["misses"], record["prefetched"]) == (1, 3), record
    assert mount.stats()["targets"][0]["misses"] == 1
    assert mount.stats()["prefetch"]["miss_batch_items"] == 4


def test_stats_json_and_table_list_the_targets(tmp_path, mounter):
    src = tmp_path / "src"
    relpaths = make_flat_dataset(src, 8, 10_000)
    mount = mounter(src)
    assert mount.stats()["targets"] == []  # no order: no targets
    publish(mount.mountpoint, 0, np.arange(8), targets=[0, 1] * 4)
    for relpath in relpaths:
        (mount.mountpoint / relpath).read_bytes()
    epoch_record(mount, 0, reads=8)
    targets = mount.stats()["targets"]
    assert [set(t) for t in targets] == [TARGET_KEYS, TARGET_KEYS]
    for target in targets:
        assert target["items"] == 4 and target["requests"] >= 4
        assert 0 < target["mean_latency_s"] <= target["p99_latency_s"] * 1.13
        assert target["in_flight"] == 0 and target["slots"] >= 1
        assert target["stall_s"] >= 0 and target["misses"] >= 0
    shown = run_cachefs("stats", mount.mountpoint)
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    header = format_targets(targets)[0]
    assert header in lines
    rows = lines[lines.index(header) + 1:]
    assert [row.split()[:3] for row in rows] == [["0", "order", "4"], ["1", "order", "4"]]


def test_the_kernel_keeps_a_file_by_its_distance_not_by_its_cost_scaled_rank():
    """A next-epoch file of a 4x slower target ranks as if 4x nearer (RAM keeps it longer),
    but whether the kernel's pages may be its only copy goes by how far away it really is:
    1,999 files at 12 ms a file is 24 s, past KERNEL_KEEP_S (20 s), though its rank says 15 s."""
    from cachefs.cache.ram import RamBlock, RamTier
    from cachefs.ranking import KERNEL_KEEP_S, Ranking
    from cachefs.source import SourceIdentity

    n = 1000
    manifest = Manifest.from_paths([f"f{i:04d}" for i in range(n)]).prepare()
    planner = Planner(32)
    in_order = np.arange(n)
    planner.set_order(order.Order(epoch=0, current=in_order, next=in_order, manifest=manifest,
                                  rank=None, world_size=None, total_length=n, file=None))
    ranking = Ranking(planner, RamTier(1 << 20, block_bytes=1 << 20), None, block_bytes=1 << 20)
    ranking.use_manifest(manifest)
    ranking.set_read_costs([4.0] * n)
    ranking.consumed_at(0.0)
    ranking.consumed_at(0.012)  # the readers' pace: 12 ms a file
    for item in (999, 10):
        planner.consume(item)  # next used in the next epoch, at n + item
    far = ranking.priority_of(999, 0, None)
    assert far == pytest.approx(n + 999 / 4) and (far - planner.cursor) * 0.012 < KERNEL_KEEP_S
    identity = SourceIdentity(1, 1, 1)
    assert not ranking.kernel_may_keep(999, RamBlock(b"x", identity, 999, 0))
    assert ranking.kernel_may_keep(10, RamBlock(b"x", identity, 10, 0))  # 1,010 files: 12 s
