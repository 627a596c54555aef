"""The FUSE hot path: cachefs against direct reads and the bare pyfuse3 passthrough, warm.

What it answers: how close cachefs serves cached files to a local page-cache read, and to the
ceiling of its own stack (pyfuse3 + trio). The data set (default 10,000 files of 110 KB and one
1 GiB file) is generated once; every contender gets a warm pass first (the source is in the
page cache, cachefs's RAM tier holds everything: its budget is larger than the data set), then
`--passes` rounds in which each case is read directly and through the mount, alternating which
goes first. Medians are compared, so each ratio comes from passes taken minutes apart at most.

Contenders (one mount at a time, `--contenders` picks):
- `bare`: scripts/passthrough.py, open/read/release, nothing else;
- `bare-keep`: the same answering OPEN with keep_cache (the kernel serves second passes);
- `cachefs`: `cachefs mount`, no order (the LRU baseline users compare with);
- `cachefs-order`: the same with the pass's order published before each pass of small files
  (a new shuffled permutation per pass, the next pass's as `next`).

Cases: files/s reading every small file whole (1 MiB reads) by `--readers` processes, worker i
of n taking every n-th file of the pass's permutation, as DataLoader workers do; MB/s reading the
big file sequentially in 1 MiB reads.

Reported per contender: the medians, the ratio to direct reads, the ratio to both bare
passthroughs when they ran, the daemon's resident memory (VmRSS) and the page cache the kernel
holds for the mount after the passes (mincore(2) over every file through the mount, which opens
each file once more), and for cachefs what its stats say of the timed passes (RAM hits, files
the kernel served whole) and the CPU its daemon, and its trio thread alone, spent per file in
the timed passes of small files and the half second after each, for the accounting of its last
closes (the median of those passes, of every `--readers` count; with the order, the pass's
publication is in it).

Usage:
    python scripts/bench_fuse.py [--files 10000] [--file-kb 110] [--big-mb 1024] [--passes 5]
        [--readers 4] [--contenders bare bare-keep cachefs cachefs-order] [--workdir DIR]
        [--mount-args '...'] [--json out.json] [--markdown out.md] [--smoke]
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
from benchlib import (GIB, KIB, MIB, BenchError, DatasetSpec, Manifest,  # noqa: E402
                      ReaderPool, ReadTask)
from cachefs.client import page_cache_bytes, stats_delta  # noqa: E402
from cachefs.order import permutation  # noqa: E402
from cachefs.publish import publish  # noqa: E402

log = logging.getLogger("bench_fuse")

CONTENDERS = ("bare", "bare-keep", "cachefs", "cachefs-order")
SMOKE = {"files": 60, "file_kb": 8, "big_mb": 4, "passes": 1, "readers": [2]}
ACCOUNTING_TAIL_S = 0.5  # after a pass, for its last closes' accounting (the CPU figures)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000, help="small files")
    parser.add_argument("--file-kb", type=int, default=110, help="size of a small file, KB")
    parser.add_argument("--big-mb", type=int, default=1024,
                        help="size of the big file, MiB (0: no big-file case)")
    parser.add_argument("--passes", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--readers", type=int, nargs="+", default=[4],
                        help="reader process counts for the small files")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=CONTENDERS, help="mounts to measure, in this order")
    parser.add_argument("--mount-args", default="",
                        help="extra arguments for every cachefs mount, e.g. '--fuse-tasks 4'")
    parser.add_argument("--read-kb", type=int, default=1024, help="read request size, KiB")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-fuse"),
                        help="data set, mount point and state (the data set is reused)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    return benchlib.parse_args_with_smoke(
        parser, argv, SMOKE, "tiny sizes, one pass: checks that the script works, in seconds")


# -- memory --------------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KIB
    return 0


# -- the run -------------------------------------------------------------------------------------

class Cases:
    """The timed cases of one round; small-file passes use one permutation per pass."""

    def __init__(self, args, manifest: Manifest, pool: ReaderPool):
        self.pool = pool
        self.read_bytes = args.read_kb * KIB
        self.small = manifest.indices_under("small/")
        self.big = manifest.indices_under("big/")
        self.readers = args.readers

    def names(self) -> list[str]:
        small = [f"files/s, {r} reader{'s' if r > 1 else ''}" for r in self.readers]
        return small + (["big file MB/s"] if len(self.big) else [])

    def files(self, name: str) -> int:
        return len(self.small) if name.startswith("files/s") else len(self.big)

    def permutation(self, pass_index: int) -> np.ndarray:
        return permutation(len(self.small), 0, pass_index)

    def run(self, name: str, root: Path, pass_index: int) -> float:
        root_bytes = os.fsencode(root)
        if name.startswith("files/s"):
            readers = int(name.split(", ")[1].split()[0])
            order = self.small[self.permutation(pass_index)]
            return self.pool.run(ReadTask(root_bytes, order, workers=readers,
                                          read_bytes=self.read_bytes)).files_per_s
        return self.pool.run(ReadTask(root_bytes, self.big,
                                      read_bytes=self.read_bytes)).mb_per_s


def measure(args, cases: Cases, manifest: Manifest, source: Path, ram_bytes: int,
            contender: str) -> dict:
    mountpoint = args.workdir / "mnt"
    cachefs = contender.startswith("cachefs")
    if cachefs:
        mount_cm = benchlib.cachefs_mount(source, mountpoint, args.workdir / "state",
                                          ram_bytes=ram_bytes,
                                          extra_args=args.mount_args.split())
    else:
        mount_cm = benchlib.passthrough_mount(source, mountpoint,
                                              keep_cache=contender == "bare-keep")
    log.info("contender %s", contender)
    passes = 0
    with mount_cm as mount:
        pid = benchlib.daemon_pid(mount) if cachefs else mount
        ordered = contender == "cachefs-order"
        if cachefs:
            benchlib.wait_for_manifest(mount)

        def pass_through(case: str) -> float:
            nonlocal passes
            if ordered and case.startswith("files/s"):
                # the manifest is every file, sorted: the small files' indices in it
                publish(mountpoint, passes, cases.small[cases.permutation(passes)],
                        next=cases.small[cases.permutation(passes + 1)])
            figure = cases.run(case, mountpoint, passes)
            if case.startswith("files/s"):
                passes += 1
            return figure

        start = mount.totals() if cachefs else None
        for case in cases.names():  # warm: source in the page cache, every block cached
            cases.run(case, source, 0)
            pass_through(case)
        figures = {case: {"direct": [], "mount": []} for case in cases.names()}
        # the warm pass's last closes counted before the timed ones start
        before = (mount.settled_totals(start, sum(map(cases.files, cases.names())))
                  if cachefs else None)
        timed_files = 0
        small_cpu: list[dict] = []  # the daemon's CPU over each timed pass of small files
        for round_index in range(args.passes):
            for case in cases.names():
                sides = ["direct", "mount"] if round_index % 2 == 0 else ["mount", "direct"]
                for side in sides:
                    if side == "direct":
                        figure = cases.run(case, source, passes)
                    else:
                        small = cachefs and case.startswith("files/s")
                        if small:
                            counted = mount.totals()
                            cpu = benchlib.DaemonCpu(mount)
                        figure = pass_through(case)
                        timed_files += cases.files(case)
                        if small:
                            # the pass's last closes are accounted a moment after it ends,
                            # which is part of what it cost the daemon; no stats request in
                            # the window (each one costs the daemon a snapshot of its stats)
                            time.sleep(ACCOUNTING_TAIL_S)
                            small_cpu.append(cpu.per_file_ms(cases.files(case)))
                            mount.settled_totals(counted, cases.files(case))
                    figures[case][side].append(figure)
        result = {"contender": contender, "cases": figures}
        if cachefs:
            result["stats_delta_timed"] = stats_delta(
                before, mount.settled_totals(before, timed_files))
            snapshot = mount.stats()
            result["kernel"] = snapshot.get("kernel")
            result["ram"] = snapshot["ram"]
            if small_cpu and all(small_cpu):  # {} where the daemon's CPU could not be read
                result["small_files_cpu_ms_per_file"] = {
                    key: benchlib.median([pass_ms[key] for pass_ms in small_cpu])
                    for key in benchlib.DAEMON_CPU_KEYS}
            else:
                log.warning("%s: the daemon's CPU could not be read", contender)
        result["daemon_rss_bytes"] = rss_bytes(pid)
        result["page_cache_bytes"] = page_cache_bytes(os.fsencode(mountpoint),
                                                      manifest.relpaths)
    for sides in figures.values():
        sides["direct_median"] = benchlib.median(sides["direct"])
        sides["mount_median"] = benchlib.median(sides["mount"])
        sides["ratio_direct"] = sides["mount_median"] / sides["direct_median"]
    return result


def add_bare_ratios(results: list[dict]) -> None:
    """cachefs's medians against each bare passthrough's, where they ran."""
    bare = {r["contender"]: r for r in results if r["contender"].startswith("bare")}
    for result in results:
        for case, sides in result["cases"].items():
            for name, other in bare.items():
                sides[f"ratio_{name}"] = (sides["mount_median"]
                                          / other["cases"][case]["mount_median"])


def report_table(results: list[dict], ram_bytes: int) -> str:
    bare_names = [r["contender"] for r in results if r["contender"].startswith("bare")]
    rows = []
    for result in results:
        for case, sides in result["cases"].items():
            rows.append([result["contender"], case, sides["direct_median"],
                         sides["mount_median"], f"{sides['ratio_direct']:.3f}",
                         *[f"{sides[f'ratio_{name}']:.2f}" for name in bare_names]])
    table = benchlib.markdown_table(
        ["contender", "case", "direct", "mount", "mount/direct",
         *[f"mount/{name}" for name in bare_names]], rows)
    memory_rows = []
    for result in results:
        delta = result.get("stats_delta_timed")
        kernel = result.get("kernel") or {}
        cpu_ms = result.get("small_files_cpu_ms_per_file", {})
        reads = delta["reads"] if delta else 0
        memory_rows.append([
            result["contender"], kernel.get("mode", "-"),
            f"{result['daemon_rss_bytes'] / MIB:.0f}",
            f"{result['page_cache_bytes'] / MIB:.0f}",
            f"{(result['daemon_rss_bytes'] + result['page_cache_bytes']) / MIB:.0f}",
            f"{delta['hits_ram'] / reads:.3f}" if reads else "-",
            kernel.get("whole_file_opens", "-"),
            *(f"{cpu_ms[key] * 1e3:.0f}" if key in cpu_ms else "-"
              for key in benchlib.DAEMON_CPU_KEYS)])
    memory = benchlib.markdown_table(
        ["contender", "data plane", "daemon RSS MiB", "page cache MiB", "sum MiB",
         "RAM-hit fraction", "opens served whole by the kernel (all passes)",
         "daemon CPU us/small file", "trio thread CPU us/small file"], memory_rows)
    return (f"{table}\n\nData plane (cachefs stats' kernel.mode), memory after the passes "
            f"(--ram-cache {ram_bytes / MIB:.0f} MiB) and "
            f"what cachefs counted in the timed passes:\n\n{memory}")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    source = args.workdir / "data"
    benchlib.generate_dataset(source, DatasetSpec("small", args.files, args.file_kb * 1000))
    if args.big_mb > 0:
        benchlib.generate_dataset(source, DatasetSpec("big", 1, args.big_mb * MIB))
    else:
        benchlib.remove_dataset(source, "big")
    manifest = Manifest.scan(source)
    # room for every block plus slack: block rounding, and nothing may be evicted
    ram_bytes = int(manifest.total_bytes * 1.25) + 256 * MIB
    results = []
    try:
        with ReaderPool(manifest, max(args.readers)) as pool:
            cases = Cases(args, manifest, pool)
            for contender in args.contenders:
                results.append(measure(args, cases, manifest, source, ram_bytes, contender))
    except BenchError as exc:
        print(f"bench_fuse: {exc}", file=sys.stderr)
        return 1
    add_bare_ratios(results)
    table = report_table(results, ram_bytes)
    header = (f"FUSE hot path: {args.files} files of {args.file_kb} KB and a {args.big_mb} MiB "
              f"file, warm (page cache, and cachefs's RAM tier of {ram_bytes / GIB:.2f} GiB), "
              f"medians of {args.passes} alternating passes, {args.read_kb} KiB reads")
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
            "ram_cache_bytes": ram_bytes, "contenders": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
