"""The order-driven RAM tier through real mounts: bytes, epochs, budgets, stats."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from cachefs import order
from cachefs.publish import publish
from conftest import (epoch_record, flat_dataset_fixture, make_flat_dataset, read_epoch, wait_for,
                      write_file)

N_FILES = 240
FILE_BYTES = 30_000


dataset = flat_dataset_fixture(N_FILES, FILE_BYTES, vary=False)


def read_in_order_with_workers(mount, relpaths, current, workers: int) -> None:
    """A DataLoader's access pattern: worker w reads positions w, w+workers, ... in order."""
    failures = []

    def work(worker: int):
        for index in current[worker::workers]:
            relpath = relpaths[index]
            if (mount.mountpoint / relpath).read_bytes() != (mount.source / relpath).read_bytes():
                failures.append(relpath)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_epochs_with_concurrent_readers(dataset, mounter):
    src, relpaths = dataset
    data_bytes = N_FILES * FILE_BYTES
    ram_bytes = data_bytes // 4
    mount = mounter(src, "--ram-cache", ram_bytes, "--source-delay-ms", 1)
    records = []
    for epoch in range(4):
        current = order.permutation(N_FILES, 0, epoch)
        publish(mount.mountpoint, epoch, current,
                next=order.permutation(N_FILES, 0, epoch + 1))
        read_in_order_with_workers(mount, relpaths, current, workers=4)
        record = epoch_record(mount, epoch, reads=N_FILES)
        records.append(record)
        assert record["reads"] == N_FILES
        assert (record["hits_ram"] + record["hits_ssd"] + record["prefetched"]
                + record["misses"]) == N_FILES
        assert record["refetched_blocks"] == 0, record
        if epoch == 0:
            # readers served from pages stored ahead (their files made known by a listing, no
            # lookup each) can outrun a window of a few files here: about half are read ahead
            assert record["hits_ram"] == 0 and record["prefetched"] > N_FILES // 4, record
        else:
            # the retained head of the epoch; the window takes a few slots of the budget (and
            # the kernel may reclaim head files it held alone: kernel_reclaimed)
            assert (record["hits_ram"] + record["kernel_reclaimed"]
                    >= 0.6 * ram_bytes / FILE_BYTES), record
    # An epoch reads from the source the files it did not hit in RAM, and may read some of the
    # next epoch's before the switch (the window reaches into the next order): those wait in
    # RAM beside the next epoch's retained head, so there are at most as many as the budget
    # holds files beyond the files the next epoch then hits.
    ram_files = ram_bytes // FILE_BYTES
    for record, following in zip(records[1:-1], records[2:], strict=True):
        early_files = ram_files - following["hits_ram"]
        most_files = N_FILES - record["hits_ram"] + early_files
        assert record["backend_bytes"] <= most_files * FILE_BYTES, (record, following)
    stats = mount.stats()
    assert stats["ram"]["budget"] == ram_bytes
    assert stats["ram"]["bytes"] <= ram_bytes


def test_a_ram_budget_of_a_few_blocks_still_works(tmp_path, mounter):
    src = tmp_path / "src"
    relpaths = make_flat_dataset(src, 40, 100_000)  # two to three 64 KiB blocks each
    mount = mounter(src, "--block-size", "64K", "--ram-cache", "192K")
    for epoch in range(2):
        record = read_epoch(mount, relpaths, epoch)
        assert record["reads"] == 40
    assert mount.stats()["ram"]["bytes"] <= 192 * 1024


