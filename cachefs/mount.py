"""Builds a mount's objects, runs pyfuse3 under trio, and takes it down cleanly.

`run(config)` is the whole life of a foreground mount: check the paths (clear errors with the
exit codes of man/cachefs-mount.1), build source -> tiers -> read path (read_path.build_read_path)
-> operations, each object after those it uses, `pyfuse3.init`, then one root nursery holding
the services (kernel invalidation, SSD admission, prefetcher, order watcher, source scan,
signal handler) and `pyfuse3.main`. SIGTERM/SIGINT/SIGHUP and an external `fusermount3 -u` or
`umount` all end `pyfuse3.main`; the nursery is cancelled, the SSD index is closed and the
kernel mount removed, and `run` returns 0. Under systemd (`--systemd`), the mount says READY=1
once the kernel has its answer to FUSE_INIT, and STOPPING=1 when it begins to go
(cachefs/sdnotify.py).

Daemonizing is the CLI's job (it starts this in a child process and waits for the mount).
With `--metrics`, `run` also listens for Prometheus (metrics.py) before the mount exists, in
this process, and stops listening when the mount is gone.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyfuse3
import trio

from cachefs import __version__, errors, heap, scheduling, state_dir, threads
from cachefs.cache.ram import RamTier
from cachefs.mountinfo import listed_path, mount_at, mounted_paths
from cachefs.config import MountConfig
from cachefs.ctrl import Control
from cachefs.freshness import Freshness
from cachefs.fuse_ops import Operations
from cachefs.kernel_invalidation import KernelInvalidation
from cachefs.inodes import ROOT_INODE, InodeTable
from cachefs.manifest import Manifest, quote_path, scan_source
from cachefs.order import load_order
from cachefs.order_watch import OrderWatcher
from cachefs import fanotify
from cachefs.fanotify import CloseWatcher, close_delivery, open_close_events
from cachefs.pagecache import KernelPages, file_pages_dropper, list_entries
from cachefs.read_path import build_read_path
from cachefs.revalidate import Revalidator
from cachefs.sdnotify import Notifier
from cachefs.source import Source
from cachefs.stats import Stats, refetch_window_blocks
from cachefs.targets import Targets
from cachefs.warm import Warmer

if TYPE_CHECKING:
    from cachefs.metrics import Exporter

log = logging.getLogger(__name__)

READ_AHEAD_KB = 1024  # kernel read-ahead of the mount: 1 MiB requests double large-file MB/s
# after a signal, how long requests in flight may take before they are given up
TERMINATE_GRACE_S = 1.0
DETACH_WAIT_S = 5.0  # fusermount3 -z returns at once; this bounds a stuck one


def check_startup(config: MountConfig) -> None:
    """Refuse to start with a clear message; exit codes are in man/cachefs-mount.1."""
    if not config.source.is_dir():
        what = "does not exist" if not config.source.exists() else "is not a directory"
        raise errors.StartupError(f"source {config.source} {what}", errors.EXIT_SOURCE)
    if listed_path(config.mountpoint) in mounted_paths():
        raise errors.StartupError(
            f"{config.mountpoint} is already a mount point (a stale cachefs mount? "
            f"run: cachefs umount {config.mountpoint})", errors.EXIT_ALREADY_MOUNTED)
    if not config.mountpoint.is_dir():
        what = "does not exist" if not config.mountpoint.exists() else "is not a directory"
        raise errors.StartupError(f"mount point {config.mountpoint} {what}",
                                  errors.EXIT_MOUNTPOINT)
    if not os.path.exists("/dev/fuse"):
        raise errors.StartupError("/dev/fuse is missing (load the fuse module or install fuse3)",
                                  errors.EXIT_NO_FUSE)
    if shutil.which("fusermount3") is None:
        raise errors.StartupError("fusermount3 is missing (install the fuse3 package)",
                                  errors.EXIT_NO_FUSE)
    if config.data_plane == "no-open":
        reason = zero_request_unavailable()
        if reason is not None:
            raise errors.StartupError(f"--data-plane no-open: {reason}", errors.EXIT_USAGE)
    if config.metrics_address is not None:
        from cachefs import metrics  # prometheus_client: only for mounts that serve metrics

        metrics.check_address(config.metrics_address)
    try:
        scheduling.cpus_asked(config.cpus)
    except ValueError as exc:
        raise errors.StartupError(str(exc), errors.EXIT_USAGE) from None


class SourceManifest:
    """The default manifest (every regular file of the source), scanned once, lazily.

    Thread-safe: the order loader (a worker thread) and the start-up scan may both ask. A scan
    that fails (the source's root cannot be listed) is a warning and an OSError for the one
    that asked; the next one to ask scans again. The mount serves the source's paths whatever
    becomes of the scan: only orders without a file list and `cachefs warm --all` need it.
    """

    def __init__(self, root: Path):
        self._root = root
        self._lock = threading.Lock()
        self.manifest: Manifest | None = None

    def get(self) -> Manifest:
        with self._lock:
            if self.manifest is None:
                started = time.monotonic()
                try:
                    self.manifest = scan_source(self._root)
                except OSError as exc:
                    log.warning("cannot scan the source %s: %s (scanned again when an order "
                                "without a file list or a warm needs its files)", self._root,
                                exc.strerror or exc)
                    raise
                log.info("source scanned: %d files in %.2f s", len(self.manifest),
                         time.monotonic() - started)
            return self.manifest

    def files_in(self, directory: bytes) -> int | None:
        """How many files the scan found under `directory` (its subdirectories' included),
        None before a scan: one search each way in the scan's sorted paths. Asked from the
        page cache's lookup threads, so numpy's search, which lets the trio thread run."""
        manifest = self.manifest
        if manifest is None:
            return None
        if not directory:
            return len(manifest)
        # b"0" sorts right after b"/": the two bounds enclose every path under the directory
        first, end = np.searchsorted(manifest.paths, [directory + b"/", directory + b"0"])
        return int(end - first)

    def get_for_order(self) -> Manifest:
        """The manifest, for an order file that indexes it: a scan that fails rejects the
        order, with the reason (the order in force stays)."""
        try:
            return self.get()
        except OSError as exc:
            raise errors.OrderError(f"the order indexes the source's files, and the source "
                                    f"cannot be listed: {exc.strerror or exc}") from None

    async def scan_at_start(self) -> None:
        """The scan, in a worker thread, once the mount serves; a failure is the warning
        `get` logs, never the end of the mount."""
        with contextlib.suppress(OSError):  # `get` logged it
            await threads.run_one(self.get)


class Mount:
    """The objects of one mount, wired; `serve` runs them."""

    def __init__(self, config: MountConfig):
        self.config = config
        cache = config.cache
        self.started_at = time.time()
        self.stats = Stats(refetch_window_blocks(cache.ram_bytes, cache.block_bytes))
        self.freshness = Freshness(config.metadata_ttl_s)
        # the storage targets' lists and counters: the source reports its requests to them
        self.targets = Targets()
        self.source = Source(config.source, threads=config.prefetch.source_threads,
                             delay_s=config.source_delay_s, requests=self.targets)
        self.notifier = Notifier.from_environment() if config.notify_systemd else None
        self.ssd = None
        # `cachefs stats`'s `ssd` of a tier whose device could not be used (full, read-only)
        self.unusable_ssd: dict | None = None
        if cache.ssd_dir is not None:
            # only mounts with an SSD tier need it
            from cachefs.cache.ssd import SsdTier, device_failure, tier_stats
            try:
                self.ssd = SsdTier(cache.ssd_dir, cache.ssd_bytes, cache.block_bytes,
                                   source=self.source.root, progress=self._starting)
            except errors.StartupError as exc:
                failure = device_failure(exc)
                if failure is None:
                    raise
                log.warning("ssd cache %s: %s; the mount goes on without its SSD tier",
                            cache.ssd_dir, failure)
                self.unusable_ssd = tier_stats(cache.ssd_dir, cache.ssd_bytes, failure)
        try:
            self._wire(config)
        except BaseException:
            # the tier is open (its meta says unclean): left so, the next start reconciled
            # every entry of it (`run` closes it only once this returned)
            if self.ssd is not None:
                self.ssd.close()
            raise

    def _wire(self, config: MountConfig) -> None:
        """Everything after the SSD tier (`__init__`), built in the order each is used."""
        cache = config.cache
        self.inodes = InodeTable(os.lstat(self.source.root), self.source.identity_of,
                                 self.freshness.trusted)
        self.source.on_look = self.inodes.confirm  # a read's look trusts its file's bytes anew
        # the kernel data plane; its thread starts once the FUSE session exists (serve)
        mountpoint = os.fsencode(os.path.abspath(config.mountpoint))
        self.source_manifest = SourceManifest(config.source)

        # a directory is listed for stores only if the scan found it small: a listing through
        # the mount has the daemon list the source's directory whole, an lstat per entry
        # (cachefs/dirs.py); KernelPages decides, with the scan's count
        self.kernel = (KernelPages(
            pyfuse3.notify_store, pyfuse3.invalidate_inode,
            lambda relpath: os.lstat(os.path.join(mountpoint, relpath)),
            lambda dir_relpath, max_entries: list_entries(
                os.path.join(mountpoint, dir_relpath), max_entries),
            self.source_manifest.files_in,
            invalidate_range_fn=getattr(pyfuse3, "invalidate_inode_range", None))
            if config.data_plane != "daemon" else None)
        self.data_plane = "daemon" if self.kernel is None else "keep-cache"  # until no-open
        self.close_watcher: CloseWatcher | None = None
        self.invalidation = KernelInvalidation(self.inodes, self.kernel)
        self.ram = RamTier(cache.ram_bytes, block_bytes=cache.block_bytes,
                           drop_kernel_pages=file_pages_dropper(self.kernel, self.inodes.inode_of))
        read_path = build_read_path(
            self.source, self.stats, self.ram, self.ssd, self.freshness, targets=self.targets,
            block_bytes=cache.block_bytes, source_threads=config.prefetch.source_threads,
            lookahead_items=config.prefetch.lookahead_items,
            sequential_blocks=config.prefetch.sequential_blocks,
            miss_batch_items=config.prefetch.miss_batch_items,
            kernel=self.kernel, kernel_inodes=self.inodes,
            on_source_changed=self.invalidation.source_changed,
            drop_file_pages=self.invalidation.drop_pages)
        self.planner = read_path.planner
        self.tiered = read_path.tiered
        self.prefetcher = read_path.prefetcher
        self.reader = read_path.reader
        self.watcher = OrderWatcher(config.order_file, self._load_order,
                                    self._order_in_force, resume=config.resume_order,
                                    before_order=self._closes_counted)
        # the kernel's read-ahead for the mount: set once it has our answer to FUSE_INIT
        # (`_serving`), and 0 while the order in force has byte-range items
        self._read_ahead_kb: int | None = None
        self._init_answered = False
        self.warmer = Warmer(self.source, self.ssd, block_bytes=cache.block_bytes,
                             threads=config.prefetch.source_threads,
                             order_paths=self._order_paths,
                             all_paths=lambda: list(self.source_manifest.get().paths))
        self.revalidator = Revalidator(self.source, self.ram, self.inodes, self.freshness,
                                       record_identity=self.prefetcher.record_identity,
                                       source_changed=self.reader.source_changed,
                                       open_files=lambda: self.ops.open_files(),
                                       serves_without_open=lambda: self.ops.no_open,
                                       range_files=read_path.range_cache.paged_files,
                                       drop_range_pages=read_path.range_cache.drop_overdue_pages)
        self.control = Control(self.snapshot, config.order_file, self.warmer.request)
        self.ops = Operations(self.source, self.reader, self.control, self.inodes, self.kernel,
                              self.freshness, kernel_timeout_s=config.kernel_timeout_s,
                              entry_drops_landed=self.invalidation.entry_drops_landed)
        self.metrics: Exporter | None = None  # the --metrics server, given by `run`

    def _starting(self, message: str) -> None:
        """A step of the start that may take minutes goes on (the SSD tier's, every
        PROGRESS_S): systemd's start timeout (90 s by default) is extended past the next
        report, as `cachefs mount` waits as long as the daemon logs."""
        if self.notifier is not None:
            from cachefs.cache.ssd import PROGRESS_S

            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(3 * PROGRESS_S * 1e6)}",
                               f"STATUS={message}")

    def _order_paths(self) -> list[bytes] | None:
        """The current order's files from the cursor on, for `cachefs warm --order`."""
        order = self.planner.order
        if order is None:  # not active
            return None
        manifest = order.manifest
        upcoming = self.planner.current[self.planner.cursor:]
        if order.items is not None:
            # an order of byte ranges: its entries are items, several to a file; each file
            # once, where its first item comes
            files = order.items.file[upcoming]
            _, first = np.unique(files, return_index=True)
            upcoming = files[np.sort(first)]
        return [manifest.path(int(index)) for index in upcoming]

    async def _closes_counted(self) -> None:
        """The closes the kernel has reported so far are counted (before a new order)."""
        if self.close_watcher is not None:
            await self.close_watcher.flushed()

    def _order_in_force(self, order) -> None:
        """The order watcher's order comes into force (`OrderWatcher`'s `on_order`)."""
        self.prefetcher.set_order(order)
        self._set_read_ahead()

    def _set_read_ahead(self) -> None:
        """1 MiB of kernel read-ahead, or none while the order in force has byte-range items:
        the kernel's read-ahead reads a file's neighbouring bytes, which for samples inside a
        file are other samples, where cachefs reads ahead the next samples of the order; and a
        page fault of a memmap reader then reads its own page alone, so that its READ says
        which sample was read (cachefs/range_read.py). It applies to files opened after it."""
        if not self._init_answered:
            return
        kb = 0 if self.prefetcher.ranking.ranged else READ_AHEAD_KB
        if kb != self._read_ahead_kb:
            _set_read_ahead(self.config.mountpoint, kb)
            self._read_ahead_kb = kb

    def _load_order(self, path: Path):
        return load_order(path, self.source_manifest.get_for_order, self._file_sizes)

    def _file_sizes(self, manifest, indices) -> np.ndarray:
        """The sizes of files of `manifest` now, for an order's byte-range items (the order
        watcher's worker thread; one lstat per file that holds items)."""
        sizes = np.empty(len(indices), np.int64)
        for slot, index in enumerate(indices.tolist()):
            relpath = manifest.path(index)
            try:
                sizes[slot] = self.source.lstat_sync(relpath).st_size
            except OSError as exc:
                raise errors.OrderError(f"{quote_path(relpath)}, which holds items: "
                                        f"{exc.strerror}") from None
        return sizes

    def snapshot(self) -> dict:
        """The JSON of `cachefs stats` (keys documented in man/cachefs-stats.1)."""
        watch = self.watcher.status()
        order = watch.get("order")
        if order is not None and self.planner.active:
            order = dict(order, **self.planner.status())
        manifest = self.source_manifest.manifest
        ssd = self.ssd.stats() if self.ssd is not None else (
            None if self.unusable_ssd is None else dict(self.unusable_ssd))
        if ssd is not None:
            ssd["admissions_skipped"] = self.tiered.admissions_skipped
            ssd["errors"] = self.stats.ssd_errors
        return {
            "version": 1,
            "cachefs_version": __version__,
            "mount": {"source": str(self.config.source), "mountpoint": str(self.config.mountpoint),
                      "pid": os.getpid(), "started_at": self.started_at,
                      "block_bytes": self.config.cache.block_bytes,
                      "cpus": sorted(os.sched_getaffinity(0))},
            "order_file": str(self.config.order_file),
            "order": order,
            "last_rejection": watch.get("last_rejection"),
            "rejections": watch.get("rejections"),
            "rejections_total": watch.get("rejections_total"),
            "publications": watch.get("publications"),
            "set_aside": watch.get("set_aside"),
            "manifest": {"files": len(manifest) if manifest is not None else None},
            "epochs": self.stats.snapshot(),
            "totals": self.stats.totals(),
            "ram": self.ram.stats(),
            "ssd": ssd,
            "prefetch": self.prefetcher.status(),
            "targets": self.targets.status(),
            "kernel": self._kernel_status(),
            # every change found, by the sweeps or any other look (TieredCache.source_changed)
            "revalidation": {**self.revalidator.status(), "changed": self.tiered.changes_found},
            "fuse_requests": dict(self.ops.requests),
            "source": self.source.status(),
            "warm": self.warmer.status(),
        }

    def _kernel_status(self) -> dict | None:
        """The kernel data plane's counters (man/cachefs-stats.1), None when it is off."""
        if self.kernel is None:
            return None
        status = dict(self.kernel.status(), mode=self.data_plane,
                      held_bytes=self.ram.kernel_bytes,
                      whole_file_opens=self.reader.kernel_opens,
                      reclaimed_blocks=self.tiered.kernel_reclaims,
                      kernel_losses=self.prefetcher.ranking.kernel_losses)
        if self.close_watcher is not None:
            status.update(close_events=self.close_watcher.events,
                          closes_counted_alone=self.reader.alone_closes,
                          close_event_overflows=self.close_watcher.overflows,
                          close_events_by="handle" if self.close_watcher.by_handle else "fd")
        return status

    async def serve(self) -> None:
        options = set(pyfuse3.default_options)
        # "ro" also spares a GETATTR per file: on a writable mount the kernel invalidates
        # a file's atime after every read and asks for its attributes again
        options |= {"fsname=cachefs", "subtype=cachefs", "ro"}
        if self.config.allow_other:
            options.add("allow_other")
        # catch SIGTERM/SIGINT/SIGHUP before the mount exists: one sent as soon as it appears
        # must unmount, not kill the process and leave a dead mount behind (SIGHUP: the
        # terminal of `cachefs mount -f` closed; libfuse's handlers catch it too)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT,
                                       signal.SIGHUP) as signals:
            # the root's stat, taken before trio's clock ran (freshness.py), counts from now
            self.inodes.update_stat(ROOT_INODE, self.inodes.get(ROOT_INODE).stat)
            pyfuse3.init(self.ops, str(self.config.mountpoint), options)  # raises: see `run`
            log.info("mounted %s at %s", self.config.source, self.config.mountpoint)
            if self.kernel is not None:
                self.kernel.start()
            if self.metrics is not None:
                self.metrics.collector.attach(self.snapshot)
            try:
                # what pyfuse3.main waits for once a signal ended it: handlers still running
                main_scope = trio.CancelScope()
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.invalidation.run)
                    nursery.start_soon(_terminate_on_signal, signals, main_scope)
                    await nursery.start(self.tiered.run)
                    await nursery.start(self.prefetcher.run)
                    await nursery.start(self.watcher.run)
                    await nursery.start(self.warmer.run)
                    await nursery.start(self.revalidator.run)
                    nursery.start_soon(self.source_manifest.scan_at_start)
                    nursery.start_soon(self._serving)
                    if self.config.data_plane in ("auto", "no-open"):
                        nursery.start_soon(self._start_zero_request)
                    else:
                        self.ops.decide_mode(no_open=False)
                    with main_scope:
                        try:
                            await pyfuse3.main(min_tasks=1, max_tasks=self.config.fuse_tasks)
                        except Exception as exc:  # noqa: BLE001 - all but one re-raised
                            if not _connection_ended(exc):
                                raise
                            log.info("the kernel ended the FUSE connection while a request "
                                     "was read: the mount is gone")
                    nursery.cancel_scope.cancel()
            finally:
                if self.notifier is not None:
                    self.notifier.send("STOPPING=1")
                if self.close_watcher is not None:
                    self.close_watcher.stop()
                # the page cache's threads end before the session their calls go to is freed
                if self.kernel is None or self.kernel.stop():
                    pyfuse3.close(unmount=True)
                else:
                    _detach_leaving_session(self.config.mountpoint)
                if self.ssd is not None:
                    self.ssd.close()
                log.info("unmounted %s", self.config.mountpoint)

    async def _serving(self) -> None:
        """What waits for the mount to serve: the kernel has our answer to FUSE_INIT once a
        stat of the mount point returns (this process answers it, so the stat runs in a worker
        thread). Then the read-ahead is raised (processing INIT set it from the init
        parameters, over anything written before) and systemd is told."""
        try:
            await threads.run_abandoning(os.stat, self.config.mountpoint)
        except OSError as exc:  # answered all the same
            log.debug("stat of the mount point: %s", exc)
        self._init_answered = True
        self._set_read_ahead()
        if self.notifier is not None:
            self.notifier.send("READY=1", f"STATUS=serving {self.config.source} at "
                                          f"{self.config.mountpoint}")

    async def _start_zero_request(self) -> None:
        """The zero-request mode (fuse_ops), where the kernel and privileges allow it:
        pyfuse3 must pass the inode to read() (scripts/patches/), and fanotify, which needs
        CAP_SYS_ADMIN, must report the mount's closes. Otherwise the mount stays in the
        keep-cache mode (OPEN and RELEASE per file), and says why. The fanotify mark is made
        once the mount answers (marking resolves the mount point, which asks this daemon), by
        a child process (cachefs/fanotify.py, `Marker`). OPENs wait for the decision,
        whatever happens here."""
        try:
            watcher = await self._watch_closes()
            mark_directory = None
            if watcher is not None and watcher.by_handle:
                mountpoint = os.fsencode(self.config.mountpoint)

                def mark_directory(relpath: bytes) -> None:
                    watcher.mark_directory(os.path.join(mountpoint, relpath))
            self.ops.decide_mode(no_open=watcher is not None, mark_directory=mark_directory)
        finally:
            if not self.ops.mode_decided.is_set():
                self.ops.decide_mode(no_open=False)

    async def _watch_closes(self) -> CloseWatcher | None:
        """Start the fanotify close watcher; None (and a log line saying why) if it cannot."""
        reason = zero_request_unavailable()
        if self.config.data_plane == "auto" and self.config.metadata_ttl_s == 0:
            reason = "--metadata-ttl 0 asks for a check at every open, and it has no open"
        events = None
        trio_token = trio.lowlevel.current_trio_token()
        if reason is None:
            try:
                # the marks are made by a child process (fanotify.Marker): a request of this
                # daemon to its own mount would keep a killed daemon from exiting
                events = await threads.run_abandoning(open_close_events,
                                                      os.fsencode(self.config.mountpoint))
            except OSError as exc:
                reason = f"fanotify: {exc.strerror}"
        if events is None:
            log.warning("zero-request mode unavailable (%s): every file costs an OPEN and a "
                        "RELEASE (keep-cache mode)", reason)
            return None
        fd, marker = events
        self.close_watcher = CloseWatcher(
            fd, marker, close_delivery(trio_token, self.ops.closed, by_handle=marker is not None))
        self.close_watcher.start()
        self.data_plane = "no-open"
        log.info("zero-request mode: files the kernel holds are read with no request "
                 "(close events %s)", "by file handle" if marker else "with an fd each")
        return self.close_watcher


