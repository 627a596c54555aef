"""Tests of the SSD cache-once tier (cachefs/cache/ssd.py), without FUSE.

What a user of the tier sees: what `contains` and `read` answer, the bytes `read` returns,
`stats()`, the files left in the cache directory, the warnings logged, the errors raised.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cachefs.cache import ssd as ssd_module
from cachefs.cache.append_log import AppendLog
from cachefs.cache.ssd import SsdTier
from cachefs.cache.ssd_format import ENTRY_HEADER_BYTES, disk_bytes
from cachefs.errors import EXIT_CACHE_DIR, StartupError
from cachefs.source import SourceIdentity

BLOCK = 4096
E = disk_bytes(1000)  # what a test entry of `payload`'s default length takes of a budget


def ident(n: int, version: int = 0) -> SourceIdentity:
    return SourceIdentity(size=1000 + n, mtime_ns=1_700_000_000_000_000_000 + version, ino=n + 1)


def payload(n: int, length: int = 1000) -> bytes:
    return random.Random(n).randbytes(length)


def key(n: int, block: int = 0) -> tuple[bytes, int]:
    return (f"train/class{n % 7}/img{n:06d}.jpg".encode(), block)


def entry_files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / "entries").rglob("*") if p.is_file())


def crash(tier: SsdTier) -> None:
    """What kill -9 leaves: the index log as appended so far, meta unclean, lock released."""
    tier._release_fds()


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "ssd"


def fill(tier: SsdTier, count: int, length: int = 1000) -> None:
    for n in range(count):
        assert tier.admit(key(n), ident(n), payload(n, length))


# ----------------------------------------------------------------- cache-once policy

def test_cache_once_fills_budget_then_admits_and_replaces_nothing(cache_dir):
    with SsdTier(cache_dir, budget_bytes=10 * E, block_bytes=BLOCK) as tier:
        admitted = [tier.admit(key(n), ident(n), payload(n)) for n in range(25)]
        assert admitted == [True] * 10 + [False] * 15
        assert not tier.has_room(1)
        # Nothing was replaced: the first ten are the ones held, byte for byte.
        for n in range(10):
            assert tier.read(key(n), ident(n)) == payload(n)
        for n in range(10, 25):
            assert not tier.contains(key(n), ident(n))
            assert tier.read(key(n), ident(n)) is None
        # Admitting a resident block again is a no-op.
        assert not tier.admit(key(3), ident(3), payload(3))
        stats = tier.stats()
        assert (stats["bytes"], stats["entries"], stats["budget"]) == (10 * E, 10, 10 * E)
        assert len(entry_files(cache_dir)) == 10


def test_hit_rate_of_random_epochs_equals_cached_fraction(cache_dir):
    items, cached = 60, 24
    hits_per_epoch = []
    rng = random.Random(4)
    with SsdTier(cache_dir, budget_bytes=cached * E, block_bytes=BLOCK) as tier:
        for _epoch in range(4):
            order = list(range(items))
            rng.shuffle(order)
            hits = 0
            for n in order:
                data = tier.read(key(n), ident(n))
                if data is None:
                    tier.admit(key(n), ident(n), payload(n))  # a miss read from the source
                else:
                    assert data == payload(n)
                    hits += 1
            hits_per_epoch.append(hits)
    assert hits_per_epoch == [0, cached, cached, cached]  # cached/total = 24/60 exactly


def test_dropping_frees_budget_for_new_admissions(cache_dir):
    with SsdTier(cache_dir, budget_bytes=3 * E, block_bytes=BLOCK) as tier:
        fill(tier, 3)
        assert not tier.admit(key(9), ident(9), payload(9))
        assert tier.drop_file(key(1)[0]) == 1
        assert tier.has_room(1000)
        assert tier.admit(key(9), ident(9), payload(9))
        assert tier.stats()["bytes"] == 3 * E


def test_drop_file_drops_every_block_of_that_file_only(cache_dir):
    with SsdTier(cache_dir, budget_bytes=100_000, block_bytes=BLOCK) as tier:
        for block in range(5):
            assert tier.admit((b"shard-0.tar", block), ident(0), payload(block, BLOCK))
        assert tier.admit((b"shard-1.tar", 0), ident(1), payload(7, BLOCK))
        assert tier.drop_file(b"shard-0.tar") == 5
        assert tier.drop_file(b"shard-0.tar") == 0
        assert not any(tier.contains((b"shard-0.tar", b), ident(0)) for b in range(5))
        assert tier.read((b"shard-1.tar", 0), ident(1)) == payload(7, BLOCK)
        assert tier.stats()["entries"] == 1
        assert len(entry_files(cache_dir)) == 1


# ----------------------------------------------------------------- persistence and recovery

def test_reopen_is_warm_with_identical_bytes(cache_dir):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 20)
        for block in range(3):  # a file of several blocks, the last one short
            tier.admit((b"big.npy", block), ident(99), payload(block, BLOCK if block < 2 else 10))
        before = tier.stats()
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert tier.stats() == before
        for n in range(20):
            assert tier.contains(key(n), ident(n))
            assert tier.read(key(n), ident(n)) == payload(n)
        assert tier.read((b"big.npy", 2), ident(99)) == payload(2, 10)
        assert tier.stats()["rejected_checksum"] == 0


def test_missing_index_is_rebuilt_from_entries(cache_dir):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 30)
    (cache_dir / "index").unlink()
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert tier.stats()["entries"] == 30
        assert all(tier.read(key(n), ident(n)) == payload(n) for n in range(30))
    assert (cache_dir / "index").stat().st_size > 30 * 72


@pytest.mark.parametrize("damage", ["garbage", "flip_in_base", "truncated"])
def test_damaged_index_is_rebuilt_from_entries(cache_dir, caplog, damage):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 30)
    index = cache_dir / "index"
    raw = bytearray(index.read_bytes())
    if damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    elif damage == "flip_in_base":
        raw[64 + 72 * 10 + 20] ^= 0x10
    else:
        raw = raw[:64 + 72 * 10 + 5]
    index.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
            assert tier.stats()["entries"] == 30
            assert all(tier.read(key(n), ident(n)) == payload(n) for n in range(30))
    assert "index damaged" in caplog.text


def test_crash_reconciles_lagging_index_and_removes_tmp(cache_dir):
    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    fill(tier, 10)
    tier.close()  # ten entries in the compacted base
    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    for n in range(10, 20):
        assert tier.admit(key(n), ident(n), payload(n))
    assert tier.drop_file(key(2)[0]) == 1
    crash(tier)
    # The index lags the files: lose the appended tail, as if those appends never happened,
    # and leave a half-written entry behind.
    index = cache_dir / "index"
    with open(index, "r+b") as f:
        f.truncate(64 + 72 * 10)
    stray = cache_dir / "entries" / "ab" / ("ab" + "0" * 30 + ".1234abcd.tmp")
    stray.write_bytes(b"half an entry")
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert not stray.exists()
        present = {n for n in range(20) if tier.contains(key(n), ident(n))}
        assert present == set(range(20)) - {2}  # adopted from files; the drop is kept
        assert all(tier.read(key(n), ident(n)) == payload(n) for n in present)
        assert tier.stats()["entries"] == 19
        assert tier.stats()["bytes"] == 19 * E
    assert not list((cache_dir / "entries").rglob("*.tmp"))


def test_crash_after_drops_replays_tombstones(cache_dir):
    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    fill(tier, 6)
    assert tier.read(key(4), ident(4, version=1)) is None  # stale: dropped
    tier.drop_file(key(5)[0])
    crash(tier)
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert [tier.contains(key(n), ident(n)) for n in range(6)] == [True] * 4 + [False] * 2
        assert tier.stats()["bytes"] == 4 * E


def test_kill_9_mid_fill_never_serves_bad_bytes(cache_dir):
    """A real kill -9 of a process filling the tier; then every entry must verify."""
    child = textwrap.dedent(f"""
        import random, sys
        from pathlib import Path
        from cachefs.cache.ssd import SsdTier
        from cachefs.source import SourceIdentity
        tier = SsdTier(Path({str(cache_dir)!r}), 1 << 30, 1 << 20)
        for n in range(100_000):
            data = random.Random(n).randbytes(50_000 + n % 7)
            tier.admit((b"f%d" % n, 0), SourceIdentity(len(data), n, n), data)
            if n == 50:
                print("filling", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                            cwd=Path(__file__).parent.parent)
    try:
        assert proc.stdout.readline() == b"filling\n"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with SsdTier(cache_dir, budget_bytes=1 << 30, block_bytes=1 << 20) as tier:
        entries = tier.stats()["entries"]
        assert entries > 50
        served = 0
        for n in range(entries + 100):
            data = random.Random(n).randbytes(50_000 + n % 7)
            got = tier.read((b"f%d" % n, 0), SourceIdentity(len(data), n, n))
            if got is not None:
                assert got == data
                served += 1
        assert served == entries
        assert tier.stats()["rejected_checksum"] == 0
    assert not list((cache_dir / "entries").rglob("*.tmp"))


