"""The SSD tier through real mounts: cache-once hit rate, persistence, staleness, corruption,
crashes, a full disk, and `cachefs warm`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cachefs.cache.ram import page_bytes
from cachefs.cache.ssd_format import disk_bytes
from conftest import (cachefs_cmd, epoch_record, flat_dataset_fixture, read_epoch, run_cachefs,
                      run_in_terminal, sha256, write_file)

N_FILES = 200
FILE_BYTES = 20_000
DATA_BYTES = N_FILES * FILE_BYTES
SSD_BYTES = DATA_BYTES // 2
SSD_FILES = SSD_BYTES // disk_bytes(FILE_BYTES)  # each file charged what it takes on disk
RAM_BYTES = 64 * 1024  # a few files: the window only, so the SSD tier's share is what shows
# the files the two tiers hold: whole files, RAM's charged as whole pages when the kernel's
# page cache holds them (cachefs.cache.ram.page_bytes)
BOUND_FILES = SSD_FILES + RAM_BYTES // page_bytes(FILE_BYTES)


dataset = flat_dataset_fixture(N_FILES, FILE_BYTES, vary=False)


def ssd_args(ssd_dir: Path, *extra) -> list:
    return ["--ssd-cache", ssd_dir, "--ssd-size", SSD_BYTES, "--ram-cache", RAM_BYTES,
            "--source-threads", 4, *extra]


def wait_ssd_full(mount, timeout_s=20.0) -> dict:
    """Admission runs behind the readers: wait until epoch 1's blocks are on the SSD."""
    deadline = time.monotonic() + timeout_s
    while True:
        ssd = mount.stats()["ssd"]
        if ssd["bytes"] + disk_bytes(FILE_BYTES) > SSD_BYTES or time.monotonic() > deadline:
            return ssd
        time.sleep(0.05)


def test_cache_once_hits_the_capacity_bound_and_survives_restart(dataset, mounter, tmp_path):
    src, relpaths = dataset
    ssd_dir = tmp_path / "ssd"
    # The bound, with a RAM tier of three files, on the default data plane (the zero-request
    # mode as root). A file is consumed at its close there, reported milliseconds after its
    # last READ: its blocks held their near rank until then, and the demand reads of a
    # reader that outruns the read-ahead gave up the next epoch's head for them (0 RAM hits
    # of the bound's 3); now they take their consumed rank at that READ (Ranking.read_whole)
    mount = mounter(src, *ssd_args(ssd_dir))
    first = read_epoch(mount, relpaths, 0)
    assert mount.stats()["kernel"]["mode"] == "no-open"  # root, the patched pyfuse3
    assert first["misses"] + first["prefetched"] == N_FILES and first["hits_ssd"] == 0
    ssd = wait_ssd_full(mount)
    assert ssd["entries"] == SSD_FILES
    for epoch in (1, 2, 3):
        record = read_epoch(mount, relpaths, epoch)
        # (a file of the RAM tier's share the kernel held alone and reclaimed is read again:
        # kernel_reclaimed, man/cachefs-stats.1; these VMs reclaim page cache early)
        assert (record["hits_ssd"] + record["hits_ram"] + record["kernel_reclaimed"]
                >= BOUND_FILES - 2), record  # 1%
        assert record["refetched_blocks"] == 0
        # the source is read only for what neither tier holds
        assert record["backend_bytes"] <= DATA_BYTES - SSD_FILES * FILE_BYTES
    assert mount.stats()["ssd"]["entries"] == SSD_FILES  # never churned
    mount.stop()

    again = mounter(src, *ssd_args(ssd_dir))
    record = read_epoch(again, relpaths, 7)
    assert record["hits_ssd"] / N_FILES >= SSD_FILES / N_FILES - 0.01
    assert again.stats()["ssd"]["rejected_checksum"] == 0


def test_no_block_is_read_twice_an_epoch_with_the_kernel_data_plane(dataset, mounter, tmp_path):
    """The zero-request mode consumes a file at its close, reported a few milliseconds after
    the reader's last READ: in between, the read-ahead read again a file whose demand read
    found no room in a RAM tier of three files (5-16 blocks an epoch here). Now it leaves a
    file a reader read whole (Prefetcher.read_whole), and the source is read only for what
    neither tier holds."""
    src, relpaths = dataset
    mount = mounter(src, *ssd_args(tmp_path / "ssd"))
    read_epoch(mount, relpaths, 0)
    wait_ssd_full(mount)
    assert mount.stats()["kernel"]["mode"] == "no-open"  # root, the patched pyfuse3
    for epoch in (1, 2):
        record = read_epoch(mount, relpaths, epoch)
        assert record["refetched_blocks"] == 0, record
        assert record["backend_bytes"] <= DATA_BYTES - SSD_FILES * FILE_BYTES, record


