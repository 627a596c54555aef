"""Side-by-side epochs: direct reads of a source vs. cachefs with and without the order.

Issue 6's suite. A data set (generated, or any directory given with `--source`) is read for
`--epochs` epochs, each in a new permutation (`cachefs.order.permutation(N, seed, epoch)`), by
every contender in the same run:

- `direct-1`, `direct-N`: N reader processes on the source, worker i taking every N-th file
  of the epoch's order, or with `--batch-files B` every N-th batch of B files, as a
  DataLoader's workers do (cachefs contenders read with the same readers);
- `direct-Tthreads`: one process with T threads (default 32) on the source: the storage's own
  ceiling for parallel reads;
- `cachefs-plain@F`: a cachefs mount with a RAM tier of F x the data set (and an SSD tier of
  `--ssd-fraction` x the data set if asked) and no order: its plain caching, LRU in RAM, which
  is also the LRU baseline;
- `cachefs-order@F`: the same mount with the order published at the start of each epoch
  (current and next), as a trainer's sampler does.

`--source-delay-ms D` makes the source slow: cachefs mounts get `--source-delay-ms D`, and the
direct readers sleep D before every open and before every read request that returns data.

Fairness rules:
- The direct contenders keep no state across epochs, so their epochs are interleaved, in a
  rotated order each epoch. A cachefs mount keeps state, so its epochs run back to back, as a
  trainer's do; each mount starts empty (a fresh daemon, its SSD directory emptied).
- Unless `--no-drop-caches`, the page cache is dropped (`sync; echo 3 > drop_caches`, root)
  before every timed epoch of every contender, so no one reads the source from RAM the others
  paid for. With `--drop source`, only the source's files are evicted (posix_fadvise
  DONTNEED over every file of `--source` and of each `--source-backing` directory, such as the
  directory a network mount serves): the source is as cold, but the pages a cachefs mount
  holds as its RAM tier survive, as they do between the epochs of a training job, where
  nothing drops the whole page cache. The time this takes between a mount's epochs is
  recorded as `gap_s`: an ordered mount reads ahead during it, as it would during a trainer's
  epoch-end work.
- Per epoch: wall time, files/s, MB/s, the readers' time per file in open() and in reads
  (for one reader, where its time per file goes), the machine's CPU time per file (every
  process: reader, daemon, the storage's client and server, the kernel; on a machine of few
  cores the CPU is what a fast contender runs out of); for cachefs also the deltas of its stats
  (hits_ram, hits_ssd, prefetched, misses, backend_bytes, stall_s), the daemon's own CPU time
  per file, and the hit rate (hits_ram + hits_ssd) / reads, against the capacity bound C/N (no
  policy can do better from one epoch to the next with a new random permutation).

Rounds (`--rounds R`): every contender runs R times, the direct ones first in even rounds and
last in odd ones (these machines are noisy: one run's ratio moves by 10%). Each record carries
its round; the report gives every epoch's speedup over `direct-N` in each round and the median
of the rounds, and the plot and summary use per-epoch medians.

Output: JSON with every figure, a Markdown table (printed and written), PNG plots of the epoch
time and hit rate per contender (skipped with a message without matplotlib).

Usage:
    python scripts/bench.py [--dataset small|mixed|shards] [--files N] [--file-kb KB]
        [--source DIR] [--source-delay-ms D] [--cache-fractions 0.25 0.5 1.0]
        [--ssd-fraction F] [--epochs 3] [--readers 4] [--batch-files 1] [--threads 32]
        [--rounds 1] [--out DIR] [--no-drop-caches | --drop all|source
        [--source-backing DIR]] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import KIB, BenchError, DatasetSpec, Manifest, ReaderPool, ReadTask  # noqa: E402

from cachefs.client import stats_delta, stats_totals  # noqa: E402
from cachefs.errors import OrderError  # noqa: E402
from cachefs.order import permutation  # noqa: E402
from cachefs.publish import publish  # noqa: E402

log = logging.getLogger("bench")

DATASET_DEFAULTS = {"small": (5000, 110), "mixed": (3000, 110), "shards": (64, 64 * 1024)}
CONTENDER_KINDS = ("direct-1", "direct-n", "direct-threads", "cachefs-plain", "cachefs-order")
MIN_RAM_BYTES = 64 * KIB
# the stats key of the daemon's CPU a file by kind of thread (benchlib.DaemonCpu.by_thread_ms)
BY_THREAD_KEY = "daemon_cpu_by_thread_ms_per_file"
# ... and of the kernel's requests the daemon answered a file, by kind (`fuse_requests` of
# `cachefs stats`; GETXATTR left out: the benchmark's own questions for the stats)
REQUESTS_KEY = "fuse_requests_per_file"
SMOKE = {"files": 40, "file_kb": 64, "epochs": 3, "readers": 2, "threads": 4,
         "cache_fractions": [0.5], "no_drop_caches": True}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(DATASET_DEFAULTS), default="small",
                        help="kind of generated data set")
    parser.add_argument("--files", type=int, help="files to generate [small 5000, mixed 3000, "
                                                  "shards 64]")
    parser.add_argument("--file-kb", type=int, help="file size, KB (mixed: the median) "
                                                    "[110; shards 65536]")
    parser.add_argument("--source", type=Path, help="read this directory instead of generating")
    parser.add_argument("--source-delay-ms", type=float, default=0.0,
                        help="latency added to every source open and read, both ways")
    parser.add_argument("--cache-fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                        help="RAM tier budgets as fractions of the data set")
    parser.add_argument("--ssd-fraction", type=float, default=0.0,
                        help="add an SSD tier of this fraction of the data set")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every contender this many times, alternated; the report "
                             "gives each epoch's speedup per round and the median [1]")
    parser.add_argument("--readers", type=int, default=4, help="N: reader processes")
    parser.add_argument("--threads", type=int, default=32, help="threads of the ceiling reader")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDER_KINDS,
                        default=list(CONTENDER_KINDS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the epoch permutations")
    parser.add_argument("--read-kb", type=int, default=1024, help="read request size, KiB")
    parser.add_argument("--batch-files", type=int, default=1,
                        help="files a reader takes at a time (a DataLoader batch): reader i of "
                             "N reads batches i, i+N, ... [1]")
    parser.add_argument("--mount-args", default="", help="extra arguments for cachefs mount")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench"),
                        help="generated data sets, mount point, state, SSD tier")
    parser.add_argument("--out", type=Path, help="results directory [WORKDIR/results]")
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="do not drop the page cache before each epoch (not root, or a "
                             "remote source)")
    parser.add_argument("--drop", choices=["all", "source"], default="all",
                        help="what is dropped before each epoch: the whole page cache, or the "
                             "source's files only (the mount's pages stay) [all]")
    parser.add_argument("--source-backing", type=Path, action="append", default=[],
                        help="with --drop source: a directory whose files back the source "
                             "(a network mount's export), evicted too; repeatable")
    args = benchlib.parse_args_with_smoke(
        parser, argv, SMOKE, "tiny sizes: checks that the script works, in seconds")
    if args.smoke:
        args.source_delay_ms = args.source_delay_ms or 1.0
    files, file_kb = DATASET_DEFAULTS[args.dataset]
    args.files = args.files or files
    args.file_kb = args.file_kb or file_kb
    if args.epochs < 1 or args.readers < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--epochs, --readers, --threads and --rounds must be at least 1")
    if any(not 0 < f for f in args.cache_fractions):
        parser.error("--cache-fractions must be positive")
    args.out = args.out or args.workdir / "results"
    return args


class Run:
    """One benchmark run: the source, its orders, the reader pool and every epoch's figures."""

    def __init__(self, args, source: Path, manifest: Manifest, pool: ReaderPool):
        self.args = args
        self.source = source
        self.manifest = manifest
        self.pool = pool
        self.orders = [permutation(len(manifest), args.seed, epoch)
                       for epoch in range(args.epochs + 1)]
        self.delay_s = args.source_delay_ms / 1000.0
        self.records: list[dict] = []
        self.round = 0  # the round the records made now belong to (`run_all`)

    def _drop(self) -> float:
        if self.args.no_drop_caches:
            return 0.0
        started_s = time.perf_counter()
        if self.args.drop == "source":
            benchlib.evict_files([self.source, *self.args.source_backing])
        else:
            benchlib.drop_page_cache()
        return time.perf_counter() - started_s

    def _read_pass(self, task: ReadTask):
        """One timed pass, and the machine's CPU per file during it (ms, all processes) with
        the time stolen from it (`benchlib.machine_ms_per_file`)."""
        before = benchlib.machine_times()
        result = self.pool.run(task)
        return result, benchlib.machine_ms_per_file(before, result.files)

    def _record(self, contender: str, fraction, epoch: int, result, **extra) -> dict:
        record = {"contender": contender, "cache_fraction": fraction, "epoch": epoch,
                  "round": self.round, **result.to_json(), **extra}
        self.records.append(record)
        log.info("%-22s epoch %d: %7.2f s, %8.0f files/s%s", contender, epoch, result.wall_s,
                 result.files_per_s, f", hit rate {extra['hit_rate']:.2f}"
                 if extra.get("hit_rate") is not None else "")
        return record

    # -- direct --------------------------------------------------------------------------------

    def direct_contenders(self) -> list[tuple[str, dict]]:
        n, threads = self.args.readers, self.args.threads
        wanted = self.args.contenders
        contenders = []
        if "direct-1" in wanted:
            contenders.append(("direct-1", {"workers": 1}))
        if "direct-n" in wanted and n > 1:
            contenders.append((f"direct-{n}", {"workers": n}))
        if "direct-threads" in wanted:
            contenders.append((f"direct-{threads}threads", {"threads": threads}))
        return contenders

    def run_direct(self) -> None:
        contenders = self.direct_contenders()
        root = os.fsencode(self.source)
        for epoch in range(self.args.epochs):
            shift = epoch % max(1, len(contenders))
            for name, shape in contenders[shift:] + contenders[:shift]:
                gap_s = self._drop()
                result, machine = self._read_pass(ReadTask(
                    root, self.orders[epoch], delay_s=self.delay_s,
                    read_bytes=self.args.read_kb * KIB, batch_files=self.args.batch_files,
                    **shape))
                self._record(name, None, epoch, result, gap_s=round(gap_s, 3), **machine)

    # -- cachefs -------------------------------------------------------------------------------

    def run_cachefs(self, fraction: float, ordered: bool) -> None:
        args = self.args
        name = f"cachefs-{'order' if ordered else 'plain'}@{fraction:g}"
        total = self.manifest.total_bytes
        ssd_dir = args.workdir / "ssd" if args.ssd_fraction > 0 else None
        if ssd_dir is not None:
            shutil.rmtree(ssd_dir, ignore_errors=True)
            ssd_dir.mkdir(parents=True, mode=0o700)  # only ours (cachefs/cache/ssd.py)
        mountpoint = args.workdir / "mnt"
        self._drop()
        with benchlib.cachefs_mount(
                self.source, mountpoint, args.workdir / "state",
                ram_bytes=self.ram_bytes(fraction), ssd_dir=ssd_dir,
                ssd_bytes=int(args.ssd_fraction * total), source_delay_ms=args.source_delay_ms,
                extra_args=args.mount_args.split()) as mount:
            files = benchlib.wait_for_manifest(mount)
            if files != len(self.manifest):
                raise BenchError(f"the daemon sees {files} files, the benchmark "
                                 f"{len(self.manifest)}: is the source changing?")
            for epoch in range(args.epochs):
                gap_s = self._drop() if epoch else 0.0
                # counted from before the publication: the read-ahead it starts is the
                # epoch's (its source reads landed between a publish and a later snapshot)
                snapshot = mount.stats()  # one question for both
                before, requests_before = stats_totals(snapshot), snapshot["fuse_requests"]
                daemon_cpu = benchlib.DaemonCpu(mount)
                if ordered:
                    try:
                        publish(mountpoint, epoch, self.orders[epoch],
                                next=self.orders[epoch + 1])
                    except OrderError as exc:
                        raise BenchError(f"{name}: publish failed: {exc}") from None
                result, machine = self._read_pass(ReadTask(
                    os.fsencode(mountpoint), self.orders[epoch], workers=args.readers,
                    read_bytes=args.read_kb * KIB, batch_files=args.batch_files))
                delta = stats_delta(before, mount.settled_totals(before, result.files))
                # what the daemon costs per file read, read-ahead and serving together
                delta.update(daemon_cpu.per_file_ms(result.files))
                # None where the daemon's CPU could not be read: no round of zeros
                delta[BY_THREAD_KEY] = daemon_cpu.by_thread_ms(result.files) or None
                requests = mount.stats()["fuse_requests"]
                delta[REQUESTS_KEY] = {
                    op: round((count - requests_before.get(op, 0)) / result.files, 3)
                    for op, count in requests.items()
                    if op != "getxattr" and count != requests_before.get(op, 0)}
                hits = delta["hits_ram"] + delta["hits_ssd"]
                self._record(name, fraction, epoch, result, gap_s=round(gap_s, 3), **machine,
                             stats=delta,
                             hit_rate=hits / delta["reads"] if delta["reads"] else None)

    def run_all(self) -> None:
        kinds = [k for k in (False, True)
                 if ("cachefs-order" if k else "cachefs-plain") in self.args.contenders]
        for round_index in range(self.args.rounds):
            self.round = round_index
            if round_index % 2 == 0:
                self.run_direct()
            for index, fraction in enumerate(self.args.cache_fractions):
                for ordered in (kinds if index % 2 == 0 else kinds[::-1]):
                    self.run_cachefs(fraction, ordered)
            if round_index % 2 == 1:
                self.run_direct()

    def ram_bytes(self, fraction: float) -> int:
        return max(int(fraction * self.manifest.total_bytes), MIN_RAM_BYTES)

    def capacity_bound(self, fraction) -> float | None:
        """C/N of a cachefs contender: what its tiers hold, as a fraction of the data set."""
        if fraction is None:
            return None
        return min(1.0, self.ram_bytes(fraction) / self.manifest.total_bytes
                   + self.args.ssd_fraction)