def zero_request_unavailable() -> str | None:
    """Why this process cannot run the zero-request mode, or None if it can."""
    if not getattr(pyfuse3, "READ_FH_IS_INODE_WITHOUT_OPEN", False):
        return ("the installed pyfuse3 does not pass the inode to read() without an open; "
                "scripts/setup.sh builds one that does")
    try:
        fanotify.check_available()
    except OSError as exc:
        if exc.errno == errno_mod.EPERM:
            return "fanotify needs CAP_SYS_ADMIN, as root has it"
        return f"fanotify: {exc.strerror}"
    return None


async def _terminate_on_signal(signals, main_scope: trio.CancelScope) -> None:
    """End pyfuse3.main at the first signal. This task first runs once main has started
    (its first checkpoint is inside main), and a signal that came earlier waits in `signals`.
    pyfuse3.main returns once its handlers in flight have: those still running after
    TERMINATE_GRACE_S (one waiting on a source that hangs) are cancelled (`main_scope`), and
    their calls to the source left to finish on their own (cachefs/threads.py)."""
    async for signum in signals:
        log.info("signal %d: unmounting", signum)
        pyfuse3.terminate()
        await trio.sleep(TERMINATE_GRACE_S)
        log.warning("requests still waiting %.0f s after the signal (a source that hangs?): "
                    "their readers get an error as the mount goes", TERMINATE_GRACE_S)
        main_scope.cancel()
        return


