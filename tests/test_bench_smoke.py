"""The benchmark scripts keep working: each runs in its tiny --smoke mode (real mounts, seconds).

A benchmark is never a timed test: these check exit codes, that the JSON has every figure a
reader of the report looks for, that the counts add up, and that no mount is left behind;
never how fast anything was.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachefs import workload
from cachefs.client import page_cache_bytes
from conftest import mounted_paths

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import benchlib  # noqa: E402


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)],
                          capture_output=True, text=True, timeout=240)


def assert_no_mount_under(path: Path) -> None:
    assert not [p for p in mounted_paths() if p.startswith(str(path))]


def run_smoke(tmp_path: Path, name: str, header: str, *args) -> tuple[
        subprocess.CompletedProcess, dict]:
    """`name --smoke` in tmp_path, which must succeed and print the table `header`; its
    output and its JSON."""
    out = tmp_path / "out.json"
    done = run_script(name, "--smoke", "--workdir", tmp_path / "work", "--json", out, *args)
    assert done.returncode == 0, done.stderr
    assert header in done.stdout
    return done, json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_bench_fuse_smoke(tmp_path):
    out = tmp_path / "fuse.json"
    done = run_script("bench_fuse.py", "--smoke", "--workdir", tmp_path / "work", "--json", out,
                      "--markdown", tmp_path / "fuse.md")
    assert done.returncode == 0, done.stderr
    assert ("| contender | case | direct | mount | mount/direct | mount/bare | mount/bare-keep |"
            in done.stdout)
    result = json.loads(out.read_text())
    assert result["dataset"]["files"] == 60
    assert result["ram_cache_bytes"] > result["dataset"]["total_bytes"]
    contenders = {c["contender"]: c for c in result["contenders"]}
    assert list(contenders) == ["bare", "bare-keep", "cachefs", "cachefs-order"]
    for contender in contenders.values():
        assert set(contender["cases"]) == {"files/s, 2 readers", "big file MB/s"}
        for figures in contender["cases"].values():
            assert len(figures["direct"]) == len(figures["mount"]) == 1
            assert figures["direct_median"] > 0 and figures["mount_median"] > 0
            assert figures["ratio_direct"] == pytest.approx(
                figures["mount_median"] / figures["direct_median"])
        assert contender["daemon_rss_bytes"] > 0
    # the kernel keeps the pages of a second pass only when asked to
    assert contenders["bare-keep"]["page_cache_bytes"] >= result["dataset"]["total_bytes"] // 2
    for name in ("cachefs", "cachefs-order"):
        # one timed pass: 60 small files with 2 readers, the big file once; warm, so every
        # one of them was a RAM hit, and the kernel served them whole from its page cache, but
        # for files whose pages the kernel reclaimed (these VMs reclaim page cache
        # proactively): misses, counted apart
        delta = contenders[name]["stats_delta_timed"]
        assert delta["reads"] == 60 + 1
        assert delta["hits_ram"] + delta["kernel_reclaimed"] == delta["reads"], delta
        assert delta["misses"] == delta["kernel_reclaimed"], delta
        # only a file whose pages the kernel reclaimed is read again from the source
        assert delta["backend_bytes"] == 0 or delta["kernel_reclaimed"] > 0, delta
        assert contenders[name]["kernel"]["whole_file_opens"] >= 60 + 1 - delta["misses"]
        assert contenders[name]["kernel"]["mode"] == "no-open"  # root, the patched pyfuse3
        # (in clock ticks of 10 ms, over 60 files: the two may round apart, or to 0)
        cpu = contenders[name]["small_files_cpu_ms_per_file"]
        assert set(cpu) == {"daemon_cpu_ms_per_file", "trio_cpu_ms_per_file"}
        assert min(cpu.values()) >= 0, cpu
    assert "| daemon CPU us/small file | trio thread CPU us/small file |" in done.stdout
    assert (tmp_path / "fuse.md").read_text().startswith("FUSE hot path:")
    assert_no_mount_under(tmp_path)


@pytest.mark.timeout(240)
def test_bench_smoke(tmp_path):
    out = tmp_path / "results"
    done = run_script("bench.py", "--smoke", "--workdir", tmp_path / "work", "--out", out)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "bench.json").read_text())
    files = result["dataset"]["files"]
    assert files == 40
    names = {r["contender"] for r in result["records"]}
    assert names == {"direct-1", "direct-2", "direct-4threads", "cachefs-plain@0.5",
                     "cachefs-order@0.5"}
    for name in names:
        records = [r for r in result["records"] if r["contender"] == name]
        assert sorted(r["epoch"] for r in records) == [0, 1, 2]
        for r in records:
            assert r["files"] == files
            assert r["bytes"] == result["dataset"]["total_bytes"]
            assert r["wall_s"] > 0 and r["files_per_s"] > 0 and r["mb_per_s"] > 0
            assert r["open_ms_per_file"] > 0 and r["read_ms_per_file"] > 0
            assert r["readers_cpu_ms_per_file"] >= 0  # the reader processes' own, in ticks
            # the machine's CPU, and the time the hypervisor took from it apart from it
            assert r["machine_cpu_ms_per_file"] >= 0 and r["steal_ms_per_file"] >= 0
            if name == "direct-1":  # one reader: its waits are part of its wall time
                assert (r["open_ms_per_file"] + r["read_ms_per_file"]) * files / 1e3 \
                    <= r["wall_s"]
            if name.startswith("cachefs"):
                stats = r["stats"]
                assert stats["reads"] == files
                # the daemon's CPU by thread: its trio thread, and its named threads
                by_thread = stats["daemon_cpu_by_thread_ms_per_file"]
                assert {"trio", "cachefs-store", "cachefs-read"} <= set(by_thread), by_thread
                assert min(by_thread.values()) >= 0, by_thread
                # the kernel's requests a file: the first epoch's files were looked up or
                # listed, and each read by a READ or from pages stored ahead (no READ)
                requests = stats["fuse_requests_per_file"]
                if r["epoch"] == 0:
                    assert requests.get("lookup", 0) + requests.get("readdir", 0) > 0, requests
                assert min(requests.values(), default=0) > 0 and "getxattr" not in requests
                assert (stats["hits_ram"] + stats["hits_ssd"] + stats["prefetched"]
                        + stats["misses"]) == files
                assert 0.0 <= r["hit_rate"] <= 1.0
            else:
                assert "stats" not in r
    # the first epoch of a fresh mount has nothing cached: all of it came from the source
    first = [r for r in result["records"] if r["contender"].startswith("cachefs")
             and r["epoch"] == 0]
    for r in first:
        assert r["hit_rate"] == 0.0
        assert r["stats"]["backend_bytes"] >= result["dataset"]["total_bytes"]
    assert result["capacity_bounds"]["0.5"] == pytest.approx(0.5, abs=0.01)
    assert result["page_cache_dropped"] is False
    assert "NOT dropped" in done.stdout
    table = (out / "bench.md").read_text()
    assert "| contender | round | epoch | time s |" in table and "cachefs-order@0.5" in table
    assert "| readers CPU ms/file |" in table and "| storage and rest CPU ms/file |" in table
    assert "| machine CPU ms/file | stolen ms/file |" in table
    assert "The daemon's CPU a file by thread, ms" in table and "| cachefs-store |" in table
    assert "The kernel's requests the daemon answered, a file, by kind" in table
    png = out / "bench-epochs.png"
    if benchlib.pyplot() is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "PNG skipped" in done.stdout
    assert_no_mount_under(tmp_path)


@pytest.mark.timeout(240)
def test_bench_rounds_give_each_epochs_speedup_per_round_and_their_median(tmp_path):
    """--rounds 2: every contender runs twice, direct first in round 0 and last in round 1,
    and each epoch's speedup is the same round's direct epoch over the mount's."""
    out = tmp_path / "results"
    done = run_script("bench.py", "--smoke", "--rounds", "2", "--contenders", "direct-n",
                      "cachefs-order", "--workdir", tmp_path / "work", "--out", out)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "bench.json").read_text())
    records = result["records"]
    walls = {(r["contender"], r["round"], r["epoch"]): r["wall_s"] for r in records}
    assert sorted(walls) == sorted((name, round_index, epoch)
                                   for name in ("direct-2", "cachefs-order@0.5")
                                   for round_index in (0, 1) for epoch in (0, 1, 2))
    assert [r["contender"] for r in records if r["epoch"] == 0] == [
        "direct-2", "cachefs-order@0.5", "cachefs-order@0.5", "direct-2"]
    rows = result["speedups"]
    assert [(row["contender"], row["epoch"]) for row in rows] == [
        ("cachefs-order@0.5", epoch) for epoch in (0, 1, 2)]
    for row in rows:
        epoch = row["epoch"]
        expected = [walls[("direct-2", r, epoch)] / walls[("cachefs-order@0.5", r, epoch)]
                    for r in (0, 1)]
        assert row["speedups"] == pytest.approx(expected)
        assert row["median"] == pytest.approx(sum(expected) / 2)
    assert "per round (2) and median" in done.stdout
    assert_no_mount_under(tmp_path)


