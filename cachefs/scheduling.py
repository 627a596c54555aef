"""The scheduling policy the daemon's threads run under: SCHED_BATCH (sched(7)).

Why. A thread under SCHED_BATCH that wakes up does not preempt the thread running on its
core; it waits for that thread's turn to end. The daemon shares the machine's cores with the
storage client (an sshfs or NFS client, its ssh or RPC threads) and the training job, and its
threads wake often and briefly: a read of the source that landed (the read pool's threads), a
page store or drop to make (the page cache's threads), a request from the kernel (the trio
thread). Each of those wake-ups took a core from a thread of the storage client, which then
waited to run. The storage is not CPU-bound in one process (in a first epoch over the
benchmarks' sshfs through cachefs: the daemon 54% of a core, sshfs 20%, each sshd 17%, ssh
14%, the packet-delay process 14%), yet a busy core beside it costs it 10-25% of its rate
(README, "Slow storage"). In the DataLoader shape over that storage, seven alternated pairs of
runs with the daemon under SCHED_BATCH and as it was: the first epoch 1.02x the direct
readers against 0.97x (medians), the daemon's CPU 0.56 against 0.62 ms a file; the hot path,
which sends the daemon no request, did not move. A thread's share of the CPU is the same as
under the default policy: only who runs first at a wake-up changes.

The policy is set once, at the start of the mount, before its threads start: a new thread
inherits its creator's policy (POSIX threads and Python's alike), so every thread of the
daemon has it.

The CPUs they run on (`--cpus`, `daemon_cpus`). On a machine of few cores, every thread of
the daemon runs on one CPU, the last of those it may use: its trio thread is one core's work at
most (Python's GIL), and its other threads mostly wait for the source or the kernel. Left to
float, the daemon's threads (the trio thread, 64 read-pool threads, the page stores) woke on
whichever core was free, beside the storage client's and the readers', and each woke with cold
caches: in the DataLoader shape over the benchmarks' sshfs on two cores, the daemon took
0.78-0.99 ms of CPU a file in a first epoch floating, 0.55-0.74 on one CPU, and the first epoch
ran at 0.86x the 8 readers against 1.03x (three alternated pairs of `--rounds 2`, medians of 6
rounds; the second epoch 1.20x against 1.33x; README, "Slow storage"). Which of the two CPUs
made no difference beyond the rounds' spread. On a machine of more cores than
`AUTO_ONE_CPU_MAX` the daemon floats: its threads then find an idle core where a core of its
own could be taken by the trainer's threads (not measured: these machines have two). The
affinity is set like the policy, on every thread there is at the start (a thread inherits its
creator's), and a list given with `--cpus` is checked against the CPUs the daemon may use (a
cpuset, taskset(1)), which `auto` picks from. One CPU turned a race of the
overdue pass with a READ into a read that never ended (cachefs/range_cache.py, fixed): a
test runs the daemon on one CPU for it (tests/test_overdue.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)

# `--cpus auto` keeps the daemon's threads on one CPU where it may use at most this many
# (module docstring)
AUTO_ONE_CPU_MAX = 4
CPU_CHOICES = ("auto", "all")  # `--cpus`, beside a list of CPUs


def run_as_batch_work() -> None:
    """Every thread of the daemon under SCHED_BATCH (module docstring): the threads there
    are now, and through them every one started after. A daemon started under another
    policy than the default (by chrt(1), or systemd's CPUSchedulingPolicy=) keeps it."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return  # started under a policy of the caller's choice (chrt): it stays
        _each_thread(lambda tid: os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0)))
    except OSError as exc:  # a seccomp filter, a container without the right
        log.warning("the daemon's threads run under their scheduling policy as it was: %s",
                    exc)


def _each_thread(apply: Callable[[int], object]) -> None:
    """`apply(tid)` to every thread of the daemon there is now (a thread started after
    inherits what its creator has); a thread that ends meanwhile is skipped."""
    for task in os.listdir("/proc/self/task"):
        try:
            apply(int(task))
        except ProcessLookupError:
            continue


def cpus_asked(text: str) -> set[int] | None:
    """`daemon_cpus` of `--cpus` `text` on the CPUs this process may use: checked at the
    start (ValueError), then applied (`run_on_cpus`)."""
    return daemon_cpus(parse_cpus(text), os.sched_getaffinity(0))


def parse_cpus(text: str) -> frozenset[int] | str:
    """`--cpus`: "auto", "all", or a list of CPUs as taskset(1) -c takes it ("1", "0,2",
    "2-3"), as a set; ValueError saying what is wrong."""
    text = text.strip()
    if text in CPU_CHOICES:
        return text
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(f"--cpus {text!r}: auto, all, or CPU numbers such as 1 or 0,2 "
                             f"or 2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"--cpus {text!r}: {part.strip()!r} is no CPU range")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def daemon_cpus(choice: frozenset[int] | str, allowed: set[int]) -> set[int] | None:
    """The CPUs the daemon's threads are to run on, given `--cpus` (`parse_cpus`) and those
    it may use; None to leave them as they are. ValueError for a list of CPUs it may not use."""
    if choice == "all":
        return None
    if choice == "auto":
        return {max(allowed)} if len(allowed) <= AUTO_ONE_CPU_MAX else None
    assert isinstance(choice, frozenset)
    outside = choice - allowed
    if outside:
        which = (f"CPU {min(outside)} is" if len(outside) == 1
                 else f"CPUs {_cpu_list(outside)} are")
        raise ValueError(f"--cpus: {which} not among those the daemon may use "
                         f"({_cpu_list(allowed)})")
    return set(choice)


def run_on_cpus(cpus: set[int] | None) -> None:
    """Every thread of the daemon on `cpus` (None: as it is), as `run_as_batch_work` sets
    the policy: the threads there are now, and through them every one started after."""
    if cpus is None:
        return
    try:
        _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))
    except OSError as exc:  # a seccomp filter, a cpuset changed meanwhile
        log.warning("the daemon's threads run on the CPUs they had: %s", exc)
        return
    log.info("the daemon's threads run on CPU %s", _cpu_list(cpus))


def _cpu_list(cpus: Collection[int]) -> str:
    """CPUs as taskset(1) writes them: 0-3,6."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{low}" if low == high else f"{low}-{high}" for low, high in ranges)