# ----------------------------------------------------------------- staleness and corruption

def test_stale_identity_is_dropped_counted_and_replaceable(cache_dir):
    with SsdTier(cache_dir, budget_bytes=3 * E, block_bytes=BLOCK) as tier:
        fill(tier, 3)
        changed = ident(1, version=1)
        assert not tier.contains(key(1), changed)
        assert tier.read(key(1), changed) is None
        assert tier.stats()["dropped_stale"] == 1
        assert not tier.contains(key(1), ident(1))  # the old entry is gone, not just hidden
        assert tier.stats()["bytes"] == 2 * E
        assert tier.admit(key(1), changed, payload(101))
        assert tier.read(key(1), changed) == payload(101)
        # Admitting under a new identity replaces the stale entry even with the budget full.
        assert tier.admit(key(2), ident(2, version=5), payload(102))
        assert tier.read(key(2), ident(2, version=5)) == payload(102)
        assert tier.stats()["dropped_stale"] == 2
        assert len(entry_files(cache_dir)) == 3


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "payload_bit_flip":
        raw[ENTRY_HEADER_BYTES + 500] ^= 0x01
    elif how == "truncated":
        raw = raw[:ENTRY_HEADER_BYTES + 300]
    elif how == "header_bit_flip":
        raw[40] ^= 0x80  # inside the identity fields
    elif how == "header_only":
        raw = raw[:ENTRY_HEADER_BYTES - 1]
    elif how == "extended":
        raw += b"\0" * 10
    elif how == "zeros":  # what a power loss may leave behind a durable rename
        raw = bytearray(len(raw))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["payload_bit_flip", "truncated", "header_bit_flip",
                                 "header_only", "extended", "zeros"])
