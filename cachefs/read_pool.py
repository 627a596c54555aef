"""Block reads of the source in threads that never take the GIL, finished in batches.

Why. A block read in a Python worker thread (cachefs/threads.py) releases and takes back the
GIL at each of its five system calls (open, fstat, pread, fstat, close). While the trio thread
runs, each take waits for it, and the hand-over costs both threads context switches: 3,000
files of 110 KB read from slowfs network storage, 64 at once, beside a trio thread half busy
with other Python work, cost 358 us of CPU and 19 context switches a file in worker threads,
against 224 us and 9 for plain Python threads reading them with nothing else running, and 266
us and 10 through this pool (`scripts/bench_fetch.py`, medians of 3). The read-ahead of a
DataLoader over network storage reads about a thousand files a second on two cores shared with
the storage client, so that was a tenth of the machine. And each read's end came back to the
trio thread on its own (a `run_sync_soon`, and a wake-up of the loop, per file).

How. `cachefs/_readpool.c` runs each read whole in a POSIX thread that touches no Python
object: the file opened beneath the source's root exactly as `cachefs.beneath` opens it
(openat2, no symbolic link, nothing outside), fstat'ed, pread, stat'ed again, closed. Reads
that finished wait in a list; the first one into an empty list writes to an eventfd, and one
trio task (`_collect`, started with the pool's first read in each trio run) takes the whole
list when the eventfd is readable and wakes each waiting task. A burst of reads costs the trio
thread one wake-up.

The stat after the read asks for the size, mtime and inode alone (statx), which is all the
source compares: a read leaves a FUSE file's atime stale, so an fstat after it waited for a
GETATTR round trip to the file system's daemon (87 us a file on the sshfs source of the
benchmarks, against 10 us for the fstat before the read, and about 30 us for the statx), taking
that daemon's CPU from the reads it serves. The three fields are the kernel's, asked of the
file system again once they time out, as the fstat before the read's are.

What it does not do: decide whether the bytes are good. It returns the fstat before and the
stat after the read; the source (cachefs/source.py) keeps the bytes only if both say the same
version and the read got all of it, and otherwise reads the block again its own way, with its
retry rules (`Source._one_version`), so there is one definition of "one version".

Where the caller knows the size to expect (`size_hint`), the bytes object is made when the read
is queued and the thread reads straight into it: no copy at the end on the trio thread. A file
found longer than that (grown, or of a size the caller estimated) is read whole all the same,
into a buffer of the thread's that the collection copies: a read that stopped at the hint was
made again by the source, so a first epoch over files of many sizes read each file longer
than the mean twice.

Without the compiled module (a build without a C compiler) `available()` is False and the
source reads in Python worker threads, as before; `cachefs stats --json` says which
(`source.block_reads`).

Slots: the caller holds one of the source's `threads.Slots` for each read, as for a thread
call, so the slots still bound the reads in flight; the pool has a thread per slot, so a read
never queues inside it. A cancelled read (unmount) returns at once, and its slot is given back
when its thread is done with it, as `threads.run_sync` does.

Two ways to wait. `read` is awaited by the task that wants the block. `start` begins a read
with no task at all, when a slot is free at once: the collection calls its `on_done` with the
outcome, on the trio thread. The read-ahead begins most of its reads so (cachefs/prefetch.py,
"Reads begun with no task").
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import outcome
import trio

from cachefs.beneath import HAVE_OPENAT2
from cachefs.threads import Slots

try:
    from cachefs import _readpool
except ImportError:  # built without a C compiler: Python worker threads (module docstring)
    _readpool = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether the pool can read here: the module is built, and openat2 works (the pool opens
    with it alone; the source's fallback walk is Python's)."""
    return _readpool is not None and HAVE_OPENAT2


@dataclass(frozen=True, slots=True)
class PoolRead:
    """A block as the pool's thread read it: its bytes, the fstat before them (an
    os.stat_result) and the (size, mtime_ns, ino) of the stat after them, and the seconds
    from the open to that stat."""

    data: bytes
    before: os.stat_result
    after: tuple[int, int, int]
    elapsed_s: float