def _connection_ended(exc: BaseException) -> bool:
    """Whether pyfuse3's loop ended on ECONNABORTED alone (or all of a nursery's exception
    group): the kernel tore the connection down while a request was read (an unmount racing
    its FORGET or RELEASE, a fusectl abort); libfuse ends quietly on ENODEV only."""
    if isinstance(exc, ConnectionAbortedError):
        return True
    inner = getattr(exc, "exceptions", ())  # an ExceptionGroup (3.11, or its backport)
    return bool(inner) and all(_connection_ended(one) for one in inner)


def _detach_leaving_session(mountpoint: Path) -> None:
    """Unmount (lazily, as pyfuse3.close does) without freeing the FUSE session: a page cache
    thread is still inside a call to it (a store waiting on a page whose READ nobody answers
    any more), and freed under it the session took the daemon down at its exit. The session
    and its device go with the process, which ends that thread's wait."""
    log.warning("a page cache thread is still in a FUSE call: unmounting without freeing "
                "the session")
    try:
        subprocess.run(["fusermount3", "-u", "-q", "-z", os.fsdecode(mountpoint)],
                       check=False, timeout=DETACH_WAIT_S, stdin=subprocess.DEVNULL,
                       capture_output=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("could not unmount %s: %s", mountpoint, exc)


def _set_read_ahead(mountpoint: Path, kb: int) -> None:
    """Best effort (root only): the kernel read-ahead of the mount's backing device, KiB.

    Only once the kernel has our answer to FUSE_INIT (`Mount._serving`): processing it sets
    the read-ahead from the init parameters, over anything written before (the mount ran at
    the kernel's 128 KiB while this was written right after `pyfuse3.init`). The device comes
    from /proc/self/mountinfo.
    """
    try:
        found = mount_at(listed_path(mountpoint))  # a mount over an earlier one: the top one
        if found is None:
            return
        with open(f"/sys/class/bdi/{found.device}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.debug("could not set the read-ahead: %s", exc)


def run(config: MountConfig) -> int:
    """Mount in the foreground until unmounted or signalled; raises StartupError."""
    check_startup(config)
    scheduling.run_as_batch_work()  # before any thread of the mount starts
    scheduling.run_on_cpus(scheduling.cpus_asked(config.cpus))
    state_dir.prepare(config)
    state_lock = state_dir.lock(config.state_dir)
    pid_file = config.state_dir / "pid"
    exporter = mount = None
    try:
        if config.metrics_address is not None:
            from cachefs.metrics import Exporter

            exporter = Exporter.start(config.metrics_address)
        mount = Mount(config)
        mount.metrics = exporter
        state_dir.write_no_link(pid_file, json.dumps({"pid": os.getpid(),
                                                      "mountpoint": str(config.mountpoint)}
                                                     ).encode())
        heap.settle()  # what exists now lives as long as the mount (cachefs/heap.py)
        try:
            trio.run(mount.serve)
        finally:
            pid_file.unlink(missing_ok=True)
    finally:
        if mount is not None and mount.ssd is not None:
            # closed by `serve` once it ran; else (a start that failed after the tier
            # opened) here, or the next start finds it unclean and reconciles it
            mount.ssd.close()
        if exporter is not None:
            exporter.close()
        os.close(state_lock)
    return errors.EXIT_OK