def test_damaged_entry_is_never_served(cache_dir, how):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert tier.admit(key(0), ident(0), payload(0))
        _damage(entry_files(cache_dir)[0], how)
        assert tier.read(key(0), ident(0)) is None
        assert tier.stats()["rejected_checksum"] == 1
        assert not tier.contains(key(0), ident(0))
        assert (tier.stats()["bytes"], tier.stats()["entries"]) == (0, 0)
        assert entry_files(cache_dir) == []
        assert tier.admit(key(0), ident(0), payload(0))  # the source bytes, again
        assert tier.read(key(0), ident(0)) == payload(0)


def test_damaged_entry_adopted_after_crash_is_rejected(cache_dir):
    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    fill(tier, 3)
    crash(tier)
    (cache_dir / "index").unlink()
    for path in entry_files(cache_dir):
        _damage(path, "payload_bit_flip")  # the header still verifies: adopted at rebuild
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert [tier.read(key(n), ident(n)) for n in range(3)] == [None] * 3
        assert tier.stats()["rejected_checksum"] == 3


def test_read_error_is_a_counted_miss(cache_dir, monkeypatch):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 2)
        real_pread = os.pread

        def failing_pread(fd, size, offset):
            if offset == ENTRY_HEADER_BYTES:
                raise OSError(errno.EIO, "Input/output error")
            return real_pread(fd, size, offset)

        monkeypatch.setattr(ssd_module.os, "pread", failing_pread)
        assert tier.read(key(0), ident(0)) is None
        monkeypatch.undo()
        assert tier.stats()["rejected_checksum"] == 1
        assert tier.read(key(1), ident(1)) == payload(1)


# ----------------------------------------------------------------- directory handling

def test_second_tier_on_same_directory_is_refused(cache_dir):
    first = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    try:
        with pytest.raises(StartupError) as raised:
            SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
        assert raised.value.exit_code == EXIT_CACHE_DIR
        assert str(raised.value) == (f"cache directory {cache_dir} is in use by another "
                                     f"cachefs mount")
    finally:
        first.close()
    first.close()  # idempotent
    SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK).close()


def test_unusable_directory_is_a_startup_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StartupError) as raised:
        SsdTier(blocker / "ssd", budget_bytes=1 << 20, block_bytes=BLOCK)
    assert raised.value.exit_code == EXIT_CACHE_DIR
    assert str(blocker / "ssd") in str(raised.value)


def test_block_size_change_wipes_entries(cache_dir, caplog):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 5)
    (cache_dir / "mine.txt").write_text("the user's own file")
    with caplog.at_level(logging.WARNING):
        with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=2 * BLOCK) as tier:
            assert tier.stats()["entries"] == 0
            assert not tier.contains(key(0), ident(0))
            assert tier.read(key(0), ident(0)) is None
    assert "discarding the cached entries" in caplog.text
    assert entry_files(cache_dir) == []
    assert (cache_dir / "mine.txt").exists()


