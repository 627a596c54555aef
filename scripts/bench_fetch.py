"""The source's block reads, as the read-ahead makes them: the read pool against Python threads.

`Source.read_block` of every file of a directory, `--threads` at once (the read-ahead's
window), inside a trio run whose thread is also busy with other Python work, as the daemon's
is (`--busy`: the share of the trio thread a task spends in Python between its awaits). Side by
side in each round, the order rotating:
- `direct`: the same files read by plain Python threads (open, read, close), no trio, nothing
  else running: what a reader process pays;
- `threads`: `read_block` in Python worker threads (cachefs.threads), which release and take
  back the GIL at each system call;
- `read pool`: `read_block` through cachefs/read_pool.py, whose threads never take the GIL.
For each: files/s, the process's CPU per file (all threads; the busy task's own CPU left out),
context switches per file, and how much work the busy task got done (its rate against the
`threads` contender's: the daemon's other work, which the reads must not slow). Medians of
`--rounds`; the source's page cache is dropped before each read (`--source-backing` too, for a
network mount of a local directory, as in scripts/bench.py).

`--cpu-load CORES` keeps that much of the machine's CPU busy in other processes for the whole
run (a process per core, each spinning a share of every 10 ms): what the readers' storage
client gets when a daemon beside it takes that CPU. On network storage served by a local
client (sshfs and ssh on the same two cores), the `direct` files/s with and without the load
say what each core the daemon takes costs the storage.

Usage: python scripts/bench_fetch.py --source DIR [--source-backing DIR] [--files 3000]
           [--threads 64] [--busy 0.5] [--cpu-load 0] [--rounds 3] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402
from cachefs import read_pool  # noqa: E402
from cachefs.source import Source  # noqa: E402

BLOCK_BYTES = 1 << 20
BUSY_SLICE_S = 0.0002  # the busy task's Python work between two awaits
SMOKE = {"files": 200, "rounds": 1, "threads": 8}
CONTENDERS = ["direct", "threads", "read pool"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="a directory of files (default: a small "
                        "local one made in --workdir)")
    parser.add_argument("--source-backing", type=Path,
                        help="the local directory behind a network --source, evicted with it")
    parser.add_argument("--files", type=int, default=3000, help="files read per contender")
    parser.add_argument("--threads", type=int, default=64, help="reads in flight")
    parser.add_argument("--busy", type=float, default=0.5,
                        help="share of the trio thread a busy task takes (0: none)")
    parser.add_argument("--cpu-load", type=float, default=0.0,
                        help="cores kept busy by other processes meanwhile (module docstring)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-fetch"))
    parser.add_argument("--json", type=Path, help="write every figure here")
    return benchlib.parse_args_with_smoke(parser, argv, SMOKE, "few files, one round")


# a process of `--cpu-load`: spins `share` of every BURN_PERIOD_S, sleeps the rest
BURN_PERIOD_S = 0.01
_BURN = """
import sys, time
share, period_s = float(sys.argv[1]), float(sys.argv[2])
while True:
    started_s = time.monotonic()
    while time.monotonic() - started_s < share * period_s:
        pass
    time.sleep((1 - share) * period_s)
