"""A manifest lookup on a thread that shares the GIL with busy workers: bisect vs. searchsorted.

The daemon's trio thread looks up a file's manifest index (`Manifest.index_of`) while the source
threads read files. `ndarray.searchsorted` releases the GIL for every call; a worker then takes
it, and the searching thread waits to get it back (cachefs/sorted_arrays.py). This measures, in
the same run, the CPU and wall time of one lookup of `index_of` as it is (its sorted search
through `sorted_arrays.index_left`, which holds the GIL) and of the same `index_of` with
`index_left` swapped for `searchsorted` during its passes, with no worker and with
`--threads` workers that do what a source thread does (a pread, a little Python). Passes
alternate between the two; medians are reported.

Usage:
    python scripts/bench_lookup.py [--files 200000] [--lookups 20000] [--threads 4] [--passes 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachefs import manifest as manifest_mod  # noqa: E402


@contextlib.contextmanager
def _searchsorted():
    """`Manifest.index_of` searching with `ndarray.searchsorted`, as it did before
    cachefs/sorted_arrays.py, while the block runs."""
    held = manifest_mod.index_left

    def index_left(array: np.ndarray, value, lo: int = 0) -> int:
        return max(lo, int(array.searchsorted(value)))
    manifest_mod.index_left = index_left
    try:
        yield
    finally:
        manifest_mod.index_left = held


def _busy_worker(stop: threading.Event) -> None:
    """A source thread's pattern: a system call (the GIL released), then some Python."""
    fd = os.open(__file__, os.O_RDONLY)
    try:
        while not stop.is_set():
            os.pread(fd, 128, 0)
            sum(range(20))
    finally:
        os.close(fd)


def _pass(manifest: manifest_mod.Manifest, queries: list[bytes]) -> tuple[float, float]:
    """(CPU us, wall us) per lookup, of this thread."""
    cpu_s, wall_s = time.thread_time(), time.perf_counter()
    for relpath in queries:
        manifest.index_of(relpath)
    count = len(queries)
    return ((time.thread_time() - cpu_s) / count * 1e6,
            (time.perf_counter() - wall_s) / count * 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--lookups", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=4, help="busy worker threads")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args(argv)
    paths = [f"d{index // 1000:04d}/f{index % 1000:04d}.jpg".encode()
             for index in range(args.files)]
    manifest = manifest_mod.Manifest.from_paths(paths)
    queries = random.Random(1).choices(paths, k=args.lookups)
    searches = {"index_of (bisect)": contextlib.nullcontext, "searchsorted": _searchsorted}
    with _searchsorted():
        found = [manifest.index_of(path) for path in queries[:100]]
    assert found == [manifest.index_of(path) for path in queries[:100]]
    print(f"{args.lookups} lookups in a manifest of {args.files} paths, medians of "
          f"{args.passes} passes\n")
    print("| busy workers | lookup | CPU us | wall us |\n|---|---|---|---|")
    for workers in sorted({0, args.threads}):
        stop = threading.Event()
        threads = [threading.Thread(target=_busy_worker, args=(stop,), daemon=True)
                   for _ in range(workers)]
        for thread in threads:
            thread.start()
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in searches}
        try:
            for _ in range(args.passes):
                for name, search in searches.items():
                    with search():
                        figures[name].append(_pass(manifest, queries))
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        for name, rounds in figures.items():
            cpu_us = statistics.median(cpu for cpu, _ in rounds)
            wall_us = statistics.median(wall for _, wall in rounds)
            print(f"| {workers} | {name} | {cpu_us:.1f} | {wall_us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