def test_smaller_budget_on_reopen_trims_to_fit(cache_dir):
    with SsdTier(cache_dir, budget_bytes=10 * E, block_bytes=BLOCK) as tier:
        fill(tier, 10)
    with SsdTier(cache_dir, budget_bytes=4 * E + E // 2, block_bytes=BLOCK) as tier:
        stats = tier.stats()
        assert (stats["entries"], stats["bytes"]) == (4, 4 * E)
        assert len(entry_files(cache_dir)) == 4


# ----------------------------------------------------------------- write errors

def test_write_error_stops_admission_once_and_reads_go_on(cache_dir, caplog, monkeypatch):
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 3)

        def disk_full(fd, buffers):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ssd_module.os, "writev", disk_full)
        with caplog.at_level(logging.WARNING, logger="cachefs.cache.ssd"):
            assert not tier.admit(key(10), ident(10), payload(10))
            monkeypatch.undo()  # the disk has room again: admission stays off for this mount
            assert not tier.admit(key(11), ident(11), payload(11))
            assert not tier.has_room(1)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert "ENOSPC" in tier.stats()["admission_disabled"]
        assert all(tier.read(key(n), ident(n)) == payload(n) for n in range(3))
        assert not list((cache_dir / "entries").rglob("*.tmp"))
        assert len(entry_files(cache_dir)) == 3


def test_full_tmpfs_stops_admission_and_reads_go_on(tmp_path, caplog):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    tier = None
    try:
        tier = SsdTier(mnt / "ssd", budget_bytes=10 << 20, block_bytes=1 << 16)
        with caplog.at_level(logging.WARNING, logger="cachefs.cache.ssd"):
            admitted = 0
            while tier.admit(key(admitted), ident(admitted), payload(admitted, 60_000)):
                admitted += 1
        assert 5 < admitted < 20
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert "ENOSPC" in tier.stats()["admission_disabled"]
        assert not tier.admit(key(admitted + 1), ident(admitted + 1), payload(1, 10))
        for n in range(admitted):
            assert tier.read(key(n), ident(n)) == payload(n, 60_000)
        assert not list((mnt / "ssd" / "entries").rglob("*.tmp"))
    finally:
        if tier is not None:
            tier.close()  # its open files would make umount fail with EBUSY
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)


# ----------------------------------------------------------------- threads

def test_a_budget_counts_what_small_and_empty_entries_take_on_disk(cache_dir):
    """300-byte samples took 14 times a budget of payload bytes on disk (a file's whole
    block, its header, its index record), and empty files nothing at all."""
    with SsdTier(cache_dir, budget_bytes=100 * 300, block_bytes=BLOCK) as tier:
        admitted = 0
        while tier.admit(key(admitted), ident(admitted), payload(admitted, admitted % 2 * 300)):
            admitted += 1
        assert admitted == 100 * 300 // disk_bytes(300) == 7
        blocks = sum(os.stat(path).st_blocks * 512 for path in entry_files(cache_dir))
        assert blocks <= tier.stats()["bytes"] <= 100 * 300


def test_concurrent_admits_reads_and_drops_keep_exact_accounting(cache_dir):
    items, budget = 400, 150 * E
    errors = []
    with SsdTier(cache_dir, budget_bytes=budget, block_bytes=BLOCK) as tier:
        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(600):
                    n = rng.randrange(items)
                    length = 1000 if n % 2 else 500
                    action = rng.random()
                    if action < 0.5:
                        tier.admit(key(n), ident(n), payload(n, length))
                    elif action < 0.95:
                        got = tier.read(key(n), ident(n))
                        assert got is None or got == payload(n, length)
                    else:
                        tier.drop_file(key(n)[0])
            except Exception as exc:  # re-raised in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        stats = tier.stats()
        resident = [n for n in range(items) if tier.contains(key(n), ident(n))]
        expected = sum(disk_bytes(1000 if n % 2 else 500) for n in resident)
        assert (stats["bytes"], stats["entries"]) == (expected, len(resident))
        assert stats["bytes"] <= budget
        assert stats["rejected_checksum"] == 0  # drop_file's drops count as dropped_stale
        files = entry_files(cache_dir)
        assert len(files) == len(resident)
        assert sum(disk_bytes(p.stat().st_size - ENTRY_HEADER_BYTES) for p in files) == expected
    with SsdTier(cache_dir, budget_bytes=budget, block_bytes=BLOCK) as tier:
        assert tier.stats()["bytes"] == expected
        assert all(tier.read(key(n), ident(n)) is not None for n in resident)