@pytest.mark.timeout(240)
def test_bench_ranges_smoke(tmp_path):
    """The .npy of rows read by one memmap reader, directly and through cachefs with the order
    file written by hand: every row counted once, the bytes of both alike, the head kept."""
    out = tmp_path / "results"
    done = run_script("bench_ranges.py", "--smoke", "--workdir", tmp_path / "work",
                      "--out", out)
    assert done.returncode == 0, done.stderr
    assert "| epoch | direct s | cachefs s | speedup |" in done.stdout
    result = json.loads((out / "bench_ranges.json").read_text())
    rows = 200
    by_contender = {name: [r for r in result["records"] if r["contender"] == name]
                    for name in ("direct", "cachefs")}
    assert [r["epoch"] for r in by_contender["cachefs"]] == [0, 1, 2]
    for direct, cached in zip(by_contender["direct"], by_contender["cachefs"], strict=True):
        assert direct["digest"] == cached["digest"]  # the same rows in the same order
        stats = cached["stats"]
        assert stats["reads"] == rows
        assert stats["hits_ram"] + stats["prefetched"] + stats["misses"] == rows
    later = by_contender["cachefs"][1:]
    assert all(r["ram_hit_rate"] >= 0.2 for r in later), later  # a quarter of the rows fit
    assert by_contender["cachefs"][0]["ram_hit_rate"] == 0.0
    assert result["result"]["bytes_identical"] is True
    assert set(result["result"]) == {"speedup_by_epoch", "epoch1_speedup_ok",
                                     "later_ram_hits_ok", "bytes_identical"}
    assert_no_mount_under(tmp_path)