# -- output ----------------------------------------------------------------------------------------

def markdown_report(run: Run) -> str:
    rows = []
    for r in run.records:
        stats = r.get("stats") or {}
        rows.append([r["contender"], r["round"], r["epoch"], r["wall_s"], r["files_per_s"],
                     r["mb_per_s"],
                     stats.get("hits_ram"), stats.get("hits_ssd"), stats.get("prefetched"),
                     stats.get("misses"),
                     stats["backend_bytes"] / 1e6 if stats else None,
                     stats.get("stall_s"), r.get("open_ms_per_file"),
                     r.get("read_ms_per_file"), r.get("machine_cpu_ms_per_file"),
                     r.get("steal_ms_per_file"), r.get("readers_cpu_ms_per_file"),
                     stats.get("daemon_cpu_ms_per_file"),
                     stats.get("trio_cpu_ms_per_file"), storage_cpu_ms(r),
                     f"{r['hit_rate']:.3f}" if r.get("hit_rate") is not None else None,
                     run.capacity_bound(r["cache_fraction"])])
    return benchlib.markdown_table(
        ["contender", "round", "epoch", "time s", "files/s", "MB/s", "hits_ram", "hits_ssd",
         "prefetched", "misses", "backend MB", "stall s", "open ms/file", "read ms/file",
         "machine CPU ms/file", "stolen ms/file", "readers CPU ms/file", "daemon CPU ms/file",
         "trio thread CPU ms/file", "storage and rest CPU ms/file", "hit rate", "C/N"], rows)