def test_event_loop_calls_do_not_wait_for_an_index_write(cache_dir, monkeypatch):
    """contains/has_entry/stats run on the event loop: a slow index append on a worker thread
    must not hold them up (issue 15, item 10)."""
    real_write = os.write
    writing = threading.Event()
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 2)

        def slow_write(fd, data):
            if threading.current_thread() is worker:  # only the admitting thread's writes
                writing.set()
                time.sleep(2.0)
            return real_write(fd, data)

        monkeypatch.setattr(ssd_module.os, "write", slow_write)
        worker = threading.Thread(target=lambda: tier.admit(key(5), ident(5), payload(5)))
        worker.start()
        assert writing.wait(5)
        started = time.monotonic()
        assert tier.contains(key(0), ident(0))
        assert tier.has_entry(key(1))
        assert tier.stats()["entries"] >= 2
        waited_s = time.monotonic() - started
        worker.join()
        monkeypatch.undo()
        assert waited_s < 1.0  # not held up by the 2 s write (a loaded machine's margin)
        assert tier.read(key(5), ident(5)) == payload(5)
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert [tier.read(key(n), ident(n)) == payload(n) for n in (0, 1, 5)] == [True] * 3


def test_index_log_keeps_queue_order_and_loses_nothing_across_threads(tmp_path):
    """AppendLog: records queued under a lock reach the file in that order, whoever writes."""
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    log_file = AppendLog(fd, on_error=lambda exc: pytest.fail(str(exc)))
    lock, queued = threading.Lock(), []

    def worker(seed: int) -> None:
        for n in range(300):
            with lock:  # the tier's lock fixes the order
                record = f"{seed}:{n};".encode()
                queued.append(record)
                log_file.append(record)
            log_file.flush()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log_file.close()
    assert path.read_bytes() == b"".join(queued)


def test_a_cache_directory_another_user_may_write_to_is_refused(tmp_path):
    """Another user who may write to DIR could plant a link where cachefs writes (the lock,
    which the daemon then chmods: any file of the system, with a root daemon) or forge
    entries; DIR must be its user's, writable by no other, and no link inside is followed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    with pytest.raises(StartupError, match="writable by other users") as raised:
        SsdTier(shared, 10 * BLOCK, BLOCK)
    assert raised.value.exit_code == EXIT_CACHE_DIR and not (shared / "lock").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # root runs the tests
    with pytest.raises(StartupError, match="belongs to user 65534"):
        SsdTier(foreign, 10 * BLOCK, BLOCK)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    victim.chmod(0o644)
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / "lock").symlink_to(victim)  # left while DIR was writable by others
    with pytest.raises(StartupError):
        SsdTier(planted, 10 * BLOCK, BLOCK)
    assert victim.stat().st_mode & 0o777 == 0o644 and victim.read_bytes() == b"keep me"
    fresh = tmp_path / "made" / "by" / "cachefs"
    with SsdTier(fresh, 10 * BLOCK, BLOCK) as tier:  # made 0700: usable
        fill(tier, 1)


def test_a_cache_directory_another_user_could_replace_is_refused(tmp_path):
    """DIR's parents must be root's or the mount's user's, and writable by no other user
    unless sticky (as /tmp is): one who may write to a parent, or owns it, renames DIR away
    and puts a directory of forged entries in its place, which a mount started later serves
    (the checksums have no secret); one inside a sticky directory is usable."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(StartupError, match="which other users may write to") as raised:
        SsdTier(open_parent / "cache", 10 * BLOCK, BLOCK)
    assert raised.value.exit_code == EXIT_CACHE_DIR
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "cache").mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # root runs the tests
    with pytest.raises(StartupError, match="belongs to user 65534"):
        SsdTier(theirs / "cache", 10 * BLOCK, BLOCK)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with SsdTier(sticky / "cache", 10 * BLOCK, BLOCK) as tier:
        fill(tier, 1)


