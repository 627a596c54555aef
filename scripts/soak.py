"""Soak: concurrent readers check every byte read through a mount while it is disturbed.

Issue 15, "Integrity under load". One implementation, two lengths: tests/test_soak.py runs a
short soak in the suite (through the tests' `mounter` fixture), `python scripts/soak.py
--duration-s 600` a long one (through `cachefs.client.MountProcess`, as a user mounts).

What runs, for `duration_s` seconds, over a generated source (files from 0 bytes to several
blocks, with a small `--block-size`, so reads cross blocks), in the default data plane (as
root, the zero-request "no-open" mode):

- `readers` threads each read, in turn, whole files of the published order (as a
  DataLoader's workers share one order) and random (offset, length) ranges of any file, and
  compare every byte with the versions the source held (`SourceModel`, `check_read`);
- orders switch from the readers' side, as a trainer's `set_epoch` does: every few hundred
  reads the reader that reaches the count publishes the next epoch (with `next`); one
  publication in four has a manifest of its own (a shuffled subset of the files);
- the RAM tier holds a fraction of the data set, the SSD tier another, so both serve;
- every `rewrite_every_s` one file is replaced in the source by new bytes of a new size
  (written beside the source and renamed over it, so the source never holds a mix);
- once, at `kill_at` of the run, the daemon is killed with SIGKILL while the readers read;
  `cachefs umount` must recover the dead mount (exit 0, mount gone); a few files are rewritten
  while nothing is mounted; the mount comes back on the same SSD directory and the readers
  go on. Errors while the mount is down are expected and counted, and so is a read the kill
  cuts short (right bytes, fewer of them); any other error fails.

The contract checked (man/cachefs-mount.1, "Changed source files"): a read may return any
version of the file that the source held at some moment from `grace_s` before the read began
to when it ended, where grace_s = --metadata-ttl + the revalidation's quarter second; a version
replaced longer ago than that is *stale*; bytes equal to no version (garbage, a mix of two
versions, a short read) are *wrong*. A whole-file read's st_size is checked the same way. At
the end, after grace_s, every file is read once more and must be its newest version, the
source on disk must be what the model says, and no daemon log may hold a traceback.

Usage: python scripts/soak.py [--duration-s 600] [--readers 8] [--files 400]
           [--rewrite-every-s 5] [--same-size-rewrites] [--subset-fraction 0.25]
           [--metadata-ttl-s 1] [--workdir DIR] [--seed 0] [--verbose]
(`--same-size-rewrites` and `--subset-fraction 0` leave out a kind of fault, to tell which
kind a failure needs.)
Exit status 0 if every check passed, 1 otherwise (each failure is printed).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from cachefs import ctrl  # noqa: E402
from cachefs.client import (MountError, MountProcess, cachefs_command,  # noqa: E402
                            daemon_killed, stats_totals)
from cachefs.errors import CachefsError, OrderError  # noqa: E402
from cachefs.mountinfo import mounted_paths  # noqa: E402
from cachefs.order import permutation  # noqa: E402
from cachefs.publish import publish, source_file_count  # noqa: E402
from cachefs.source import pread_full  # noqa: E402
from cachefs.revalidate import MIN_INTERVAL_S  # noqa: E402

log = logging.getLogger(__name__)

KIB = 1024
TRACEBACK = "Traceback (most recent call last)"
MAX_FAILURES_KEPT = 50  # failures described in full; all are counted
# what a FUSE mount whose daemon died answers
DEAD_MOUNT_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)
DEAD_PROBE_S = 5.0  # a request to a dead mount fails at once, or hangs (_umount_dead)
ESTALE_RETRIES, ESTALE_RETRY_S = 10, 0.01
T = TypeVar("T")


def retry_estale(read: Callable[[], T], on_estale: Callable[[], None] = lambda: None) -> T:
    """`read()`, tried again while it fails with ESTALE (a few times, ESTALE_RETRY_S apart:
    the mount drops the kernel's attributes of the file in a thread, just after answering
    it); the last try's error is raised."""
    for _ in range(ESTALE_RETRIES):
        try:
            return read()
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
            on_estale()
            time.sleep(ESTALE_RETRY_S)
    return read()


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    readers: int = 8
    files: int = 400
    block_bytes: int = 64 * KIB
    ram_fraction: float = 0.15  # of the data set's bytes
    ssd_fraction: float = 0.30
    metadata_ttl_s: float = 1.0
    source_delay_ms: float = 1.0  # keeps read-ahead in flight when orders switch
    source_threads: int = 8
    reads_per_order: tuple[int, int] = (150, 400)  # a new order after this many reads
    subset_fraction: float = 0.25  # of publications with a manifest of their own
    range_fraction: float = 0.35  # of reads that read a random range of a random file
    rewrite_every_s: float = 5.0
    same_size_rewrites: bool = False  # new bytes only; else sizes change too
    kill_at: float = 0.5  # of duration_s
    rewrites_while_down: int = 3
    seed: int = 0

    @property
    def grace_s(self) -> float:
        """How long after a change the old version may still be served (module docstring)."""
        return self.metadata_ttl_s + MIN_INTERVAL_S