def test_bench_rejects_a_missing_source(tmp_path):
    done = run_script("bench.py", "--source", tmp_path / "nope", "--workdir", tmp_path)
    assert done.returncode == 2, done.stderr
    assert "is not a directory" in done.stderr


def test_dataset_is_generated_once_and_listed_in_manifest_order(tmp_path):
    spec = benchlib.DatasetSpec("mixed", 30, 5000, seed=3)
    assert benchlib.generate_dataset(tmp_path / "d", spec) is True
    assert benchlib.generate_dataset(tmp_path / "d", spec) is False  # reused
    manifest = benchlib.Manifest.scan(tmp_path / "d")
    assert len(manifest) == 30
    assert manifest.relpaths == sorted(manifest.relpaths)
    assert manifest.total_bytes == int(spec.sizes().sum())
    # another shape of the same kind replaces the files, never mixes them
    assert benchlib.generate_dataset(tmp_path / "d", benchlib.DatasetSpec("mixed", 5, 5000))
    assert len(benchlib.Manifest.scan(tmp_path / "d")) == 5


@pytest.mark.parametrize("size, every, expected_sleeps", [
    (10_000, 0, 1 + 3),  # the benchmarks': the open, then reads of 4096, 4096 and 1808 bytes
    (20_000, 6000, 1 + 4),  # the demo's, per block: the open, then runs at 0, 6000, ... 18000
])
def test_delayed_reader_sleeps_before_open_and_each_data_read(tmp_path, monkeypatch, size,
                                                              every, expected_sleeps):
    path = tmp_path / "f"
    path.write_bytes(b"x" * size)
    sleeps = []
    monkeypatch.setattr(workload.time, "sleep", sleeps.append)
    buffer = memoryview(mmap.mmap(-1, 4096))
    assert benchlib.read_whole_file(bytes(path), buffer, delay_s=0.002,
                                    delay_every_bytes=every) == size
    assert sleeps == [0.002] * expected_sleeps