def test_a_cache_directory_given_through_another_users_link_is_refused(tmp_path):
    """The daemon keeps using DIR as given: a symbolic link on it that another user owns (in
    a sticky directory such as /tmp, where the link is theirs to replace) or may replace (in
    a directory writable by others) passed the check of the directory it pointed to then,
    and could be pointed at a directory of forged entries afterwards."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "theirs").symlink_to(mine)
    os.lchown(sticky / "theirs", 65534, 65534)  # root runs the tests
    with pytest.raises(StartupError, match="goes through the link .* belongs to user 65534"):
        SsdTier(sticky / "theirs" / "cache", 10 * BLOCK, BLOCK)
    (sticky / "ours").symlink_to(mine)  # root's own link: only root may replace it
    with SsdTier(sticky / "ours" / "cache", 10 * BLOCK, BLOCK) as tier:
        fill(tier, 1)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    (open_dir / "link").symlink_to(mine)
    open_dir.chmod(0o777)  # anyone may replace the link in it
    with pytest.raises(StartupError, match="which another user could replace"):
        SsdTier(open_dir / "link" / "cache", 10 * BLOCK, BLOCK)


def test_no_file_of_the_tier_is_read_through_a_link(cache_dir, tmp_path):
    """A link planted among the tier's files is not followed: an entry that is one is a miss
    (dropped as damaged), and a meta file that is one stops the start."""
    with SsdTier(cache_dir, 10 * E, BLOCK) as tier:
        assert tier.admit(key(1), ident(1), payload(1))
    [entry] = entry_files(cache_dir)
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    with SsdTier(cache_dir, 10 * E, BLOCK) as tier:
        assert tier.read(key(1), ident(1)) is None
    (cache_dir / "meta").rename(tmp_path / "meta")
    (cache_dir / "meta").symlink_to(tmp_path / "meta")
    with pytest.raises(StartupError, match="not usable"):
        SsdTier(cache_dir, 10 * E, BLOCK)


def modes(directory: Path) -> dict[str, int]:
    """Permission bits of DIR and of everything under it, by path relative to DIR."""
    found = {".": directory.stat().st_mode & 0o7777}
    for path in directory.rglob("*"):
        found[str(path.relative_to(directory))] = path.lstat().st_mode & 0o7777
    return found


def test_the_cache_is_private_and_an_older_cache_is_made_so(cache_dir):
    """Cached bytes may come from files only root may read: 0700 directories, 0600 files,
    also in a cache directory left by a version that made them 0755 and 0644."""
    with SsdTier(cache_dir, 10 * BLOCK, BLOCK) as tier:
        fill(tier, 3)
    found = modes(cache_dir)
    assert len(found) == 1 + 1 + 256 + 3 + 3  # DIR, entries/, fan-outs, entries, lock/meta/index
    assert {path: mode for path, mode in found.items()
            if mode != (0o700 if (cache_dir / path).is_dir() else 0o600)} == {}
    for path in [cache_dir, *cache_dir.rglob("*")]:  # what an older version left
        path.chmod(0o755 if path.is_dir() else 0o644)
    with SsdTier(cache_dir, 10 * BLOCK, BLOCK) as tier:
        assert tier.read(key(1), ident(1)) == payload(1)
        found = modes(cache_dir)
    assert found.pop(".") == 0o755  # DIR existed: it keeps its mode, its contents are private
    assert {path: mode for path, mode in found.items()
            if (cache_dir / path).is_dir() and mode != 0o700} == {}
    for name in ("lock", "meta", "index"):
        assert found[name] == 0o600, name


def tiered_over(tier: SsdTier, tmp_path: Path, run_ssd):
    """A TieredCache over `tier`, a source of one file `f` and a plan that keeps everything,
    its SSD calls made through `run_ssd`."""
    from cachefs import stats as stats_mod
    from cachefs.cache.ram import RamTier
    from cachefs.cache.tiered import TieredCache
    from cachefs.source import Source

    class Ranking:
        def priority_of(self, item, block_index, identity):
            return 1.0

        def item_now(self, relpath, item, manifest):
            return item, manifest

    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(payload(1))
    return TieredCache(RamTier(1 << 20, block_bytes=BLOCK), Source(src, threads=1),
                       stats_mod.Stats(), BLOCK, Ranking(), ssd=tier, run_ssd=run_ssd)


def test_a_change_takes_the_old_versions_entries_out_of_the_index_at_once(cache_dir, tmp_path):
    """A change found (`TieredCache.source_changed`) takes the old version's entries out of
    the tier's index at once, on the event loop: the drop waited its turn in the tier's
    threads, and meanwhile a read of the old version (a handle opened on it, a read-ahead
    queued) was served from the SSD. Their files go after, in a worker thread."""
    import trio

    old = ident(1)
    new = old._replace(mtime_ns=old.mtime_ns + 1)
    ran: list[str] = []

    async def busy_ssd_threads(fn, *args):  # the call waits its turn, then runs
        await trio.sleep(0.05)
        ran.append(fn.__name__)
        return fn(*args)

    with SsdTier(cache_dir, budget_bytes=10 * E, block_bytes=BLOCK) as tier:
        assert tier.admit((b"f", 0), old, payload(1))
        tiered = tiered_over(tier, tmp_path, busy_ssd_threads)

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(tiered.run)
                tiered.source_changed(b"f", new)
                assert not tier.contains((b"f", 0), old)
                assert tier.read((b"f", 0), old) is None
                assert len(entry_files(cache_dir)) == 1  # its file goes later
                await trio.sleep(0.2)
                nursery.cancel_scope.cancel()

        trio.run(main)
        assert ran == ["unlink_forgotten"]
        assert entry_files(cache_dir) == []
        assert tier.stats()["entries"] == 0
        assert tier.admit((b"f", 0), new, payload(2))  # the key is free again


def test_a_change_seen_after_the_tiers_run_ended_starts_nothing(cache_dir, tmp_path):
    """The mount stops: the tiered cache's run (the nursery its SSD drops run in) has ended
    when a source read landing late finds a change. Its RAM copies go and nothing starts (a
    closed nursery raised); the old version's entry stays for the next mount, which serves
    an entry only to a reader of the version it was written from."""
    import trio

    old = ident(1)
    new = old._replace(mtime_ns=old.mtime_ns + 1)
    with SsdTier(cache_dir, budget_bytes=10 * E, block_bytes=BLOCK) as tier:
        assert tier.admit((b"f", 0), old, payload(1))

        async def run_ssd(fn, *args):
            return fn(*args)
        tiered = tiered_over(tier, tmp_path, run_ssd)

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(tiered.run)
                nursery.cancel_scope.cancel()  # as the mount's end cancels it
            tiered.source_changed(b"f", new)

        trio.run(main)
        assert tier.contains((b"f", 0), old)
        assert tier.read((b"f", 0), new) is None  # and the stale entry goes
        assert not tier.contains((b"f", 0), old)


def test_a_block_read_before_a_change_is_not_left_in_the_tier_after_it(cache_dir, tmp_path):
    """A block of the old version, read before the change was found and still on its way to
    the tier (its admission queued, or being written) when the change took the old version's
    entries out, stayed there after it (cache-once keeps it, across restarts too)."""
    import trio

    old = ident(1)
    new = old._replace(mtime_ns=old.mtime_ns + 1)

    async def busy_ssd_threads(fn, *args):  # each call waits its turn, then runs
        await trio.sleep(0.05)
        return fn(*args)

    with SsdTier(cache_dir, budget_bytes=10 * E, block_bytes=BLOCK) as tier:
        tiered = tiered_over(tier, tmp_path, busy_ssd_threads)

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(tiered.run)
                tiered._queue_admission((b"f", 0), old, payload(1))  # being written
                await trio.sleep(0.01)
                tiered.source_changed(b"f", new)
                tiered._queue_admission((b"f", 1), old, payload(2))  # still queued
                await trio.sleep(0.5)
                nursery.cancel_scope.cancel()

        trio.run(main)
        assert not tier.contains((b"f", 0), old) and not tier.contains((b"f", 1), old)
        assert entry_files(cache_dir) == [] and tier.stats()["entries"] == 0


def test_warm_replaces_the_stale_entries_of_a_full_tier(cache_dir, tmp_path):
    """The data set was regenerated while unmounted (every file has a new mtime) and the tier
    is full of the old versions: warm found no room and stopped at once, admitting nothing,
    although each new block replaces its file's stale one."""
    import trio

    from cachefs.source import Source
    from cachefs.warm import Warmer

    src = tmp_path / "src"
    src.mkdir()
    for n in range(4):
        (src / f"f{n}").write_bytes(payload(n))
    source = Source(src, threads=2)
    with SsdTier(cache_dir, budget_bytes=4 * E, block_bytes=BLOCK) as tier:
        for n in range(4):
            old = source.identity_of(os.stat(src / f"f{n}"))._replace(mtime_ns=1)
            assert tier.admit((b"f%d" % n, 0), old, payload(n))
        assert not tier.has_room(1000)
        warmer = Warmer(source, tier, block_bytes=BLOCK, threads=2, order_paths=lambda: None,
                        all_paths=lambda: [])
        warmer._status.update(bytes_admitted=0, bytes_present=0, blocks_admitted=0)

        async def warm_all():
            return [await warmer._warm_file(b"f%d" % n) for n in range(4)]

        assert trio.run(warm_all) == [True] * 4
        for n in range(4):
            assert tier.read((b"f%d" % n, 0),
                             source.identity_of(os.stat(src / f"f{n}"))) == payload(n)


