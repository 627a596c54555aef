"""SSD/NVRAM tier: cache-once, persistent, checksummed, crash-safe (docs/design.md §3).

Policy. Blocks are admitted until the byte budget is full; after that nothing is admitted and
nothing is replaced (seed 004: on a data set larger than the cache, a cache filled once and
never churned hits size(cache)/size(data) of every later epoch, where LRU gets about half the
square of that). Dropping an entry whose source changed, or whose bytes fail their checksum,
frees its budget. The budget counts what the entries take on disk
(`ssd_format.disk_bytes`): each entry file, its 96-byte header and payload rounded up to whole
4 KiB blocks, and its 72-byte index record (about 2% over the payload for 110 KB blocks; for
300-byte samples, 14 times it, which a budget of payload bytes let the tier take).

The bytes on disk (the directory's layout, entry headers, the index log and its checks) are
`cachefs.cache.ssd_format`; this module decides what is kept, recovers after a crash, and
keeps the in-memory index that the threads share.

Private: the cached bytes may come from files only root may read, so DIR is created 0700,
and every directory under it is 0700 (set again at each start: an older version made them
0755) and every file 0600. A DIR that existed already keeps its mode (it may be a directory
with other uses); what cachefs keeps in it is private all the same. DIR must belong to the
daemon's user and be writable by no other, and its parents must belong to root or that user
and be writable by no other unless sticky (`_check_only_ours`); no file of it is opened
through a link.

Crash recovery. `meta` says ``"clean": false`` from open until `close` has compacted the index
and fsynced it. An entry is written to a temporary name, renamed into place, and only then is
its index record appended; a drop appends its tombstone, then unlinks. So after a crash the
index may lag the entry files in both directions. When an open finds the previous session
unclean, or the index missing or damaged, it reconciles with one scan of the 256 fan-out
directories: leftover ``.tmp`` files are removed; entry files missing from the index are
adopted if their header verifies (a crash loses nothing that was fully renamed), deleted
otherwise; index records whose file is gone are dropped; then the index is rewritten
compacted. A clean open touches no entry file. The worst a crash can cause is a lost entry
(for example an index record for a replaced entry whose new record was lost is later dropped
as stale), never wrong bytes, because every read verifies the header against the request.

Errors. Any OSError while writing an entry or the index (ENOSPC on a full disk, EIO) removes
the temporary file, stops admission for the rest of this mount, logs one warning and records
the reason in `stats()`; reads go on. So does a start on a device the tier filled, which has
no room for the compacted index a reconciliation writes: the tier serves what it holds,
writes nothing (its meta stays unclean, so the next start reconciles again) and admits
nothing. A read error or a failed check on an entry is a miss: the entry is dropped and
counted, nothing is raised to the caller.

Threads. Every public method may be called from worker threads at once, and those that do
no I/O (`contains`, `has_entry`, `holds_other_version`, `has_room`, `stats`, `forget_file`)
from the event loop.
One `threading.Lock` guards the in-memory index and is never held across I/O, so the event loop
never waits on the disk: an index record is queued under the lock, in the order of the changes
in memory, and written to the log after the lock is released (cachefs/cache/append_log.py);
entry payloads are read and written outside it, and `close` writes the index outside it.
Invariants, under the lock:

- a key whose entry file is being written or unlinked is in `_busy` and has no live row, so
  two threads never race on one file name and a reader never sees a key mid-change;
- `_bytes` is the sum of the live rows' disk bytes (`disk_bytes` of their payload lengths),
  and `_bytes + _reserved_bytes` (admissions in flight) never exceeds the budget;
- `close` refuses new work at once, waits for the writes in flight, takes the final copy of
  the index (`_index_final`: a row added later would not be saved, so none is), then compacts.

Why this module is over 600 lines: it is one class, and every method of `SsdTier` keeps the
invariants above; in one file, a reader can check each method against them. What has no share
in them (the on-disk format) is `cachefs.cache.ssd_format`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from cachefs.cache.append_log import AppendLog
from cachefs.cache.ssd_format import (
    ENTRY_HEADER_BYTES, FANOUT, FORMAT_VERSION, MASK64, OP_ADD, OP_DROP, RECORD_DTYPE, BlockKey,
    Corrupt, disk_bytes, entry_name, load_index, merge_log, open_for_reading, open_private,
    pack_header, pack_record, unpack_header, write_index,
)
from cachefs.errors import EXIT_CACHE_DIR, StartupError
from cachefs.sorted_arrays import index_left
from cachefs.source import SourceIdentity
from cachefs.trusted_dirs import check_no_other_user_can_swap

log = logging.getLogger(__name__)

# What a device fails with when it is full, read-only or failing (`device_failure`)
DEVICE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # of those, a device with no room left
PROGRESS_S = 10.0  # how often a long step at start says how far it is (`_Progress`)
# a read failing with one of these says nothing of the entry: it is kept (`read`)
PASSING_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})

# How many damaged-entry warnings to log per mount before going quiet (a dying disk would
# otherwise log one line per block); the count in stats() keeps going.
_MAX_ENTRY_WARNINGS = 10
# How long close() waits for entry writes in flight before giving up on a clean close.
_CLOSE_WAIT_S = 30.0


class _Progress:
    """Says how far a step of the tier's start that may take minutes is (a reconciliation, a
    wipe, a trim of millions of entries), every PROGRESS_S: in the log, which `cachefs mount`
    watches to go on waiting for its daemon (cachefs/cli.py), and to `report` (systemd's
    start timeout, extended with each: cachefs/mount.py)."""

    def __init__(self, directory: Path, what: str, total: int,
                 report: Callable[[str], None] | None):
        self._directory, self._what, self._total, self._report = directory, what, total, report
        self._said_s = time.monotonic()

    def done(self, count: int) -> None:
        if time.monotonic() - self._said_s < PROGRESS_S:
            return
        self._said_s = time.monotonic()
        message = f"ssd cache {self._directory}: {self._what}, {count} of {self._total} done"
        log.info("%s", message)
        if self._report is not None:
            self._report(message)


class SsdTier:
    """A cache-once block store in one directory; see the module docstring."""

    def __init__(self, directory: Path, budget_bytes: int, block_bytes: int,
                 source: bytes | None = None, progress: Callable[[str], None] | None = None):
        """`source`: the source directory's real path, which the entries are of (None: not
        checked, for tools that open a tier without a mount); `progress(message)`: told how
        far a long step of the start is (`_Progress`)."""
        if budget_bytes <= 0 or block_bytes <= 0:
            raise ValueError("budget_bytes and block_bytes must be positive")
        self._dir = Path(directory)
        self._entries_dir = self._dir / "entries"
        self._index_path = self._dir / "index"
        self._budget = budget_bytes
        self._block_bytes = block_bytes
        self._source = None if source is None else os.fsdecode(source)
        self._progress = progress

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _busy shrinks
        self._closed = False
        self._index_final = False  # close() has copied the index to save: add no rows
        self._busy: set[int] = set()  # key_lo of entries being written or unlinked
        self._reserved_bytes = 0  # budget held by admissions in flight
        self._bytes = 0
        self._entries = 0
        self._rejected = 0
        self._dropped_stale = 0
        self._disabled: str | None = None
        self._entry_warnings = 0
        self._log: AppendLog | None = None  # the index file's tail, open while mounted

        self._lock_fd = self._acquire_lock()
        try:
            self._open_state()
        except OSError as exc:
            self._release_fds()
            raise StartupError(f"cache directory {self._dir} is not usable: {exc}",
                               EXIT_CACHE_DIR) from exc

    # ----------------------------------------------------------------- public API

    def contains(self, key: tuple[bytes, int], identity: SourceIdentity) -> bool:
        k = BlockKey(*key)
        with self._lock:
            if self._closed:
                return False
            row = self._find(k)
            return row is not None and self._same_identity(row, identity)

    def has_entry(self, key: tuple[bytes, int]) -> bool:
        """True if an entry for `key` exists, of any version. In memory only."""
        k = BlockKey(*key)
        with self._lock:
            if self._closed:
                return False
            row = self._find(k)
            return row is not None and row != -1

    def holds_other_version(self, key: tuple[bytes, int], identity: SourceIdentity) -> bool:
        """True if an entry for `key` exists for another identity (stale). In memory only;
        `read` with the current identity drops such an entry and counts it."""
        k = BlockKey(*key)
        with self._lock:
            if self._closed:
                return False
            row = self._find(k)
            return row is not None and row != -1 and not self._same_identity(row, identity)

    def read(self, key: tuple[bytes, int], identity: SourceIdentity) -> bytes | None:
        k = BlockKey(*key)
        with self._lock:
            if self._closed:
                return None
            row = self._find(k)
            if row is None or row == -1:
                return None
            if not self._same_identity(row, identity):
                self._dropped_stale += 1
                self._kill_row(row)
                self._busy.add(k.lo)
                stale = True
            else:
                stale = False
                length = int(self._length[row])
        if stale:
            self._index_log.flush()
            self._unlink_entry(k)
            return None
        try:
            return self._read_entry(k, identity, length)
        except OSError as exc:
            if exc.errno in PASSING_ERRNOS:
                # the process's, not the entry's (out of descriptors or memory): a miss,
                # and the entry stays for the next read
                log.debug("ssd cache %s: cannot read entry %s now: %s", self._dir, k.name, exc)
                return None
            self._reject(k, row, exc)
            return None
        except Corrupt as exc:
            self._reject(k, row, exc)
            return None

    def admit(self, key: tuple[bytes, int], identity: SourceIdentity, data: bytes) -> bool:
        length = len(data)
        if length > self._block_bytes:
            raise ValueError(f"block of {length} bytes exceeds block_bytes {self._block_bytes}")
        k = BlockKey(*key)
        with self._lock:
            if self._closed or self._disabled is not None or k.lo in self._busy:
                return False
            row = self._find(k)
            if row == -1:
                return False  # a different key shares the low 64 bits: keep the resident one
            replaced_bytes = 0
            if row is not None:
                if self._same_identity(row, identity):
                    return False
                replaced_bytes = disk_bytes(int(self._length[row]))
            charge = disk_bytes(length)
            if self._bytes - replaced_bytes + self._reserved_bytes + charge > self._budget:
                return False
            if row is not None:
                # The old entry is stale; its file is replaced atomically by the rename below.
                self._dropped_stale += 1
                self._kill_row(row)
            self._busy.add(k.lo)
            self._reserved_bytes += charge
        self._index_log.flush()
        try:
            self._write_entry(k, identity, data)
        except OSError as exc:
            if row is not None:
                self._unlink_quietly(self._entry_path(k.name))
            with self._lock:
                self._reserved_bytes -= charge
                self._release_busy(k.lo)
            self._disable(f"{_errno_name(exc)}: {exc}")
            return False
        with self._lock:
            self._reserved_bytes -= charge
            self._release_busy(k.lo)
            orphan = self._index_final  # close() gave up waiting for us
            if not orphan:
                self._add_row(k, identity, length)
        if orphan:  # an unindexed file would stay on disk for nothing
            self._unlink_quietly(self._entry_path(k.name))
            return False
        self._index_log.flush()
        return True

    def has_room(self, size_bytes: int) -> bool:
        with self._lock:
            return (not self._closed and self._disabled is None
                    and self._bytes + self._reserved_bytes + disk_bytes(size_bytes)
                    <= self._budget)

    def drop_file(self, relpath: bytes, keep: SourceIdentity | None = None) -> int:
        """Drop every block of a file whose source changed, except those of identity `keep`
        (the current version, possibly admitted already); returns how many were dropped."""
        keys = self.forget_file(relpath, keep)
        self.unlink_forgotten(keys)
        return len(keys)

    def forget_file(self, relpath: bytes, keep: SourceIdentity | None = None
                    ) -> list[BlockKey]:
        """`drop_file`'s part in memory, which the event loop may call: the entries leave the
        index at once (no read gets one from here on), and their files stay, their keys busy,
        until `unlink_forgotten(keys)` (worker threads)."""
        path_lo = xxhash.xxh3_128_intdigest(relpath) & MASK64
        keys: list[BlockKey] = []
        with self._lock:
            if self._closed:
                return keys
            used = self._n
            rows = np.nonzero(self._live[:used] & (self._path_lo[:used] == np.uint64(path_lo)))[0]
            for row in rows.tolist():
                k = BlockKey(relpath, int(self._block[row]))
                if self._find(k) == row and not (keep is not None
                                                  and self._same_identity(row, keep)):
                    # the same path (not merely a path-hash collision), another version
                    self._dropped_stale += 1
                    self._kill_row(row)
                    self._busy.add(k.lo)
                    keys.append(k)
        return keys

    def unlink_forgotten(self, keys: list[BlockKey]) -> None:
        """Write the tombstones of entries `forget_file` took out of the index, unlink their
        files, and let their keys be admitted again."""
        self._index_log.flush()
        for k in keys:
            self._unlink_entry(k)

    def stats(self) -> dict:
        with self._lock:
            return tier_stats(self._dir, self._budget, self._disabled, bytes=self._bytes,
                              entries=self._entries, rejected_checksum=self._rejected,
                              dropped_stale=self._dropped_stale)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            settled = self._idle.wait_for(lambda: not self._busy, timeout=_CLOSE_WAIT_S)
            in_flight = len(self._busy)
            self._index_final = True
            live = self._live_records() if settled else None
        # The files are written outside the lock: the event loop may still ask `contains`.
        self._index_log.close()  # its queued records are in `live` already
        if live is None:
            log.warning("ssd cache %s: %d entry writes still in flight at close; the next "
                        "mount will reconcile", self._dir, in_flight)
        try:
            if live is not None:
                write_index(self._index_path, live, self._block_bytes)
                self._write_meta(clean=True)
        except OSError as exc:
            log.warning("ssd cache %s: cannot save the index at close (%s); the next mount "
                        "will rebuild it", self._dir, exc)
        self._release_fds()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----------------------------------------------------------------- opening

    def _acquire_lock(self) -> int:
        import fcntl  # POSIX only, like the rest of a FUSE file system

        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_only_ours(self._dir)
            fd = os.open(self._dir / "lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot use cache directory {self._dir}: {exc}",
                               EXIT_CACHE_DIR) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(f"cache directory {self._dir} is in use by another cachefs mount",
                               EXIT_CACHE_DIR) from None
        return fd

    def _open_state(self) -> None:
        meta = self._read_meta()
        foreign = None if meta is None else self._foreign_source(meta)
        if meta is None or meta.get("format") != FORMAT_VERSION or (
                meta.get("block_bytes") != self._block_bytes) or foreign is not None:
            self._wipe(meta, foreign)
            table, needs_rewrite = np.empty(0, RECORD_DTYPE), True
        else:
            table, needs_rewrite = self._load(clean=bool(meta.get("clean")))
        for directory in [self._entries_dir] + [self._entries_dir / f"{fan:02x}"
                                                for fan in range(FANOUT)]:
            directory.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(directory)  # not a link, nor another user's (_check_only_ours)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(errno.EPERM, "not a directory of this user", str(directory))
            os.chmod(directory, 0o700)  # private (module docstring), also if made before
        full = None
        if needs_rewrite:
            try:
                write_index(self._index_path, table, self._block_bytes)
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS or not self._index_path.exists():
                    raise
                # A device the tier filled has no room for a second copy of its index: the
                # tier still serves what it holds (every read is verified against its
                # header), admits nothing, and the index on disk stays as it was
                full = f"{_errno_name(exc)} rewriting the index: the device is full"
        self._install_table(table)
        index_fd = os.open(self._index_path,
                           os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        os.fchmod(index_fd, 0o600)
        os.fchmod(self._lock_fd, 0o600)
        self._log = AppendLog(
            index_fd,
            lambda exc: self._disable(
                f"{_errno_name(exc)} writing the index: {exc}"))
        if full is not None:
            self._disable(full)  # nothing is written from now on, the meta included
        else:
            self._write_meta(clean=False)
        self._trim_to_budget()
        self._index_log.flush()
        log.info("ssd cache %s: %d entries, %d of %d bytes", self._dir, self._entries,
                 self._bytes, self._budget)

    def _load(self, clean: bool) -> tuple[np.ndarray, bool]:
        """The live records and whether the index file must be rewritten."""
        loaded = load_index(self._index_path, self._block_bytes)
        if loaded is None:
            if self._index_path.exists():
                log.warning("ssd cache %s: index damaged; rebuilding it from the entries",
                            self._dir)
            else:
                log.info("ssd cache %s: no index; rebuilding it from the entries", self._dir)
            return self._reconcile(np.empty(0, RECORD_DTYPE)), True
        base, tail, intact = loaded
        if clean and intact and not len(tail):
            return base, False
        table = merge_log(np.concatenate([base, tail])) if len(tail) else base
        if not clean or not intact:
            log.info("ssd cache %s: previous session did not close cleanly; reconciling",
                     self._dir)
            table = self._reconcile(table)
        return table, True

    def _reconcile(self, table: np.ndarray) -> np.ndarray:
        """Bring `table` in line with the entry files (one scan of the fan-out dirs)."""
        known = dict(zip(table["key_lo"].tolist(), range(len(table)), strict=True))
        seen = np.zeros(len(table), dtype=bool)
        adopted = []
        removed = 0
        progress = _Progress(self._dir, "reconciling the directories", FANOUT, self._progress)
        for fan in range(FANOUT):
            progress.done(fan)
            sub = self._entries_dir / f"{fan:02x}"
            try:
                names = os.listdir(sub)
            except FileNotFoundError:
                continue
            for name in names:
                # and within a directory: one of a tier of millions holds tens of thousands
                # of entries, each read whole when the index is lost, which took longer on a
                # cold disk than the silence `cachefs mount` waits through
                progress.done(fan)
                path = sub / name
                if name.endswith(".tmp"):
                    self._unlink_quietly(path)
                    removed += 1
                    continue
                try:
                    entry_hash = int(name, 16)
                except ValueError:
                    continue  # not ours: leave it alone
                row = known.get(entry_hash & MASK64)
                if row is not None and int(table["key_hi"][row]) == entry_hash >> 64:
                    seen[row] = True
                    continue
                record = self._record_from_header(path, entry_hash)
                if record is None:
                    self._unlink_quietly(path)
                    removed += 1
                else:
                    adopted.append(record)
        missing = int(len(table) - seen.sum())
        log.info("ssd cache %s: reconciled: %d entries adopted from files, %d index records "
                 "without a file dropped, %d temporary or damaged files removed",
                 self._dir, len(adopted), missing, removed)
        extra = np.frombuffer(b"".join(adopted), dtype=RECORD_DTYPE)
        return merge_log(np.concatenate([table[seen], extra]))

    def _record_from_header(self, path: Path, entry_hash: int) -> bytes | None:
        """An index record for an entry file whose header verifies, else None."""
        try:
            with open_for_reading(path) as f:
                head = f.read(ENTRY_HEADER_BYTES)
                file_bytes = os.fstat(f.fileno()).st_size
            fields = unpack_header(head, self._block_bytes)
        except (OSError, Corrupt):
            return None
        path_hash, block, size, mtime_ns, ino, payload_len = fields[4:10]
        path_hash = int.from_bytes(path_hash, "little")
        name_hash = xxhash.xxh3_128_intdigest(path_hash.to_bytes(16, "little")
                                              + block.to_bytes(8, "little"))
        if name_hash != entry_hash or file_bytes != ENTRY_HEADER_BYTES + payload_len:
            return None
        return pack_record(OP_ADD, payload_len, entry_hash & MASK64, entry_hash >> 64,
                           path_hash & MASK64, block, SourceIdentity(size, mtime_ns, ino))

    def _foreign_source(self, meta: dict) -> str | None:
        """The source directory the entries are of, if not this mount's: a cache directory
        used before for another data set, whose files of the same paths, sizes and
        modification times (to the second, on an object store's FUSE mount, which has no
        stable inode numbers) would be served as this one's. A meta of a version that did
        not record its source is taken as this one's."""
        cached = meta.get("source")
        if self._source is None or cached is None or cached == self._source:
            return None
        return str(cached)

    def _wipe(self, meta: dict | None, foreign: str | None = None) -> None:
        """Remove our entries and index (only our own names: DIR may hold other files)."""
        if foreign is not None:
            log.warning("ssd cache %s holds blocks of source %s; this mount's source is %s: "
                        "discarding them", self._dir, foreign, self._source)
        elif meta is not None:
            log.warning("ssd cache %s holds format %s with %s-byte blocks; this mount uses "
                        "format %d with %d-byte blocks: discarding the cached entries",
                        self._dir, meta.get("format"), meta.get("block_bytes"),
                        FORMAT_VERSION, self._block_bytes)
        elif self._entries_dir.exists():
            log.warning("ssd cache %s: entries without a meta file: discarding them", self._dir)
        progress = _Progress(self._dir, "discarding the directories", FANOUT, self._progress)
        for fan in range(FANOUT):
            progress.done(fan)
            shutil.rmtree(self._entries_dir / f"{fan:02x}", ignore_errors=True)
        shutil.rmtree(self._entries_dir, ignore_errors=True)
        self._unlink_quietly(self._index_path)

    def _read_meta(self) -> dict | None:
        try:
            with open_for_reading(self._dir / "meta") as f:
                meta = json.loads(f.read().decode())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            log.warning("ssd cache %s: meta file damaged", self._dir)
            return {}
        return meta if isinstance(meta, dict) else {}

    def _write_meta(self, clean: bool) -> None:
        meta: dict[str, object] = {"format": FORMAT_VERSION, "block_bytes": self._block_bytes,
                                   "clean": clean}
        if self._source is not None:
            meta["source"] = self._source
        tmp = self._dir / "meta.tmp"
        with open_private(tmp, "w") as out:
            json.dump(meta, out)
            out.flush()
            # Durable before any entry is written: a "clean" meta that outlived a crash would
            # skip the reconciliation that the unsynced index relies on.
            os.fsync(out.fileno())
        os.rename(tmp, self._dir / "meta")

    def _trim_to_budget(self) -> None:
        """A smaller --ssd-size than last time: drop entries until the rest fits."""
        if self._bytes <= self._budget:
            return
        dropped = 0
        progress = _Progress(self._dir, "trimming to the budget, entries", self._n,
                             self._progress)
        for row in range(self._n - 1, -1, -1):
            if self._bytes <= self._budget:
                break
            progress.done(dropped)
            name = entry_name(int(self._key_hi[row]), int(self._key_lo[row]))
            self._kill_row(row)
            self._unlink_quietly(self._entry_path(name))
            dropped += 1
        log.warning("ssd cache %s: over the %d-byte budget; dropped %d entries", self._dir,
                    self._budget, dropped)

    def _release_fds(self) -> None:
        if self._log is not None:
            self._log.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
        self._lock_fd = -1

    # ----------------------------------------------------------------- in-memory index
    # Rows [0, _base_n) are the loaded base, sorted by key_lo and found by binary search;
    # later rows are found through _added (key_lo -> row). Rows are never reused while
    # mounted, so a row number identifies one entry for the lifetime of the SsdTier.

    def _install_table(self, table: np.ndarray) -> None:
        capacity = len(table) + max(4096, len(table) // 8)
        self._table = np.zeros(capacity, dtype=RECORD_DTYPE)
        self._table[:len(table)] = table
        self._live = np.zeros(capacity, dtype=bool)
        self._live[:len(table)] = True
        self._n = self._base_n = len(table)
        # Contiguous: searchsorted on the strided table column would copy it on every lookup.
        self._base_keys = np.ascontiguousarray(table["key_lo"])
        self._added: dict[int, int] = {}
        self._bind_columns()
        self._bytes = (int(disk_bytes(table["length"].astype(np.int64)).sum())
                       if len(table) else 0)
        self._entries = len(table)

    def _bind_columns(self) -> None:
        table = self._table
        self._key_lo, self._key_hi = table["key_lo"], table["key_hi"]
        self._path_lo, self._block = table["path_lo"], table["block"]
        self._size, self._mtime_ns, self._ino = table["size"], table["mtime_ns"], table["ino"]
        self._length = table["length"]

    def _find(self, k: BlockKey) -> int | None:
        """The live row of `k`, None if absent, -1 if another key holds its low 64 bits."""
        row = self._added.get(k.lo)
        if row is None and self._base_n:
            pos = index_left(self._base_keys, np.uint64(k.lo))
            if pos < self._base_n and int(self._key_lo[pos]) == k.lo:
                row = pos
        if row is None or not self._live[row]:
            return None
        return row if int(self._key_hi[row]) == k.hi else -1

    def _same_identity(self, row: int, identity: SourceIdentity) -> bool:
        return (row >= 0 and int(self._size[row]) == identity.size
                and int(self._mtime_ns[row]) == identity.mtime_ns
                and int(self._ino[row]) == identity.ino)

    def _row_identity(self, row: int) -> SourceIdentity:
        return SourceIdentity(int(self._size[row]), int(self._mtime_ns[row]), int(self._ino[row]))

    def _add_row(self, k: BlockKey, identity: SourceIdentity, length: int) -> None:
        record = pack_record(OP_ADD, length, k.lo, k.hi, k.path_hash & MASK64, k.block, identity)
        if self._n == len(self._table):
            self._grow()
        row = self._n
        self._table[row:row + 1] = np.frombuffer(record, dtype=RECORD_DTYPE)
        self._live[row] = True
        self._n += 1
        self._added[k.lo] = row
        self._bytes += disk_bytes(length)
        self._entries += 1
        self._append_log(record)

    def _kill_row(self, row: int) -> None:
        self._live[row] = False
        key_lo = int(self._key_lo[row])
        if self._added.get(key_lo) == row:
            del self._added[key_lo]
        length = int(self._length[row])
        self._bytes -= disk_bytes(length)
        self._entries -= 1
        self._append_log(pack_record(OP_DROP, length, key_lo, int(self._key_hi[row]),
                                     int(self._path_lo[row]), int(self._block[row]),
                                     self._row_identity(row)))

    def _grow(self) -> None:
        capacity = 2 * len(self._table)
        table = np.zeros(capacity, dtype=RECORD_DTYPE)
        table[:self._n] = self._table[:self._n]
        live = np.zeros(capacity, dtype=bool)
        live[:self._n] = self._live[:self._n]
        self._table, self._live = table, live
        self._bind_columns()

    def _live_records(self) -> np.ndarray:
        return self._table[:self._n][self._live[:self._n]]

    @property
    def _index_log(self) -> AppendLog:
        assert self._log is not None  # opened by __init__ (_open_state), kept to the end
        return self._log

    def _append_log(self, record: bytes) -> None:
        """Queue one record (under the lock, so the log order is the memory order); the
        caller flushes it after releasing the lock."""
        if self._disabled is not None:
            # After a write error the log is not trusted to be complete: the meta stays
            # unclean (close() rewrites it from memory, or the next open reconciles).
            return
        self._index_log.append(record)

    def _disable(self, reason: str) -> None:
        """Stop admission for this mount (called without the lock: it takes it, then logs)."""
        with self._lock:
            first = self._disabled is None
            if first:
                self._disabled = reason
        if first:
            log.warning("ssd cache %s: admission stopped for this mount (%s); reads continue",
                        self._dir, reason)

    def _release_busy(self, key_lo: int) -> None:
        self._busy.discard(key_lo)
        self._idle.notify_all()

    # ----------------------------------------------------------------- entry files

    def _entry_path(self, name: str) -> str:
        return os.path.join(self._entries_dir, name[:2], name)

    def _write_entry(self, k: BlockKey, identity: SourceIdentity, data: bytes) -> None:
        """Write to a temporary name in the entry's directory, then rename into place.

        No fsync: after a power loss the rename may be durable while the data is not, but the
        header holds the payload's xxh3 and its own, so zeros or stale blocks in the file fail
        the checks and are dropped, never served. What a crash can lose is only cache.
        """
        final = self._entry_path(k.name)
        tmp = f"{final}.{secrets.token_hex(4)}.tmp"
        header = pack_header(k, self._block_bytes, identity, len(data),
                              xxhash.xxh3_64_intdigest(data))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, [header, data])
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError:
            self._unlink_quietly(tmp)
            raise

    def _read_entry(self, k: BlockKey, identity: SourceIdentity, length: int) -> bytes:
        fd = os.open(self._entry_path(k.name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            head = os.pread(fd, ENTRY_HEADER_BYTES, 0)
            fields = unpack_header(head, self._block_bytes)
            # One byte more than expected, to notice a file longer than its header says.
            payload = os.pread(fd, length + 1, ENTRY_HEADER_BYTES)
        finally:
            os.close(fd)
        path_hash, block, size, mtime_ns, ino, payload_len, payload_hash = fields[4:11]
        if int.from_bytes(path_hash, "little") != k.path_hash or block != k.block:
            raise Corrupt("header names another block")
        if (size, mtime_ns, ino) != tuple(identity):
            raise Corrupt("header identity differs from the index")
        if payload_len != length or len(payload) != length:
            raise Corrupt(f"payload is {len(payload)} bytes, header says {payload_len}, "
                           f"index says {length}")
        if xxhash.xxh3_64_intdigest(payload) != payload_hash:
            raise Corrupt("payload checksum mismatch")
        return payload

    def _reject(self, k: BlockKey, row: int, exc: Exception) -> None:
        """A failed read: drop the entry and count it, unless it changed meanwhile."""
        with self._lock:
            if self._closed or self._find(k) != row:
                return  # dropped or replaced by another thread while we read
            self._rejected += 1
            self._kill_row(row)
            self._busy.add(k.lo)
            self._entry_warnings += 1
            quiet = self._entry_warnings > _MAX_ENTRY_WARNINGS
        self._index_log.flush()
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "ssd cache %s: dropping entry %s: %s", self._dir, k.name, exc)
        self._unlink_entry(k)

    def _unlink_entry(self, k: BlockKey) -> None:
        """Unlink a dropped entry's file, then let the key be admitted again."""
        self._unlink_quietly(self._entry_path(k.name))
        with self._lock:
            self._release_busy(k.lo)

    @staticmethod
    def _unlink_quietly(path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("cannot remove %s: %s", path, exc)


def tier_stats(directory: Path, budget_bytes: int, disabled: str | None, *, bytes: int = 0,
               entries: int = 0, rejected_checksum: int = 0, dropped_stale: int = 0) -> dict:
    """`cachefs stats`'s `ssd` (man/cachefs-stats.1): a tier's, or, with the defaults, that of
    one whose device could not be used (`device_failure`), which holds and admits nothing."""
    return {"bytes": bytes, "budget": budget_bytes, "entries": entries,
            "rejected_checksum": rejected_checksum, "dropped_stale": dropped_stale,
            "admission_disabled": disabled, "dir": str(directory)}


def device_failure(exc: StartupError) -> str | None:
    """Why the tier could not be opened, if it was its device's failure (full, read-only,
    failing: DEVICE_ERRNOS), for a mount that goes on without the tier, as it goes on when a
    write fails later; None if it was anything else (a directory it may not use, another
    mount's lock): the mount fails."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno in DEVICE_ERRNOS:
        return f"{_errno_name(cause)} opening the tier: {cause}"
    return None


def _check_only_ours(directory: Path) -> None:
    """Refuse a cache directory another user may write to, as ssh's StrictModes refuses a
    ~/.ssh others may write to: one could plant a link where cachefs writes (its lock, meta
    or index, which the daemon, often root, then chmods or truncates) or forge entries, whose
    checksums have no secret. A link the user gave as the directory itself is followed. Nor
    may another user be able to put another directory in its place (`trusted_dirs`)."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        raise StartupError(f"cache directory {directory} belongs to user {st.st_uid}, not to "
                           f"this one ({os.geteuid()}): that user could change what the mount "
                           f"serves", EXIT_CACHE_DIR)
    if st.st_mode & 0o022:
        raise StartupError(f"cache directory {directory} is writable by other users (mode "
                           f"{st.st_mode & 0o7777:o}): they could change what the mount serves; "
                           f"give a directory only its owner may write to (one cachefs makes is "
                           f"0700)", EXIT_CACHE_DIR)
    check_no_other_user_can_swap(directory, "cache directory", EXIT_CACHE_DIR)


def _errno_name(exc: OSError) -> str:
    """'ENOSPC' for an OSError of that errno; else its number (or None), as str() gives it."""
    return errno.errorcode.get(exc.errno if exc.errno is not None else -1, str(exc.errno))


def _write_all(fd: int, buffers: list) -> None:
    """os.writev until every byte is written (a regular file may take a short write)."""
    views = [memoryview(buf).cast("B") for buf in buffers]
    while views:
        written = os.writev(fd, views)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