# -- the source and its versions ------------------------------------------------------------

@dataclass
class Version:
    data: bytes
    written_s: float  # time.monotonic() before the rename that made it the source's
    replaced_s: float = math.inf  # time.monotonic() after the rename of the next version


def file_sizes(count: int, block_bytes: int, rng: np.random.Generator) -> list[int]:
    """Sizes from 0 bytes to several blocks: a few tiny files, most within a block or two."""
    kinds = rng.choice(4, size=count, p=[0.1, 0.5, 0.3, 0.1])
    bounds = [(0, 4 * KIB), (4 * KIB, block_bytes), (block_bytes, 4 * block_bytes),
              (4 * block_bytes, 8 * block_bytes)]
    sizes = [int(rng.integers(*bounds[kind])) for kind in kinds]
    sizes[0] = 0  # an empty file
    return sizes


class SourceModel:
    """Every version each source file has held, and the source directory kept in step.

    A rewrite writes the new bytes beside the source (`tmp_dir`, same file system) and renames
    them over the file, so a reader of the source sees one version or the other, never a mix.
    """

    def __init__(self, root: Path, tmp_dir: Path):
        self.root = root
        self.tmp_dir = tmp_dir
        self._lock = threading.Lock()
        self._versions: dict[str, list[Version]] = {}

    def create(self, relpaths: list[str], sizes: list[int], rng: np.random.Generator) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        for relpath, size in zip(relpaths, sizes, strict=True):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            path = self.root / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            self._versions[relpath] = [Version(data, -math.inf)]

    @property
    def relpaths(self) -> list[str]:
        return sorted(self._versions, key=os.fsencode)  # the daemon's manifest order

    def newest(self, relpath: str) -> bytes:
        with self._lock:
            return self._versions[relpath][-1].data

    def max_size(self, relpath: str) -> int:
        with self._lock:
            return max(len(v.data) for v in self._versions[relpath])

    def rewrite(self, relpath: str, data: bytes) -> None:
        temporary = self.tmp_dir / "rewrite.tmp"
        temporary.write_bytes(data)
        with self._lock:
            old = self._versions[relpath][-1]
            self._versions[relpath].append(Version(data, time.monotonic()))
        os.rename(temporary, self.root / relpath)
        with self._lock:
            old.replaced_s = time.monotonic()

    def versions(self, relpath: str, started_s: float, ended_s: float,
                 grace_s: float) -> tuple[list[Version], list[Version]]:
        """(acceptable, stale) versions for a read of `relpath` from started_s to ended_s,
        each newest first: acceptable ones were the source's at some moment from grace_s
        before the read began to its end; stale ones were replaced longer ago than that."""
        acceptable, stale = [], []
        with self._lock:
            for version in reversed(self._versions[relpath]):
                if version.replaced_s + grace_s <= started_s:
                    stale.append(version)
                elif version.written_s <= ended_s:
                    acceptable.append(version)
        return acceptable, stale

    def history(self, relpath: str) -> list[Version]:
        with self._lock:
            return list(self._versions[relpath])