# `ReadPool.start`'s `on_done(errno, read)`: 0 and the read, or an errno and None
OnDone = Callable[[int, "PoolRead | None"], None]


@dataclass(frozen=True, slots=True)
class _Begun:
    """A read begun with `start`: the slot it holds, and whom to tell when it ends."""

    slots: Slots
    on_done: OnDone


def _stat_result(fields: tuple) -> os.stat_result:
    mode, ino, dev, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns, blksize, blocks, rdev \
        = fields
    return os.stat_result(
        (mode, ino, dev, nlink, uid, gid, size, atime_ns // 10**9, mtime_ns // 10**9,
         ctime_ns // 10**9),
        {"st_atime": atime_ns / 1e9, "st_mtime": mtime_ns / 1e9, "st_ctime": ctime_ns / 1e9,
         "st_atime_ns": atime_ns, "st_mtime_ns": mtime_ns, "st_ctime_ns": ctime_ns,
         "st_blksize": blksize, "st_blocks": blocks, "st_rdev": rdev})


class ReadPool:
    def __init__(self, root_fd: int, threads: int):
        assert available(), "check read_pool.available() first"
        self._root_fd, self._threads = root_fd, threads
        # started with the first read: a source may never read a block
        self._pool: _readpool.Pool | None = None
        # read ident -> the task waiting for it, the slots to give its slot back to if its
        # task was cancelled, or the `_Begun` of a read begun with `start`
        self._waiting: dict[int, trio.lowlevel.Task | Slots | _Begun] = {}
        self._next_ident = 0
        self._collecting: trio.lowlevel.TrioToken | None = None  # the run `_collect` is in

    def close(self) -> None:
        """End the pool's threads (reads still queued are dropped; a later read starts a new
        pool). In a trio run, the collecting task is told first, and ends. The reads in flight
        end here, since the pool drops their results: a task still waiting for one gets
        ECANCELED, and the slot of one cancelled goes back (its thread may still finish it: a
        read may hang on a stuck network file system, and nobody waits for it)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self._collecting = None  # a new pool's first read starts a task for it
        try:
            trio.lowlevel.notify_closing(pool.fileno())
        except RuntimeError:
            pass  # outside a trio run: no task waits on it
        pool.close()
        waiting, self._waiting = self._waiting, {}
        try:
            trio.lowlevel.current_trio_token()
            in_run = True
        except RuntimeError:
            in_run = False
        for waiter in waiting.values():
            if isinstance(waiter, _Begun) and not in_run:
                waiter.slots.release()  # what it would tell is of a trio run that has ended
                continue
            try:
                _wake(waiter, errno.ECANCELED, None)
            except RuntimeError:
                pass  # a task of a trio run that has ended

    async def read(self, slots: Slots, relpath: bytes, offset: int, max_bytes: int,
                   delay_s: float = 0.0, size_hint: int = 0) -> PoolRead:
        """Up to `max_bytes` of `relpath` from `offset` (to its end), holding one of `slots`;
        OSError as the system calls failed (module docstring). `delay_s`: the source's
        testing delay, slept before the open and before the read. `size_hint` > 0: the
        bytes expected, read straight into the bytes object returned (cachefs/_readpool.c)
        if the file holds no more."""
        await slots.acquire()
        ident = self._submit(slots, relpath, offset, max_bytes, delay_s, size_hint)
        self._waiting[ident] = trio.lowlevel.current_task()

        def abort(_raise_cancel) -> trio.lowlevel.Abort:
            self._waiting[ident] = slots  # the slot goes back when the thread is done
            return trio.lowlevel.Abort.SUCCEEDED

        errno_, read = await trio.lowlevel.wait_task_rescheduled(abort)
        slots.release()
        if errno_:
            raise OSError(errno_, os.strerror(errno_), relpath)
        return read

    def start(self, slots: Slots, relpath: bytes, offset: int, max_bytes: int,
              delay_s: float, size_hint: int, on_done: OnDone) -> bool:
        """`read`, begun now if one of `slots` is free (else False, and nothing is begun),
        with no task waiting: `on_done(errno, read)` is called on the trio thread when it
        ends, as `read` would return or raise; an exception it raises is logged, and
        ends nothing else. Never calls it before returning."""
        if not slots.try_acquire():
            return False
        ident = self._submit(slots, relpath, offset, max_bytes, delay_s, size_hint)
        self._waiting[ident] = _Begun(slots, on_done)
        return True

    def _submit(self, slots: Slots, relpath: bytes, offset: int, max_bytes: int,
                delay_s: float, size_hint: int) -> int:
        """Hand a read to the pool's threads, holding a slot of `slots` already taken (given
        back if it cannot be handed): its ident."""
        try:
            if self._pool is None:
                assert _readpool is not None  # available()
                self._pool = _readpool.Pool(self._root_fd, self._threads)
            token = trio.lowlevel.current_trio_token()
            if self._collecting is not token:
                # the first read of this trio run (tests run several over one source)
                self._collecting = token
                trio.lowlevel.spawn_system_task(self._collect, self._pool,
                                                name="cachefs-read-pool")
            ident = self._next_ident
            self._next_ident += 1
            self._pool.submit(ident, relpath, offset, max_bytes, int(delay_s * 1e9),
                              size_hint)
        except BaseException:
            slots.release()
            raise
        return ident

    async def _collect(self, pool: _readpool.Pool) -> None:
        """Wake the task of each finished read of `pool`, a batch per wake-up (module
        docstring), until the pool is closed: by then this task may not have started yet, or
        may be about to run after its wait ended (`close` told no task, or a new pool's
        collector waits on the same descriptor number)."""
        if self._pool is not pool:
            return
        fd = pool.fileno()
        while True:
            try:
                await trio.lowlevel.wait_readable(fd)
            except trio.ClosedResourceError:
                return  # `close`
            if self._pool is not pool:
                return
            waiting = self._waiting  # `close` gives the pool that follows a new dict
            try:
                finished = pool.completed()
            except MemoryError:
                # no memory for the list of the batch (each read's own bytes that find none
                # fail alone, ENOMEM): the batch is lost, so every read waited for fails
                # rather than wait forever, one at a time (no list to make); those still
                # running are waited for no more, and their slots go back now
                log.error("out of memory collecting the source's reads: the reads in flight "
                          "fail")
                while waiting:
                    _wake(waiting.popitem()[1], errno.ENOMEM, None)
                continue
            for ident, errno_, data, before, after, elapsed_ns in finished:
                waiter = waiting.pop(ident, None)
                read = None
                # _Begun first: the read-ahead's, most of them, and trio's Task class is an
                # ABC, whose isinstance runs its metaclass's check
                if not errno_ and isinstance(waiter, (_Begun, trio.lowlevel.Task)):
                    assert data is not None and before is not None and after is not None
                    read = PoolRead(data, _stat_result(before), after, elapsed_ns / 1e9)
                _wake(waiter, errno_, read)


def _wake(waiter: trio.lowlevel.Task | Slots | _Begun | None, errno_: int,
          read: PoolRead | None) -> None:
    """A read is over: its task gets (errno, the read), or, cancelled, its slot goes back
    (`ReadPool.read`), or, begun with `start`, its slot goes back and its `on_done` is told;
    None: a read of an earlier trio run, long cancelled."""
    if isinstance(waiter, _Begun):
        waiter.slots.release()
        try:
            waiter.on_done(errno_, read)
        except Exception:  # noqa: BLE001 - one read's handling never ends the collection
            log.exception("unexpected error handling a finished read of the source")
    elif isinstance(waiter, Slots):
        waiter.release()
    elif waiter is not None:
        trio.lowlevel.reschedule(waiter, outcome.Value((errno_, read)))