def test_reader_pool_splits_an_order_between_workers(tmp_path):
    benchlib.generate_dataset(tmp_path / "d", benchlib.DatasetSpec("small", 9, 1000))
    manifest = benchlib.Manifest.scan(tmp_path / "d")
    order = np.arange(9)[::-1]
    with benchlib.ReaderPool(manifest, 3) as pool:
        for shape in ({"workers": 1}, {"workers": 3}, {"threads": 4}):
            result = pool.run(benchlib.ReadTask(bytes(tmp_path / "d"), order, **shape))
            assert (result.files, result.bytes) == (9, 9000)
        with pytest.raises(benchlib.BenchError, match="reader failed"):
            pool.run(benchlib.ReadTask(bytes(tmp_path / "gone"), order, workers=2))


def test_readers_split_an_order_as_dataloader_workers_do():
    order = np.arange(100, 110)
    by_batch = benchlib.ReadTask(b"/", order, workers=3, batch_files=2)
    assert [by_batch.share(i).tolist() for i in range(3)] == \
        [[100, 101, 106, 107], [102, 103, 108, 109], [104, 105]]
    by_file = benchlib.ReadTask(b"/", order, workers=3)
    assert [by_file.share(i).tolist() for i in range(3)] == \
        [order[i::3].tolist() for i in range(3)]
    assert benchlib.ReadTask(b"/", order[:2], workers=4).share(3).tolist() == []


def test_bench_offorder_smoke(tmp_path):
    done, result = run_smoke(tmp_path, "bench_offorder.py",
                             "| reader | seconds | / no order | of which waiting for the daemon |")
    assert set(result["seconds"]) == {"direct", "no order", "order", "no order again"}
    assert all(len(values) == 1 and values[0] > 0 for values in result["seconds"].values())
    # the waits for each daemon to go quiet are part of its mount's seconds
    assert set(result["waits"]) == {"no order", "order", "no order again"}
    assert all(0 <= result["waits"][name][0] < result["seconds"][name][0]
               for name in result["waits"])
    seconds = {name: values[0] for name, values in result["seconds"].items()}
    assert result["round_ratios"] == [seconds["order"] / seconds["no order"]]
    assert result["again_ratios"] == [seconds["no order again"] / seconds["no order"]]
    assert "order / no order, round by round: " in done.stdout
    assert "no order again / no order, round by round (the noise floor): " in done.stdout
    assert "| mount | blocks in RAM | RSS scanned MiB | order MiB |" in done.stdout
    for name in ("no order", "order", "no order again"):  # the RSS before the read: the base
        used = result["memory"][name][0]
        assert used["rss_scanned"] > 0 and used["rss_before"] > 0 and used["blocks"] > 0
    assert_no_mount_under(tmp_path)


def test_bench_lookups_smoke(tmp_path):
    """First lookups of one directory's files by several threads: direct, cachefs, bare."""
    import pyfuse3

    done, result = run_smoke(tmp_path, "bench_lookups.py", "| contender | files/s | / direct |")
    assert set(result["medians"]) == {"direct", "cachefs", "bare"}
    assert len(result["rounds"]) == 1 and all(rate > 0 for rate in result["medians"].values())
    assert result["parallel_dirops"] == bool(getattr(pyfuse3, "PARALLEL_DIROPS", False))
    assert "40 files of" in done.stdout
    assert_no_mount_under(tmp_path)