def test_files_outside_the_order_do_not_move_the_cursor(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    subset = relpaths[: N_FILES // 2]
    publish(mount.mountpoint, 0, np.arange(len(subset)), files=subset)
    outside = relpaths[-1]
    assert (mount.mountpoint / outside).read_bytes() == (src / outside).read_bytes()
    for relpath in subset[:3]:
        (mount.mountpoint / relpath).read_bytes()
    # counted once the kernel reports the closes (RELEASE, or a fanotify event)
    assert epoch_record(mount, 0, reads=4)["reads"] == 4
    status = mount.stats()["order"]
    assert (status["consumed"], status["cursor"]) == (3, 3)


def test_large_file_streams_with_sequential_read_ahead(tmp_path, mounter):
    src = tmp_path / "src"
    size = 24 * 1024 * 1024 + 777
    write_file(src / "shard.bin", size, seed=5)
    mount = mounter(src, "--block-size", "1M", "--ram-cache", "16M", "--source-delay-ms", 1)
    with open(mount.mountpoint / "shard.bin", "rb") as f:
        data = f.read()
    assert data == (src / "shard.bin").read_bytes()
    record = epoch_record(mount, None, reads=1)
    assert record["backend_bytes"] == size  # every block read once, ahead of the reader
    assert record["refetched_blocks"] == 0
    assert mount.stats()["ram"]["bytes"] <= 16 * 1024 * 1024


def test_stats_json_has_the_documented_keys(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    read_epoch(mount, relpaths, 0)
    stats = mount.stats()
    record = stats["epochs"][-1]
    for key in ("epoch", "reads", "hits_ram", "hits_ssd", "misses", "prefetched",
                "backend_bytes", "stall_s"):
        assert key in record
    for key in ("bytes", "budget", "blocks"):
        assert key in stats["ram"]
    assert stats["ssd"] is None
    assert set(stats) >= {"order", "last_rejection", "manifest", "epochs", "ram", "mount"}


def test_files_read_ahead_are_looked_up_and_read_without_asking_the_source_again(
        dataset, mounter):
    """The read-ahead's own fstat answers the lookup of the file (the one the daemon asks of
    the kernel to store its pages, pagecache.py `look_up`, or else the reader's): a file read
    ahead costs the source one request in all, not a second one (a round trip per file on
    network storage). The listing `look_up` makes of each directory costs one listing of the
    directory in all."""
    src, relpaths = dataset
    # RAM and the window hold the whole data set, so everything is read ahead before the first
    # lookup; a long metadata TTL keeps those stats fresh however slow the machine is
    mount = mounter(src, "--ram-cache", 2 * N_FILES * FILE_BYTES, "--lookahead", N_FILES,
                    "--metadata-ttl", 600)
    before = mount.stats()["source"]
    current = order.permutation(N_FILES, 0, 0)
    publish(mount.mountpoint, 0, current)
    deadline = time.monotonic() + 60
    while mount.stats()["source"]["requests"]["block_read"] < N_FILES:
        assert time.monotonic() < deadline, mount.stats()["source"]
        time.sleep(0.02)
    for index in current:
        relpath = relpaths[index]
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
    record = epoch_record(mount, 0, reads=N_FILES)
    after = mount.stats()["source"]
    directories = {str(Path(relpath).parent) for relpath in relpaths}
    # each file read once; only the class directories, which nothing read ahead, were stat'ed
    # for their lookups, and each listed once
    assert after["requests"] == dict(before["requests"],
                                     block_read=before["requests"]["block_read"] + N_FILES,
                                     lstat=before["requests"]["lstat"] + len(directories),
                                     listdir=before["requests"]["listdir"] + len(directories))
    # (a file the listing made known is looked up by no one; the others' lookups were answered
    # from the read's fstat: no lstat of a file above)
    assert record["misses"] == 0 and record["stall_s"] == 0


def test_files_listed_then_read_off_the_order_are_counted_as_their_items(dataset, mounter):
    """A reader that lists the data set (READDIRPLUS: the kernel gets every inode at once),
    then reads it in directory order (not the published order), consumes each file as its own
    item: every file counted once, and the epoch completes, so the next order comes into
    force. A file new since the manifest, listed first in its directory and never read, is no
    item: had it shifted its neighbours' items, one of the order's would stay unconsumed."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", 2 * N_FILES * FILE_BYTES)
    publish(mount.mountpoint, 0, order.permutation(N_FILES, 0, 0),
            next=order.permutation(N_FILES, 0, 1))
    write_file(src / "class3" / "new_first.bin", 100, seed=1)  # sorts before "sample_*"
    listed = sorted(str(path.relative_to(mount.mountpoint))
                    for path in mount.mountpoint.rglob("*") if path.is_file())
    assert listed == sorted(relpaths + ["class3/new_first.bin"])
    for relpath in relpaths:
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
    record = epoch_record(mount, 0, reads=N_FILES)
    assert record["reads"] == N_FILES
    wait_for(lambda: mount.stats()["order"]["epoch"] == 1)
