"""Shared pieces of the benchmark scripts (bench.py, bench_fuse.py): one copy of each helper.

What is measured and how (the machine facts behind these choices: docs/design.md §4, the
kernel data plane):

- Data sets are generated once under a directory and reused when a marker file says they have
  the same shape. Their files are written, and read, by `cachefs.workload`, which `cachefs
  demo` uses too (file contents are slices of one random pool). The manifest is
  `cachefs.manifest.scan_source` of the directory (every regular file, sorted by path bytes),
  so an index means the same file to a reader and to the daemon.
- Readers are persistent worker processes (fork), created before anything is timed. A pass
  sends each worker its share of an order (worker i of n takes positions i, i+n, ..., as a
  DataLoader's workers do) and is timed from sending the task to the last worker's answer.
  One worker can instead run a thread pool (the "32-thread reader", the storage's ceiling).
- Readers time their open() and their reads of each file (`Waits`): for one reader, per-file
  time is those two plus its own bookkeeping, so they show which requests a mount makes slow.
- Every read goes into a page-aligned buffer (`cachefs.workload.aligned_buffer`).
- A delayed direct reader (`delay_s`) sleeps before every open and before every read request
  that still has data to return, as cachefs's `--source-delay-ms` does for its source
  (`cachefs.workload.read_whole_file`).
- `cachefs_mount` mounts with the real CLI (daemonized, `cachefs.client.MountProcess`, the
  demo's too) and always unmounts, lazily if it must, even when the benchmark fails or is
  interrupted.

Nothing here prints; the scripts do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from cachefs.client import MountError, MountProcess  # noqa: E402
from cachefs.errors import OrderError  # noqa: E402
from cachefs.manifest import scan_source  # noqa: E402
from cachefs.mountinfo import mounted_paths  # noqa: E402
from cachefs.order import rank_of_file_name  # noqa: E402
from cachefs.publish import source_file_count  # noqa: E402
from cachefs.workload import Waits, aligned_buffer, read_whole_file, write_dataset  # noqa: E402

log = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
DEFAULT_READ_BYTES = 1 * MIB  # one read request of a reader
MARKER_SUFFIX = ".bench-dataset.json"  # beside the data root, so not in its manifest


PASSTHROUGH_MOUNT_WAIT_S = 30.0  # scripts/passthrough.py's mount to appear


class BenchError(Exception):
    """A benchmark could not run (mount failed, a reader failed); the script exits non-zero."""


# -- data sets -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DatasetSpec:
    """The shape of a generated data set; equal specs mean the same files."""

    kind: str  # "small", "mixed", "shards" or "big"
    files: int
    file_bytes: int  # each file's size ("mixed": the median size)
    seed: int = 0

    def sizes(self) -> np.ndarray:
        if self.kind == "mixed":
            # log-normal around the median, from 1 KiB to 32x the median: a few large files
            # carry much of the bytes, as in real mixed data sets
            rng = np.random.default_rng(self.seed)
            sizes = self.file_bytes * np.exp(rng.normal(0.0, 1.0, self.files))
            return np.clip(sizes, KIB, 32 * self.file_bytes).astype(np.int64)
        return np.full(self.files, self.file_bytes, dtype=np.int64)

    def relpath(self, index: int) -> str:
        if self.kind == "shards":
            return f"shards/shard-{index:05d}.tar"
        if self.kind == "big":
            return f"big/file-{index:03d}.bin"
        # ImageNet-like: a thousand files per class directory
        return f"{self.kind}/class{index // 1000:04d}/sample_{index:07d}.bin"


def generate_dataset(root: Path, spec: DatasetSpec) -> bool:
    """Create spec's files under root unless they are already there; True if it wrote any.

    A marker per kind (in root, named after the kind) records the spec; a different spec of the
    same kind removes that kind's directory first, so a data set is never a mix of two runs.
    Several kinds can share one root (bench_fuse puts small files and a big file side by side).
    """
    root.mkdir(parents=True, exist_ok=True)
    marker = _marker(root, spec.kind)
    wanted = asdict(spec)
    try:
        if json.loads(marker.read_text()) == wanted:
            return False
    except (OSError, ValueError):
        pass
    top = root / spec.relpath(0).split("/")[0]
    shutil.rmtree(top, ignore_errors=True)
    write_dataset(root, [spec.relpath(index) for index in range(spec.files)], spec.sizes(),
                  spec.seed)
    os.sync()
    marker.write_text(json.dumps(wanted))
    log.info("generated %d %s files under %s", spec.files, spec.kind, root)
    return True


def remove_dataset(root: Path, kind: str) -> None:
    """Remove the files of `kind` under root and their marker (a run that wants none)."""
    _marker(root, kind).unlink(missing_ok=True)
    shutil.rmtree(root / kind, ignore_errors=True)


def _marker(root: Path, kind: str) -> Path:
    """The file that records the spec of the `kind` files under root (generate_dataset)."""
    return root.parent / f"{root.name}.{kind}{MARKER_SUFFIX}"


@dataclass
class Manifest:
    """The source's regular files as cachefs indexes them, and their sizes."""

    relpaths: list[bytes]
    sizes: np.ndarray

    @classmethod
    def scan(cls, root: Path) -> Manifest:
        relpaths = [bytes(p) for p in scan_source(root).paths]
        root_bytes = os.fsencode(root)
        sizes = np.array([os.stat(root_bytes + b"/" + p).st_size for p in relpaths],
                         dtype=np.int64)
        return cls(relpaths, sizes)

    def __len__(self) -> int:
        return len(self.relpaths)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def indices_under(self, prefix: str) -> np.ndarray:
        wanted = os.fsencode(prefix)
        return np.array([i for i, p in enumerate(self.relpaths) if p.startswith(wanted)],
                        dtype=np.int64)


