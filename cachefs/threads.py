"""Trips to a worker thread (a blocking call off the trio thread): the one way cachefs hops;
and the daemon's long-lived threads, started named (`start_thread`).

An object that blocks (the tiered cache's SSD calls, warming) holds a `RunSync`,
`await run(fn, *args)`, made by `pool(threads)`: at most `threads` of its calls run at once.
The source holds its `Slots` itself and calls `run_sync` with them, since its block reads take
the same slots in the read pool's threads (cachefs/read_pool.py). A
call made once (at start-up, for one request) goes through `run_one`; one that may never
return while this process runs (a stat of the process's own mount before it answers, an order
file on a hung file system) through `run_abandoning`, which a cancellation leaves behind
instead of waiting for. Where the simulator needs other hops, the wiring passes them in: the
simulator (cachefs/sim.py) gives the tiered cache a `RunSync` that runs its in-memory SSD's
calls inline on virtual time, and no library is patched.

Why not `trio.to_thread.run_sync` for the pools: it is the right default, but the source's hot
path makes one call per file read ahead (hundreds to thousands a second, on a daemon that
shares two cores with the storage client), and there its per-call machinery cost more CPU than
the hop itself: a `CapacityLimiter` whose acquire and release each pass through the scheduler,
a copied context, the `from_thread` plumbing. `scripts/bench_thread_hop.py` measures both in
one run.

`run_sync(slots, fn, *args)`:
- takes a slot from `Slots`, a FIFO counting semaphore whose fast path (a slot is free) does
  not yield, so the number of calls in flight stays bounded as with a limiter;
- runs `fn(*args)` in trio's cache of idle threads (`trio.lowlevel.start_thread_soon`);
- sleeps until the thread hands the outcome back through the trio token, and returns it or
  raises its exception.

A cancelled call returns at once (Cancelled) and leaves its thread to finish on its own, as
`trio.to_thread.run_sync(abandon_on_cancel=True)` does; its slot stays taken until the thread
ends, so no more calls than slots ever run. Cancellations come at unmount: a source that hangs
(an NFS hard mount, a stuck sshfs) held the unmount, and every signal after it, for as long
as it hung. Waiting for a slot can be cancelled too.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

# the kernel keeps a thread's name in 16 bytes, its NUL included (prctl(2) PR_SET_NAME)
OS_THREAD_NAME_MAX = 15
_PR_SET_NAME = 15

# `await run(fn, *args)`: fn(*args) in a worker thread, its value returned or its exception
# raised (module docstring)
RunSync = Callable[..., Awaitable[Any]]


class Slots:
    """At most `total` holders at once; waiters are served first come, first served."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"Slots needs at least one slot, got {total}")
        self.total = total
        self.free = total
        self._waiters: deque[trio.Event] = deque()

    @property
    def in_use(self) -> int:
        return self.total - self.free

    def can_acquire(self) -> bool:
        """A slot is free and nobody waits for one: `try_acquire` would take it."""
        return bool(self.free) and not self._waiters

    def try_acquire(self) -> bool:
        """Take a slot if `can_acquire` (the fast path of `acquire`)."""
        if self.can_acquire():
            self.free -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        handed = trio.Event()
        self._waiters.append(handed)
        try:
            await handed.wait()  # release() handed its slot to us
        except BaseException:
            if handed.is_set():
                self.release()  # cancelled after the hand-over: pass the slot on
            else:
                self._waiters.remove(handed)
            raise

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # the slot goes straight to the first waiter
        else:
            self.free += 1


async def run_sync(slots: Slots, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread, holding one of `slots`; see the module docstring."""
    await slots.acquire()
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    abandoned = False  # the caller was cancelled: the thread's end gives the slot back

    def finished(result: outcome.Outcome) -> None:  # on the trio thread
        if abandoned:
            slots.release()
        else:
            trio.lowlevel.reschedule(task, result)

    def deliver(result: outcome.Outcome) -> None:  # runs in the worker thread
        try:
            token.run_sync_soon(finished, result)
        except trio.RunFinishedError:
            pass  # the loop is gone (an abandoned call outlived the mount)

    def abort(_raise_cancel) -> trio.lowlevel.Abort:
        nonlocal abandoned
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    try:
        # start_thread_soon captures fn's outcome (value or exception) and passes it to deliver
        trio.lowlevel.start_thread_soon(functools.partial(fn, *args), deliver)
    except BaseException:
        slots.release()
        raise
    try:
        # returns fn's value or raises its exception (the outcome is unwrapped by trio)
        return await trio.lowlevel.wait_task_rescheduled(abort)
    finally:
        if not abandoned:
            slots.release()


def pool(threads: int) -> RunSync:
    """A `RunSync` with at most `threads` calls in worker threads at once."""
    return functools.partial(run_sync, Slots(threads))


async def run_one(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread, for a call made once (at start-up, for one request)."""
    return await run_sync(Slots(1), fn, *args)


async def run_abandoning(fn: Callable[..., T], *args,
                         limiter: trio.CapacityLimiter | None = None) -> T:
    """`fn(*args)` in a worker thread; a cancellation returns at once and leaves the thread
    to finish on its own (for a call that may never return, module docstring). It holds a
    token of `limiter` (trio's default: 40, shared) until it does: calls that may hang in
    numbers take a limiter of their own, so that those left behind starve no other."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=limiter)


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread that runs `target`, named `name` in Python and in the kernel, where
    ps -L, top -H, perf and /proc/PID/task/*/comm read it (Python 3.11 names only its own
    object): the daemon's CPU can then be told apart by thread (scripts/benchlib.py,
    `DaemonCpu`). The C read pool names its threads too (cachefs/_readpool.c)."""
    assert len(name.encode()) <= OS_THREAD_NAME_MAX, f"{name!r} is too long a thread name"

    def run() -> None:
        _name_os_thread(name)
        target()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


@functools.cache
def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _name_os_thread(name: str) -> None:
    """Best effort: a thread with the kernel's default name (the program's) works the same."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)
