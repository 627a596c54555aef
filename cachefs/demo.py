"""`cachefs demo`: a slow data set read for a few epochs, with and without cachefs, side by side.

What it does, in order, all inside one temporary directory that is removed at the end:

1. Generate a sample data set: `files` files of about `file_kb` KiB (sizes uniform between half
   and one and a half times that) in class subdirectories, like an image data set.
2. Read it *directly*, for `epochs` epochs, from a slow source. "Directly" means the same reader
   reads the same files from the source directory and itself sleeps `delay_ms` before every
   open and before every 4 MiB of data, exactly where the daemon's `--source-delay-ms` (a testing
   aid) sleeps. Both ways therefore pay the same latency per source access; neither is helped
   by anything the other is not (the source's files are in the page cache for both).
3. Mount cachefs over the data set with `--source-delay-ms delay_ms`, a RAM budget of
   `ram_fraction` of the data set's bytes and, if `ssd_fraction` > 0, an SSD tier of that
   fraction; its state directory (order file, log, pid) is inside the temporary directory. For
   each epoch it publishes the order as a trainer's sampler would (`current` = the epoch's
   permutation, `next` = the next epoch's) and reads every file through the mount with the
   same reader.
4. Unmount, remove the temporary directory (the data set stays with `keep`), and return the
   figures; `write_json` and `plot` save them, `format_table` prints them.

The reader is a trainer's DataLoader in miniature: `workers` threads, position i of the epoch's
order read by worker i % workers, each worker in order, every file read whole. Both ways read
the same orders (`cachefs.order.permutation(n, seed, epoch)`), so the epochs are comparable one
by one.

Hits by tier come from the daemon's own counters (`user.cachefs.stats`), as the difference of
their totals before and after each epoch: a file is counted when the kernel releases it, which
may come a moment after close() and after the daemon has moved to the next epoch's record.

Cleanup runs in a finally, also on Ctrl-C (KeyboardInterrupt): the reader threads are told to
stop and joined, the mount is unmounted (lazily if busy) even when the reader failed, and the
temporary directory is removed. SIGINT is ignored while cleaning up so that a second Ctrl-C
cannot leave a mount behind. The mount command runs in its own session, so a Ctrl-C in the
terminal reaches only the demo, which then cleans up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cachefs import __version__
from cachefs.client import MountError, MountProcess, stats_delta
from cachefs.errors import CachefsError
from cachefs.manifest import scan_source
from cachefs.order import permutation
from cachefs.publish import publish
from cachefs.workload import aligned_buffer, read_whole_file, write_dataset

log = logging.getLogger(__name__)

SOURCE_BLOCK_BYTES = 4 * 1024 * 1024  # the daemon's default block: one delay per block read
READ_BUFFER_BYTES = 1024 * 1024
CLASS_DIRS = 10
JOIN_POLL_S = 0.1
JSON_NAME = "cachefs-demo.json"
TRACEBACK_LINES = 40  # of a traceback in the daemon's log, in the error
PNG_NAME = "cachefs-demo.png"

Progress = Callable[[str], None]


class DemoError(CachefsError):
    """The demo could not run (mount failed, a read failed); the message says why."""


@dataclass(frozen=True)
class DemoConfig:
    """What `cachefs demo` runs; validated here so that the CLI only parses. The defaults are
    the CLI's (cachefs.cli._DEMO_SETTINGS), in one place."""

    files: int
    file_kb: float
    epochs: int
    workers: int
    ram_fraction: float
    ssd_fraction: float
    delay_ms: float
    seed: int
    output: Path
    keep: bool

    def __post_init__(self):
        if self.files < 1 or self.epochs < 1 or self.workers < 1:
            raise ValueError("files, epochs and workers must be at least 1")
        if self.file_kb <= 0:
            raise ValueError("file_kb must be positive")
        if self.ram_fraction <= 0 or self.ssd_fraction < 0:
            raise ValueError("ram_fraction must be positive and ssd_fraction not negative")
        if self.delay_ms < 0 or self.seed < 0:
            raise ValueError("delay_ms and seed must not be negative")


