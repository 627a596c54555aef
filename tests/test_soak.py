"""The soak (scripts/soak.py; issue 15, "Integrity under load"), short, in the suite.

The long one is the script: `python scripts/soak.py --duration-s 600`. The soak's checker is
tested first, on reads it must reject, so that the soak cannot pass by checking nothing.
"""

from __future__ import annotations

import errno

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import soak  # noqa: E402

SHORT = soak.SoakConfig(duration_s=25.0, files=240, rewrite_every_s=4.0)
MIN_READS = 3000  # the short soak checks ~25k reads on a 2-core machine: far above


def versions(*datas_and_times) -> list[soak.Version]:
    return [soak.Version(data, written_s, replaced_s)
            for data, written_s, replaced_s in datas_and_times]


OLD, NEW = bytes(range(200)) * 50, bytes(range(50, 250)) * 60


def test_check_read_accepts_the_versions_a_read_may_see():
    acceptable = versions((NEW, 10.0, math.inf), (OLD, -math.inf, 10.0))
    assert soak.check_read(NEW, 0, None, acceptable, []) is None
    assert soak.check_read(OLD, 0, None, acceptable, []) is None
    assert soak.check_read(NEW[100:600], 100, 500, acceptable, []) is None
    assert soak.check_read(OLD[9000:], 9000, 4096, acceptable, []) is None  # to the end
    assert soak.check_read(b"", len(NEW) + 5, 10, acceptable, []) is None


@pytest.mark.parametrize("read, offset, length", [
    (NEW[:1234] + bytes([NEW[1234] ^ 1]) + NEW[1235:], 0, None),  # one wrong bit
    (NEW[:len(OLD)], 0, None),  # the new bytes cut at the old size: a mix
    (OLD[:5000] + NEW[5000:], 0, None),  # half old, half new
    (NEW[:-1], 0, None),  # a short read
    (NEW[100:599], 100, 500),  # a short range
    (bytes(500), 100, 500),  # zeros
])
def test_check_read_rejects_wrong_bytes(read, offset, length):
    acceptable = versions((NEW, 10.0, math.inf), (OLD, -math.inf, 10.0))
    problem = soak.check_read(read, offset, length, acceptable, [])
    assert problem is not None and problem.startswith("wrong:")


def test_cut_short_tells_a_right_but_short_read():
    acceptable = versions((NEW, 10.0, math.inf), (OLD, -math.inf, 10.0))
    assert soak.cut_short(NEW[:8117], 0, None, acceptable)
    assert soak.cut_short(OLD[100:300], 100, 500, acceptable)
    assert soak.cut_short(b"", 0, None, acceptable)
    assert not soak.cut_short(NEW, 0, None, acceptable)  # whole: not short
    assert not soak.cut_short(NEW[:1000] + b"x", 0, None, acceptable)  # wrong byte
    assert not soak.cut_short(OLD[:5000] + NEW[5000:6000], 0, None, acceptable)  # a mix


def test_a_short_read_fails_unless_the_kill_came_during_it(tmp_path):
    """A read the daemon's kill cut short (the kernel returns what it had copied when the
    dead connection is aborted) is counted with the reads that failed while down; the same
    short read begun after the kill, or ended before it, is a failure."""
    run = soak.Soak(soak.SoakConfig(files=20), tmp_path, mount_factory=None)
    run.model.create(["a"], [70_000], np.random.default_rng(2))
    short = tmp_path / "short"
    short.write_bytes(run.model.newest("a")[:56_117])
    run._read_and_check(short, "a", 0, None)  # no kill yet
    assert run.report.failure_count == 1 and run.report.errors_while_down == 0
    versions = run.model.versions

    def killed_during_the_read(relpath, started_s, ended_s, grace_s):
        run._killed_s = ended_s  # as _kill_and_remount would, while the read went on
        return versions(relpath, started_s, ended_s, grace_s)
    run.model.versions = killed_during_the_read
    run._read_and_check(short, "a", 0, None)
    assert run.report.failure_count == 1 and run.report.errors_while_down == 1
    run.model.versions = versions
    run._read_and_check(short, "a", 0, None)  # begun after the kill
    assert run.report.failure_count == 2 and run.report.errors_while_down == 1


