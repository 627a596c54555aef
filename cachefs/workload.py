"""A synthetic training workload: generated data sets, and a reader that can play a slow source.

`cachefs demo` and the benchmarks (scripts/benchlib.py) measure the same thing, a trainer
reading a data set from slow storage with and without cachefs, so they share these pieces
(the scripts import the package; the package never imports the scripts):

- `write_dataset` writes files whose bytes are slices of one random pool of `POOL_BYTES`, at
  page-aligned random offsets: incompressible, and cheap to make (writing gigabytes costs no
  random-number time). The shapes (how many files, their sizes and names) are the callers'.
- `read_whole_file` reads a file to its end as a DataLoader's worker does. Given `delay_s` it
  stands in for a slow source read directly: it sleeps before the open and before each request
  that still has data to return, as the daemon's `--source-delay-ms` sleeps before each open
  and each read of its source; `delay_every_bytes` makes it one sleep per run of that many
  bytes instead (`cachefs demo`: one per 4 MiB, the daemon's default block). Either way a
  direct reader and a cachefs mount pay the same latency per source access.
- Reads go into a page-aligned buffer (`aligned_buffer`): reads into a buffer a few bytes past
  a page boundary copy at a fraction of the speed on some CPUs.

Nothing here prints or mounts.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POOL_BYTES = 64 * 1024 * 1024  # random bytes that file contents are sliced from
_PAGE_MASK = ~4095


def write_dataset(root: Path, relpaths: list[str], sizes: np.ndarray, seed: int) -> int:
    """Write each relpath under root with its size in bytes; return the total written.

    The pool and the offsets are drawn from `seed` (and seed + 1), so a seed gives the same
    bytes in every run.
    """
    pool = np.random.default_rng(seed).integers(0, 256, POOL_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(seed + 1)
    for relpath, size in zip(relpaths, sizes.tolist(), strict=True):
        offset = int(rng.integers(0, POOL_BYTES)) & _PAGE_MASK
        _write_from_pool(root / relpath, size, pool, offset)
    return int(sizes.sum())


def _write_from_pool(path: Path, size_bytes: int, pool: np.ndarray, offset: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        written = 0
        while written < size_bytes:
            start = (offset + written) % POOL_BYTES
            chunk = pool[start:start + min(size_bytes - written, POOL_BYTES - start)]
            # ndarray has the buffer protocol; numpy's stubs declare it for Python 3.12+ only
            written += os.write(fd, memoryview(chunk))  # type: ignore[arg-type]
    finally:
        os.close(fd)


@dataclass
class Waits:
    """Time a reader spent in open() and in its reads, summed over files: where one reader's
    time per file goes (through a FUSE mount, open is a LOOKUP and an OPEN request, the
    reads one READ per request size; close is not waited for, its RELEASE is sent after)."""

    open_s: float = 0.0
    read_s: float = 0.0

    def add(self, other: Waits) -> None:
        self.open_s += other.open_s
        self.read_s += other.read_s


def aligned_buffer(size_bytes: int) -> memoryview:
    """A page-aligned buffer of at least size_bytes (an anonymous mapping)."""
    return memoryview(mmap.mmap(-1, max(size_bytes, mmap.PAGESIZE)))


def read_whole_file(path: bytes, buffer: memoryview, delay_s: float = 0.0,
                    waits: Waits | None = None, *, delay_every_bytes: int = 0) -> int:
    """Read a file to its end in buffer-sized requests; returns the bytes read.

    With `delay_s`, sleeps as a slow source would (module docstring); with
    `delay_every_bytes`, requests are also cut at multiples of it, so that each run of that
    many bytes starts with a request of its own. With `waits`, adds the time spent opening and
    reading to it.
    """
    if delay_s:
        time.sleep(delay_s)
    opening_s = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    reading_s = time.perf_counter()
    try:
        size = os.fstat(fd).st_size if delay_s else -1
        run_bytes = delay_every_bytes
        total = 0
        while True:
            starts_run = not run_bytes or total % run_bytes == 0
            if delay_s and starts_run and total < size:
                time.sleep(delay_s)  # a request that returns data; the EOF probe is free
            request = buffer[:run_bytes - total % run_bytes] if run_bytes else buffer
            count = os.readv(fd, [request])
            if count == 0:
                break
            total += count
    finally:
        if waits is not None:
            done_s = time.perf_counter()
            waits.open_s += reading_s - opening_s
            waits.read_s += done_s - reading_s
        os.close(fd)
    return total
