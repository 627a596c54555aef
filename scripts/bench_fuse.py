"""The FUSE hot path alone: cachefs with everything in its RAM tier vs. direct page-cache reads.

Issue 2's figures. The data set (default 20,000 files of 110 KB and one 1 GiB file) is read
once directly and once through the mount before anything is timed, so the source is in the
page cache and every block is in cachefs's RAM tier (its budget is larger than the data set).
Then, for each mount configuration, `--passes` rounds alternate direct and mount passes of each
case in the same run, swapping which goes first every round, and the medians are compared:

- files/s reading every small file whole (1 MiB reads), with 1 and 4 reader processes (worker
  i of n takes every n-th file of a fixed permutation);
- MB/s reading the big file sequentially in 1 MiB reads;
- entries/s of one os.walk over the whole tree.

Each timed mount pass also checks what the daemon saw (stats deltas): in a warm pass every
read should be a RAM hit, and the report says if it was not.

Configurations: one mount per `--fuse-tasks` value (pyfuse3's max_tasks), and one per entry of
`--metadata-ttl` (how long an open trusts the known source identity before re-checking it in a
worker thread), plus anything in `--mount-args`. The daemon's defaults are used otherwise.

Usage:
    python scripts/bench_fuse.py [--files 20000] [--file-kb 110] [--big-mb 1024] [--passes 5]
        [--readers 1 4] [--fuse-tasks 1 4 16] [--metadata-ttl 1 3600] [--workdir DIR]
        [--json out.json] [--markdown out.md] [--smoke]
Prints a Markdown table; writes every pass to the JSON file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import (GIB, KIB, MIB, BenchError, DatasetSpec, Manifest, PassResult,  # noqa: E402
                      ReaderPool, ReadTask)
from cachefs.client import stats_delta  # noqa: E402

log = logging.getLogger("bench_fuse")

SMOKE = {"files": 60, "file_kb": 8, "big_mb": 4, "passes": 1, "readers": [1, 2],
         "fuse_tasks": [1, 16], "metadata_ttl": [None]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=20_000, help="small files")
    parser.add_argument("--file-kb", type=int, default=110, help="size of a small file, KB")
    parser.add_argument("--big-mb", type=int, default=1024, help="size of the big file, MiB")
    parser.add_argument("--passes", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 4],
                        help="reader process counts for the small files")
    parser.add_argument("--fuse-tasks", type=int, nargs="+", default=[1, 4, 16],
                        help="one mount per value of cachefs mount --fuse-tasks")
    parser.add_argument("--metadata-ttl", type=float, nargs="+", default=[None],
                        help="one mount per value of --metadata-ttl (with the first "
                             "--fuse-tasks value); default: the daemon's")
    parser.add_argument("--mount-args", default="",
                        help="extra arguments for every cachefs mount, e.g. '--block-size 1MiB'")
    parser.add_argument("--read-kb", type=int, default=1024, help="read request size, KiB")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-fuse"),
                        help="data set, mount point and state (the data set is reused)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one pass: checks that the script works, in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def mount_configs(args) -> list[tuple[str, list[str]]]:
    """(name, extra mount arguments) for every mount to measure."""
    extra = args.mount_args.split()
    configs = [(f"fuse-tasks={tasks}", ["--fuse-tasks", str(tasks), *extra])
               for tasks in args.fuse_tasks]
    for ttl in args.metadata_ttl:
        if ttl is not None:
            configs.append((f"fuse-tasks={args.fuse_tasks[0]},metadata-ttl={ttl:g}",
                            ["--fuse-tasks", str(args.fuse_tasks[0]), "--metadata-ttl",
                             f"{ttl:g}", *extra]))
    return configs


class Cases:
    """The timed cases of one round: each takes a root (the source or the mount point)."""

    def __init__(self, args, manifest: Manifest, pool: ReaderPool):
        self.pool = pool
        self.read_bytes = args.read_kb * KIB
        small = manifest.indices_under("small/")
        self.small_order = np.random.default_rng(0).permutation(small)
        self.big_order = manifest.indices_under("big/")
        self.readers = args.readers

    def names(self) -> list[str]:
        return [f"files/s, {r} reader{'s' if r > 1 else ''}" for r in self.readers] + [
            "big file MB/s", "os.walk entries/s"]

    def run(self, name: str, root: Path) -> float:
        root_bytes = os.fsencode(root)
        if name.startswith("files/s"):
            readers = int(name.split(", ")[1].split()[0])
            result = self.pool.run(ReadTask(root_bytes, self.small_order, workers=readers,
                                            read_bytes=self.read_bytes))
            return result.files_per_s
        if name == "big file MB/s":
            result = self.pool.run(ReadTask(root_bytes, self.big_order,
                                            read_bytes=self.read_bytes))
            return result.mb_per_s
        started_s = time.perf_counter()
        entries = benchlib.walk_entries(root)
        return entries / (time.perf_counter() - started_s)

    def warm(self, root: Path) -> PassResult:
        everything = np.concatenate([self.small_order, self.big_order])
        return self.pool.run(ReadTask(os.fsencode(root), everything,
                                      workers=max(self.readers), read_bytes=self.read_bytes))


def measure_config(args, cases: Cases, source: Path, ram_bytes: int, name: str,
                   extra: list[str]) -> dict:
    mountpoint, state_dir = args.workdir / "mnt", args.workdir / "state"
    log.info("mount %s", name)
    with benchlib.cachefs_mount(source, mountpoint, state_dir, ram_bytes=ram_bytes,
                                extra_args=extra) as mount:
        benchlib.wait_for_manifest(mount)
        cases.warm(source)
        warm = cases.warm(mountpoint)  # fills the RAM tier
        log.info("warm pass through the mount: %.0f files/s", warm.files_per_s)
        figures = {case: {"direct": [], "mount": []} for case in cases.names()}
        before = mount.totals()
        for round_index in range(args.passes):
            for case in cases.names():
                sides = ["direct", "mount"] if round_index % 2 == 0 else ["mount", "direct"]
                for side in sides:
                    root = source if side == "direct" else mountpoint
                    figures[case][side].append(cases.run(case, root))
        delta = stats_delta(before, mount.totals())
        ram = mount.stats()["ram"]
    for case, sides in figures.items():
        sides["direct_median"] = benchlib.median(sides["direct"])
        sides["mount_median"] = benchlib.median(sides["mount"])
        sides["ratio"] = sides["mount_median"] / sides["direct_median"]
    return {"name": name, "mount_args": extra, "warm_files_per_s": warm.files_per_s,
            "cases": figures, "stats_delta_timed": delta,
            "ram_hit_fraction": delta["hits_ram"] / delta["reads"] if delta["reads"] else None,
            "ram": ram}


def report_table(results: list[dict]) -> str:
    rows = []
    for config in results:
        for case, sides in config["cases"].items():
            rows.append([config["name"], case, sides["direct_median"], sides["mount_median"],
                         f"{sides['ratio']:.3f}"])
    table = benchlib.markdown_table(["mount", "case", "direct", "cachefs", "cachefs/direct"],
                                    rows)
    hits = ", ".join(f"{c['name']}: {c['ram_hit_fraction']:.3f}" for c in results
                     if c["ram_hit_fraction"] is not None)
    return f"{table}\n\nRAM-hit fraction of the timed mount reads: {hits}"


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    source = args.workdir / "data"
    benchlib.generate_dataset(source, DatasetSpec("small", args.files, args.file_kb * 1000))
    benchlib.generate_dataset(source, DatasetSpec("big", 1, args.big_mb * MIB))
    manifest = Manifest.scan(source)
    # room for every block plus slack: block rounding, and nothing may be evicted
    ram_bytes = int(manifest.total_bytes * 1.25) + 256 * MIB
    results = []
    try:
        with ReaderPool(manifest, max(args.readers)) as pool:
            cases = Cases(args, manifest, pool)
            for name, extra in mount_configs(args):
                results.append(measure_config(args, cases, source, ram_bytes, name, extra))
    except BenchError as exc:
        print(f"bench_fuse: {exc}", file=sys.stderr)
        return 1
    table = report_table(results)
    header = (f"FUSE hot path: {args.files} files of {args.file_kb} KB and a {args.big_mb} MiB "
              f"file, warm (page cache and RAM tier of {ram_bytes / GIB:.2f} GiB), medians of "
              f"{args.passes} alternating passes, {args.read_kb} KiB reads")
    print(f"{header}\n\n{table}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"{header}\n\n{table}\n")
    if args.json:
        benchlib.write_json(args.json, {
            "benchmark": "bench_fuse", "machine": benchlib.machine_info(),
            "args": {k: v for k, v in vars(args).items()},
            "dataset": {"files": args.files, "file_bytes": args.file_kb * 1000,
                        "big_bytes": args.big_mb * MIB, "total_bytes": manifest.total_bytes},
            "ram_cache_bytes": ram_bytes, "configs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