def test_changed_source_files_are_served_new_and_dropped(dataset, mounter, tmp_path):
    src, relpaths = dataset
    mount = mounter(src, *ssd_args(tmp_path / "ssd", "--metadata-ttl", 0))
    read_epoch(mount, relpaths, 0)
    entries = wait_ssd_full(mount)["entries"]
    for i, relpath in enumerate(relpaths):  # same sizes, new bytes, new mtimes
        write_file(src / relpath, FILE_BYTES, seed=10_000 + i)
    read_epoch(mount, relpaths, 1)  # compares every file with the source's new bytes
    assert mount.stats()["ssd"]["dropped_stale"] == entries


def test_corrupt_entry_is_detected_and_read_from_source(dataset, mounter, tmp_path):
    src, relpaths = dataset
    ssd_dir = tmp_path / "ssd"
    mount = mounter(src, *ssd_args(ssd_dir))
    read_epoch(mount, relpaths, 0)
    wait_ssd_full(mount)
    mount.stop()
    entries = sorted(p for p in (ssd_dir / "entries").rglob("*") if p.is_file())
    victim = entries[len(entries) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one bit flip in the payload
    victim.write_bytes(bytes(data))
    again = mounter(src, *ssd_args(ssd_dir))
    read_epoch(again, relpaths, 1)  # every file byte-identical to the source
    assert again.stats()["ssd"]["rejected_checksum"] == 1


def test_kill_9_mid_fill_then_remount_serves_identical_bytes(dataset, mounter, tmp_path):
    src, relpaths = dataset
    ssd_dir = tmp_path / "ssd"
    mount = mounter(src, *ssd_args(ssd_dir))
    for relpath in relpaths[: N_FILES // 3]:
        (mount.mountpoint / relpath).read_bytes()
    mount.process.kill()
    mount.process.wait()
    assert run_cachefs("umount", mount.mountpoint).returncode == 0
    again = mounter(src, *ssd_args(ssd_dir))
    for relpath in relpaths:
        assert sha256(again.mountpoint / relpath) == sha256(src / relpath)
    assert again.stats()["ssd"]["rejected_checksum"] == 0


def test_full_ssd_disk_stops_admission_and_reads_go_on(dataset, mounter, tmp_path):
    src, relpaths = dataset
    ssd_dir = tmp_path / "tiny"
    ssd_dir.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(ssd_dir)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        mount = mounter(src, "--ssd-cache", ssd_dir, "--ssd-size", DATA_BYTES,
                        "--ram-cache", RAM_BYTES)
        read_epoch(mount, relpaths, 0)
        deadline = time.monotonic() + 10
        while mount.stats()["ssd"]["admission_disabled"] is None:
            assert time.monotonic() < deadline, mount.stats()["ssd"]
            time.sleep(0.05)
        read_epoch(mount, relpaths, 1)
        assert mount.process.poll() is None
        assert mount.log().count("admission") >= 1
        mount.stop()
    finally:
        subprocess.run(["umount", "-l", str(ssd_dir)])


def test_a_full_ssd_disk_at_start_mounts_without_the_tier(dataset, mounter, tmp_path):
    """A device full (or read-only, or failing) before the tier's first write: the mount
    comes up without it, says why in its log and `cachefs stats`, and serves the source; it
    failed with exit status 7, and a trainer read an empty mount point."""
    src, relpaths = dataset
    ssd_dir = tmp_path / "full"
    ssd_dir.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs",
                       str(ssd_dir)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        filler = os.open(ssd_dir / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(filler, b"\0" * 4096)
        finally:
            os.close(filler)
        mount = mounter(src, "--ssd-cache", ssd_dir, "--ssd-size", DATA_BYTES,
                        "--ram-cache", RAM_BYTES)
        ssd = mount.stats()["ssd"]
        assert ssd["entries"] == 0 and "ENOSPC" in ssd["admission_disabled"], ssd
        assert "goes on without its SSD tier" in mount.log()
        for relpath in relpaths[:20]:
            assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
        done = run_cachefs("stats", mount.mountpoint)
        assert done.returncode == 0 and "ssd: 0.0" in done.stdout, done.stdout
        mount.stop()
    finally:
        subprocess.run(["umount", "-l", str(ssd_dir)])


def test_warm_fills_the_tier_in_order_and_resumes(dataset, mounter, tmp_path):
    src, relpaths = dataset
    mount = mounter(src, *ssd_args(tmp_path / "ssd"))
    from cachefs import order
    from cachefs.publish import publish

    current = order.permutation(N_FILES, 3, 0)
    publish(mount.mountpoint, 0, current, next=order.permutation(N_FILES, 3, 1))
    done = run_cachefs("warm", mount.mountpoint, "--order")
    assert done.returncode == 0, done.stderr
    assert "the SSD tier is full" in done.stdout
    assert mount.stats()["ssd"]["bytes"] == SSD_FILES * disk_bytes(FILE_BYTES)
    assert mount.stats()["order"]["consumed"] == 0  # warming is not reading
    record = read_epoch(mount, relpaths, 0, seed=3, publish=False)
    # the order's first half came from the SSD tier, in order
    assert record["hits_ssd"] >= SSD_FILES - 1
    again = run_cachefs("warm", mount.mountpoint, "--order")
    assert again.returncode == 0 and "0.0 MB written" in again.stdout


def test_warm_of_an_order_of_byte_ranges_warms_their_files(dataset, mounter, tmp_path):
    # its entries are items, several to a file: once taken for file numbers, they named
    # files out of the order's list (a failed warm) or other files
    src, relpaths = dataset
    mount = mounter(src, *ssd_args(tmp_path / "ssd"))
    from cachefs import order
    from cachefs.order_items import ItemArrays
    from cachefs.publish import publish

    files = relpaths[:2]  # 4 items in each, 5,000 bytes apart
    items = ItemArrays(np.repeat(np.arange(2), 4), np.tile(np.arange(4) * 5000, 2),
                       np.full(8, 5000))
    publish(mount.mountpoint, 0, order.permutation(8, 1, 0), items=items, files=files)
    done = run_cachefs("warm", mount.mountpoint, "--order")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warm done; 2/2 files" in done.stdout
    assert mount.stats()["ssd"]["entries"] == 2


def test_warm_from_a_list_and_refusals(dataset, mounter, tmp_path):
    src, relpaths = dataset
    plain = mounter(src)
    done = run_cachefs("warm", plain.mountpoint)
    assert done.returncode == 1 and "no SSD tier" in done.stderr
    mount = mounter(src, *ssd_args(tmp_path / "ssd"))
    listing = tmp_path / "some.txt"
    listing.write_text("\n".join(relpaths[:10]) + "\n")
    done = run_cachefs("warm", mount.mountpoint, "--files", listing)
    assert done.returncode == 0, done.stderr
    assert "warm done; 10/10 files" in done.stdout
    assert done.stderr == ""  # no progress bar off a terminal, unless asked for
    assert mount.stats()["ssd"]["entries"] == 10
    done = run_cachefs("warm", mount.mountpoint, "--files", listing, "--progress")
    assert done.returncode == 0, done.stderr
    # rich's bar, drawn once at the end off a terminal: files done of the total, MB written
    assert "warm" in done.stderr and "10/10 files, 0.0 MB written" in done.stderr
    code, text = run_in_terminal(cachefs_cmd("warm", mount.mountpoint, "--files", listing))
    assert code == 0 and "warm done; 10/10 files" in text, text
    assert "\x1b[2K" in text and "10/10 files, 0.0 MB written" in text  # drawn in place
    listing.write_text("../outside\n")
    done = run_cachefs("warm", mount.mountpoint, "--files", listing)
    assert done.returncode == 1 and "'..'" in done.stdout + done.stderr
    assert os.listdir(tmp_path / "ssd")  # the tier is still there and usable
    assert epoch_record(mount, None)["reads"] == 0


def test_a_warm_list_larger_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    from cachefs import warm

    monkeypatch.setattr(warm, "LIST_MAX_BYTES", 20)
    listing = tmp_path / "list.txt"
    listing.write_text("a/b\nc/d\n")
    assert warm._read_list(listing) == [b"a/b", b"c/d"]
    listing.write_text("./a//b\n")  # as `find .` writes them: the mount's spelling
    assert warm._read_list(listing) == [b"a/b"]
    listing.write_text("a/b\nc/d\n" * 3)
    with pytest.raises(warm.WarmError, match="is larger than 20 bytes"):
        warm._read_list(listing)