@dataclass
class EpochFigures:
    """One epoch read one way. For `direct`, every read is a miss and `stall_s` is the time the
    workers spent in open and read (all of it waiting for the slow source); for `cachefs` the
    classes and `stall_s` are the daemon's counters."""

    epoch: int
    time_s: float
    files: int
    bytes: int
    io_s: float  # summed over workers: time inside open() and read(), as the reader saw it
    reads: int
    hits_ram: int
    hits_ssd: int
    prefetched: int
    misses: int
    backend_bytes: int
    stall_s: float

    @property
    def files_per_s(self) -> float:
        return self.files / self.time_s if self.time_s > 0 else math.inf

    def to_json(self) -> dict:
        return {**asdict(self), "files_per_s": round(self.files_per_s, 1),
                "time_s": round(self.time_s, 4), "io_s": round(self.io_s, 4),
                "stall_s": round(self.stall_s, 6)}


@dataclass
class DemoResult:
    config: DemoConfig
    dataset_files: int
    dataset_bytes: int
    ram_cache_bytes: int
    ssd_size_bytes: int
    direct: list[EpochFigures] = field(default_factory=list)
    cachefs: list[EpochFigures] = field(default_factory=list)
    kept_dataset: Path | None = None

    @property
    def capacity_fraction(self) -> float:
        """C/N: the most of an epoch any cache of this size can serve from what it kept."""
        return min(1.0, (self.ram_cache_bytes + self.ssd_size_bytes) / max(1, self.dataset_bytes))

    def speedup(self, epoch_index: int) -> float:
        return _ratio(self.direct[epoch_index].time_s, self.cachefs[epoch_index].time_s)

    @property
    def overall_speedup(self) -> float:
        return _ratio(sum(f.time_s for f in self.direct), sum(f.time_s for f in self.cachefs))

    def to_json(self) -> dict:
        config = {**asdict(self.config), "output": str(self.config.output)}
        return {
            "version": 1,
            "cachefs_version": __version__,
            "config": config,
            "dataset": {"files": self.dataset_files, "bytes": self.dataset_bytes,
                        "kept_at": str(self.kept_dataset) if self.kept_dataset else None},
            "ram_cache_bytes": self.ram_cache_bytes,
            "ssd_size_bytes": self.ssd_size_bytes,
            "capacity_fraction": round(self.capacity_fraction, 4),
            "epochs": [{"epoch": d.epoch, "direct": d.to_json(), "cachefs": c.to_json(),
                        "speedup": round(self.speedup(i), 3)}
                       for i, (d, c) in enumerate(zip(self.direct, self.cachefs, strict=True))],
            "overall": {"direct_time_s": round(sum(f.time_s for f in self.direct), 4),
                        "cachefs_time_s": round(sum(f.time_s for f in self.cachefs), 4),
                        "speedup": round(self.overall_speedup, 3)},
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


# -- the data set --------------------------------------------------------------------------------

def generate_dataset(root: Path, files: int, file_kb: float, seed: int) -> int:
    """Write `files` files of varying size under root/class_XX/; return their total bytes.

    Sizes are uniform between half and one and a half times `file_kb` KiB; the bytes are
    written by `cachefs.workload.write_dataset`, as the benchmarks' are.
    """
    mean_bytes = file_kb * 1024
    sizes = np.random.default_rng(seed).uniform(0.5 * mean_bytes, 1.5 * mean_bytes, files)
    sizes = np.maximum(sizes.astype(np.int64), 1)
    relpaths = [f"class_{index % CLASS_DIRS:02d}/sample_{index:06d}.bin"
                for index in range(files)]
    return write_dataset(root, relpaths, sizes, seed)


# -- the reader ----------------------------------------------------------------------------------

@dataclass
class _EpochRead:
    time_s: float
    bytes: int
    io_s: float


def read_epoch(paths: list[bytes], workers: int, delay_s: float,
               stop: threading.Event) -> _EpochRead:
    """Read paths (in epoch order) with `workers` threads: position i by worker i % workers.

    Waits in short joins so that Ctrl-C reaches the main thread at once; on any exception
    (KeyboardInterrupt included) the workers are stopped and joined before it propagates, so no
    thread still holds a file of the mount when the caller unmounts.
    """
    totals = [0] * workers
    io_times = [0.0] * workers
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        buffer = aligned_buffer(READ_BUFFER_BYTES)
        try:
            for path in paths[worker::workers]:
                if stop.is_set():
                    return
                started = time.perf_counter()
                # with delay_s, a sleep where the daemon's slow source sleeps: per block
                totals[worker] += read_whole_file(path, buffer, delay_s,
                                                  delay_every_bytes=SOURCE_BLOCK_BYTES)
                io_times[worker] += time.perf_counter() - started
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=(w,), name=f"demo-reader-{w}", daemon=True)
               for w in range(workers)]
    started = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(JOIN_POLL_S)
    except BaseException:
        stop.set()  # each worker finishes the file it is reading, then returns
        for thread in threads:
            if thread.ident is not None:  # an interrupt may come before every thread started
                thread.join()
        raise
    elapsed_s = time.perf_counter() - started
    if failures:
        exc = failures[0]
        raise DemoError(f"reading failed: {exc}") from exc
    return _EpochRead(elapsed_s, sum(totals), sum(io_times))