def by_kind_table(run: Run, key: str, heading: str) -> str:
    """A figure a file by kind (the stats' `key`: BY_THREAD_KEY, where the daemon's time
    goes; REQUESTS_KEY, what the kernel asked it), each contender's epochs, medians over the
    rounds (a kind a round has not counts 0 in it), after `heading`."""
    values: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in run.records:
        by_kind = (r.get("stats") or {}).get(key)
        if by_kind is not None:
            values.setdefault((r["contender"], r["epoch"]), []).append(by_kind)
    if not values:
        return ""
    totals: dict[str, float] = {}
    for rounds in values.values():
        for by_kind in rounds:
            for kind, figure in by_kind.items():
                totals[kind] = totals.get(kind, 0.0) + figure
    kinds = sorted(totals, key=lambda kind: -totals[kind])
    rows = [[name, epoch, *(benchlib.median([by_kind.get(kind, 0.0) for by_kind in rounds])
                            for kind in kinds)]
            for (name, epoch), rounds in values.items()]
    return f"{heading}\n\n" + benchlib.markdown_table(["contender", "epoch", *kinds], rows)


def storage_cpu_ms(record: dict) -> float | None:
    """The machine's CPU per file that neither the readers nor the daemon spent: the
    storage's client and server (sshfs, ssh, sshd and the packet delay, over slowfs), the
    kernel's threads, anything else running (not the time the hypervisor stole: that is
    `steal_ms_per_file`)."""
    machine, readers = record.get("machine_cpu_ms_per_file"), record.get("readers_cpu_ms_per_file")
    if machine is None or readers is None:
        return None
    daemon = (record.get("stats") or {}).get("daemon_cpu_ms_per_file", 0.0)
    return round(machine - readers - daemon, 3)


