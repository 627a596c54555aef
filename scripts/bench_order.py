"""Time publishing and loading an ImageNet-sized order file (issue 3's scale bar: < 1 s each).

Builds 1,281,167 relative paths shaped like ImageNet's (``train/n01440764/n01440764_10026.JPEG``,
1000 classes, sorted by bytes as `scan_source` would list them), creates no data files, and
uses them both as the source manifest (`Manifest.from_paths`) and as the order's `files`.
Each step is timed separately, median of the repeats:

- write: `write_order_file` from a Python list of str (the conversion a trainer pays is
  included), with `current` and `next` permutations, fsync and rename; and the same with
  `files` already a numpy ``S`` array (what a trainer holding a Manifest passes);
- load: `load_order` of that file against the source manifest (read, validate every index and
  path, build the lookup table);
- load (shuffled files): the same with `files` in a different order from the source, which
  takes the hash lookup path instead of the equal-listing shortcut.

Usage: python scripts/bench_order.py [--items N] [--repeats 3] [--dir DIR]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from cachefs.manifest import Manifest
from cachefs.order import load_order, permutation, write_order_file

IMAGENET_TRAIN_ITEMS = 1_281_167
IMAGENET_CLASSES = 1000


def imagenet_like_paths(items: int, seed: int = 0) -> list[str]:
    """Sorted relative paths spread over 1000 synsets, as a directory scan would give them."""
    rng = np.random.default_rng(seed)
    synsets = sorted(f"n{wnid:08d}" for wnid in rng.choice(10**8, IMAGENET_CLASSES,
                                                            replace=False))
    image_ids = rng.choice(10**7, items, replace=False)  # unique file names
    paths = [f"train/{synsets[i % IMAGENET_CLASSES]}/{synsets[i % IMAGENET_CLASSES]}_"
             f"{image_ids[i]}.JPEG" for i in range(items)]
    paths.sort(key=lambda p: p.encode())
    return paths


def timed(step, repeats: int) -> tuple[float, object]:
    durations, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = step()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=IMAGENET_TRAIN_ITEMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the order file (default: a temporary directory)")
    args = parser.parse_args()

    paths = imagenet_like_paths(args.items)
    source = Manifest.from_paths(paths).prepare()  # the daemon builds this once at mount
    current = permutation(args.items, seed=0, epoch=1)
    next_order = permutation(args.items, seed=0, epoch=2)
    shuffled = [paths[i] for i in permutation(args.items, seed=1, epoch=0)]

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        order_path = Path(directory) / "order.npz"
        shuffled_path = Path(directory) / "order-shuffled.npz"
        write_s, identity = timed(lambda: write_order_file(
            order_path, epoch=1, current=current, next=next_order, files=paths), args.repeats)
        write_array_s, _ = timed(lambda: write_order_file(
            order_path, epoch=1, current=current, next=next_order, files=source.paths),
            args.repeats)
        load_s, order = timed(lambda: load_order(order_path, source), args.repeats)
        assert len(order.current) == args.items and order.manifest is source
        write_order_file(shuffled_path, epoch=1, current=current, next=next_order,
                         files=shuffled)
        shuffled_s, shuffled_order = timed(lambda: load_order(shuffled_path, source),
                                           args.repeats)
        assert shuffled_order.manifest.path(0) == shuffled[0].encode()
        file_bytes = identity.size

    rows = [("write_order_file", write_s), ("write_order_file (files as S array)", write_array_s),
            ("load_order", load_s),
            ("load_order (files shuffled)", shuffled_s)]
    print(f"{args.items} items, order file {file_bytes / 2**20:.1f} MiB, "
          f"median of {args.repeats}")
    print(f"{'step':36s} {'seconds':>8s}  bar 1 s")
    for name, seconds in rows:
        print(f"{name:36s} {seconds:8.3f}  {'ok' if seconds < 1.0 else 'MISSED'}")
    print(json.dumps({"items": args.items, "file_bytes": file_bytes, "repeats": args.repeats,
                      "write_s": round(write_s, 4),
                      "write_files_array_s": round(write_array_s, 4), "load_s": round(load_s, 4),
                      "load_shuffled_files_s": round(shuffled_s, 4)}))


if __name__ == "__main__":
    main()
