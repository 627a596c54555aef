#!/usr/bin/env python3
"""Benchmark of the SSD tier's index and entry I/O (cachefs/cache/ssd.py).

Measures, in one run on one directory:

1. Open time of an SsdTier whose index holds N entries (default 1,000,000), cleanly closed:
   what a remount costs. The index is written by the module's own `write_index` from a small
   sample of real entries plus synthetic records (the open reads no entry file, so the missing
   files do not change the figure); the sample is read back through the big index.
2. Rebuild time from entry headers after the index is lost, on real tiny entries, per entry.
3. admit and read throughput of 110 KB blocks (an ImageNet-sized JPEG), one thread; reads come
   from the page cache unless the set is larger than RAM, so they measure the tier's own cost.
4. Checksum speed of xxh3_64 against zlib.crc32 on 4 MiB.

Usage: PYTHONPATH=. python scripts/bench_ssd_index.py [--dir DIR] [--entries N]
       [--rebuild-entries N] [--io-blocks N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import xxhash

from cachefs.cache.ssd import SsdTier
from cachefs.cache.ssd_format import RECORD_DTYPE, load_index, records_check, write_index
from cachefs.source import SourceIdentity

BLOCK_BYTES = 4 << 20
SAMPLE_BYTES = 110_000


def synthetic_records(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    records = np.zeros(count, dtype=RECORD_DTYPE)
    records["magic"] = 0x4346
    records["op"] = 1
    records["length"] = SAMPLE_BYTES
    for field in ("key_lo", "key_hi", "path_lo", "ino"):
        records[field] = rng.integers(0, 2**63, count, dtype=np.uint64)
    records["size"] = SAMPLE_BYTES
    records["mtime_ns"] = 1_700_000_000_000_000_000
    records["check"] = records_check(records)
    return records


def identity(n: int) -> SourceIdentity:
    return SourceIdentity(SAMPLE_BYTES, 1_700_000_000_000_000_000 + n, n + 1)


def bench_open(directory: Path, entries: int, sample: int) -> dict:
    blocks = [os.urandom(SAMPLE_BYTES) for _ in range(sample)]
    with SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES) as tier:
        for n, data in enumerate(blocks):
            tier.admit((b"sample/%d.jpg" % n, 0), identity(n), data)
    base, _tail, _intact = load_index(directory / "index", BLOCK_BYTES)
    write_index(directory / "index",
                np.concatenate([base, synthetic_records(entries - len(base))]), BLOCK_BYTES)
    index_bytes = (directory / "index").stat().st_size

    open_s = []
    for _ in range(3):
        started = time.perf_counter()
        tier = SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES)
        open_s.append(time.perf_counter() - started)
        assert tier.stats()["entries"] == entries, tier.stats()
        tier.close()
    with SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES) as tier:
        started = time.perf_counter()
        for n in range(sample):
            assert tier.contains((b"sample/%d.jpg" % n, 0), identity(n))
        contains_us = (time.perf_counter() - started) / sample * 1e6
        assert all(tier.read((b"sample/%d.jpg" % n, 0), identity(n)) == data
                   for n, data in enumerate(blocks))
        started = time.perf_counter()
        tier.close()
        close_s = time.perf_counter() - started
    return {"open_s": statistics.median(open_s), "open_runs": open_s, "index_mb": index_bytes / 1e6,
            "contains_us": contains_us, "close_s": close_s}


def bench_rebuild(directory: Path, count: int) -> dict:
    with SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES) as tier:
        for n in range(count):
            tier.admit((b"tiny/%d" % n, 0), identity(n), b"x" * 100)
    (directory / "index").unlink()
    started = time.perf_counter()
    with SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES) as tier:
        rebuild_s = time.perf_counter() - started
        assert tier.stats()["entries"] == count
    return {"rebuild_s": rebuild_s, "rebuild_us_per_entry": rebuild_s / count * 1e6}


def bench_io(directory: Path, count: int) -> dict:
    blocks = [os.urandom(SAMPLE_BYTES) for _ in range(count)]
    with SsdTier(directory, budget_bytes=1 << 50, block_bytes=BLOCK_BYTES) as tier:
        started = time.perf_counter()
        for n, data in enumerate(blocks):
            assert tier.admit((b"io/%d.jpg" % n, 0), identity(n), data)
        admit_s = time.perf_counter() - started
        started = time.perf_counter()
        for n, _ in enumerate(blocks):
            assert tier.read((b"io/%d.jpg" % n, 0), identity(n)) is not None
        read_s = time.perf_counter() - started
    total_mb = count * SAMPLE_BYTES / 1e6
    return {"admit_mb_s": total_mb / admit_s, "read_mb_s": total_mb / read_s,
            "admit_us": admit_s / count * 1e6, "read_us": read_s / count * 1e6}


def bench_checksums(repeat: int = 50) -> dict:
    data = os.urandom(4 << 20)
    result = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_intdigest), ("crc32", zlib.crc32)):
        fn(data)
        started = time.perf_counter()
        for _ in range(repeat):
            fn(data)
        result[name] = repeat * len(data) / 1e6 / (time.perf_counter() - started)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where to build caches (default: a temp dir)")
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--sample", type=int, default=1000)
    parser.add_argument("--rebuild-entries", type=int, default=20_000)
    parser.add_argument("--io-blocks", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ssd-", dir=args.dir))
    try:
        opened = bench_open(root / "index", args.entries, args.sample)
        rebuilt = bench_rebuild(root / "rebuild", args.rebuild_entries)
        io = bench_io(root / "io", args.io_blocks)
        sums = bench_checksums()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        (f"open, {args.entries:,} entries (median of 3)", f"{opened['open_s'] * 1e3:.0f} ms",
         "runs " + ", ".join(f"{s * 1e3:.0f}" for s in opened["open_runs"]) + " ms; index "
         f"{opened['index_mb']:.0f} MB"),
        ("contains() on that index", f"{opened['contains_us']:.1f} us", "per call"),
        ("close (compact + fsync index)", f"{opened['close_s'] * 1e3:.0f} ms", ""),
        (f"rebuild from headers, {args.rebuild_entries:,} entries",
         f"{rebuilt['rebuild_s']:.2f} s", f"{rebuilt['rebuild_us_per_entry']:.0f} us/entry"),
        (f"admit 110 KB blocks x {args.io_blocks}", f"{io['admit_mb_s']:.0f} MB/s",
         f"{io['admit_us']:.0f} us/block"),
        (f"read 110 KB blocks x {args.io_blocks}", f"{io['read_mb_s']:.0f} MB/s",
         f"{io['read_us']:.0f} us/block (page cache warm)"),
        ("xxh3_64 on 4 MiB", f"{sums['xxh3_64']:.0f} MB/s", ""),
        ("zlib.crc32 on 4 MiB", f"{sums['crc32']:.0f} MB/s",
         f"xxh3_64 is {sums['xxh3_64'] / sums['crc32']:.1f}x faster"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>12}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