def epoch_medians(run: Run, field: str) -> dict[str, list[float]]:
    """Per contender, the median over the rounds of `field` (of a record) in each epoch."""
    values: dict[str, dict[int, list[float]]] = {}
    for r in run.records:
        values.setdefault(r["contender"], {}).setdefault(r["epoch"], []).append(
            r.get(field) or 0.0)  # direct readers have no hit rate
    return {name: [benchlib.median(by_epoch[epoch]) for epoch in sorted(by_epoch)]
            for name, by_epoch in values.items()}


def baseline_name(names) -> str | None:
    """The contender the speedups are over: direct-N, else the first."""
    names = list(names)
    return next((name for name in names if name.startswith("direct-")
                 and not name.endswith("threads") and name != "direct-1"),
                next(iter(names), None))


def summary_table(run: Run) -> str:
    """Mean epoch time per contender over the epochs after the first (each epoch's median of
    the rounds), and the speedup."""
    by_name = epoch_medians(run, "wall_s")
    baseline_name_ = baseline_name(by_name)
    later = {name: (times[1:] or times) for name, times in by_name.items()}
    baseline = (sum(later[baseline_name_]) / len(later[baseline_name_]) if baseline_name_
                else None)
    rows = []
    for name, times in later.items():
        mean_s = sum(times) / len(times)
        rows.append([name, by_name[name][0], mean_s,
                     f"{baseline / mean_s:.2f}x" if baseline and mean_s else None])
    return (f"Speedup against {baseline_name_} (mean of epochs after the first):\n\n"
            + benchlib.markdown_table(["contender", "epoch 0 s", "later epochs s (mean)",
                                       "speedup"], rows))