# -- page cache ----------------------------------------------------------------------------------

def drop_caches(what: int) -> None:
    """`echo what > /proc/sys/vm/drop_caches` (needs root; OSError without it): 1 the clean
    page cache, 2 dentries and inodes, 3 both."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(f"{what}\n")


def drop_page_cache() -> None:
    """Write dirty pages and drop the clean page cache, dentries and inodes (needs root)."""
    os.sync()
    try:
        drop_caches(3)
    except OSError as exc:
        raise BenchError(f"cannot drop the page cache ({exc.strerror}); run as root or pass "
                         f"--no-drop-caches") from None


def evict_files(roots: list[Path], threads: int = 32) -> int:
    """Drop the page cache of every file under `roots` (posix_fadvise DONTNEED; clean pages,
    dirty ones are only written back), and nothing else: a cold source for the next epoch
    without dropping the pages a cachefs mount holds as its RAM tier, which nothing drops
    between a training job's epochs. Threads, since a network source pays a round trip per
    open. Returns the files evicted."""
    paths = [os.path.join(directory, name) for root in roots
             for directory, _, names in os.walk(root) for name in names]

    def evict(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(evict, paths))
    return len(paths)


# -- readers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReadTask:
    """One pass: read `order` (manifest indices) under `root` with `workers` processes.

    The order is cut into batches of `batch_files` positions, and worker i reads batches i,
    i + workers, ... each in order, as a DataLoader's workers do (with 1, positions i,
    i + workers, ...). With `threads` > 1 a single worker reads the whole order with that many
    threads instead.
    """

    root: bytes
    order: np.ndarray
    workers: int = 1
    threads: int = 1
    delay_s: float = 0.0
    read_bytes: int = DEFAULT_READ_BYTES
    batch_files: int = 1

    def share(self, worker_index: int) -> np.ndarray:
        """The manifest indices worker `worker_index` reads, in its reading order."""
        batch = self.batch_files
        starts = range(worker_index * batch, len(self.order), self.workers * batch)
        return np.concatenate([self.order[start:start + batch] for start in starts]
                              or [self.order[:0]])


@dataclass
class PassResult:
    wall_s: float
    files: int
    bytes: int
    waits: Waits = field(default_factory=Waits)
    readers_cpu_s: float = 0.0  # the reader processes' CPU over the pass (all their threads)

    @property
    def files_per_s(self) -> float:
        return self.files / self.wall_s if self.wall_s > 0 else math.inf

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.wall_s if self.wall_s > 0 else math.inf

    def to_json(self) -> dict:
        per_file_ms = 1e3 / max(1, self.files)
        return {"wall_s": round(self.wall_s, 6), "files": self.files, "bytes": self.bytes,
                "files_per_s": round(self.files_per_s, 1), "mb_per_s": round(self.mb_per_s, 1),
                "open_ms_per_file": round(self.waits.open_s * per_file_ms, 3),
                "read_ms_per_file": round(self.waits.read_s * per_file_ms, 3),
                "readers_cpu_ms_per_file": round(self.readers_cpu_s * per_file_ms, 3)}


def _read_share(task: ReadTask, relpaths: list[bytes], share: np.ndarray
                ) -> tuple[int, int, Waits]:
    buffer = aligned_buffer(task.read_bytes)
    root = task.root + b"/"
    total = 0
    waits = Waits()
    for index in share.tolist():
        total += read_whole_file(root + relpaths[index], buffer, task.delay_s, waits)
    return len(share), total, waits


def _read_threaded(task: ReadTask, relpaths: list[bytes]) -> tuple[int, int, Waits]:
    root = task.root + b"/"
    local = threading.local()
    per_thread: list[Waits] = []

    def one(index: int) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = aligned_buffer(task.read_bytes)
            local.waits = Waits()
            per_thread.append(local.waits)
        return read_whole_file(root + relpaths[index], local.buffer, task.delay_s, local.waits)

    with ThreadPoolExecutor(task.threads) as pool:
        total = sum(pool.map(one, task.order.tolist(), chunksize=16))
    waits = Waits()
    for thread_waits in per_thread:
        waits.add(thread_waits)
    return len(task.order), total, waits


def _worker_main(connection, relpaths: list[bytes], worker_index: int) -> None:
    while True:
        task = connection.recv()
        if task is None:
            return
        try:
            if task.threads > 1:
                result = _read_threaded(task, relpaths)
            else:
                result = _read_share(task, relpaths, task.share(worker_index))
            connection.send(("ok", result))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
            connection.send(("error", traceback.format_exc()))


class ReaderPool:
    """`size` persistent reader processes that know the manifest (inherited through fork)."""

    def __init__(self, manifest: Manifest, size: int):
        context = multiprocessing.get_context("fork")
        self._workers = []
        for index in range(size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_worker_main,
                                      args=(child_end, manifest.relpaths, index), daemon=True)
            process.start()
            child_end.close()
            self._workers.append((process, parent_end))

    def run(self, task: ReadTask) -> PassResult:
        used = 1 if task.threads > 1 else task.workers
        if used > len(self._workers):
            raise BenchError(f"{used} readers asked of a pool of {len(self._workers)}")
        readers = [process.pid for process, _ in self._workers[:used]]
        readers_cpu_s = sum(process_cpu_s(pid) for pid in readers)
        started_s = time.perf_counter()
        for _, connection in self._workers[:used]:
            connection.send(task)
        files = total = 0
        waits = Waits()
        errors = []
        for _, connection in self._workers[:used]:
            status, value = connection.recv()
            if status == "ok":
                files += value[0]
                total += value[1]
                waits.add(value[2])
            else:
                errors.append(value)
        wall_s = time.perf_counter() - started_s
        readers_cpu_s = sum(process_cpu_s(pid) for pid in readers) - readers_cpu_s
        if errors:
            raise BenchError("a reader failed:\n" + errors[0])
        return PassResult(wall_s, files, total, waits, readers_cpu_s)

    def close(self) -> None:
        for _, connection in self._workers:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process, _ in self._workers:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()

    def __enter__(self) -> ReaderPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def parse_args_with_smoke(parser: argparse.ArgumentParser, argv, smoke: dict,
                          smoke_help: str) -> argparse.Namespace:
    """parser.parse_args(argv), with a last option --smoke that sets `smoke`'s settings (tiny
    sizes: a check that the script works, not a measurement)."""
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)
    return args


def walk_entries(root: Path) -> int:
    """Entries (directories and files) seen by one os.walk of root."""
    count = 0
    for _, dirnames, filenames in os.walk(root):
        count += len(dirnames) + len(filenames)
    return count


def median(values) -> float:
    return statistics.median(values) if values else math.nan


def rotated(items, shift: int) -> list:
    """`items` starting at `shift` (modulo their count) and wrapping round: contenders taking
    turns, each first as often over the rounds, since these machines' speed drifts."""
    items = list(items)
    shift %= len(items)
    return items[shift:] + items[:shift]


