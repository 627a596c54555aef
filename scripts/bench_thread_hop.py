"""CPU and wall time of one trip to a worker thread and back: trio's vs. cachefs.threads.

The source's hot path makes one such trip per file read ahead. This measures, in the same run,
`trio.to_thread.run_sync(fn, limiter=CapacityLimiter(N))` against
`cachefs.threads.run_sync(Slots(N), fn)` for a function that does nothing, with 1 and with
`--concurrency` tasks making trips at once (a read-ahead window keeps tens in flight). Passes
alternate between the two; the medians are reported, with their ratio.

Then what a task per read costs the trio thread beside a call (cachefs/prefetch.py, "Reads
begun with no task"): `--hops` tasks spawned, each through a chain of eight coroutines to one
park (as a read-ahead's fetch waits for the read pool), all woken by one task (as the pool's
collection does), against as many calls of a function.

Usage:
    python scripts/bench_thread_hop.py [--hops 20000] [--passes 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachefs import threads  # noqa: E402


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _nothing() -> None:
    return None


async def _pass(hop, hops: int, concurrency: int) -> tuple[float, float]:
    """(CPU us, wall us) per hop."""
    async def worker(count: int) -> None:
        for _ in range(count):
            await hop()

    cpu_s, wall_s = _cpu_s(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker, hops // concurrency)
    done = hops // concurrency * concurrency
    return ((_cpu_s() - cpu_s) / done * 1e6, (time.perf_counter() - wall_s) / done * 1e6)


async def _main(args) -> None:
    limiter = trio.CapacityLimiter(args.concurrency)
    slots = threads.Slots(args.concurrency)
    contenders = {
        "trio.to_thread.run_sync": lambda: trio.to_thread.run_sync(_nothing, limiter=limiter),
        "cachefs.threads.run_sync": lambda: threads.run_sync(slots, _nothing),
    }
    print("| concurrency | hop | CPU us/hop | wall us/hop |")
    print("|---|---|---|---|")
    for concurrency in (1, args.concurrency):
        samples = {name: [] for name in contenders}
        for _ in range(args.passes):
            for name, hop in contenders.items():
                samples[name].append(await _pass(hop, args.hops, concurrency))
        medians = {name: (statistics.median(s[0] for s in values),
                          statistics.median(s[1] for s in values))
                   for name, values in samples.items()}
        for name, (cpu_us, wall_us) in medians.items():
            print(f"| {concurrency} | {name} | {cpu_us:.1f} | {wall_us:.1f} |")
        trio_cpu, lean_cpu = (medians[name][0] for name in contenders)
        print(f"| {concurrency} | ratio lean/trio | {lean_cpu / trio_cpu:.2f} | |")


async def _parked(depth: int, parked: list) -> None:
    """`depth` coroutines down, park until woken (a fetch waiting for its read)."""
    if depth:
        return await _parked(depth - 1, parked)
    parked.append(trio.lowlevel.current_task())
    await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)


async def _task_per_read(reads: int) -> float:
    """Thread CPU us per read: a task spawned, parked, woken and ended."""
    parked: list = []
    started_s = time.thread_time()
    async with trio.open_nursery() as nursery:
        for _ in range(reads):
            nursery.start_soon(_parked, 8, parked)
        while len(parked) < reads:
            await trio.sleep(0)
        for task in parked:
            trio.lowlevel.reschedule(task)
    return (time.thread_time() - started_s) / reads * 1e6


def _call_per_read(reads: int) -> float:
    """Thread CPU us per read: one call of a function."""
    landed: list = []
    on_done = landed.append
    started_s = time.thread_time()
    for index in range(reads):
        on_done(index)
    return (time.thread_time() - started_s) / reads * 1e6


async def _tasks_against_calls(args) -> None:
    tasks, calls = [], []
    for _ in range(args.passes):
        tasks.append(await _task_per_read(args.hops))
        calls.append(_call_per_read(args.hops))
    print()
    print("| a read's end handled by | trio thread CPU us/read |")
    print("|---|---|")
    print(f"| its own task (spawned, parked, woken) | {statistics.median(tasks):.2f} |")
    print(f"| a call | {statistics.median(calls):.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hops", type=int, default=20000)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    trio.run(_main, args)
    trio.run(_tasks_against_calls, args)


if __name__ == "__main__":
    main()
