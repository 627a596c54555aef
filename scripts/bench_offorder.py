"""A reader that does not follow the published order: is it slowed down by the read-ahead?

Issue 13's cases 8 and 9. Many tiny files (default 200,000 of one byte, 1,000 per directory), a
shuffled order published for all of them, and one reader that reads a part of them (default the
first 50 directories, 50,000 files) in directory order, as a validation pass or another
sampler would (`find DIRS -type f | xargs cat`). The read-ahead then works on positions all
over the epoch while the reader waits on its own requests. Side by side in one run: the same
reader directly on the source, through a mount with no order, and through a mount with the
order published; medians of `--passes` rounds, fresh mounts each; and the ratio of the two
mounts' times round by round, with its median.

The mounts are up at once and the reader takes turns between them, a directory (1,000 files,
a third of a second) at a time, the mount that goes first rotating. Mounted one
after the other, each for its whole read, the ratio of a round spread from 0.66x to 1.29x on
these VMs (their speed drifts over seconds with their neighbours'), where the difference to
measure is a few per cent; taking turns, rounds agree within a few per cent. Neither mount is
credited with the other's work: after each directory the reader waits for that mount's daemon
to go quiet (the closes of its files are reported to it after the reader's close returned),
and that wait counts in the mount's time, as the read-ahead's filling of its window after
the order's publication counts in the order's; the table gives the waits apart (a quarter of a
second of a mount's twenty on 2026-12-02, alike with and without the order).

A third mount with no order, the same as the first, takes its turns beside them: its ratio to
the first, round by round, is the noise floor of the order's (two identical mounts differed by
4-9 % a round on these VMs, more than the order's cost to measure), and the median of the
order's rounds means something only where it stands clear of that. Which mount is made first
rotates from round to round, as the first place of the reader's turns does: the first made
ran a few per cent slower than the others, whatever it served.

It also reports what the daemon's bookkeeping costs per cached block (case 9): its resident
memory (VmRSS) after the read, less its RSS before it (once the source was scanned, and the
order published if there is one), over the blocks its RAM tier holds then (one per tiny file:
the files read with no order, the read-ahead window's with one), beside the RAM tier's own
count of the bytes it holds. The order's own memory (its arrays over the 200,000 files, a
fixed base) is the RSS after its publication less the RSS after the scan.

Usage: python scripts/bench_offorder.py [--files 200000] [--read-dirs 50] [--passes 3]
           [--workdir DIR] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from cachefs.order import permutation  # noqa: E402
from cachefs.publish import publish, source_file_count  # noqa: E402

FILES_PER_DIR = 1000
# the mounts, and the names of their mountpoints and state directories
MOUNTS = {"no order": "no-order", "order": "order", "no order again": "no-order-again"}
# the mount whose time the others' are compared with, round by round
BASE = "no order"
# a daemon is quiet once its threads ran under QUIET_CPU_S over QUIET_WINDOW_S (an idle one
# runs a pass over its overdue files every quarter second, well under a millisecond)
QUIET_WINDOW_S = 0.01
QUIET_CPU_S = 0.0005
QUIET_TIMEOUT_S = 30.0
SMOKE = {"files": 2000, "read_dirs": 1, "passes": 1}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200_000, help="one-byte files")
    parser.add_argument("--read-dirs", type=int, default=50,
                        help="directories the reader reads (1,000 files each)")
    parser.add_argument("--passes", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-offorder"))
    parser.add_argument("--json", type=Path, help="write every figure here")
    return benchlib.parse_args_with_smoke(parser, argv, SMOKE, "tiny sizes, one pass")


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


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise benchlib.BenchError(f"no VmRSS for process {pid}")


def daemon_ran_s(pid: int) -> float:
    """CPU seconds all the daemon's threads have run (the scheduler's nanoseconds)."""
    return sum(seconds for _, seconds in benchlib.threads_cpu_s(pid).values())


def until_quiet_s(pid: int) -> float:
    """Seconds until the daemon goes quiet (under QUIET_CPU_S of CPU over QUIET_WINDOW_S),
    the quiet window itself not counted: what it still does for a reader that is done (closes
    are reported to it in batches, after the reader's close returned; the read-ahead's
    completions)."""
    started_s = time.perf_counter()
    deadline_s = started_s + QUIET_TIMEOUT_S
    ran_s = daemon_ran_s(pid)
    while True:
        window_start_s = time.perf_counter()
        time.sleep(QUIET_WINDOW_S)
        now_ran_s = daemon_ran_s(pid)
        if now_ran_s - ran_s < QUIET_CPU_S or window_start_s > deadline_s:
            return window_start_s - started_s
        ran_s = now_ran_s


def through_mounts(args, source: Path, dirs: list[str], round_index: int
                   ) -> dict[str, tuple[float, float, dict, dict]]:
    """The mounts up at once, the reader taking turns between them directory by directory
    (each in each place of the turn as often: the mount that goes first rotates), so that a
    machine whose speed drifts over seconds (these VMs' neighbours) weighs on all alike. Each
    mount is charged the time its daemon takes to go quiet after each of its directories
    (`until_quiet_s`), so that none of its work lands in another's time, and the order's
    mount the time its read-ahead takes to fill the window after the order's publication.

    Per mount: the seconds, the seconds of them spent waiting for the daemon to go quiet,
    the daemon's memory (`rss_*` bytes, RAM tier blocks) and its CPU per file read
    (`daemon_cpu_ms_per_file`, `trio_cpu_ms_per_file`: the reader reads one file at a time,
    so what the trio thread spends per file is on its path)."""
    # the mount made first rotates too: made first in every round, a mount with no order took
    # 0.90-1.01x (median 0.96x) the time of one made last with no order either
    made = benchlib.rotated(MOUNTS.items(), round_index)
    with contextlib.ExitStack() as stack:
        mounts = {name: stack.enter_context(benchlib.cachefs_mount(
            source, args.workdir / f"mnt-{slug}", args.workdir / f"state-{slug}",
            ram_bytes=1 << 30)) for name, slug in made}
        pids, memory, cpu, seconds, waited = {}, {}, {}, {}, {}
        for name, mount in mounts.items():
            files = source_file_count(mount.mountpoint, 300)
            pids[name] = benchlib.daemon_pid(mount)
            memory[name] = {"rss_scanned": rss_bytes(pids[name])}
            cpu[name] = benchlib.DaemonCpu(mount)
            seconds[name] = waited[name] = 0.0
        # returns once the daemon took it (and made its arrays); its read-ahead then fills
        # the window, charged to the order's mount
        publish(mounts["order"].mountpoint, 0, permutation(files, 0, 0),
                next=permutation(files, 0, 1))
        waited["order"] += until_quiet_s(pids["order"])
        for name in mounts:
            memory[name]["rss_before"] = rss_bytes(pids[name])
        for index, directory in enumerate(dirs):
            for name in benchlib.rotated(mounts, index + round_index):
                seconds[name] += read_dirs(mounts[name].mountpoint, [directory])
                waited[name] += until_quiet_s(pids[name])
        figures = {}
        for name, mount in mounts.items():
            cpu_ms = cpu[name].per_file_ms(len(dirs) * FILES_PER_DIR)
            ram = mount.stats()["ram"]
            memory[name].update(rss_read=rss_bytes(pids[name]), blocks=ram["blocks"],
                                ram_bytes=ram["bytes"])
            figures[name] = (seconds[name] + waited[name], waited[name], memory[name], cpu_ms)
        return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    source = args.workdir / "data"
    make_files(source, args.files)
    dirs = [f"d{index:04d}" for index in range(args.read_dirs)]
    figures: dict[str, list[float]] = {"direct": [], **{name: [] for name in MOUNTS}}
    waits: dict[str, list[float]] = {name: [] for name in MOUNTS}
    memory: dict[str, list[dict]] = {name: [] for name in MOUNTS}
    cpu: dict[str, list[dict]] = {name: [] for name in MOUNTS}
    try:
        for round_index in range(args.passes):
            read_dirs(source, dirs)  # the source in the page cache, as for the mounts
            figures["direct"].append(read_dirs(source, dirs))
            for name, (seconds, waited_s, used, cpu_ms) in through_mounts(
                    args, source, dirs, round_index).items():
                figures[name].append(seconds)
                waits[name].append(waited_s)
                memory[name].append(used)
                cpu[name].append(cpu_ms)
    except benchlib.BenchError as exc:
        print(f"bench_offorder: {exc}", file=sys.stderr)
        return 1
    medians = {name: benchlib.median(values) for name, values in figures.items()}
    cpu_medians = {name: {key: benchlib.median([round_ms[key] for round_ms in rounds
                                                if key in round_ms])
                          for key in benchlib.DAEMON_CPU_KEYS}
                   for name, rounds in cpu.items() if all(rounds)}
    wait_medians = {name: benchlib.median(values) for name, values in waits.items()}
    rows = [[name, f"{seconds:.2f}", f"{seconds / medians[BASE]:.2f}",
             f"{wait_medians[name]:.2f}" if name in wait_medians else "-",
             *(f"{cpu_medians[name][key]:.3f}" if name in cpu_medians else "-"
               for key in benchlib.DAEMON_CPU_KEYS)]
            for name, seconds in medians.items()]
    # the mounts of a round read side by side: their ratio, round by round, is steadier than
    # the ratio of the medians
    round_ratios, again_ratios = ([mine / base for mine, base
                                   in zip(figures[name], figures[BASE], strict=True)]
                                  for name in ("order", "no order again"))
    print(f"{args.read_dirs * FILES_PER_DIR} of {args.files} one-byte files read in directory "
          f"order, medians of {args.passes}\n")
    print(benchlib.markdown_table(["reader", "seconds", "/ no order",
                                   "of which waiting for the daemon", "daemon CPU ms/file",
                                   "trio thread CPU ms/file"], rows))
    print(f"\norder / no order, round by round: "
          f"{', '.join(f'{ratio:.2f}x' for ratio in round_ratios)} "
          f"(median {benchlib.median(round_ratios):.2f}x)")
    print(f"no order again / no order, round by round (the noise floor): "
          f"{', '.join(f'{ratio:.2f}x' for ratio in again_ratios)} "
          f"(median {benchlib.median(again_ratios):.2f}x)")
    rows = []
    for name, rounds in memory.items():
        per_block = benchlib.median([(used["rss_read"] - used["rss_before"])
                                     / max(used["blocks"], 1) for used in rounds])
        last = rounds[-1]
        rows.append([name, last["blocks"], f"{last['rss_scanned'] / 2**20:.1f}",
                     f"{(last['rss_before'] - last['rss_scanned']) / 2**20:.1f}",
                     f"{last['rss_read'] / 2**20:.1f}", f"{last['ram_bytes'] / 2**20:.1f}",
                     f"{per_block:.0f}"])
    print("\nDaemon memory (last round; bytes per block: median)\n")
    print(benchlib.markdown_table(["mount", "blocks in RAM", "RSS scanned MiB",
                                   "order MiB", "RSS after MiB", "RAM tier MiB",
                                   "RSS bytes per block"], rows))
    if args.json:
        benchlib.write_json(args.json, {"benchmark": "bench_offorder", "args": vars(args),
                                        "seconds": figures, "medians": medians,
                                        "waits": waits,
                                        "round_ratios": round_ratios,
                                        "again_ratios": again_ratios,
                                        "memory": memory, "cpu": cpu})
    return 0


if __name__ == "__main__":
    sys.exit(main())
