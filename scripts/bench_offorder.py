"""A reader that does not follow the published order: is it slowed down by the read-ahead?

Issue 13's case 8: many tiny files (default 200,000 of one byte, 1,000 per directory), a
shuffled order published for all of them, and one reader that reads a part of them (default the
first 50 directories, 50,000 files) in directory order, as a validation pass or another
sampler would (`find DIRS -type f | xargs cat`). The read-ahead then works on positions all
over the epoch while the reader waits on its own requests. Side by side in one run: the same
reader directly on the source, through a mount with no order, and through a mount with the
order published; medians of `--passes` rounds, a fresh mount each.

Usage: python scripts/bench_offorder.py [--files 200000] [--read-dirs 50] [--passes 3]
           [--workdir DIR] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from cachefs.order import permutation, publish, source_file_count  # noqa: E402

FILES_PER_DIR = 1000
SMOKE = {"files": 2000, "read_dirs": 1, "passes": 1}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200_000, help="one-byte files")
    parser.add_argument("--read-dirs", type=int, default=50,
                        help="directories the reader reads (1,000 files each)")
    parser.add_argument("--passes", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-offorder"))
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one pass")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def make_files(root: Path, files: int) -> None:
    marker = root.with_name(root.name + ".offorder.json")
    if marker.exists() and json.loads(marker.read_text()) == {"files": files}:
        return
    for index in range(files):
        directory = root / f"d{index // FILES_PER_DIR:04d}"
        if index % FILES_PER_DIR == 0:
            directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{index % FILES_PER_DIR:04d}").write_bytes(b"x")
    marker.write_text(json.dumps({"files": files}))


def read_dirs(root: Path, dirs: list[str]) -> float:
    """Seconds for `find DIRS -type f | xargs cat`, run in `root`."""
    started_s = time.perf_counter()
    subprocess.run(f"find {' '.join(dirs)} -type f | xargs cat > /dev/null", shell=True,
                   cwd=root, check=True)
    return time.perf_counter() - started_s


def through_mount(args, source: Path, dirs: list[str], ordered: bool) -> float:
    mountpoint, state = args.workdir / "mnt", args.workdir / "state"
    with benchlib.cachefs_mount(source, mountpoint, state, ram_bytes=1 << 30):
        files = source_file_count(mountpoint, 300)
        if ordered:
            publish(mountpoint, 0, permutation(files, 0, 0), next=permutation(files, 0, 1))
        return read_dirs(mountpoint, dirs)


def main(argv=None) -> int:
    args = parse_args(argv)
    source = args.workdir / "data"
    make_files(source, args.files)
    dirs = [f"d{index:04d}" for index in range(args.read_dirs)]
    figures = {"direct": [], "no order": [], "order": []}
    try:
        for _ in range(args.passes):
            read_dirs(source, dirs)  # the source in the page cache, as for the mounts
            figures["direct"].append(read_dirs(source, dirs))
            figures["no order"].append(through_mount(args, source, dirs, ordered=False))
            figures["order"].append(through_mount(args, source, dirs, ordered=True))
    except benchlib.BenchError as exc:
        print(f"bench_offorder: {exc}", file=sys.stderr)
        return 1
    medians = {name: benchlib.median(values) for name, values in figures.items()}
    rows = [[name, f"{seconds:.2f}", f"{seconds / medians['no order']:.2f}"]
            for name, seconds in medians.items()]
    print(f"{args.read_dirs * FILES_PER_DIR} of {args.files} one-byte files read in directory "
          f"order, medians of {args.passes}\n")
    print(benchlib.markdown_table(["reader", "seconds", "/ no order"], rows))
    if args.json:
        benchlib.write_json(args.json, {"benchmark": "bench_offorder", "args": vars(args),
                                        "seconds": figures, "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