def round_speedups(run: Run) -> list[dict]:
    """Every epoch's speedup of each cachefs contender over direct-N in each round (the
    baseline's epoch of the same round), and their median."""
    walls = {(r["contender"], r["round"], r["epoch"]): r["wall_s"] for r in run.records}
    base = baseline_name(dict.fromkeys(r["contender"] for r in run.records))
    rows = []
    for name in dict.fromkeys(r["contender"] for r in run.records):
        if name.startswith("direct"):
            continue
        for epoch in range(run.args.epochs):
            ratios = [walls[(base, round_index, epoch)] / walls[(name, round_index, epoch)]
                      for round_index in range(run.args.rounds)
                      if (base, round_index, epoch) in walls
                      and walls.get((name, round_index, epoch))]
            if ratios:
                rows.append({"contender": name, "epoch": epoch, "speedups": ratios,
                             "median": benchlib.median(ratios)})
    return rows


def rounds_table(run: Run) -> str:
    rows = [[row["contender"], row["epoch"],
             ", ".join(f"{ratio:.2f}x" for ratio in row["speedups"]), f"{row['median']:.2f}x"]
            for row in round_speedups(run)]
    return (f"Each epoch's speedup against {baseline_name(r['contender'] for r in run.records)}"
            f", per round ({run.args.rounds}) and median:\n\n"
            + benchlib.markdown_table(["contender", "epoch", "speedup per round", "median"],
                                      rows))