def expected_range(version: Version, offset: int, length: int | None) -> bytes:
    """What a read at `offset` of `length` bytes (to the end if None) returns of `version`."""
    return version.data[offset:None if length is None else offset + length]


def check_read(data: bytes, offset: int, length: int | None, acceptable: list[Version],
               stale: list[Version]) -> str | None:
    """None if `data`, read at `offset` (`length` bytes, or to the end if None), is the same
    range of an acceptable version; else why not ("stale: ..." or "wrong: ...")."""
    if any(data == expected_range(version, offset, length) for version in acceptable):
        return None
    for age, version in enumerate(stale, start=1):
        if data == expected_range(version, offset, length):
            return f"stale: the version {age} rewrite(s) old"
    want = expected_range(acceptable[0], offset, length)
    same = common_prefix(data, want)
    return (f"wrong: {len(data)} bytes where the newest version has {len(want)}; first "
            f"difference at byte {offset + same} of the file; equal to no version of it: "
            f"{describe(data, offset, acceptable + stale)}")


def cut_short(data: bytes, offset: int, length: int | None, versions: list[Version]) -> bool:
    """Whether `data` is a strict prefix of the range read of one of `versions`: what a read
    returns when the connection is aborted under it (the kernel hands back what it had
    copied), so a read that spanned the daemon's kill is counted with the failed ones."""
    wants = (expected_range(version, offset, length) for version in versions)
    return any(len(data) < len(want) and want.startswith(data) for want in wants)


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(differ[0]) if len(differ) else n


def describe(data: bytes, offset: int, versions: list[Version], parts: int = 4) -> str:
    """What a wrong read is made of, for the report: runs of bytes equal to a version's at the
    same offsets, zeros, or other bytes ("9764 bytes of the 9764-byte version, then ...")."""
    out, position = [], 0
    while position < len(data) and len(out) < parts:
        at = offset + position
        run, source = max(((common_prefix(data[position:], v.data[at:]), v) for v in versions),
                          key=lambda pair: pair[0], default=(0, None))
        if run:
            out.append(f"{run} bytes of the {len(source.data)}-byte version")
        else:
            rest = np.frombuffer(data, np.uint8)[position:]
            nonzero = np.flatnonzero(rest)
            run = int(nonzero[0]) if len(nonzero) else len(rest)
            out.append(f"{run} zero bytes" if run else f"{len(rest)} other bytes")
            run = run or len(rest)
        position += run
    return ", then ".join(out) + (", ..." if position < len(data) else "")


# -- orders, published by the readers ---------------------------------------------------------

class Orders:
    """The order the readers share, and its publication every few hundred reads."""

    def __init__(self, relpaths: list[str], config: SoakConfig, rng: random.Random):
        self.all_paths = relpaths
        self.config = config
        self._rng = rng
        self._lock = threading.Lock()
        self.epoch = -1
        self._paths: list[str] | None = None  # the manifest in force
        self._current: np.ndarray | None = None
        self._position = 0
        self._reads = 0
        self._due_after = 0
        self._publishing = False
        self.switches = 0
        self.manifest_switches = 0

    def next_item(self, rng: random.Random) -> tuple[str, bool]:
        """The next file of the order (any file before the first), and whether this reader
        publishes the next order once it has read it."""
        with self._lock:
            if self._current is None:
                return rng.choice(self.all_paths), False
            relpath = self._paths[self._current[self._position % len(self._current)]]
            self._position += 1
            self._reads += 1
            due = not self._publishing and self._reads >= self._due_after
            if due:
                self._publishing = True
            return relpath, due

    def claim(self) -> bool:
        """Take the publisher's turn (after a remount); False if a reader has it."""
        with self._lock:
            if self._publishing:
                return False
            self._publishing = True
            return True

    def publish_next(self, mountpoint: Path) -> None:
        """Publish epoch + 1 (with next) to the mount; the caller holds the publisher's turn.
        Raises what `cachefs.order.publish` raises."""
        try:
            if self._rng.random() < self.config.subset_fraction:
                count = max(2, int(len(self.all_paths) * self._rng.uniform(0.3, 0.9)))
                paths = self._rng.sample(self.all_paths, count)  # shuffled, too
                files = paths
            else:
                paths, files = self.all_paths, None  # the source's own listing
            epoch = self.epoch + 1
            current = permutation(len(paths), self.config.seed, epoch)
            publish(mountpoint, epoch, current,
                    next=permutation(len(paths), self.config.seed, epoch + 1), files=files)
            with self._lock:
                if paths != self._paths and self._paths is not None:
                    self.manifest_switches += 1
                self.epoch, self._paths, self._current = epoch, paths, current
                self._position = self._reads = 0
                self._due_after = self._rng.randint(*self.config.reads_per_order)
                self.switches += 1
        finally:
            with self._lock:
                self._publishing = False


