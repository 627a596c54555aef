"""The slow source directory: every access to it, and nothing else.

The source may be NFS, Lustre, sshfs or a spinning disk, where one call can take milliseconds.
So every call runs in a worker thread (`cachefs.threads.run_sync`, a leaner hop than
`trio.to_thread.run_sync` for this, the daemon's busiest one) holding one of a fixed number of
slots: that number is how many source requests are in flight at once, which is what hides the
source's latency. Block reads, the most of them by far, run in the read pool's threads instead
(cachefs/read_pool.py: C threads that never take the GIL, their completions collected in
batches), holding the same slots; where the pool is not built, in worker threads as the
rest. There are three sets: read-ahead and warming (`background=True`) share `threads`
slots; what a reader is waiting for right now (a lookup, an open, a demand read) has
`DEMAND_THREADS` slots of its own, so a reader's request never queues behind a full read-ahead
window; and directory listings, a call per few hundred entries, have `LISTING_THREADS`, so
that neither waits behind them (`listdir`). Paths are relative and bytes (`b""` is the root),
exactly as FUSE hands names to us, so no name is ever decoded.

Every path is opened beneath a descriptor of the source's root, through no symbolic link
(`cachefs.beneath`): whatever names it is given (a warm list, a stale inode), the daemon never
reads, lists or stats anything outside the source. What lstat(2) says of a path is the fstat
of the path opened O_PATH (a link as itself); a link's target is read, never followed. Data is
read only from regular files, opened non-blocking so that a FIFO cannot hold a worker thread.

A block read opens, fstats, preads and closes in one thread call (the pool's, or
`read_block_sync`): the identity returned with the data comes from the same open file, so
data and identity always belong together (a cached
block is served only while the source still has that identity; see `SourceIdentity`). The
file is fstat'ed again after its bytes are read (`_one_version`): a rewrite in place
(`np.save`, `torch.save` and cp truncate, then write) between the fstat and the pread gave
bytes cut short, or of the new version, labelled with the old identity, which the RAM and
SSD tiers then kept and served; such a read is made again, with the identity after it (a read
pool's read of two versions, or short, is made again by `read_block_sync`, whose rules these
are).
Identities are made only by `identity_of`, which leaves the inode number out on FUSE sources
(sshfs, rclone, s3fs...): those number inodes per mount and renumber them whenever the kernel
forgets one (after `drop_caches`, or a remount), which would make every cached copy look stale.

Stats are remembered (a bounded memo of the latest stat of each recently seen path, with the
time it was asked, `freshness.now_s`), so that a lookup of a file the prefetcher has just read is
answered from the fstat of that read instead of a second round trip: on network storage that
round trip was the reader's whole wait per file once the data was read ahead. `lstat_recent`
is the only reader of the memo, and uses a remembered stat only while the caller's
`Freshness` trusts it (the mount's metadata TTL).

Each block read is timed in its worker thread, from the open to the last byte (the queue for a
slot left out: that is the mount's own limit, not the source's latency), and the time goes into
`read_seconds`, a fixed-bucket histogram (`cachefs stats --json`, the Prometheus metrics).

`delay_s` is a testing aid (`--source-delay-ms`): it sleeps before every open and every read,
in the worker thread, to turn a fast local directory into a slow one; and once after each
batch of re-checks (`lstat_many`), so that their answers land that late, as from a slow server,
while telling what the source held when they were asked.

Every look at a file (an lstat, or the fstat of a block read) is handed, with when it was
asked, to `on_look` (the mount's inode table, InodeTable.confirm: the bytes of a file the
read-ahead read are then trusted from that read, not from the lookup of an epoch ago).

Every request for a file's data or identity (`read_block`, `lstat`, `check_readable`) is
reported to `requests`, a `RequestObserver` (the storage targets' counters, cachefs/targets.py):
when it starts, and when it ends with its latency, timed in the worker thread (a wait for a free
thread is not the source's latency), and the bytes it read.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import trio

from cachefs import read_pool
from cachefs import threads as threads_mod
from cachefs.beneath import check_relpath, open_beneath, proc_path
from cachefs.freshness import NEVER_S, Freshness, now_s
from cachefs.held_files import HeldFiles
from cachefs.inodes import PackedStat
from cachefs.mountinfo import filesystem_type
from cachefs.recent import RecentMap
from cachefs.stats import Histogram

log = logging.getLogger(__name__)


DEMAND_THREADS = 8
# Listings (a directory's names, then its entries' lstats) have slots of their own
# (`listdir`), as many as the demand slots they shared before: the listings of a data set's
# directories, started together, run as fast as before, and no reader waits for them
LISTING_THREADS = 8
# A listing's lstats run in up to this many calls at once (`listdir`), each of at least
# LISTING_STAT_MIN_NAMES names
LISTING_STAT_CALLS = 4
LISTING_STAT_MIN_NAMES = 64
# Paths whose latest stat is remembered: a read-ahead window is tens of files, and a lookup
# follows its prefetch within a window's time, so a few thousand covers any window with room.
RECENT_STATS = 8192
# reads of a file that changed while it was read, before the file's read fails with EIO
# (`_one_version`); a file rewritten that often is not one a cache can hold
READ_ATTEMPTS = 3


class SourceIdentity(NamedTuple):
    """What a cached copy is checked against: the file it came from has not changed."""

    size: int
    mtime_ns: int
    ino: int  # 0 where the source's inode numbers are not stable (Source.identity_of)


@dataclass(frozen=True)
class BlockData:
    """One block as read from the source, with the identity of the file it came from."""

    data: bytes
    identity: SourceIdentity
    stat: os.stat_result | None = None  # the fstat the identity came from
    read_s: float = 0.0  # how long the source took, open to last byte
    # how much older than the read its look at the path is: the age of a descriptor held open
    # for it (cachefs/held_files.py), which is of the file as it was when opened
    look_age_s: float = 0.0


class RequestObserver(Protocol):
    """Who is told of each source request (module docstring)."""

    def request_started(self, relpath: bytes, item: int | None = None) -> Any:
        """A request for `relpath` starts; what is returned is handed to request_finished.
        `item`: the file's index in the manifest in force, if the caller knows it."""

    def request_finished(self, started: Any, elapsed_s: float, nbytes: int) -> None:
        """The request ended (or failed) after `elapsed_s` in its thread, having read `nbytes`."""