def plot(run: Run, path: Path) -> str:
    plt = benchlib.pyplot()
    if plt is None:
        return "PNG skipped: matplotlib is not installed (pip install matplotlib)"
    figure, (time_axes, hit_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    walls, hit_rates = epoch_medians(run, "wall_s"), epoch_medians(run, "hit_rate")
    for name, times in walls.items():
        epochs = list(range(len(times)))
        style = "--" if name.startswith("direct") else "-"
        line, = time_axes.plot(epochs, times, style, marker="o", label=name)
        if not name.startswith("direct"):
            hit_axes.plot(epochs, hit_rates[name], style, marker="o", color=line.get_color(),
                          label=name)
    for fraction in run.args.cache_fractions:
        bound = run.capacity_bound(fraction)
        hit_axes.axhline(bound, color="grey", linestyle=":", linewidth=1)
        hit_axes.annotate(f"C/N = {bound:g}", (0, bound), xytext=(2, 2),
                          textcoords="offset points", fontsize=8, color="grey")
    time_axes.set(xlabel="epoch", ylabel="epoch time (s)", title="Epoch time")
    hit_axes.set(xlabel="epoch", ylabel="(hits_ram + hits_ssd) / reads", ylim=(0, 1.05),
                 title="Hit rate (dotted: capacity bound C/N)")
    for axes in (time_axes, hit_axes):
        axes.set_xticks(range(run.args.epochs))
        axes.grid(alpha=0.3)
    time_axes.legend(fontsize=7)
    hit_axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"PNG: {path}"


def describe(run: Run, source_label: str) -> str:
    args = run.args
    drop = ("page cache NOT dropped (--no-drop-caches): direct reads may come from RAM"
            if args.no_drop_caches else "page cache dropped before every timed epoch"
            if args.drop == "all" else "the source's pages evicted before every timed epoch")
    delay = (f", source delay {args.source_delay_ms:g} ms per open and read"
             if args.source_delay_ms else "")
    return (f"{source_label}: {len(run.manifest)} files, {run.manifest.total_bytes / 1e6:.1f} MB"
            f"{delay}; {args.epochs} epochs"
            f"{f' x {args.rounds} rounds' if args.rounds > 1 else ''}, {args.readers} readers, "
            f"{args.read_kb} KiB reads; "
            f"{drop}")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.source is not None:
        source = args.source.absolute()
        if not source.is_dir():
            print(f"bench: {source} is not a directory", file=sys.stderr)
            return 2
        label = f"source {source}"
    else:
        source = args.workdir / f"data-{args.dataset}"
        benchlib.generate_dataset(source, DatasetSpec(args.dataset, args.files,
                                                      args.file_kb * 1000))
        label = f"generated {args.dataset} data set ({args.files} x {args.file_kb} KB)"
    manifest = Manifest.scan(source)
    if len(manifest) == 0:
        print(f"bench: no regular files under {source}", file=sys.stderr)
        return 2
    try:
        with ReaderPool(manifest, args.readers) as pool:
            run = Run(args, source, manifest, pool)
            run.run_all()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    header = describe(run, label)
    report = (f"{header}\n\n{markdown_report(run)}\n\n{summary_table(run)}\n\n"
              f"{rounds_table(run)}\n\n"
              + by_kind_table(run, BY_THREAD_KEY, "The daemon's CPU a file by thread, ms "
                              f"(medians over the rounds; {benchlib.TRIO_THREAD}: the main "
                              "thread):")
              + "\n\n" + by_kind_table(run, REQUESTS_KEY, "The kernel's requests the daemon "
                                       "answered, a file, by kind (medians over the rounds):"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(report + "\n")
    benchlib.write_json(args.out / "bench.json", {
        "benchmark": "bench", "machine": benchlib.machine_info(), "description": header,
        "args": vars(args), "source": str(source),
        "dataset": {"files": len(manifest), "total_bytes": manifest.total_bytes},
        "page_cache_dropped": not args.no_drop_caches,
        "dropped": "none" if args.no_drop_caches else args.drop,
        "capacity_bounds": {f"{f:g}": run.capacity_bound(f) for f in args.cache_fractions},
        "records": run.records, "speedups": round_speedups(run)})
    # the figures are on disk before the plot is tried
    print(f"{report}\n\n{plot(run, args.out / 'bench-epochs.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