# -- the mount -----------------------------------------------------------------------------------

# -- the run -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _sigint_ignored():
    """No KeyboardInterrupt while cleaning up (only the main thread can set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _epoch_paths(data_dir: Path, manifest_paths: np.ndarray, order: np.ndarray) -> list[bytes]:
    root = os.fsencode(data_dir) + b"/"
    return [root + bytes(manifest_paths[i]) for i in order.tolist()]


def _run_direct(result: DemoResult, data_dir: Path, manifest_paths: np.ndarray,
                stop: threading.Event, progress: Progress) -> None:
    config = result.config
    n = len(manifest_paths)
    for epoch in range(config.epochs):
        paths = _epoch_paths(data_dir, manifest_paths, permutation(n, config.seed, epoch))
        read = read_epoch(paths, config.workers, config.delay_ms / 1000.0, stop)
        figures = EpochFigures(epoch=epoch, time_s=read.time_s, files=n, bytes=read.bytes,
                               io_s=read.io_s, reads=n, hits_ram=0, hits_ssd=0, prefetched=0,
                               misses=n, backend_bytes=read.bytes, stall_s=read.io_s)
        result.direct.append(figures)
        progress(f"direct  epoch {epoch}: {figures.time_s:6.2f} s, "
                 f"{figures.files_per_s:7.0f} files/s")


def _run_cachefs(result: DemoResult, mount: MountProcess, manifest_paths: np.ndarray,
                 stop: threading.Event, progress: Progress) -> None:
    config = result.config
    n = len(manifest_paths)
    for epoch in range(config.epochs):
        current = permutation(n, config.seed, epoch)
        before = mount.totals()
        started = time.perf_counter()
        # Part of the epoch's time: a trainer's sampler publishes before its first batch.
        publish(mount.mountpoint, epoch, current, next=permutation(n, config.seed, epoch + 1))
        publish_s = time.perf_counter() - started
        read = read_epoch(_epoch_paths(mount.mountpoint, manifest_paths, current),
                          config.workers, 0.0, stop)
        after = mount.settled_totals(before, n)
        delta = stats_delta(before, after)
        figures = EpochFigures(epoch=epoch, time_s=publish_s + read.time_s, files=n,
                               bytes=read.bytes, io_s=read.io_s, reads=delta["reads"],
                               hits_ram=delta["hits_ram"], hits_ssd=delta["hits_ssd"],
                               prefetched=delta["prefetched"], misses=delta["misses"],
                               backend_bytes=delta["backend_bytes"], stall_s=delta["stall_s"])
        result.cachefs.append(figures)
        progress(f"cachefs epoch {epoch}: {figures.time_s:6.2f} s, "
                 f"{figures.files_per_s:7.0f} files/s, ram hits {figures.hits_ram}, "
                 f"ssd hits {figures.hits_ssd}, prefetched {figures.prefetched}, "
                 f"misses {figures.misses}")


def _mount_args(config: DemoConfig, ram_bytes: int, ssd_bytes: int, ssd_dir: Path) -> list[str]:
    args = ["--ram-cache", str(ram_bytes), "--source-delay-ms", f"{config.delay_ms:g}"]
    if ssd_bytes:
        args += ["--ssd-cache", str(ssd_dir), "--ssd-size", str(ssd_bytes)]
    return args


def _cleanup(workdir: Path, keep_dir: Path | None) -> None:
    """Remove the working directory, all but keep_dir if given."""
    if keep_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for entry in workdir.iterdir():
        if entry != keep_dir:
            shutil.rmtree(entry, ignore_errors=True)


def run(config: DemoConfig, progress: Progress = lambda message: None) -> DemoResult:
    """Generate, read directly, read through cachefs, clean up; return the figures.

    Raises DemoError if the mount or a read fails, or if the mount's daemon logged a
    traceback (a bug: the daemon answers EIO and logs it, and the figures may look fine).
    Everything is unmounted and removed before this returns or raises, KeyboardInterrupt
    included; with config.keep the data set stays.
    """
    workdir = Path(tempfile.mkdtemp(prefix="cachefs-demo-"))
    data_dir = workdir / "data"
    mount: MountProcess | None = None
    stop = threading.Event()
    succeeded = False
    daemon_error = None
    try:
        progress(f"generating {config.files} files of about {config.file_kb:g} KiB "
                 f"in {data_dir}")
        dataset_bytes = generate_dataset(data_dir, config.files, config.file_kb, config.seed)
        manifest = scan_source(data_dir)
        ram_bytes = max(1, int(dataset_bytes * config.ram_fraction))
        ssd_bytes = int(dataset_bytes * config.ssd_fraction)
        result = DemoResult(config, len(manifest), dataset_bytes, ram_bytes, ssd_bytes)
        progress(f"data set: {len(manifest)} files, {dataset_bytes / 1e6:.1f} MB; slow source: "
                 f"{config.delay_ms:g} ms per open and per read; {config.workers} readers")

        _run_direct(result, data_dir, manifest.paths, stop, progress)

        mount = MountProcess(data_dir, workdir / "mnt", workdir / "state",
                             _mount_args(config, ram_bytes, ssd_bytes, workdir / "ssd"))
        progress(f"mounting cachefs: RAM {ram_bytes / 1e6:.1f} MB"
                 + (f", SSD {ssd_bytes / 1e6:.1f} MB" if ssd_bytes else "")
                 + f", C/N = {result.capacity_fraction:.2f}")
        try:
            mount.start()
        except MountError as exc:
            raise DemoError(str(exc)) from None
        _run_cachefs(result, mount, manifest.paths, stop, progress)
        succeeded = True
    finally:
        with _sigint_ignored():
            stop.set()
            if mount is not None:
                mount.stop()
                daemon_error = _traceback_in(mount.state_dir / "daemon.log")
            keep_dir = data_dir if config.keep and data_dir.is_dir() else None
            _cleanup(workdir, keep_dir)
    if daemon_error is not None:
        raise DemoError(f"the cachefs daemon logged an unexpected error (a bug):\n{daemon_error}")
    if config.keep and succeeded:
        result.kept_dataset = data_dir
    return result


def _traceback_in(log_path: Path) -> str | None:
    """The first traceback in the daemon's log, up to TRACEBACK_LINES lines, or None."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    start = text.find("Traceback (most recent call last)")
    if start < 0:
        return None
    start = text.rfind("\n", 0, start) + 1
    return "\n".join(text[start:].splitlines()[:TRACEBACK_LINES])