def _timed(fn, *args) -> tuple[Any, float]:
    """`fn(*args)` and the seconds it took; in the worker thread."""
    started_s = time.perf_counter()
    return fn(*args), time.perf_counter() - started_s


class Source:
    """Read-only access to the source directory, in worker threads."""

    def __init__(self, root: Path, *, threads: int, delay_s: float = 0.0,
                 requests: RequestObserver | None = None, read_pool_wanted: bool = True):
        self.root = os.fsencode(os.path.realpath(root))
        # every path is resolved beneath this descriptor (module docstring)
        self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self._root_fd)
        self.stable_inodes = not filesystem_type(self.root).startswith(b"fuse")
        self._background = threads_mod.Slots(threads)
        self._demand = threads_mod.Slots(DEMAND_THREADS)
        self._listing = threads_mod.Slots(LISTING_THREADS)
        # block reads in threads without the GIL (cachefs/read_pool.py), a thread per slot;
        # None: in Python worker threads (no pool built, or not wanted: scripts/bench_fetch.py
        # compares the two)
        self._reads = (read_pool.ReadPool(self._root_fd, threads + DEMAND_THREADS)
                       if read_pool_wanted and read_pool.available() else None)
        self.delay_s = delay_s
        # relpath -> (latest stat, freshness.now_s() before it was asked)
        self._recent_stats: RecentMap[bytes, tuple[os.stat_result, float]] = \
            RecentMap(RECENT_STATS)
        # requests made to the source, by kind, and stats answered from the memo instead
        self.requests = {"lstat": 0, "block_read": 0, "identity_check": 0, "listdir": 0}
        self.stats_reused = 0
        self.read_seconds = Histogram()  # block reads' latency (module docstring)
        self._observer = requests
        # every look at a file, with when it was asked (module docstring)
        self.on_look: Callable[[bytes, os.stat_result, float], None] = lambda *look: None
        # files kept open for range reads (samples inside large files)
        self._held = HeldFiles(lambda relpath: self._open(relpath)[0])

    def identity_of(self, st: os.stat_result | PackedStat) -> SourceIdentity:
        if isinstance(st, PackedStat):
            size, mtime_ns, ino = st.identity_fields()
        else:
            size, mtime_ns, ino = st.st_size, st.st_mtime_ns, st.st_ino
        return SourceIdentity(size, mtime_ns, ino if self.stable_inodes else 0)

    def _open_path(self, relpath: bytes) -> int:
        """An O_PATH descriptor of `relpath` (a link opened as itself), for lstat and the like."""
        return open_beneath(self._root_fd, relpath, os.O_PATH)

    async def _run(self, fn, *args, background: bool = False):
        return await threads_mod.run_sync(self._background if background else self._demand,
                                          fn, *args)

    async def _observed(self, relpath: bytes, fn, *args, background: bool = False,
                        item: int | None = None):
        """`_run(fn, relpath, *args)`, reported to the observer (module docstring); `item`:
        the file's in the manifest in force, if the caller knows it (the observer would
        search the manifest for it)."""
        if self._observer is None:
            return await self._run(fn, relpath, *args, background=background)
        return await self._observing(relpath, item,
                                     self._run(_timed, fn, relpath, *args, background=background))

    async def _observing(self, relpath: bytes, item: int | None, timed):
        """`await timed`, a request giving (its result, the seconds it took in its thread),
        reported to the observer (`_observed`)."""
        observer = self._observer
        assert observer is not None
        started = observer.request_started(relpath, item)
        waited_s = time.perf_counter()
        elapsed_s, nbytes = None, 0
        try:
            result, elapsed_s = await timed
            nbytes = len(result.data) if isinstance(result, BlockData) else 0
            return result
        finally:
            if elapsed_s is None:  # it failed: its time, with the wait for a thread
                elapsed_s = time.perf_counter() - waited_s
            observer.request_finished(started, elapsed_s, nbytes)

    # -- metadata --------------------------------------------------------------------------

    def lstat_sync(self, relpath: bytes) -> os.stat_result:
        fd = self._open_path(relpath)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    async def lstat(self, relpath: bytes, *, background: bool = False) -> os.stat_result:
        asked_s = now_s()
        self.requests["lstat"] += 1
        st = await self._observed(relpath, self.lstat_sync, background=background)
        self._remember(relpath, st, asked_s)
        return st

    async def lstat_recent(self, relpath: bytes, freshness: Freshness,
                           after_s: float = NEVER_S) -> tuple[os.stat_result, float]:
        """An lstat `freshness` trusts, and the freshness.now_s() it was asked: the
        remembered one if still trusted and asked after `after_s` (no round trip), else a
        new one."""
        seen = self._recent_stats.get(relpath)
        if seen is not None and seen[1] > after_s and freshness.trusted(seen[1]):
            self.stats_reused += 1
            return seen
        asked_s = now_s()
        return await self.lstat(relpath), asked_s

    def recent_look(self, relpath: bytes) -> tuple[os.stat_result, float] | None:
        """The latest look at the file remembered, and when it was asked, however old."""
        return self._recent_stats.get(relpath)

    def status(self) -> dict:
        return {"requests": dict(self.requests), "stats_reused": self.stats_reused,
                "block_reads": "read pool" if self._reads is not None else "worker threads",
                "read_seconds": self.read_seconds.snapshot()}

    def _remember(self, relpath: bytes, st: os.stat_result, asked_s: float) -> None:
        self.on_look(relpath, st, asked_s)
        seen = self._recent_stats.get(relpath)
        if seen is None or asked_s >= seen[1]:
            # not over one asked later: a lookup would make an inode of the older version
            # (the file changed between the two looks), and the kernel's next open of it
            # would get ESTALE (cachefs/inodes.py)
            self._recent_stats.put(relpath, (st, asked_s))

    def distrust_stat(self, relpath: bytes, identity: SourceIdentity) -> None:
        """A look saw the file at `identity`: a remembered stat of another version is not
        answered from any more. Which of two such looks saw the file later cannot always be
        told (a read that waited for a thread, landing after a lookup asked later), and the
        memo kept the one asked later: a lookup answered from it gave the kernel that version
        for a TTL after the source was seen at the other."""
        seen = self._recent_stats.get(relpath)
        if seen is not None and self.identity_of(seen[0]) != identity:
            del self._recent_stats[relpath]
        # and a descriptor held open for its range reads is read no more: it may be of the
        # old version (a file renamed over), whose reads came back as looks of now
        self._held.let_go(relpath)

    async def lstat_many(self, relpaths: list[bytes]
                         ) -> list[tuple[bytes, os.stat_result | OSError]]:
        """lstat of each path in one worker-thread call (a batch costs one hop, not one per
        file); a path that fails gets its OSError in place of the stat. Remembered as
        `lstat`'s are."""
        asked_s = now_s()
        self.requests["lstat"] += len(relpaths)
        results = await self._run(self._lstat_many, relpaths, background=True)
        for relpath, st in results:
            if not isinstance(st, OSError):
                self._remember(relpath, st, asked_s)
        return results

    def _lstat_many(self, relpaths: list[bytes]) -> list[tuple[bytes, os.stat_result | OSError]]:
        results: list[tuple[bytes, os.stat_result | OSError]] = []
        for relpath in relpaths:
            try:
                results.append((relpath, self.lstat_sync(relpath)))
            except OSError as exc:
                results.append((relpath, exc))
        if self.delay_s:
            time.sleep(self.delay_s)  # the answers of a slow server (module docstring)
        return results

    def _names_in(self, relpath: bytes) -> list[bytes]:
        """The names of one directory's entries, as the directory lists them."""
        fd = open_beneath(self._root_fd, relpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:  # names as str: back to the bytes they were
                return [os.fsencode(entry.name) for entry in it]
        finally:
            os.close(fd)

    def _lstat_in(self, relpath: bytes, names: list[bytes]
                  ) -> list[tuple[bytes, os.stat_result]]:
        """(name, lstat) of each of `names` in the directory `relpath`, less those that
        vanished since it was listed or cannot be stat'ed."""
        entries = []
        fd = self._open_path(relpath)  # O_PATH: no open of the directory at the source
        try:
            for name in names:
                try:
                    entries.append((name, os.lstat(name, dir_fd=fd)))
                except FileNotFoundError:
                    continue  # vanished between readdir and stat: not listed
                except OSError as exc:
                    # one entry the source cannot stat (EIO of an object store, a
                    # stale NFS handle) left the whole directory unlistable; as ls
                    # does, the others are listed, and a lookup of it gets its errno
                    log.warning("%r in %r left out of its listing: %s", name, relpath, exc)
        finally:
            os.close(fd)
        return entries

    async def listdir(self, relpath: bytes) -> list[tuple[bytes, os.stat_result]]:
        """Names and lstat results of one directory, sorted by name bytes: the names in one
        call, then the lstats in up to LISTING_STAT_CALLS calls at once (each of at least
        LISTING_STAT_MIN_NAMES names). One after the other, each lstat of a network source
        waits its turn behind the reads in flight there: on the benchmarks' sshfs, with the
        read-ahead's reads queued, a directory of 1,000 files took 1.2-2.7 s to list in a
        first epoch, and the read-ahead's page stores that waited for it were READs
        instead (the listing for stores: cachefs/pagecache.py's module docstring).

        The calls hold slots of their own (LISTING_THREADS), neither a reader's nor the
        read-ahead's. On the demand slots, the read-ahead's stores reaching the five
        directories of a data set at once had the listings take all eight (twenty calls):
        the readers' lookups of files not read ahead yet, whose lstats wait for those slots,
        waited for the listings to end, and for 100-150 ms early in a first epoch
        (DataLoader shape over sshfs) the eight readers read 8-16 files per 50 ms against
        50-90 before and after, while the source delivered the read-ahead's 50. Bounded
        together to half the demand slots instead, the listings took so long that most
        files of the epoch's first second were read with no page store, each a READ (the
        daemon's CPU a file up by a sixth)."""
        self.requests["listdir"] += 1
        names = await threads_mod.run_sync(self._listing, self._names_in, relpath)
        per_call = max(LISTING_STAT_MIN_NAMES, -(-len(names) // LISTING_STAT_CALLS))
        parts: list[list[tuple[bytes, os.stat_result]]] = []
        # a call's OSError (the directory gone since its names were read) is raised as one
        # listing's would be: out of the nursery it came wrapped in an exception group,
        # which the callers' `except OSError` let through (an EIO for an ENOENT)
        failures: list[OSError] = []

        async def stat_part(start: int) -> None:
            try:
                parts.append(await threads_mod.run_sync(
                    self._listing, self._lstat_in, relpath, names[start:start + per_call]))
            except OSError as exc:
                failures.append(exc)
        async with trio.open_nursery() as nursery:
            for start in range(0, len(names), per_call):
                nursery.start_soon(stat_part, start)
        if failures:
            raise failures[0]
        entries = [entry for part in parts for entry in part]
        entries.sort()
        return entries

    async def readlink(self, relpath: bytes) -> bytes:
        return await self._run(self._on_path, relpath, lambda fd: os.readlink(b"", dir_fd=fd))

    async def statvfs(self) -> os.statvfs_result:
        return await self._run(os.statvfs, self._root_fd)

    async def listxattr(self, relpath: bytes) -> list[str]:
        return await self._run(self._on_path, relpath, lambda fd: os.listxattr(proc_path(fd)))

    async def getxattr(self, relpath: bytes, name: bytes) -> bytes:
        return await self._run(self._on_path, relpath,
                               lambda fd: os.getxattr(proc_path(fd), name))

    def _on_path(self, relpath: bytes, call):
        """`call(fd)` on an O_PATH descriptor of relpath: the link itself, if it is one."""
        fd = self._open_path(relpath)
        try:
            return call(fd)
        finally:
            os.close(fd)

    async def check_readable(self, relpath: bytes) -> SourceIdentity:
        """Open the file for reading (permission check, as the reader's open would) and fstat
        it. The fstat is remembered as a block read's is: a change this check finds has the
        kernel look the file up again, and a lookup answered from an older stat made an
        inode of the version it replaced (cachefs/inodes.py), ESTALE to the open again."""
        asked_s = now_s()
        self.requests["identity_check"] += 1
        st = await self._observed(relpath, self._open_stat)
        self._remember(relpath, st, asked_s)
        return self.identity_of(st)

    def _open_stat(self, relpath: bytes) -> os.stat_result:
        fd, st = self._open(relpath)
        os.close(fd)
        return st

    # -- data ------------------------------------------------------------------------------

    def _open(self, relpath: bytes) -> tuple[int, os.stat_result]:
        """A regular file opened for reading, and its fstat; OSError for anything else.

        O_NONBLOCK: a FIFO put where a file was opens at once (and is refused) instead of
        holding the thread until a writer comes; regular files ignore the flag. O_NOCTTY: a
        terminal put there does not become the daemon's controlling terminal.
        """
        if self.delay_s:
            time.sleep(self.delay_s)
        fd = open_beneath(self._root_fd, relpath, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL,
                              "not a regular file", relpath)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def read_block_sync(self, relpath: bytes, block_index: int, block_bytes: int) -> BlockData:
        started_s = time.monotonic()
        fd, st = self._open(relpath)

        def read(st: os.stat_result) -> tuple[bytes, bool]:
            offset = block_index * block_bytes
            want = max(0, min(block_bytes, st.st_size - offset))
            data = pread_full(fd, want, offset)
            return data, len(data) == want

        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            data, st = self._one_version(relpath, fd, st, read)
        finally:
            os.close(fd)
        return BlockData(data, self.identity_of(st), st, time.monotonic() - started_s)

    def _one_version(self, relpath: bytes, fd: int, st: os.stat_result,
                     read: Callable[[os.stat_result], tuple[bytes, bool]]
                     ) -> tuple[bytes, os.stat_result]:
        """`read(st)` of the open file `fd` (its bytes, and whether it got all it asked for
        at `st`'s size), with the fstat after it that says they are all of `st`'s version;
        else read again at the version after it (module docstring)."""
        short_unchanged = 0  # reads that ended before the size, the file unchanged during each
        for _ in range(READ_ATTEMPTS):
            data, complete = read(st)
            after = os.fstat(fd)
            unchanged = self.identity_of(after) == self.identity_of(st)
            short_unchanged += unchanged and not complete
            if unchanged and (complete or short_unchanged == 2):
                # (or shorter than its size twice, unchanged during each of those reads: the
                # source's own way, a file system whose sizes are estimates, served as it
                # reads; reading it a third time tripled its reads and logged a change that
                # never was)
                return data, st
            if unchanged:
                log.debug("source file read short of its size; reading it again: %r", relpath)
            else:
                log.info("source file changed while it was read: %r", relpath)
            st = after
        raise OSError(errno.EIO, f"the file changed each of the {READ_ATTEMPTS} times it was "
                                 "read", relpath)

    async def read_block(self, relpath: bytes, block_index: int, block_bytes: int, *,
                         background: bool = False, item: int | None = None,
                         expected_bytes: int = 0) -> BlockData:
        """The block's bytes and identity (module docstring). `expected_bytes` > 0: its
        length as last seen, which the read pool reads into at once (cachefs/read_pool.py)."""
        asked_s = now_s()
        self.requests["block_read"] += 1
        block: BlockData | None = None
        if self._reads is not None:
            read = self._pooled_block(relpath, block_index, block_bytes, background,
                                      expected_bytes)
            block = (await read)[0] if self._observer is None else \
                await self._observing(relpath, item, read)
        if block is None:  # no pool, or its read was not all of one version: read again here
            block = await self._observed(relpath, self.read_block_sync, block_index,
                                         block_bytes, background=background, item=item)
        self._block_read(relpath, block, asked_s)
        return block

    def can_start_block(self) -> bool:
        """Whether `start_block` would begin a read now (the read pool, a read-ahead slot
        free)."""
        return self._reads is not None and self._background.can_acquire()

    def start_block(self, relpath: bytes, block_index: int, block_bytes: int, *, item: int,
                    expected_bytes: int,
                    on_done: Callable[[BlockData | None, OSError | None], None]) -> bool:
        """`read_block(background=True)` begun now by the read pool, with no task waiting
        (cachefs/read_pool.py `start`), if it has a free slot; else False, and nothing is
        begun. `on_done(block, error)` is then called on the trio thread with the block, or
        with None if the pool's read was not all of one version (`read_block` reads such a
        block again its own way: the caller awaits it), or with the OSError it raised."""
        if self._reads is None:
            return False
        check_relpath(relpath)  # as open_beneath checks a path before openat2
        offset = block_index * block_bytes
        asked_s = now_s()
        observer = self._observer
        started_s = time.perf_counter()

        def landed(errno_: int, read: read_pool.PoolRead | None) -> None:
            block, error = None, None
            if read is None:
                error = OSError(errno_, os.strerror(errno_), relpath)
            else:
                block = self._pool_block(relpath, offset, block_bytes, read)
            if observer is not None:  # as `_observing` reports a request
                observer.request_finished(
                    target, time.perf_counter() - started_s if read is None else read.elapsed_s,
                    0 if block is None else len(block.data))
            if block is not None:
                self._block_read(relpath, block, asked_s)
            if block is not None or error is not None:
                self.requests["block_read"] += 1  # else the caller's `read_block` counts it
            on_done(block, error)

        if not self._reads.start(self._background, relpath or b".", offset, block_bytes,
                                 self.delay_s, expected_bytes, landed):
            return False
        target = observer.request_started(relpath, item) if observer is not None else None
        return True

    def _block_read(self, relpath: bytes, block: BlockData, asked_s: float) -> None:
        """A block was read (asked at `asked_s`): its time counted, its fstat remembered."""
        self.read_seconds.observe(block.read_s)
        # fstat of a file opened through no link: what lstat would say of a regular file
        assert block.stat is not None  # a block read always has its fstat
        self._remember(relpath, block.stat, asked_s)

    async def _pooled_block(self, relpath: bytes, block_index: int, block_bytes: int,
                            background: bool, expected_bytes: int
                            ) -> tuple[BlockData | None, float]:
        """One read of the block by the read pool, and its seconds in the pool's thread
        (`_pool_block`)."""
        check_relpath(relpath)  # as open_beneath checks a path before openat2
        offset = block_index * block_bytes
        assert self._reads is not None
        read = await self._reads.read(self._background if background else self._demand,
                                      relpath or b".", offset, block_bytes, self.delay_s,
                                      expected_bytes)
        return self._pool_block(relpath, offset, block_bytes, read), read.elapsed_s

    def _pool_block(self, relpath: bytes, offset: int, block_bytes: int,
                    read: read_pool.PoolRead) -> BlockData | None:
        """The block the read pool read: None unless the fstats before and after it say one
        version and it got all of the block at that version (else `read_block_sync` reads it
        again, with its retries)."""
        st = read.before
        whole = len(read.data) == max(0, min(block_bytes, st.st_size - offset))
        if not whole or read.after != (st.st_size, st.st_mtime_ns, st.st_ino):
            log.debug("source file changed or read short in the read pool; reading it again: "
                      "%r", relpath)
            return None
        return BlockData(read.data, self.identity_of(st), st, read.elapsed_s)

    def read_ranges_sync(self, relpath: bytes, ranges: list[tuple[int, int]],
                         hold_s: float = 0.0) -> BlockData:
        """The bytes of each (offset, length) of the file, cut at its end, one after the
        other in `data`, with the identity of the same open file, as `read_block_sync`
        reads a block. `hold_s` > 0: from a descriptor kept open that long for the file's
        next range reads (cachefs/held_files.py), fstat'ed at each read."""
        started_s = time.monotonic()

        def read(fd: int, st: os.stat_result | None = None) -> tuple[bytes, os.stat_result]:
            st = st if st is not None else os.fstat(fd)
            if self.delay_s:
                time.sleep(self.delay_s)

            def at(st: os.stat_result) -> tuple[bytes, bool]:
                wants = [(offset, max(0, min(length, st.st_size - offset)))
                         for offset, length in ranges]
                parts = [pread_full(fd, want, offset) for offset, want in wants]
                return b"".join(parts), all(len(part) == want
                                            for part, (_, want) in zip(parts, wants, strict=True))
            return self._one_version(relpath, fd, st, at)

        look_age_s = 0.0
        if hold_s > 0:
            (data, st), look_age_s = self._held.use(relpath, hold_s, read)
        else:
            fd, opened = self._open(relpath)
            try:
                data, st = read(fd, opened)
            finally:
                os.close(fd)
        return BlockData(data, self.identity_of(st), st, time.monotonic() - started_s,
                         look_age_s)

    async def read_ranges(self, relpath: bytes, ranges: list[tuple[int, int]], *,
                          background: bool = False, hold_s: float = 0.0) -> BlockData:
        """Byte ranges of one file in one worker-thread call: the byte-range items of an
        order (cachefs/range_cache.py), or the edges of their pages; `hold_s`: see
        `read_ranges_sync`."""
        asked_s = now_s()
        self.requests["block_read"] += 1
        block = await self._run(self.read_ranges_sync, relpath, ranges, hold_s,
                                background=background)
        self.read_seconds.observe(block.read_s)
        self._remember(relpath, block.stat, asked_s - block.look_age_s)
        return block


def pread_full(fd: int, size: int, offset: int) -> bytes:
    """pread until `size` bytes or EOF: network file systems may return short reads, and so
    may a FUSE mount (scripts/soak.py reads through cachefs with it)."""
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)
