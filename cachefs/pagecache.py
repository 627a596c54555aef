"""The kernel's page cache as the mount's data plane: worker threads store and drop its pages.

Why. Serving a cached file through the daemon costs a READ request per file on top of OPEN and
RELEASE, 60-85 us of pyfuse3/trio CPU each. The kernel serves bytes it holds in its page cache
with no request at all. So the daemon decides what the kernel holds (docs in
man/cachefs-mount.1, "Kernel page cache"), and this module carries those decisions out:

- `store(inode, offset, data)` queues `pyfuse3.notify_store`: the bytes become page-cache pages
  of the inode, so a reader whose open is answered with keep_cache reads them with no READ;
- `invalidate(inode, keep)` queues `pyfuse3.invalidate_inode`: the kernel drops the inode's
  pages (and its cached attributes, which it then asks for again); given byte extents to
  `keep`, and `invalidate_inode_range` (scripts/patches/), only the ranges outside them;
- `look_up(relpath, then)` has the kernel look a file up (an lstat through the mount), then
  runs `then` on the trio thread: a store needs an inode the kernel holds;
- `drain(inode)` waits until everything of the inode queued before it has run (`drain()`:
  everything);
- `dropped_lately(inode)`: whether the inode's pages were dropped in the last
  DROPPED_READ_S. The daemon forgets a block before the drop of its pages lands, and a reader
  may be reading them meanwhile with no READ (the zero-request mode): its close, reported
  after, is counted as a read of them (cachefs/reader.py `closed_without_reads`).

The kernel calls run in worker threads, never on the trio thread: a store waits on the lock of
each page it fills, and a READ pending in the kernel holds that lock until the trio thread
answers it (a store from the trio thread can deadlock). The trio thread only appends to a queue
(no lock is shared with the threads that call the kernel, docs/design.md §8). One FIFO, taken
in order by one thread: a store queued before an invalidation of its inode always lands before
it, and one queued after lands after it, so an invalidation (or a `drain` before an open that
drops the pages) can never be overtaken by a store of older bytes, nor come after one of newer.
That thread hands stores to `STORE_THREADS` threads and waits for those of an inode before
invalidating it (before a drain, for those of its inode, or all). A store of an inode with no
job in the FIFO (most: the read-ahead's, of files not dropped since) skips the FIFO and goes to
the store threads at once: nothing of its inode is ahead of it to keep order with, and the
FIFO's thread cost each store a wake-up and a hand-over of the GIL (the DataLoader shape stores
three files in four). Why not one thread for all: a store into a page the reader got to first
waits until the trio thread has answered its READ, and every store queued behind it waited too.
With a memmap reader of byte-range items the stores fell 31 jobs behind (median; 60 at p90):
the reader then met unstored pages of items read ahead long before, each a READ, whose page
lock held up the stores further (1,700-3,700 such READs an epoch of 5,000 items; stores took
242 us on average, 33 us at the median). A drop still waits for its inode's stores, and the
jobs behind it with it: with one packed file, a store stuck on a page holds up the FIFO at the
next drop (every 128 items, cachefs/range_cache.py).

A store for an inode the kernel does not hold (never looked up, or forgotten) fails with
ENOENT; that costs nothing but the attempt: the reader's READs are then served by the daemon
as before. Failures are counted, not raised. In the first epoch no file has been looked up
when the read-ahead has it, so four in five of them were served by READs (DataLoader shape:
795 stores for 4,065 files read ahead); `look_up` moves the LOOKUP the reader's open would
send ahead of it, from threads of their own (never the trio thread, which answers it; nor
the store threads, whose stores would wait with it for the answer). That LOOKUP is no extra request
(the kernel keeps the entry for the entry timeout, 300 s, so the open sends none), and the
READ is saved. A lookup per file still cost the trio thread a LOOKUP request, and a wake-up
for the answer, for nearly every file of the first epoch; so a directory is listed through the
mount, once, when its lookups for stores show that the read-ahead works through it: at the
lookup that reaches one for every LOOKUPS_PER_LISTING of its files (the first, for a directory
of up to that many), if the source's scan found at most `LISTED_MAX_ENTRIES` files in it
(`files_in`). Its READDIRPLUS makes the kernel hold an inode for every entry at a fraction of a
LOOKUP's cost each, and the stores of the directory's other files land with no lookup at all.
The listing runs in threads of its own (`_listings`), while the lookups go on: over a slow
source it takes seconds, and the lookups that waited behind it were too late for their files.
Why not at the first lookup: a listing costs the daemon an lstat and an entry for every file of
the directory, which an epoch in the order earns back, but a reader off the order does not: a
validation pass in directory order under a published shuffled order has the read-ahead push a
window of files spread over every directory of the data set, a few each, and listing all of
them cost more than the pass's own reads (200 directories of 1,000 files for 2,048 files
pushed: `scripts/bench_offorder.py`). Waiting for a 1/LOOKUPS_PER_LISTING share of lookups
first costs an epoch in the order that share of its files looked up one by one, and bounds the
listing to directories the read-ahead goes through. The per-file lstat stays, after the
listing: it costs nothing for a file the listing made known (the kernel answers it from its
dentry), and it covers a file of a larger directory, one listed past the cap, or one the
kernel has forgotten since. The kernel calls are injected (`store_fn`, `invalidate_fn`,
`invalidate_range_fn`, `lookup_fn`, `list_fn`, `files_in`), so the simulator runs the same
decisions with fakes that record them.

Counters are plain ints written by the worker threads (those that several threads write,
under one lock) and read by the trio thread for stats (a torn read of a Python int cannot
happen under the GIL).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import trio

from cachefs.recent import RecentMap
from cachefs.threads import start_thread

log = logging.getLogger(__name__)

# A close with no READ up to this long after the file's pages were dropped read them before
# they went (`dropped_lately`): the close is reported milliseconds after it happens, and a
# file open without a read (a stat through open) within it is the only one miscounted
DROPPED_READ_S = 5.0
DROPS_REMEMBERED = 4096  # inodes whose last drop `dropped_lately` remembers

_STOP = object()
LOOKUP_THREADS = 4  # lookups in flight at once (each waits for the trio thread's answer)
# listings for stores at once, in threads of their own (module docstring): the lookups that
# decide one go on with their files
LISTING_THREADS = 2
STORE_THREADS = 3  # stores at once: one waiting on a page a READ holds holds up no other
# A directory is listed for one file's store only if the source's scan found at most this
# many files in it, and read this far at most (module docstring): the daemon lists the
# source's directory whole for it, an lstat per entry, and its trio thread answers the
# READDIRPLUS entry by entry; a directory of millions of files would cost seconds and
# hundreds of MB to make known files the read-ahead may never reach.
LISTED_MAX_ENTRIES = 10_000
# ... and once the read-ahead has looked up one of its files for every this many (module
# docstring): a directory of 1,000 files at its 32nd lookup, one of up to 32 at its first
LOOKUPS_PER_LISTING = 32


class KernelPages:
    """Stores into and drops from the kernel's page cache, in FIFO order: one thread takes
    the jobs in order and hands the stores to `STORE_THREADS` threads (module docstring)."""

    def __init__(self, store_fn: Callable[[int, int, bytes], None],
                 invalidate_fn: Callable[[int], None],
                 lookup_fn: Callable[[bytes], object] | None = None,
                 list_fn: Callable[[bytes, int], object] | None = None,
                 files_in: Callable[[bytes], int | None] | None = None, *,
                 invalidate_range_fn: Callable[[int, int, int], None] | None = None):
        """`lookup_fn(relpath)`: an lstat of the file through the mount; `list_fn(dir_relpath,
        max_entries)`: a listing of a directory through the mount, that far at most;
        `files_in(dir_relpath)`: how many files the source's scan found under the directory
        (its subdirectories' included: a directory whose files are mostly in subdirectories
        is then looked up file by file), None if it has not finished. No lookups or listings
        in the simulator, whose kernel knows every file. `invalidate_range_fn(inode, offset,
        length)`: drop that range of the inode's pages (length 0: to the end), if the kernel
        interface has it."""
        self._store_fn = store_fn
        self._invalidate_fn = invalidate_fn
        self._invalidate_range_fn = invalidate_range_fn
        self._lookup_fn = lookup_fn
        self._list_fn = list_fn
        self._files_in = files_in
        # directories listed (or being listed) for stores, and lookups for stores in each
        # directory not listed yet; the lookup threads', under their lock
        self._listed_dirs: set[bytes] = set()
        self._dir_lookups: dict[bytes, int] = {}
        self._listing_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # stores handed to the store threads, and how many of each inode are not done; the
        # counters below are written under the same lock (several threads finish jobs)
        self._store_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._store_threads: list[threading.Thread] = []
        self._storing: dict[int, int] = {}
        # inode -> its jobs in the FIFO the thread has not handed out or run yet (the trio
        # thread counts them in, the thread out, under `_finished`): a store of an inode with
        # none skips the FIFO (module docstring)
        self._in_fifo: dict[int, int] = {}
        self._finished = threading.Condition()
        self._stopping = False  # the mount is going down: stores still queued are skipped
        # lookups run in threads of their own: each waits on the trio thread's answer, and
        # stores queued behind it in the one FIFO would wait with it; and listings in others
        self._lookup_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lookup_threads: list[threading.Thread] = []
        self._listing_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._listing_threads: list[threading.Thread] = []
        # inode -> when its pages were last dropped (`dropped_lately`; the trio thread's)
        self._dropped_s: RecentMap[int, float] = RecentMap(DROPS_REMEMBERED)
        self.queued = 0  # jobs handed to the thread (trio thread writes)
        self.done = 0  # jobs finished (worker threads write)
        self.stores = 0
        self.stored_bytes = 0
        self.store_failures = 0  # ENOENT (the kernel forgot the inode) and other errors
        self.invalidations = 0
        self.invalidate_failures = 0
        self.lookups = 0  # files looked up for a store (look_up; the trio thread writes)
        self.lookup_failures = 0
        self.listings = 0  # directories listed for stores (look_up; the trio thread writes)

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._store_threads = [start_thread(self._stores, "cachefs-store")
                               for _ in range(STORE_THREADS)]
        self._thread = start_thread(self._work, "cachefs-pages")
        if self._lookup_fn is not None:
            self._lookup_threads = [start_thread(self._look_ups, "cachefs-lookup")
                                    for _ in range(LOOKUP_THREADS)]
            if self._list_fn is not None:
                self._listing_threads = [start_thread(self._listings, "cachefs-listing")
                                         for _ in range(LISTING_THREADS)]

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the threads (the mount is going down): the drops queued run, the stores still
        queued are skipped (pages of a mount going away). A store can wait on a page whose
        READ nobody answers any more (pyfuse3.main has returned): after `timeout_s` its
        thread is left to the unmount, which ends that wait. False if a thread that calls
        into the FUSE session is still running: the caller must not free the session under
        it (cachefs/mount.py)."""
        deadline_s = time.monotonic() + timeout_s
        stopped = True
        self._stopping = True
        for _ in self._lookup_threads:
            self._lookup_jobs.put(_STOP)
        for _ in self._listing_threads:
            self._listing_jobs.put(_STOP)
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join(max(0.0, deadline_s - time.monotonic()))
            if self._thread.is_alive():
                log.warning("page cache thread still busy at unmount; leaving it")
                stopped = False
            self._thread = None
        for _ in self._store_threads:
            self._store_jobs.put(_STOP)
        for thread in self._store_threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))
            if thread.is_alive():
                log.warning("page cache store thread still busy at unmount; leaving it")
                stopped = False
        self._store_threads = []
        # the lookups and listings last: they make no kernel call of the session (a lookup
        # or a listing through the mount, its answer handed to a trio run that has ended), and
        # one waiting for an answer nobody gives any more took all of the time the stores and
        # drops had
        for thread in self._lookup_threads + self._listing_threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))
        self._lookup_threads, self._listing_threads = [], []
        return stopped

    def _work(self) -> None:
        """The FIFO, in order (module docstring): stores go to the store threads (inline
        without them: the simulator), an invalidation waits for its inode's, a drain for its
        inode's or (None) all."""
        while (job := self._jobs.get()) is not _STOP:
            kind, inode, offset, data = job
            if kind == "store" and self._store_threads:
                # counted among its inode's stores before it leaves the FIFO's count: an
                # invalidation or drain finds it in one or the other
                self._hand_to_store_threads(job)
                with self._finished:
                    self._out_of_fifo(inode)
                continue  # done when its store thread is
            try:
                if kind == "store":
                    self._store(inode, offset, data)
                elif kind == "invalidate":
                    self._wait_for_stores(inode)
                    self._invalidate(inode, data)
                else:  # a drain marker: `data` wakes the waiting task
                    self._wait_for_stores(inode)
                    data()
            except Exception:  # noqa: BLE001 - the thread must keep serving the mount
                log.exception("page cache job %s(%s) failed", kind, inode)
            finally:
                with self._finished:
                    self.done += 1
                    if kind != "drain":
                        self._out_of_fifo(inode)

    def _hand_to_store_threads(self, job: tuple) -> None:
        """A store job to the store threads, counted as one of its inode's not done yet."""
        inode = job[1]
        with self._finished:
            self._storing[inode] = self._storing.get(inode, 0) + 1
        self._store_jobs.put(job)

    def _out_of_fifo(self, inode: int) -> None:
        """A job of `inode` left the FIFO (handed out, or run); under `_finished`."""
        left = self._in_fifo[inode] - 1
        if left:
            self._in_fifo[inode] = left
        else:
            del self._in_fifo[inode]

    def _stores(self) -> None:
        while (job := self._store_jobs.get()) is not _STOP:
            _, inode, offset, data = job
            try:
                if not self._stopping:
                    self._store(inode, offset, data)
            except Exception:  # noqa: BLE001 - the thread must keep serving the mount
                log.exception("page cache store(%d) failed", inode)
            finally:
                with self._finished:
                    left = self._storing[inode] - 1
                    if left:
                        self._storing[inode] = left
                    else:
                        del self._storing[inode]
                    self.done += 1
                    self._finished.notify_all()

    def _wait_for_stores(self, inode: int | None) -> None:
        """Until the stores handed out before are done: the inode's, or all (None)."""
        with self._finished:
            self._finished.wait_for(lambda: not self._storing if inode is None
                                    else inode not in self._storing)

    def _store(self, inode: int, offset: int, data) -> None:
        try:
            self._store_fn(inode, offset, data)
        except OSError as exc:
            with self._finished:
                self.store_failures += 1
            if exc.errno != errno.ENOENT:
                log.warning("notify_store(%d) failed: %s", inode, exc)
            return
        with self._finished:
            self.stores += 1
            self.stored_bytes += len(data)

    def _invalidate(self, inode: int, keep: list[tuple[int, int]] | None) -> None:
        try:
            if keep is None or self._invalidate_range_fn is None:
                self._invalidate_fn(inode)
            else:
                try:
                    for offset, length in outside(keep):
                        self._invalidate_range_fn(inode, offset, length)
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        raise
                    # whatever of the ranges is left goes with the rest (the kept pages too)
                    log.warning("invalidate_inode_range(%d) failed: %s", inode, exc)
                    self._invalidate_fn(inode)
        except OSError as exc:
            # ENOENT: the kernel holds no such inode, so it holds none of its pages either
            if exc.errno != errno.ENOENT:
                self.invalidate_failures += 1
                log.warning("invalidate_inode(%d) failed: %s", inode, exc)
            return
        self.invalidations += 1

    def _look_ups(self) -> None:
        assert self._lookup_fn is not None  # these threads run only with one
        while (job := self._lookup_jobs.get()) is not _STOP:
            relpath, done, listed = job
            looked_up = False
            try:
                directory = self._listing_due(relpath)
                if directory is not None:
                    self._listing_jobs.put((directory, listed))
                self._lookup_fn(relpath)
                looked_up = True
            except OSError as exc:  # gone from the source, or the mount going down
                log.debug("lookup of %r for a store failed: %s", relpath, exc)
            except Exception:  # noqa: BLE001 - the thread must keep serving the mount
                log.exception("unexpected error looking %r up for a store", relpath)
            try:
                done(looked_up)  # whatever happened: the file may be pushed again
            except trio.RunFinishedError:
                pass  # the mount is down: nothing to store into

    def _listings(self) -> None:
        """List directories through the mount for stores (`_listing_due`), LISTED_MAX_ENTRIES
        entries at most, in threads of their own: a listing over a slow source takes
        seconds (an lstat per file, queued behind the read-ahead's reads: 0.4-2.6 s for
        1,000 files over the benchmarks' sshfs in a first epoch), and made in the lookup
        thread that decided it, it held up the lookups queued behind it, four listings at
        the start of an epoch all of them: a lookup for a store took 136 ms at the median
        and 361 at p90, where the read-ahead is some 50 ms ahead of the readers, and a file
        that landed before its reader looked it up was read by READs instead (a third of
        the first epoch's files in the DataLoader shape)."""
        assert self._list_fn is not None  # these threads run only with one
        while (job := self._listing_jobs.get()) is not _STOP:
            directory, listed = job
            try:
                self._list_fn(directory, LISTED_MAX_ENTRIES)
            except OSError as exc:  # the per-file lookups find the files, or fail
                log.debug("listing %r for stores failed: %s", directory, exc)
                continue
            except Exception:  # noqa: BLE001 - the thread must keep serving the mount
                log.exception("unexpected error listing %r for stores", directory)
                continue
            try:
                listed()
            except trio.RunFinishedError:
                pass  # the mount is down

    def _listing_due(self, relpath: bytes) -> bytes | None:
        """`relpath`'s directory, if it is to be listed through the mount now: its lookups
        for stores reach one per LOOKUPS_PER_LISTING of its files, and it has at most
        LISTED_MAX_ENTRIES (module docstring); marked as listed then."""
        directory = relpath.rpartition(b"/")[0]
        # a listed directory's later lookups stop here, before the scan's count is searched
        # (a set lookup is atomic under the GIL; the lock below checks it again)
        if self._list_fn is None or self._files_in is None or directory in self._listed_dirs:
            return None
        # None: the scan has not finished; asked again at the next lookup there
        files = self._files_in(directory)
        with self._listing_lock:  # the count and the mark, one lookup thread at a time
            if directory in self._listed_dirs:
                return None
            lookups = self._dir_lookups.get(directory, 0) + 1
            if (files is None or files > LISTED_MAX_ENTRIES
                    or lookups * LOOKUPS_PER_LISTING < files):
                self._dir_lookups[directory] = lookups
                return None
            # marked before the listing: no other lookup thread lists it a second time
            self._listed_dirs.add(directory)
            self._dir_lookups.pop(directory, None)
        return directory

    # -- the trio side ---------------------------------------------------------------------

    def _put(self, job: tuple) -> None:
        kind, inode = job[0], job[1]
        if self._stopping:
            # the mount is going down (`stop`): nothing more reaches the kernel, whose
            # session may be gone already, and nothing runs inline here as it does before
            # `start` (a late batch of closes dropped pages on the trio thread, through a
            # freed session); a drain's waiter is woken
            if kind == "drain":
                job[3]()
            return
        if kind != "drain":
            with self._finished:
                self._in_fifo[inode] = self._in_fifo.get(inode, 0) + 1
        if self._thread is None:
            # not started (a simulator run or a unit test): run the job inline; the fakes do
            # not block
            self.queued += 1
            self._jobs.put(job)
            self._jobs.put(_STOP)
            self._work()
            return
        self.queued += 1
        self._jobs.put(job)

    def store(self, inode: int, offset: int, data) -> None:
        # the thread only takes the inode's jobs out of `_in_fifo`: none there now, none
        # comes before this store (module docstring)
        if self._store_threads and inode not in self._in_fifo:
            self.queued += 1
            self._hand_to_store_threads(("store", inode, offset, data))
            return
        self._put(("store", inode, offset, data))

    def invalidate(self, inode: int, keep: list[tuple[int, int]] | None = None) -> bool:
        """Drop the inode's pages: all of them, or, where the kernel can drop a range
        (`drops_ranges`), all but those of the byte extents [lo, hi) in `keep` (sorted).
        True if the pages of `keep` stay."""
        self._dropped_s.put(inode, time.monotonic())
        self._put(("invalidate", inode, 0, keep))
        return keep is not None and self.drops_ranges

    def dropped_lately(self, inode: int) -> bool:
        """The inode's pages were dropped (queued to be) in the last DROPPED_READ_S."""
        dropped_s = self._dropped_s.get(inode)
        return dropped_s is not None and time.monotonic() - dropped_s <= DROPPED_READ_S

    @property
    def drops_ranges(self) -> bool:
        return self._invalidate_range_fn is not None

    @property
    def can_look_up(self) -> bool:
        """`look_up` works: a lookup function, and the threads to run it (started with the
        mount: inline, a lookup would wait on the trio thread that must answer it)."""
        return bool(self._lookup_threads)

    def look_up(self, relpath: bytes, then: Callable[[], None]) -> None:
        """Have the kernel look `relpath` up, then run `then()` on the trio thread (whether
        the lookup succeeded or not). Only when `can_look_up`."""
        assert self.can_look_up
        token = trio.lowlevel.current_trio_token()

        # on the trio thread: one writer of the counts; by `run_sync_soon`, where an exception
        # would end the trio run, and the mount with it
        def finished(looked_up: bool) -> None:
            if looked_up:
                self.lookups += 1
            else:
                self.lookup_failures += 1
            try:
                then()
            except Exception:  # noqa: BLE001 - one file's store is lost, not the mount
                log.exception("unexpected error after the lookup of %r", relpath)
        def listed() -> None:
            self.listings += 1
        self._lookup_jobs.put((relpath,
                               lambda looked_up: token.run_sync_soon(finished, looked_up),
                               lambda: token.run_sync_soon(listed)))

    @property
    def pending(self) -> int:
        return self.queued - self.done

    async def drain(self, inode: int | None = None) -> None:
        """Return once every job of `inode` queued before this call has run (None: every
        job). With nothing of the inode queued or being stored it returns at once; else its
        marker takes its turn in the FIFO (behind an invalidation queued before it, which
        waits for its own inode's stores) and then waits for this inode's stores alone, not
        every store handed out: a store waits on a page whose READ waits for the source, and
        a drain for all of them held an OPEN of any other file that drains as long as a
        source stuck on that one file (fuse_ops.Operations._open)."""
        if self._thread is None or not self.pending:
            return
        if inode is not None:
            with self._finished:
                if inode not in self._in_fifo and inode not in self._storing:
                    return  # nothing of it queued, nor being stored
        token = trio.lowlevel.current_trio_token()
        ran = trio.Event()
        self._put(("drain", inode, 0, lambda: token.run_sync_soon(ran.set)))
        await ran.wait()

    def status(self) -> dict:
        return {"stores": self.stores, "stored_bytes": self.stored_bytes,
                "store_failures": self.store_failures, "invalidations": self.invalidations,
                "lookups": self.lookups, "lookup_failures": self.lookup_failures,
                "listings": self.listings,
                "pending": self.pending}


def outside(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) of the bytes outside the sorted extents [lo, hi), the last one to the
    file's end (length 0, as FUSE_NOTIFY_INVAL_INODE takes it)."""
    ranges, position = [], 0
    for lo, hi in extents:
        if lo > position:
            ranges.append((position, lo - position))
        position = max(position, hi)
    ranges.append((position, 0))
    return ranges


def list_entries(path: bytes, max_entries: int) -> None:
    """Read the first `max_entries` entries of the directory at `path` (`list_fn` of
    KernelPages, through the mount: the kernel learns their inodes from the READDIRPLUS)."""
    with os.scandir(path) as entries:
        for count, _ in enumerate(entries, start=1):
            if count >= max_entries:
                break


def file_pages_dropper(kernel: KernelPages | None,
                       inode_of: Callable[[bytes], int | None]) -> Callable[[bytes], None]:
    """The RAM tier's `drop_kernel_pages(relpath)`: drop the pages of the file's inode, if the
    kernel holds one (`inode_of`, the inode table's); nothing without a data plane."""
    if kernel is None:
        return lambda relpath: None

    def drop(relpath: bytes) -> None:
        inode = inode_of(relpath)
        if inode is not None:
            kernel.invalidate(inode)
    return drop