# -- the soak -------------------------------------------------------------------------------

@dataclass
class SoakReport:
    reads_checked: int = 0
    whole_reads: int = 0
    range_reads: int = 0
    final_reads: int = 0
    bytes_checked: int = 0
    order_switches: int = 0
    manifest_switches: int = 0
    rewrites: int = 0
    kills: int = 0
    umounts_recovered: int = 0
    remounts: int = 0
    outage_s: float = 0.0
    errors_while_down: int = 0
    estale_reads: int = 0  # reads answered ESTALE (the file changed under them), retried
    max_stale_served_s: float = 0.0  # longest time after a rename an old version was served
    ssd_entries_at_remount: int | None = None  # kept by the killed daemon, still valid
    tier_hits: dict = field(default_factory=dict)  # per mount: the counters of its epochs
    events: list[str] = field(default_factory=list)  # the faults, with their times
    failures: list[str] = field(default_factory=list)
    failure_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.failure_count == 0

    def fail(self, message: str) -> None:
        """Count a failure (from any thread); the first MAX_FAILURES_KEPT are kept in full."""
        with self._lock:
            self.failure_count += 1
            if len(self.failures) < MAX_FAILURES_KEPT:
                self.failures.append(message)
        log.error("%s", message)

    def lines(self) -> list[str]:
        out = [f"reads checked: {self.reads_checked} ({self.whole_reads} whole files, "
               f"{self.range_reads} ranges, {self.final_reads} in the final pass), "
               f"{self.bytes_checked / 2**20:.1f} MiB compared",
               f"orders switched: {self.order_switches} ({self.manifest_switches} with a "
               f"new manifest)",
               f"faults: {self.rewrites} rewrites, {self.kills} SIGKILL, "
               f"{self.umounts_recovered} dead mount recovered by cachefs umount, "
               f"{self.remounts} remount on the same SSD directory "
               f"({self.outage_s:.2f} s down, {self.errors_while_down} reads failed "
               f"meanwhile, as expected)",
               f"old versions served up to {self.max_stale_served_s:.2f} s after a rewrite; "
               f"{self.estale_reads} reads answered ESTALE for a file that changed under them, "
               f"each read again within {ESTALE_RETRIES * ESTALE_RETRY_S:.1f} s",
               f"SSD entries found at the remount: {self.ssd_entries_at_remount}"]
        for name, counters in self.tier_hits.items():
            out.append(f"{name}: " + ", ".join(f"{key} {value}"
                                               for key, value in counters.items()))
        out.append(f"failures: {self.failure_count}")
        if self.failure_count:
            out.append("faults injected (seconds from the start):")
            out.extend(f"  {event}" for event in self.events)
        out.extend(f"  {message}" for message in self.failures)
        return out


MountFactory = Callable[[list], object]  # mount args -> a started mount (mountpoint, state_dir)