# -- cachefs mounts ------------------------------------------------------------------------------

def daemon_pid(mount: MountProcess) -> int:
    """The mount's daemon, from its pid file."""
    try:
        return json.loads((mount.state_dir / "pid").read_text())["pid"]
    except (OSError, ValueError, KeyError) as exc:
        raise BenchError(f"no daemon pid for {mount.mountpoint}: {exc}") from None


def process_cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process, or of its thread `tid`, in seconds (proc(5): fields 14 and
    15 of /proc/PID/stat, /proc/PID/task/TID/stat)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    after_name = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


# the figures DaemonCpu.per_file_ms returns
DAEMON_CPU_KEYS = ("daemon_cpu_ms_per_file", "trio_cpu_ms_per_file")


# what `DaemonCpu.by_thread_ms` calls the daemon's main thread, and trio's worker threads
TRIO_THREAD = "trio"
TRIO_WORKERS = "trio-workers"
# the CPU of threads that ended before the stretch did (trio's idle workers end after a while),
# with the rounding of the process's total, counted in clock ticks, against the threads'
# nanoseconds
ENDED_THREADS = "ended"
# threads that keep the program's name: none of cachefs's own (numpy's BLAS threads, say)
UNNAMED_THREADS = "unnamed"


def threads_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (the thread's name in the kernel, its CPU seconds) of every thread of `pid`
    (cachefs.threads names the daemon's threads; one that ended while this read is left out).
    The seconds are the scheduler's, in nanoseconds (/proc/PID/task/TID/schedstat's first
    field): a read pool thread takes a few milliseconds an epoch, below the clock tick that
    /proc/PID/task/TID/stat counts in."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            ran_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        threads[int(tid)] = (name, ran_ns / 1e9)
    return threads


def thread_kind(pid: int, tid: int, name: str, main_name: str) -> str:
    """The kind a thread's CPU is counted under: its name, trio's numbered worker threads
    ("Trio thread N") under one, the main thread as the trio thread, and threads with the
    main thread's name (`main_name`, the program's) as unnamed."""
    if tid == pid:
        return TRIO_THREAD
    if name.startswith("Trio thread"):
        return TRIO_WORKERS
    return UNNAMED_THREADS if name == main_name else name


class DaemonCpu:
    """The daemon's CPU over a stretch of a run, made at its start: all its threads, and its
    trio thread alone (the main thread, which answers every request and does the read path's
    bookkeeping; the rest is the source's worker threads, the page-store and lookup threads),
    and every kind of thread apart (`by_thread_ms`)."""

    def __init__(self, mount: MountProcess):
        try:
            self._pid: int | None = daemon_pid(mount)
            self._start_s = self._now_s()
            self._start_threads = threads_cpu_s(self._pid)
        except (OSError, BenchError):
            self._pid = None

    def _now_s(self) -> tuple[float, float]:
        assert self._pid is not None
        return process_cpu_s(self._pid), process_cpu_s(self._pid, self._pid)

    def per_file_ms(self, files: int) -> dict:
        """`daemon_cpu_ms_per_file` and `trio_cpu_ms_per_file` since the start; {} if the
        daemon's CPU cannot be read."""
        if self._pid is None or not files:
            return {}
        try:
            end_s = self._now_s()
        except OSError:
            return {}
        daemon_s, trio_s = (end - start for end, start in zip(end_s, self._start_s,
                                                              strict=True))
        return {key: round(seconds * 1e3 / files, 3)
                for key, seconds in zip(DAEMON_CPU_KEYS, (daemon_s, trio_s), strict=True)}

    def by_thread_ms(self, files: int) -> dict[str, float]:
        """The daemon's CPU a file since the start, by kind of thread (`thread_kind`), the
        largest first; what threads that ended meanwhile took is `ENDED_THREADS` (within a
        clock tick). {} if the
        daemon's CPU cannot be read."""
        if self._pid is None or not files:
            return {}
        try:
            total_s = process_cpu_s(self._pid) - self._start_s[0]
            threads = threads_cpu_s(self._pid)
        except OSError:
            return {}
        by_kind: dict[str, float] = {}
        main_name = threads.get(self._pid, ("", 0.0))[0]
        for tid, (name, cpu_s) in threads.items():
            started_s = self._start_threads.get(tid, (name, 0.0))[1]
            kind = thread_kind(self._pid, tid, name, main_name)
            by_kind[kind] = by_kind.get(kind, 0.0) + cpu_s - started_s
        by_kind[ENDED_THREADS] = max(0.0, total_s - sum(by_kind.values()))
        return {kind: round(seconds * 1e3 / files, 3)
                for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])}