def test_versions_past_the_grace_are_stale(tmp_path):
    model = soak.SourceModel(tmp_path / "src", tmp_path / "tmp")
    model.create(["a"], [3000], np.random.default_rng(0))
    model.rewrite("a", NEW)
    renamed_s = model._versions["a"][0].replaced_s
    # a read begun before the rename + grace may see either; after it, only the new one
    acceptable, stale = model.versions("a", renamed_s + 0.5, renamed_s + 0.6, grace_s=1.0)
    assert [len(v.data) for v in acceptable] == [len(NEW), 3000] and stale == []
    acceptable, stale = model.versions("a", renamed_s + 1.0, renamed_s + 1.1, grace_s=1.0)
    assert [len(v.data) for v in acceptable] == [len(NEW)] and len(stale) == 1
    old = stale[0].data
    assert soak.check_read(old, 0, None, acceptable, stale).startswith("stale:")
    # a read that ended before the rename began cannot have seen the new version
    first_written_s = model._versions["a"][1].written_s
    acceptable, _ = model.versions("a", first_written_s - 2, first_written_s - 1, grace_s=1.0)
    assert [v.data for v in acceptable] == [old]
    assert (tmp_path / "src" / "a").read_bytes() == NEW


def test_the_soak_reader_fails_a_corrupted_file(tmp_path):
    """The soak's own read-and-check path, on a copy of the source with one byte changed."""
    run = soak.Soak(soak.SoakConfig(files=20), tmp_path, mount_factory=None)
    relpaths = ["a/one", "a/two"]
    run.model.create(relpaths, [70_000, 100], np.random.default_rng(1))
    copy = tmp_path / "copy"
    for relpath in relpaths:
        (copy / relpath).parent.mkdir(parents=True, exist_ok=True)
        (copy / relpath).write_bytes(run.model.newest(relpath))
    run._read_and_check(copy / "a/one", "a/one", 0, None)
    run._read_and_check(copy / "a/one", "a/one", 65_000, 10_000)
    assert run.report.ok and run.report.reads_checked == 2
    data = bytearray(run.model.newest("a/one"))
    data[66_000] ^= 0x40
    (copy / "a/one").write_bytes(data)
    run._read_and_check(copy / "a/one", "a/one", 65_000, 10_000)
    run._read_and_check(copy / "a/one", "a/one", 0, None)
    run._read_and_check(copy / "a/one", "a/one", 0, 1000)  # before the bad byte: fine
    assert run.report.failure_count == 2 and run.report.reads_checked == 5
    assert all("first difference at byte 66000" in f for f in run.report.failures)


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_short_soak(tmp_path, mounter):
    run = soak.Soak(SHORT, tmp_path, lambda args: mounter(tmp_path / "src", *args))
    report = run.run()
    print("\n".join(report.lines()))
    assert report.ok, "\n".join(report.lines())
    assert report.reads_checked >= MIN_READS
    assert report.whole_reads and report.range_reads
    assert report.final_reads == SHORT.files
    assert report.order_switches >= 10 and report.manifest_switches >= 1
    assert report.rewrites >= SHORT.rewrites_while_down + 3
    assert (report.kills, report.umounts_recovered, report.remounts) == (1, 1, 1)
    assert report.ssd_entries_at_remount > 0


@pytest.mark.parametrize("new_size", [200_000, 50_000], ids=["grown", "shrunk"])
@pytest.mark.parametrize("plane", ["no-open", "keep-cache", "daemon"])
def test_a_file_rewritten_within_the_ttl_is_read_as_one_version(tmp_path, mounter, plane,
                                                                new_size):
    """The soak's torn reads, made deterministic: a file the mount holds no copy of (the RAM
    tier has room for one file, there is no SSD tier) is read, replaced in the source by a
    longer or a shorter one, and read again within --metadata-ttl. The kernel still holds the
    old size, which would cut or zero-pad the new bytes (what the mount served before this
    test): the read gets one whole version, or ESTALE, after which the next read gets the new
    version whole (errors.StaleFileError)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    old, new = (rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                for size in (100_000, new_size))
    (src / "a").write_bytes(old)
    for name in "bcd":
        (src / name).write_bytes(old[::-1])
    mount = mounter(src, "--ram-cache", 256 * 1024, "--block-size", 65536,
                    "--metadata-ttl", 30, "--data-plane", plane)
    assert (mount.mountpoint / "a").read_bytes() == old
    for name in "bcd":  # "a" leaves the RAM tier and the kernel's page cache
        (mount.mountpoint / name).read_bytes()
    (tmp_path / "new").write_bytes(new)
    (tmp_path / "new").rename(src / "a")
    try:
        got = (mount.mountpoint / "a").read_bytes()
    except OSError as exc:
        assert exc.errno == errno.ESTALE, exc
        got = soak.retry_estale((mount.mountpoint / "a").read_bytes)
        assert got == new
    if got not in (old, new):
        pytest.fail(f"{len(got)} bytes, equal to the new version's first {len(got)}: "
                    f"{new.startswith(got[:len(new)])}")
