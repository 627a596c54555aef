"""Storage targets (issue 17): two slow servers of different latency under one source directory.

Two network storage servers (`../shared/tools/slowfs`: sshfs to an sshd in its own network
namespace, every packet held `--delays-us`, by default 500 us and 3,000 us) are mounted at
`SOURCE/t0` and `SOURCE/t1`, each holding `--files` files of `--file-kb` KB (generated once in
`WORKDIR/export-t*`). cachefs tells them apart by their devices (no `targets` in the order),
one read-ahead list each. Side by side in one run:

- `direct`: one process with `--threads` threads (32) reading the epoch's order from SOURCE,
  the storage's own ceiling; run before and after cachefs (its epochs bracket cachefs's, so
  that drift of the machine shows), each epoch in the order cachefs reads it;
- `cachefs`: one reader through a mount of SOURCE with RAM = `--ram-fraction` of the data
  set, the order (current and next) published before each epoch, as a trainer's sampler
  does; its epochs run back to back on one mount.

Before every timed epoch the source's files are evicted from the page cache (posix_fadvise
DONTNEED through the sshfs mounts, `benchlib.evict_files`): the pages a cachefs mount holds as
its RAM tier survive, as between a training job's epochs. The servers' own files (local to
this machine) stay cached for both contenders alike.

Per epoch: files/s of each contender and cachefs / direct (against the mean of the direct
epochs of the same order before and after), cachefs's stats delta (hits, misses, stall) and the
daemon's CPU; at the end, `cachefs stats --json`'s `targets`. The issue's bar: epoch 1 >= 0.9
and epoch 2 >= 1.2 of the 32-thread direct reader.

`--backend tmpfs` puts two tmpfs mounts in place of the servers (no latency, no network: a
check of the script, which `--smoke` uses). The servers are brought up at the start and always
taken down at the end, also on failure.

Usage: python scripts/bench_targets.py [--files 1500] [--file-kb 110] [--delays-us 500 3000]
           [--epochs 3] [--threads 32] [--ram-fraction 0.25] [--workdir DIR] [--json PATH]
           [--mount-args ARGS] [--backend slowfs|tmpfs] [--slowfs DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import BenchError, DatasetSpec, Manifest, ReaderPool, ReadTask  # noqa: E402

from cachefs.client import cachefs_command, stats_delta  # noqa: E402
from cachefs.order import permutation  # noqa: E402
from cachefs.publish import publish  # noqa: E402

log = logging.getLogger("bench_targets")

SLOWFS = Path(__file__).resolve().parents[2] / "shared" / "tools" / "slowfs"
SMOKE = {"files": 30, "epochs": 2, "threads": 4, "backend": "tmpfs"}
BAR = {1: 0.9, 2: 1.2}  # the issue's: epoch -> cachefs / direct at least


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1500, help="files on each server")
    parser.add_argument("--file-kb", type=int, default=110, help="file size, KB")
    parser.add_argument("--delays-us", type=int, nargs="+", default=[500, 3000],
                        help="per-packet delay of each server, one server each")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32, help="threads of the direct reader")
    parser.add_argument("--ram-fraction", type=float, default=0.25,
                        help="cachefs's RAM tier, as a fraction of the data set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the epochs' orders")
    parser.add_argument("--mount-args", default="", help="extra arguments for cachefs mount")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-targets"))
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--backend", choices=["slowfs", "tmpfs"], default="slowfs",
                        help="what serves each target's files")
    parser.add_argument("--slowfs", type=Path, default=SLOWFS,
                        help="the directory of slowfs-net-up.sh and slowfs-net-down.sh")
    args = benchlib.parse_args_with_smoke(parser, argv, SMOKE,
                                          "tiny sizes on tmpfs: checks that the script works")
    if args.files < 1 or args.epochs < 1 or args.threads < 1 or not 0 < args.ram_fraction:
        parser.error("--files, --epochs, --threads and --ram-fraction must be positive")
    return args


# -- the servers -------------------------------------------------------------------------------

class Servers:
    """The targets' servers, mounted at SOURCE/t<i>; `down` takes down whatever is up."""

    def __init__(self, args, source: Path):
        self.args = args
        self.source = source
        self.points = [source / f"t{index}" for index in range(len(args.delays_us))]
        self._up: list[int] = []

    def _slowfs_env(self, index: int) -> dict:
        state = self.args.workdir / f"slowfs-t{index}"
        return dict(os.environ, SLOWFS_STATE=str(state), SLOWFS_NS=f"cfsbench{index}")

    def up(self) -> None:
        for index, (point, delay_us) in enumerate(zip(self.points, self.args.delays_us,
                                                      strict=True)):
            export = self.args.workdir / f"export-t{index}"
            point.mkdir(parents=True, exist_ok=True)
            self._up.append(index)
            if self.args.backend == "tmpfs":
                subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
                shutil.copytree(export, point, dirs_exist_ok=True)
            else:
                done = subprocess.run([str(self.args.slowfs / "slowfs-net-up.sh"), str(export),
                                       str(point), str(delay_us)], env=self._slowfs_env(index),
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    raise BenchError(f"slowfs server t{index} did not come up: "
                                     f"{(done.stderr or done.stdout).strip()}")
            log.info("target t%d up at %s (%s, %d us)", index, point, self.args.backend,
                     delay_us)

    def down(self) -> None:
        while self._up:
            index = self._up.pop()
            if self.args.backend == "tmpfs":
                subprocess.run(["umount", "-l", str(self.points[index])], check=False)
            else:
                subprocess.run([str(self.args.slowfs / "slowfs-net-down.sh")],
                               env=self._slowfs_env(index), capture_output=True)
            log.info("target t%d down", index)


# -- the run -----------------------------------------------------------------------------------

class Run:
    def __init__(self, args, source: Path, manifest: Manifest, pool: ReaderPool):
        self.args = args
        self.source = source
        self.manifest = manifest
        self.pool = pool
        self.orders = [permutation(len(manifest), args.seed, epoch)
                       for epoch in range(args.epochs + 1)]
        self.records: list[dict] = []
        self.targets: list[dict] = []

    def _evict(self) -> float:
        started_s = time.perf_counter()
        benchlib.evict_files([self.source])
        return time.perf_counter() - started_s

    def _pass(self, task: ReadTask):
        before = benchlib.machine_times()
        result = self.pool.run(task)
        return result, benchlib.machine_ms_per_file(before, result.files)

    def _record(self, contender: str, epoch: int, result, machine: dict, **extra) -> None:
        self.records.append({"contender": contender, "epoch": epoch + 1, **result.to_json(),
                             **machine, **extra})
        log.info("%-9s epoch %d: %6.2f s, %6.0f files/s", contender, epoch + 1, result.wall_s,
                 result.files_per_s)

    def direct(self, name: str) -> None:
        for epoch in range(self.args.epochs):
            gap_s = self._evict()
            result, machine = self._pass(ReadTask(os.fsencode(self.source), self.orders[epoch],
                                                  threads=self.args.threads))
            self._record(name, epoch, result, machine, gap_s=round(gap_s, 3))

    def cachefs(self) -> None:
        args = self.args
        mountpoint = args.workdir / "mnt"
        ram_bytes = int(args.ram_fraction * self.manifest.total_bytes)
        self._evict()
        with benchlib.cachefs_mount(self.source, mountpoint, args.workdir / "state",
                                    ram_bytes=ram_bytes,
                                    extra_args=args.mount_args.split()) as mount:
            files = benchlib.wait_for_manifest(mount)
            if files != len(self.manifest):
                raise BenchError(f"the daemon sees {files} files, the benchmark "
                                 f"{len(self.manifest)}")
            for epoch in range(args.epochs):
                gap_s = self._evict() if epoch else 0.0
                publish(mountpoint, epoch, self.orders[epoch], next=self.orders[epoch + 1])
                before = mount.totals()
                daemon_cpu = benchlib.DaemonCpu(mount)
                result, machine = self._pass(ReadTask(os.fsencode(mountpoint),
                                                      self.orders[epoch], workers=1))
                delta = stats_delta(before, mount.settled_totals(before, result.files))
                delta.update(daemon_cpu.per_file_ms(result.files))
                self._record("cachefs", epoch, result, machine, gap_s=round(gap_s, 3),
                             stats=delta)
            shown = subprocess.run(cachefs_command("stats", "--json", mountpoint),
                                   capture_output=True, text=True, timeout=60)
            if shown.returncode != 0:
                raise BenchError(f"cachefs stats --json failed: {shown.stderr.strip()}")
            # (a cachefs before storage targets has none: the script measures it too)
            self.targets = json.loads(shown.stdout).get("targets", [])

    def ratios(self) -> list[dict]:
        """Per epoch: cachefs's files/s over the mean of the direct epochs of that order."""
        rows = []
        for epoch in range(1, self.args.epochs + 1):
            direct = [r["files_per_s"] for r in self.records
                      if r["contender"].startswith("direct") and r["epoch"] == epoch]
            mine = next(r for r in self.records
                        if r["contender"] == "cachefs" and r["epoch"] == epoch)
            direct_mean = sum(direct) / len(direct)
            ratio = mine["files_per_s"] / direct_mean
            rows.append({"epoch": epoch, "direct_files_per_s": [round(d, 1) for d in direct],
                         "cachefs_files_per_s": mine["files_per_s"],
                         "ratio": round(ratio, 3), "bar": BAR.get(epoch),
                         "meets_bar": None if epoch not in BAR else ratio >= BAR[epoch]})
        return rows


# -- output ------------------------------------------------------------------------------------

def report(run: Run, ratios: list[dict]) -> str:
    rows = []
    for r in run.records:
        stats = r.get("stats") or {}
        rows.append([r["contender"], r["epoch"], r["wall_s"], r["files_per_s"],
                     stats.get("hits_ram"), stats.get("prefetched"), stats.get("misses"),
                     stats.get("stall_s"), r["machine_cpu_ms_per_file"], r["steal_ms_per_file"],
                     stats.get("daemon_cpu_ms_per_file"), stats.get("trio_cpu_ms_per_file")])
    epochs = benchlib.markdown_table(
        ["contender", "epoch", "time s", "files/s", "hits_ram", "prefetched", "misses",
         "stall s", "machine CPU ms/file", "stolen ms/file", "daemon CPU ms/file",
         "trio thread CPU ms/file"],
        rows)
    ratio_table = benchlib.markdown_table(
        ["epoch", "direct files/s (before, after)", "cachefs files/s", "cachefs / direct",
         "bar"],
        [[r["epoch"], ", ".join(f"{d:.0f}" for d in r["direct_files_per_s"]),
          r["cachefs_files_per_s"], f"{r['ratio']:.2f}",
          "-" if r["bar"] is None else f">= {r['bar']} {'met' if r['meets_bar'] else 'NOT met'}"]
         for r in ratios])
    targets = benchlib.markdown_table(
        ["target", "by", "items", "slots", "depth", "requests", "MB", "mean ms", "p99 ms",
         "misses", "stall s", "batches"],
        [[t["target"], t["by"], t["items"], t["slots"], t["depth"], t["requests"],
          t["bytes"] / 1e6, _ms(t["mean_latency_s"]), _ms(t["p99_latency_s"]), t["misses"],
          t["stall_s"], t["batches"]] for t in run.targets])
    return f"{epochs}\n\n{ratio_table}\n\n`cachefs stats --json` targets:\n\n{targets}"


def _ms(seconds) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for index in range(len(args.delays_us)):
        benchlib.generate_dataset(args.workdir / f"export-t{index}",
                                  DatasetSpec("small", args.files, args.file_kb * 1000,
                                              seed=index))
    source = args.workdir / "source"
    servers = Servers(args, source)
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(servers.down)
            servers.up()
            manifest = Manifest.scan(source)
            with ReaderPool(manifest, 1) as pool:
                run = Run(args, source, manifest, pool)
                run.direct("direct")
                run.cachefs()
                run.direct("direct-after")
    except BenchError as exc:
        print(f"bench_targets: {exc}", file=sys.stderr)
        return 1
    ratios = run.ratios()
    header = (f"{len(args.delays_us)} targets ({args.backend}, "
              f"{', '.join(f'{d} us' for d in args.delays_us)} per packet), {args.files} files "
              f"of {args.file_kb} KB each, {manifest.total_bytes / 1e6:.0f} MB; cachefs: one "
              f"reader, RAM {args.ram_fraction:g} of the data set; direct: {args.threads} "
              f"threads; {args.epochs} epochs")
    print(f"{header}\n\n{report(run, ratios)}")
    if args.json is not None:
        benchlib.write_json(args.json, {
            "benchmark": "bench_targets", "machine": benchlib.machine_info(),
            "description": header, "args": vars(args),
            "dataset": {"files": len(manifest), "total_bytes": manifest.total_bytes},
            "records": run.records, "ratios": ratios, "targets": run.targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