@dataclass(frozen=True)
class MachineTimes:
    """CPU seconds the whole machine has spent since boot (/proc/stat, all cores)."""

    busy_s: float  # not idle: the readers, the daemon, the storage's client and server, the kernel
    # wanted and not given: on a virtual machine, time the hypervisor ran another guest on a
    # core this one had work for (the stolen column). It is neither idle nor anyone's work here,
    # and on these machines it comes in bursts (a fifth of a core at times) that slow one epoch
    # and not the next: reported beside each figure so that a slow round can be told from a
    # slow contender.
    steal_s: float


def machine_times() -> MachineTimes:
    with open("/proc/stat") as f:
        ticks = [int(value) for value in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal
    idle_ticks, steal_ticks = ticks[3] + ticks[4], ticks[7]
    per_s = os.sysconf("SC_CLK_TCK")
    return MachineTimes((sum(ticks) - idle_ticks - steal_ticks) / per_s, steal_ticks / per_s)


def machine_ms_per_file(before: MachineTimes, files: int) -> dict[str, float]:
    """The machine's CPU (`machine_cpu_ms_per_file`) and the time stolen from it
    (`steal_ms_per_file`) since `before`, per file read."""
    after = machine_times()
    files = max(1, files)
    return {"machine_cpu_ms_per_file": round((after.busy_s - before.busy_s) * 1e3 / files, 3),
            "steal_ms_per_file": round((after.steal_s - before.steal_s) * 1e3 / files, 3)}


@contextlib.contextmanager
def cachefs_mount(source: Path, mountpoint: Path, state_dir: Path, *, ram_bytes: int,
                  ssd_dir: Path | None = None, ssd_bytes: int = 0,
                  source_delay_ms: float = 0.0, extra_args=()):
    """Mount with `cachefs mount` (daemonized); always unmounted on the way out."""
    args = ["--ram-cache", ram_bytes]
    if ssd_dir is not None:
        args += ["--ssd-cache", ssd_dir, "--ssd-size", ssd_bytes]
    if source_delay_ms:
        args += ["--source-delay-ms", source_delay_ms]
    args += list(extra_args)
    mount = MountProcess(source, mountpoint, state_dir, args)
    mount.stop()  # a stale mount of an interrupted run
    state_dir.mkdir(parents=True, exist_ok=True)
    # no order left over from a last run: the plain order file, and any rank files, which the
    # daemon would merge until the first publication
    plain = state_dir / "order.npz"
    for path in state_dir.iterdir():
        if path == plain or rank_of_file_name(plain, path.name) is not None:
            path.unlink()
    try:
        try:
            mount.start()
        except MountError as exc:
            raise BenchError(str(exc)) from None
        yield mount
    finally:
        mount.stop()


@contextlib.contextmanager
def passthrough_mount(source: Path, mountpoint: Path, keep_cache: bool):
    """scripts/passthrough.py in a subprocess; always unmounted on the way out."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("passthrough.py")), str(source),
           str(mountpoint), *(["--keep-cache"] if keep_cache else [])]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + PASSTHROUGH_MOUNT_WAIT_S
        while str(mountpoint) not in mounted_paths():
            if process.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the passthrough did not mount (exit {process.poll()})")
            time.sleep(0.02)
        yield process.pid
    finally:
        if str(mountpoint) in mounted_paths():
            subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def wait_for_manifest(mount: MountProcess, timeout_s: float = 300.0) -> int:
    """Files in the daemon's manifest, once it has scanned the source."""
    try:
        return source_file_count(mount.mountpoint, timeout_s)
    except OrderError as exc:
        raise BenchError(str(exc)) from None


# -- output --------------------------------------------------------------------------------------

def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine_info() -> dict:
    return {"cpus": os.cpu_count(), "kernel": os.uname().release,
            "python": sys.version.split()[0],
            "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