def test_a_tier_that_filled_its_device_still_serves_after_a_restart(cache_dir, monkeypatch):
    """After a crash the index is rewritten compacted at the next start, which needs room
    for a second copy of it: on the device the tier filled, that failed with ENOSPC at
    every start, and the whole tier was given up (the mount went on without it), its
    entries never read again. It now serves them and admits nothing; the half-written
    copy is removed, not left to take the device's last bytes."""
    from cachefs.cache import ssd_format

    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    fill(tier, 5)
    crash(tier)
    real_fsync = os.fsync

    def fsync_of_a_full_device(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("index.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(ssd_format.os, "fsync", fsync_of_a_full_device)
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert all(tier.read(key(n), ident(n)) == payload(n) for n in range(5))
        assert "ENOSPC" in tier.stats()["admission_disabled"]
        assert not tier.admit(key(7), ident(7), payload(7))
        assert not (cache_dir / "index.tmp").exists()
    monkeypatch.setattr(ssd_format.os, "fsync", real_fsync)  # room again: all as before
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        assert all(tier.read(key(n), ident(n)) == payload(n) for n in range(5))
        assert tier.stats()["admission_disabled"] is None
        assert tier.admit(key(7), ident(7), payload(7))


def test_a_cache_directory_of_another_source_is_emptied(cache_dir):
    """The cache directory of one data set given to the mount of another: files of the same
    paths, sizes and times (to the second on an object store's mount, with no inode
    numbers) were served as this one's. Its entries go; those of the same source stay."""
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK, source=b"/data/a") as tier:
        fill(tier, 3)
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK, source=b"/data/a") as tier:
        assert tier.stats()["entries"] == 3
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK, source=b"/data/b") as tier:
        assert tier.stats()["entries"] == 0
        assert not any(tier.contains(key(n), ident(n)) for n in range(3))