class Soak:
    """One run; `run()` returns its report. The caller owns the mounts the factory makes and
    takes them down afterwards (the killed one is unmounted here, by `cachefs umount`)."""

    def __init__(self, config: SoakConfig, workdir: Path, mount_factory: MountFactory):
        self.config = config
        self.workdir = Path(workdir)
        self.mount_factory = mount_factory
        self.report = SoakReport()
        self.model = SourceModel(self.workdir / "src", self.workdir / "tmp")
        self._rng = random.Random(config.seed)
        self._report_lock = threading.Lock()
        self._serving = threading.Event()  # cleared while the mount is down
        self._stopping = threading.Event()
        self._died = threading.Event()  # the daemon died by itself
        self._generation = 0  # bumped when the mount goes down
        self._killed_s = math.inf  # when the daemon was killed (time.monotonic())
        self._started_s = time.monotonic()  # the run's clock; reset once the mount is up
        self.mounts: list = []
        self.mount = None

    @property
    def source(self) -> Path:
        return self.model.root

    def mount_args(self, data_bytes: int) -> list:
        c = self.config
        return ["--ram-cache", max(int(data_bytes * c.ram_fraction), 4 * c.block_bytes),
                "--ssd-cache", self.workdir / "ssd",
                "--ssd-size", max(int(data_bytes * c.ssd_fraction), 4 * c.block_bytes),
                "--block-size", c.block_bytes, "--metadata-ttl", c.metadata_ttl_s,
                "--source-delay-ms", c.source_delay_ms,
                "--source-threads", c.source_threads]

    def run(self) -> SoakReport:
        c = self.config
        rng = np.random.default_rng(c.seed)
        relpaths = [f"class{i % 7}/sample_{i:05d}.bin" for i in range(c.files)]
        sizes = file_sizes(c.files, c.block_bytes, rng)
        self.model.create(relpaths, sizes, rng)
        shutil.rmtree(self.workdir / "ssd", ignore_errors=True)
        self._args = self.mount_args(sum(sizes))
        self.orders = Orders(self.model.relpaths, c, random.Random(c.seed + 1))
        self._start_mount()
        self._started_s = time.monotonic()
        threads = [threading.Thread(target=self._reader, args=(index,), daemon=True,
                                    name=f"soak-reader-{index}") for index in range(c.readers)]
        for thread in threads:
            thread.start()
        try:
            self._inject_faults(self._started_s)
        except (OSError, CachefsError, MountError, RuntimeError) as exc:
            # the daemon died by itself (its pid file went with it), a mount did not come up
            self.report.fail(f"injecting faults: {exc!r}")
            self._died.set()
        finally:
            self._stopping.set()
            self._serving.set()
            for thread in threads:
                thread.join()
        self._finish()
        return self.report

    # -- mounts ---------------------------------------------------------------------------

    def _start_mount(self) -> None:
        self.mount = self.mount_factory(self._args)
        self.mounts.append(self.mount)
        source_file_count(self.mount.mountpoint)  # the daemon has scanned the source
        self._publish_from_here()
        self._serving.set()

    def _publish_from_here(self) -> None:
        """Publish the next order now (at the start, after a remount), as a trainer resumes."""
        deadline = time.monotonic() + 30
        while not self.orders.claim():  # a reader's publication is under way
            if time.monotonic() > deadline:
                raise RuntimeError("a reader's publication never finished")
            time.sleep(0.01)
        try:
            self.orders.publish_next(self.mount.mountpoint)
        except (OrderError, OSError) as exc:
            self.report.fail(f"publishing the order after a (re)mount: {exc}")

    def _kill_and_remount(self) -> None:
        mount = self.mount
        self._record_tiers("mount 0 (until killed)", mount)
        pid = json.loads((Path(mount.state_dir) / "pid").read_text())["pid"]
        began_s = self._killed_s = time.monotonic()
        self._serving.clear()
        self._generation += 1
        os.kill(pid, signal.SIGKILL)
        self.report.kills += 1
        wait_until_dead(pid)
        self._event(f"killed the daemon (pid {pid}) with SIGKILL")
        # rewrite files with nothing mounted: the SSD tier's copies of them are now stale
        for _ in range(self.config.rewrites_while_down):
            self._rewrite()
        self._umount_dead(mount)
        self._start_mount()
        self.report.remounts += 1
        self._event(f"remounted at {self.mount.mountpoint}")
        ssd = ctrl.read_stats(Path(self.mount.mountpoint)).get("ssd") or {}
        self.report.ssd_entries_at_remount = ssd.get("entries")
        self.report.outage_s += time.monotonic() - began_s

    def _umount_dead(self, mount) -> None:
        mountpoint = os.path.abspath(mount.mountpoint)
        answers: list = []

        def probe() -> None:
            try:
                os.statvfs(mountpoint)  # a request the kernel cannot answer from its caches
                answers.append(None)
            except OSError as exc:
                answers.append(exc)

        # The probe hangs instead if a thread of the killed daemon still waits in the kernel
        # (a page store behind a READ nobody answers): cachefs umount must unblock it
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        prober.join(DEAD_PROBE_S)
        if prober.is_alive():
            self._event("the dead mount hangs (a thread of the killed daemon waits in the "
                         "kernel); cachefs umount aborts its connection")
        done = subprocess.run(cachefs_command("umount", mountpoint, "--state-dir",
                                              mount.state_dir),
                              capture_output=True, text=True, timeout=120)
        prober.join(DEAD_PROBE_S)
        if prober.is_alive():
            self.report.fail(f"a request to the dead mount {mountpoint} still hangs after "
                             f"cachefs umount")
        elif answers[0] is None:
            self.report.fail(f"the mount {mountpoint} still answered after its daemon was "
                             f"killed")
        elif answers[0].errno not in DEAD_MOUNT_ERRNOS:
            self.report.fail(f"the dead mount {mountpoint} answered {answers[0]!r}")
        if done.returncode == 0 and mountpoint not in mounted_paths():
            self.report.umounts_recovered += 1
            return
        self.report.fail(f"cachefs umount of the dead mount {mountpoint}: exit "
                         f"{done.returncode}, {(done.stderr or done.stdout).strip()!r}, "
                         f"{'still' if mountpoint in mounted_paths() else 'not'} mounted")
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)

    # -- faults ---------------------------------------------------------------------------

    def _inject_faults(self, started_s: float) -> None:
        c = self.config
        kill_s = started_s + c.kill_at * c.duration_s
        next_rewrite_s = started_s + c.rewrite_every_s / 2
        killed = False
        end_s = started_s + c.duration_s
        while (now_s := time.monotonic()) < end_s and not self._stopping.is_set():
            if not killed and now_s >= kill_s:
                self._kill_and_remount()
                killed = True
            elif now_s >= next_rewrite_s:
                self._rewrite()
                next_rewrite_s += c.rewrite_every_s
            time.sleep(min(0.05, max(0.0, end_s - now_s)))

    def _rewrite(self) -> None:
        relpath = self._rng.choice(self.model.relpaths)
        old = self.model.newest(relpath)
        size = len(old) if self.config.same_size_rewrites else self._rng.choice(
            [len(old), len(old) // 2, len(old) * 2 + 1,
             self._rng.randrange(1, 3 * self.config.block_bytes)])
        self.model.rewrite(relpath, self._rng.randbytes(size))
        self.report.rewrites += 1
        self._event(f"rewrote {relpath}: {len(old)} -> {size} bytes")

    # -- readers --------------------------------------------------------------------------

    def _reader(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        while not self._stopping.is_set():
            self._serving.wait()
            if self._stopping.is_set():
                return
            mountpoint, generation = Path(self.mount.mountpoint), self._generation
            publisher = False
            if rng.random() < self.config.range_fraction:
                relpath = rng.choice(self.orders.all_paths)
                span = self.model.max_size(relpath) + 1
                offset = rng.randrange(span)
                length = rng.randrange(1, 3 * self.config.block_bytes)
            else:
                relpath, publisher = self.orders.next_item(rng)
                offset, length = 0, None
            try:
                self._read_checked(mountpoint / relpath, relpath, offset, length)
            except OSError as exc:
                self._failed_read(generation, f"reading {relpath}: {exc!r}", exc)
            if publisher:
                try:
                    self.orders.publish_next(mountpoint)
                except (OrderError, OSError) as exc:
                    self._failed_read(generation, f"publishing an order: {exc}", exc)

    def _failed_read(self, generation: int, message: str, exc: Exception) -> None:
        if generation != self._generation or not self._serving.is_set():
            with self._report_lock:
                self.report.errors_while_down += 1
            return
        self.report.fail(message)
        if isinstance(exc, OSError) and exc.errno in DEAD_MOUNT_ERRNOS:
            self._died.set()  # the daemon died by itself: nothing more to check
            self._stopping.set()

    def _read_checked(self, path: Path, relpath: str, offset: int, length: int | None,
                      final: bool = False) -> None:
        """A checked read; one answered ESTALE is read again (a few times, 10 ms apart, while
        the kernel drops its entry of the file), and the last try must pass.

        ESTALE is the mount's answer to a read of a version of the file that the source
        replaced (its inode is retired: cachefs/inodes.py), beyond the pages the kernel
        still holds of it: the other choice would be a mix of two versions. A user's program
        sees the error once; its next open of the file gets the new version."""
        retry_estale(lambda: self._read_and_check(path, relpath, offset, length, final),
                     self._count_estale)

    def _count_estale(self) -> None:
        with self._report_lock:
            self.report.estale_reads += 1

    def _read_and_check(self, path: Path, relpath: str, offset: int, length: int | None,
                        final: bool = False) -> None:
        started_s = time.monotonic()
        if length is None:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read()
        else:
            size = None
            fd = os.open(path, os.O_RDONLY)
            try:
                # pread again after a short one, as a buffered reader does: a read the kernel
                # served in part from its pages and then failed returns the part (the file
                # changed under the reader), and the next pread gets the error (ESTALE)
                data = pread_full(fd, length, offset)
            finally:
                os.close(fd)
        ended_s = time.monotonic()
        acceptable, stale = self.model.versions(relpath, started_s, ended_s,
                                                self.config.grace_s)
        problem = check_read(data, offset, length, acceptable, stale)
        if (problem is not None and started_s <= self._killed_s <= ended_s
                and cut_short(data, offset, length, acceptable)):
            # The kill aborted the read midway: what it returned is right, only short.
            with self._report_lock:
                self.report.errors_while_down += 1
            return
        if problem is None and size is not None and size not in {len(v.data)
                                                                 for v in acceptable}:
            problem = (f"st_size {size}, where the versions it may be have "
                       f"{[len(v.data) for v in acceptable]} bytes")
        with self._report_lock:
            report = self.report
            report.reads_checked += 1
            report.bytes_checked += len(data)
            if final:
                report.final_reads += 1
            elif length is None:
                report.whole_reads += 1
            else:
                report.range_reads += 1
            if problem is None:
                served = next(v for v in acceptable if check_read(data, offset, length, [v], [])
                              is None)
                report.max_stale_served_s = max(report.max_stale_served_s,
                                                 started_s - served.replaced_s)
        if problem is not None:
            what = "whole file" if length is None else f"{length} bytes at {offset}"
            self.report.fail(f"{relpath} ({what}, read at {self._clock(started_s)}-"
                             f"{self._clock(ended_s)}): {problem}; its versions: "
                             + self._history(relpath))

    def _event(self, what: str) -> None:
        self.report.events.append(f"{self._clock(time.monotonic())}: {what}")
        log.info("%s", what)

    def _clock(self, monotonic_s: float) -> str:
        """A time of the run, in seconds from its start ("12.31 s")."""
        return f"{monotonic_s - self._started_s:.2f} s"

    def _history(self, relpath: str) -> str:
        return "; ".join(f"{len(v.data)} bytes from {self._clock(v.written_s)}"
                         for v in self.model.history(relpath))

    # -- the end --------------------------------------------------------------------------

    def _finish(self) -> None:
        report = self.report
        report.order_switches = self.orders.switches
        report.manifest_switches = self.orders.manifest_switches
        for relpath in self.model.relpaths:
            if (self.source / relpath).read_bytes() != self.model.newest(relpath):
                report.fail(f"the source's {relpath} is not the soak's newest version of it")
        if not self._died.is_set():
            self._final_pass()
        # a mount's daemon log: the fixture's Mount names it, MountProcess's is in the state dir
        logs = {Path(getattr(mount, "log_path", Path(mount.state_dir) / "daemon.log"))
                for mount in self.mounts}
        for log_path in sorted(logs):
            text = log_path.read_text(errors="replace")
            if TRACEBACK in text:
                report.fail(f"{log_path} holds {text.count(TRACEBACK)} traceback(s): "
                            + "; ".join(exceptions_logged(text)[-3:]))

    def _final_pass(self) -> None:
        """Every file once more, each past its grace: its newest version only; the tiers'
        counters."""
        report = self.report
        time.sleep(self.config.grace_s)
        mountpoint = Path(self.mount.mountpoint)
        for relpath in self.model.relpaths:
            try:
                self._read_checked(mountpoint / relpath, relpath, 0, None, final=True)
            except OSError as exc:
                report.fail(f"final pass, {relpath}: {exc!r}")
                if exc.errno in DEAD_MOUNT_ERRNOS:
                    return
        last = self._record_tiers(f"mount {len(self.mounts) - 1} (at the end)", self.mount)
        if report.kills and not last["hits_ssd"]:
            report.fail("the SSD tier served no read after the remount")
        if not any(hits["hits_ram"] + hits["prefetched"] for hits in report.tier_hits.values()):
            report.fail("the RAM tier served no read")

    def _record_tiers(self, name: str, mount) -> dict:
        """The mount's counters, summed over its epochs, and its SSD tier's, into the report."""
        snapshot = ctrl.read_stats(Path(mount.mountpoint))
        totals = stats_totals(snapshot)
        hits = {key: totals[key] for key in ("reads", "hits_ram", "prefetched", "hits_ssd",
                                             "misses")}
        ssd = snapshot.get("ssd") or {}
        hits.update({f"ssd_{key}": ssd.get(key) for key in
                     ("entries", "dropped_stale", "rejected_checksum")})
        self.report.tier_hits[name] = hits
        return hits


def wait_until_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until the daemon's main thread is gone (a thread of it may still wait in the kernel:
    cachefs umount unblocks it)."""
    deadline = time.monotonic() + timeout_s
    while not daemon_killed(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not die")
        time.sleep(0.01)


def exceptions_logged(text: str) -> list[str]:
    """The exception lines of the tracebacks in a daemon log, each once ("IndexError: ...")."""
    found = re.findall(r"^[ |+-]*((?:[\w.]+)(?:Error|Exception|Exit)\b.*)$", text, re.M)
    return list(dict.fromkeys(line for line in found if not line.startswith("Traceback")))


# -- the script -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--readers", type=int, default=defaults.readers)
    parser.add_argument("--files", type=int, default=defaults.files)
    parser.add_argument("--rewrite-every-s", type=float, default=defaults.rewrite_every_s)
    parser.add_argument("--same-size-rewrites", action="store_true",
                        help="rewrite files with new bytes of the same size only")
    parser.add_argument("--subset-fraction", type=float, default=defaults.subset_fraction,
                        help="publications with a manifest of their own (0: never)")
    parser.add_argument("--metadata-ttl-s", type=float, default=defaults.metadata_ttl_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-soak"))
    parser.add_argument("--verbose", action="store_true", help="log the faults as they come")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(message)s")
    config = SoakConfig(duration_s=args.duration_s, readers=args.readers, files=args.files,
                        rewrite_every_s=args.rewrite_every_s,
                        same_size_rewrites=args.same_size_rewrites,
                        subset_fraction=args.subset_fraction,
                        metadata_ttl_s=args.metadata_ttl_s, seed=args.seed)
    workdir = args.workdir
    mounts: list[MountProcess] = []

    def mount_factory(mount_args: list) -> MountProcess:
        # the same mount point and state directory each time, as a user remounts
        mount = MountProcess(workdir / "src", workdir / "mnt", workdir / "state", mount_args)
        mounts.append(mount)
        mount.start()
        return mount

    MountProcess(workdir / "src", workdir / "mnt", workdir / "state").stop()  # an old run's
    shutil.rmtree(workdir / "state", ignore_errors=True)  # its order files and log
    try:
        report = Soak(config, workdir, mount_factory).run()
    except MountError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        for mount in mounts:
            mount.stop()
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