"""


@contextlib.contextmanager
def cpu_load(cores: float):
    """Processes keeping `cores` of CPU busy while the block runs (a whole core each, and
    one for the fraction left)."""
    shares = [1.0] * int(cores) + ([cores % 1] if cores % 1 else [])
    burners = [subprocess.Popen([sys.executable, "-c", _BURN, str(share), str(BURN_PERIOD_S)])
               for share in shares]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def list_files(root: Path, count: int) -> list[bytes]:
    """The first `count` files of the source, as cachefs indexes them."""
    relpaths = benchlib.Manifest.scan(root).relpaths
    if len(relpaths) < count:
        raise benchlib.BenchError(f"{root} has {len(relpaths)} files, fewer than {count}")
    return relpaths[:count]


def _cpu_s() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_nvcsw + usage.ru_nivcsw


def read_direct(root: Path, relpaths: list[bytes], threads: int) -> None:
    def read(relpath: bytes) -> int:
        with open(os.path.join(os.fsencode(root), relpath), "rb") as f:
            return len(f.read())
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, relpaths))


async def read_through_source(source: Source, relpaths: list[bytes], threads: int,
                              busy: float) -> tuple[int, float]:
    """Reads every file with `threads` in flight, beside the busy task: (its slices done, its
    thread CPU seconds)."""
    done = trio.Event()
    slices, busy_cpu_s = 0, 0.0

    async def busy_task() -> None:
        nonlocal slices, busy_cpu_s
        pause_s = BUSY_SLICE_S * (1 - busy) / busy
        table: dict[int, int] = {}
        while not done.is_set():
            started_cpu_s = time.thread_time()
            until_s = time.perf_counter() + BUSY_SLICE_S
            while time.perf_counter() < until_s:  # Python work, as the daemon's handlers do
                for key in range(50):
                    table[key] = table.get(key, 0) + 1
            busy_cpu_s += time.thread_time() - started_cpu_s
            slices += 1
            await trio.sleep(pause_s)

    async def reader(queue: list[bytes]) -> None:
        while queue:
            await source.read_block(queue.pop(), 0, BLOCK_BYTES, background=True)

    async with trio.open_nursery() as nursery:
        if busy > 0:
            nursery.start_soon(busy_task)
        queue = list(reversed(relpaths))
        async with trio.open_nursery() as readers:
            for _ in range(threads):
                readers.start_soon(reader, queue)
        done.set()
    return slices, busy_cpu_s


def one_pass(args, root: Path, relpaths: list[bytes], contender: str) -> dict:
    benchlib.evict_files([path for path in (root, args.source_backing) if path is not None])
    started_s = time.perf_counter()
    cpu_before_s, switches_before = _cpu_s()
    slices, busy_cpu_s = 0, 0.0
    if contender == "direct":
        read_direct(root, relpaths, args.threads)
    else:
        # (main has checked that the pool is built)
        source = Source(root, threads=args.threads,
                        read_pool_wanted=contender == "read pool")
        slices, busy_cpu_s = trio.run(read_through_source, source, relpaths, args.threads,
                                      args.busy)
    wall_s = time.perf_counter() - started_s
    cpu_after_s, switches_after = _cpu_s()
    files = len(relpaths)
    return {"files_per_s": files / wall_s,
            "cpu_us_per_file": (cpu_after_s - cpu_before_s - busy_cpu_s) * 1e6 / files,
            "switches_per_file": (switches_after - switches_before) / files,
            "busy_slices_per_s": slices / wall_s}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not read_pool.available():
        print("bench_fetch: cachefs._readpool is not built (pip install -e .)", file=sys.stderr)
        return 1
    root = args.source
    if root is None:
        root = args.workdir / "data"
        benchlib.generate_dataset(root, benchlib.DatasetSpec("small", args.files, 110_000))
    try:
        relpaths = list_files(root, args.files)
        passes: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
        with cpu_load(args.cpu_load):
            for round_index in range(args.rounds):
                for contender in benchlib.rotated(CONTENDERS, round_index):
                    passes[contender].append(one_pass(args, root, relpaths, contender))
    except benchlib.BenchError as exc:
        print(f"bench_fetch: {exc}", file=sys.stderr)
        return 1
    medians = {name: {key: benchlib.median([figures[key] for figures in rounds])
                      for key in rounds[0]} for name, rounds in passes.items()}
    direct, threads = medians["direct"], medians["threads"]
    rows = [[name, f"{figures['files_per_s']:,.0f}",
             f"{figures['files_per_s'] / direct['files_per_s']:.2f}",
             f"{figures['cpu_us_per_file']:.0f}",
             f"{figures['cpu_us_per_file'] / direct['cpu_us_per_file']:.2f}",
             f"{figures['switches_per_file']:.1f}",
             "-" if name == "direct" else
             f"{figures['busy_slices_per_s'] / max(threads['busy_slices_per_s'], 1e-9):.2f}"]
            for name, figures in medians.items()]
    print(f"{len(relpaths)} files of {root}, {args.threads} reads in flight, the trio thread "
          f"{args.busy:.0%} busy besides, {args.cpu_load:g} cores kept busy by other "
          f"processes; medians of {args.rounds}\n")
    print(benchlib.markdown_table(
        ["contender", "files/s", "/ direct", "CPU us/file", "CPU / direct",
         "context switches/file", "busy task's work / threads'"], rows))
    if args.json:
        benchlib.write_json(args.json, {"benchmark": "bench_fetch", "args": vars(args),
                                        "passes": passes, "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