def test_a_read_failing_for_the_process_keeps_the_entry(cache_dir, monkeypatch):
    """Out of descriptors (EMFILE) or memory is the process's failure, not the entry's: it
    dropped good entries of a cache-once tier for good. A miss, and the entry stays."""
    with SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK) as tier:
        fill(tier, 2)
        real_open = os.open

        def out_of_descriptors(path, *args, **kwargs):
            if "entries" in str(path):
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(ssd_module.os, "open", out_of_descriptors)
        assert tier.read(key(0), ident(0)) is None
        monkeypatch.setattr(ssd_module.os, "open", real_open)
        assert tier.read(key(0), ident(0)) == payload(0)
        assert tier.stats()["rejected_checksum"] == 0


def test_a_reconciliation_says_how_far_it_is(cache_dir, monkeypatch, caplog):
    """`cachefs mount` waits for a daemon as long as it logs: a reconciliation of millions
    of entries after a crash (minutes) logs its progress, or the mount was given up."""
    tier = SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK)
    fill(tier, 3)
    crash(tier)
    monkeypatch.setattr(ssd_module, "PROGRESS_S", 0.0)
    reported = []
    with caplog.at_level(logging.INFO, logger="cachefs.cache.ssd"):
        SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK,
                progress=reported.append).close()
    assert "reconciling the directories, 1 of 256 done" in caplog.text
    # once per directory, and once per entry within it (a directory of a large tier holds
    # tens of thousands, each read whole when the index is lost)
    assert len(reported) == 256 + 3
    assert reported[1].endswith("reconciling the directories, 1 of 256 done")
    # so do a trim to a smaller budget and a wipe (another source's cache directory)
    reported.clear()
    with SsdTier(cache_dir, budget_bytes=disk_bytes(1000), block_bytes=BLOCK,
                 progress=reported.append) as tier:
        assert tier.stats()["entries"] == 1
    assert any("trimming to the budget, entries, 1 of 3 done" in m for m in reported)
    reported.clear()
    SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK, source=b"/a").close()
    SsdTier(cache_dir, budget_bytes=1 << 20, block_bytes=BLOCK, source=b"/b",
            progress=reported.append).close()
    assert any("discarding the directories, 255 of 256 done" in m for m in reported)


def test_a_long_start_extends_systemds_start_timeout():
    """Under --systemd, a start step's progress extends systemd's start timeout (90 s by
    default ended a reconciliation of millions of entries, and Restart= began it again)."""
    from types import SimpleNamespace

    from cachefs.mount import Mount

    sent = []
    mount = SimpleNamespace(notifier=SimpleNamespace(send=lambda *lines: sent.append(lines)))
    Mount._starting(mount, "ssd cache /c: reconciling the directories, 9 of 256 done")
    assert sent == [("EXTEND_TIMEOUT_USEC=30000000",
                     "STATUS=ssd cache /c: reconciling the directories, 9 of 256 done")]


def test_a_mount_that_fails_after_its_ssd_tier_opened_closes_it(tmp_path, monkeypatch):
    """A start that fails after the tier opened (the source's root unreadable, say) left it
    open, its meta unclean: the next start reconciled every entry of it."""
    import json

    from cachefs import mount as mount_mod
    from cachefs.config import CacheConfig, MountConfig

    source, ssd_dir, state = tmp_path / "src", tmp_path / "ssd", tmp_path / "state"
    source.mkdir()
    ssd_dir.mkdir(mode=0o700)
    config = MountConfig(source, tmp_path / "mnt", state, state / "order.npz",
                         cache=CacheConfig(ram_bytes=1 << 20, ssd_dir=ssd_dir,
                                           ssd_bytes=1 << 20))

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mount_mod, "InodeTable", broken)
    with pytest.raises(OSError):
        mount_mod.Mount(config)
    assert json.loads((ssd_dir / "meta").read_text())["clean"] is True
    SsdTier(ssd_dir, 1 << 20, 4 << 20).close()  # the lock was let go too