def test_bench_fetch_smoke(tmp_path):
    """The source's block reads, the read pool against Python threads and direct reads."""
    done, result = run_smoke(tmp_path, "bench_fetch.py",
                             "| contender | files/s | / direct | CPU us/file |",
                             "--cpu-load", "0.2")
    assert "0.2 cores kept busy by other processes" in done.stdout
    assert set(result["passes"]) == {"direct", "threads", "read pool"}
    for rounds in result["passes"].values():
        assert len(rounds) == 1 and rounds[0]["files_per_s"] > 0
        assert rounds[0]["cpu_us_per_file"] > 0 and rounds[0]["switches_per_file"] >= 0
    assert result["passes"]["direct"][0]["busy_slices_per_s"] == 0
    assert result["passes"]["read pool"][0]["busy_slices_per_s"] > 0


def test_bench_pickup_smoke(tmp_path):
    """The order watcher's pickup, with inotify and polling (a measurement: no bar asserted)."""
    out = tmp_path / "pickup.json"
    done = run_script("bench_pickup.py", "--smoke", "--json", out)
    assert done.returncode == 0, done.stderr
    assert "| watch | publications | median ms | max ms | bar 200 ms |" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"inotify", "polling"}
    assert all(len(values) == 3 and all(math.isfinite(value) for value in values)
               for values in result["seconds"].values())


def test_evict_files_drops_only_the_files_pages(tmp_path):
    """bench.py --drop source: the source's pages go, other files' stay."""
    source, other = tmp_path / "src", tmp_path / "other"
    for directory in (source / "a", other):
        directory.mkdir(parents=True)
    names = [b"a/x", b"a/y", b"z"]
    for name in names:
        (source / name.decode()).write_bytes(b"s" * 3 * mmap.PAGESIZE)
    (other / "keep").write_bytes(b"k" * 3 * mmap.PAGESIZE)
    for path in [*(source / n.decode() for n in names), other / "keep"]:
        path.read_bytes()  # into the page cache (tmp_path is a real file system here)
    os.sync()  # clean pages: dirty ones are written back, not dropped
    before = page_cache_bytes(bytes(source), names)
    assert benchlib.evict_files([source]) == 3
    assert before > 0 and page_cache_bytes(bytes(source), names) == 0
    assert page_cache_bytes(bytes(other), [b"keep"]) == 3 * mmap.PAGESIZE


@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="its two targets are tmpfs mounts: root")
def test_bench_targets_smoke(tmp_path):
    out = tmp_path / "targets.json"
    done = run_script("bench_targets.py", "--smoke", "--workdir", tmp_path / "work",
                      "--json", out)
    assert done.returncode == 0, done.stderr
    assert "| epoch | direct files/s (before, after) | cachefs files/s |" in done.stdout
    result = json.loads(out.read_text())
    files = result["dataset"]["files"]
    assert files == 2 * 30
    for contender in ("direct", "cachefs", "direct-after"):
        records = [r for r in result["records"] if r["contender"] == contender]
        assert [r["epoch"] for r in records] == [1, 2]
        assert all(r["files"] == files and r["bytes"] == result["dataset"]["total_bytes"]
                   for r in records)
    for record in result["records"]:
        if record["contender"] == "cachefs":
            stats = record["stats"]
            assert stats["reads"] == files
            assert stats["hits_ram"] + stats["prefetched"] + stats["misses"] == files
        assert record["machine_cpu_ms_per_file"] >= 0 and record["steal_ms_per_file"] >= 0
    assert [r["epoch"] for r in result["ratios"]] == [1, 2]
    assert all(r["ratio"] > 0 for r in result["ratios"])
    # one target per tmpfs, told apart by device, with every file of the order on one of them
    targets = result["targets"]
    assert len(targets) == 2 and {t["by"] for t in targets} == {"device"}
    assert [t["items"] for t in targets] == [30, 30]
    assert all(t["requests"] >= 30 for t in targets)
    assert_no_mount_under(tmp_path)


def test_bench_listing_smoke(tmp_path):
    """Listing directories of a busy source: cachefs beside the source and the passthrough."""
    _, result = run_smoke(tmp_path, "bench_listing.py",
                          "| contender | median s per directory | speed / direct | speed / bare |")
    assert set(result["seconds"]) == {"direct", "bare", "cachefs"}
    assert all(len(values) == len(result["dirs"]) and all(value > 0 for value in values)
               for values in result["seconds"].values())
    assert_no_mount_under(tmp_path)
