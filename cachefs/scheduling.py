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
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def run_as_batch_work() -> None:
    """Every thread of the daemon under SCHED_BATCH (module docstring): the threads there
    are now, and through them every one started after. A daemon started under another
    policy than the default (by chrt(1), or systemd's CPUSchedulingPolicy=) keeps it."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return  # started under a policy of the caller's choice (chrt): it stays
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(task), os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
    except OSError as exc:  # a seccomp filter, a container without the right
        log.warning("the daemon's threads run under their scheduling policy as it was: %s",
                    exc)