# -- output --------------------------------------------------------------------------------------

def write_json(result: DemoResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return path


def format_table(result: DemoResult) -> str:
    """Per epoch, a row each way; then the totals and the speedup."""
    header = (f"{'epoch':>5}  {'way':<8}{'time s':>8}{'files/s':>9}{'MB/s':>8}{'ram hits':>10}"
              f"{'ssd hits':>10}{'prefetched':>12}{'misses':>8}{'stall s':>9}{'speedup':>9}")
    config = result.config
    tiers = f"RAM {result.ram_cache_bytes / 1e6:.1f} MB" + (
        f" + SSD {result.ssd_size_bytes / 1e6:.1f} MB" if result.ssd_size_bytes else "")
    title = (f"{result.dataset_files} files, {result.dataset_bytes / 1e6:.1f} MB; source "
             f"latency {config.delay_ms:g} ms per open and per read; {config.workers} readers; "
             f"cachefs {tiers} (C/N = {result.capacity_fraction:.2f})")
    lines = [title, header]

    def row(label, way, figures: EpochFigures, speedup: str) -> str:
        mb_per_s = figures.bytes / figures.time_s / 1e6 if figures.time_s > 0 else math.inf
        return (f"{label:>5}  {way:<8}{figures.time_s:>8.2f}{figures.files_per_s:>9.0f}"
                f"{mb_per_s:>8.1f}{figures.hits_ram:>10}{figures.hits_ssd:>10}"
                f"{figures.prefetched:>12}{figures.misses:>8}{figures.stall_s:>9.2f}"
                f"{speedup:>9}").rstrip()

    for index, (direct, cached) in enumerate(zip(result.direct, result.cachefs, strict=True)):
        lines.append(row(direct.epoch, "direct", direct, ""))
        lines.append(row(cached.epoch, "cachefs", cached, f"{result.speedup(index):.2f}x"))
    lines.append(row("all", "direct", _sum(result.direct), ""))
    lines.append(row("all", "cachefs", _sum(result.cachefs), f"{result.overall_speedup:.2f}x"))
    return "\n".join(lines)


def _sum(epochs: list[EpochFigures]) -> EpochFigures:
    return EpochFigures(
        epoch=-1, time_s=sum(f.time_s for f in epochs), files=sum(f.files for f in epochs),
        bytes=sum(f.bytes for f in epochs), io_s=sum(f.io_s for f in epochs),
        reads=sum(f.reads for f in epochs), hits_ram=sum(f.hits_ram for f in epochs),
        hits_ssd=sum(f.hits_ssd for f in epochs), prefetched=sum(f.prefetched for f in epochs),
        misses=sum(f.misses for f in epochs),
        backend_bytes=sum(f.backend_bytes for f in epochs),
        stall_s=sum(f.stall_s for f in epochs))


def plot(result: DemoResult, path: Path) -> Path:
    """Two panels: epoch time both ways; cachefs's reads by class with the bound C/N.

    Raises ImportError if matplotlib is missing (the `demo` extra installs it).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    epochs = [f.epoch for f in result.cachefs]
    x = np.arange(len(epochs))
    fig, (ax_time, ax_hits) = plt.subplots(1, 2, figsize=(11, 4.2))

    width = 0.38
    ax_time.bar(x - width / 2, [f.time_s for f in result.direct], width,
                label="direct (slow source)", color="#9e9e9e")
    bars = ax_time.bar(x + width / 2, [f.time_s for f in result.cachefs], width,
                       label="cachefs", color="#1f77b4")
    for index, bar in enumerate(bars):
        ax_time.annotate(f"{result.speedup(index):.1f}x", (bar.get_x() + bar.get_width() / 2,
                         bar.get_height()), ha="center", va="bottom", fontsize=9)
    ax_time.set_xticks(x, [str(e) for e in epochs])
    ax_time.set_xlabel("epoch")
    ax_time.set_ylabel("epoch time (s)")
    ax_time.set_title(f"Epoch time, {result.dataset_files} files, "
                      f"{result.config.workers} readers")
    top_s = max(f.time_s for f in result.direct + result.cachefs)
    ax_time.set_ylim(0, top_s * 1.3)  # room for the legend above the bars
    ax_time.legend(loc="upper center", ncol=2)

    def share(key: str) -> np.ndarray:
        return np.array([getattr(f, key) / max(1, f.reads) for f in result.cachefs])

    classes = [("hits_ram", "RAM hits", "#2ca02c"), ("hits_ssd", "SSD hits", "#17becf"),
               ("prefetched", "prefetched (no stall)", "#aec7e8"),
               ("misses", "misses (stalled)", "#d62728")]
    if not result.ssd_size_bytes:
        del classes[1]
    bottom = np.zeros(len(epochs))
    for key, label, color in classes:
        values = share(key)
        ax_hits.bar(x, values, 0.6, bottom=bottom, label=label, color=color)
        bottom += values
    ax_hits.axhline(result.capacity_fraction, color="black", linestyle="--", linewidth=1)
    ax_hits.annotate(f"capacity bound C/N = {result.capacity_fraction:.2f}",
                     (x[0] - 0.3, result.capacity_fraction), xytext=(0, 3),
                     textcoords="offset points", fontsize=9)
    ax_hits.set_xticks(x, [str(e) for e in epochs])
    ax_hits.set_ylim(0, 1.3)  # room for the legend above the bars
    ax_hits.set_xlabel("epoch")
    ax_hits.set_ylabel("share of reads")
    ax_hits.set_title("cachefs: how each read was served")
    ax_hits.legend(fontsize=8, loc="upper center", ncol=2)

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
