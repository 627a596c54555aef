"""Samples inside one large file (issue 19): a .npy read by rows through numpy.memmap, directly
on the slow directory and through cachefs with the order of its rows published, side by side.

The data set is one `.npy` of `--rows` rows of `--row-kb` KB (100,000 bytes for 100), written
under `--source-backing` (the directory a slow mount serves, e.g. the export of
`../shared/tools/slowfs/slowfs-net-up.sh`) unless it is there already, and read from
`--source` (that slow mount; by default the backing directory itself). Each epoch reads every
row once, in `cachefs.order.permutation(rows, seed, epoch)`, with one `numpy.memmap` reader (a
child process, persistent, opened before the timing of its first epoch), and checks the bytes
of each epoch (one xxh3-128 digest over the rows in reading order).

Contenders, in one run:
- `direct`: the reader on `--source`. Before each of its epochs the page cache of the file is
  evicted (posix_fadvise DONTNEED, on the slow mount and on the backing directory), so every
  epoch reads the storage.
- `cachefs`: a mount of `--source` with a RAM tier of `--ram-fraction` of the file, the order
  file written directly with the keys of cachefs-order(5) (`current`, `next`, `files` and the
  item table `item_file`, `item_offset`, `item_length`: row i is item i) before each epoch,
  as a trainer without cachefs's Python code would; epochs run back to back, as a trainer's do,
  with the source's pages evicted between them (the mount's own pages stay: nothing drops them
  between a training job's epochs). The reader opens the file once the first order is in
  force.

Reported per epoch: wall time, rows/s, MB/s, for cachefs the deltas of its stats (hits_ram,
prefetched, misses, backend MB, stall s) and the RAM hit rate, the speedup over direct in the
same epoch, and whether the digests of both contenders agree; then the issue's done-when bars
(epoch 1 at least 3x direct, epochs 2-3 at least 24 % RAM hits, bytes identical). JSON and a
Markdown table are written to `--out`.

Usage (root, slowfs with 1 ms per packet):
    DATA=/tmp/cachefs-bench-ranges/data SLOW=/tmp/cachefs-bench-ranges/slow
    mkdir -p $DATA && ../shared/tools/slowfs/slowfs-net-up.sh $DATA $SLOW 1000
    python scripts/bench_ranges.py --source $SLOW --source-backing $DATA
    ../shared/tools/slowfs/slowfs-net-down.sh
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import BenchError  # noqa: E402

from cachefs import ctrl  # noqa: E402
from cachefs.client import stats_delta  # noqa: E402
from cachefs.order import permutation  # noqa: E402

log = logging.getLogger("bench_ranges")

FILE_NAME = "rows.npy"
ACCEPT_TIMEOUT_S = 30.0
SMOKE = {"rows": 200, "row_kb": 20, "epochs": 3}
# the done-when bars of issue 19
EPOCH1_SPEEDUP = 3.0
LATER_RAM_HITS = 0.24


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path,
                        help="directory the .npy is read from (the slow mount) [backing]")
    parser.add_argument("--source-backing", type=Path,
                        help="directory the .npy is written to if missing, and evicted "
                             "[WORKDIR/data]")
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--row-kb", type=int, default=100, help="row size, KB (1000 B)")
    parser.add_argument("--ram-fraction", type=float, default=0.25,
                        help="RAM tier as a fraction of the file")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mount-args", default="", help="extra arguments for cachefs mount")
    parser.add_argument("--contenders", nargs="+", choices=("direct", "cachefs"),
                        default=["direct", "cachefs"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-ranges"),
                        help="mount point, state, generated data")
    parser.add_argument("--out", type=Path, help="results directory [WORKDIR/results]")
    args = benchlib.parse_args_with_smoke(
        parser, argv, SMOKE, "tiny sizes on a local directory: checks the script, in seconds")
    if args.rows < 1 or args.row_kb < 1 or args.epochs < 1 or not 0 < args.ram_fraction:
        parser.error("--rows, --row-kb, --epochs and --ram-fraction must be positive")
    args.source_backing = args.source_backing or args.workdir / "data"
    args.source = (args.source or args.source_backing).absolute()
    args.out = args.out or args.workdir / "results"
    return args


# -- the data set --------------------------------------------------------------------------------

def ensure_rows(directory: Path, rows: int, row_bytes: int, seed: int) -> None:
    """The .npy of `rows` x `row_bytes` random bytes, unless one of that shape is there."""
    path = directory / FILE_NAME
    try:
        if np.load(path, mmap_mode="r").shape == (rows, row_bytes):
            return
    except (OSError, ValueError):
        pass
    directory.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(path.with_suffix(".tmp"), mode="w+", dtype=np.uint8,
                                    shape=(rows, row_bytes))
    generator = np.random.default_rng(seed)
    for start in range(0, rows, 256):
        stop = min(rows, start + 256)
        out[start:stop] = generator.integers(0, 256, (stop - start, row_bytes), np.uint8)
    out.flush()
    del out
    os.replace(path.with_suffix(".tmp"), path)
    os.sync()
    log.info("generated %s: %d rows of %d bytes", path, rows, row_bytes)


def row_table(path: Path) -> tuple[int, int, int]:
    """(rows, row bytes, header bytes) of the .npy."""
    rows = np.load(path, mmap_mode="r")
    return rows.shape[0], rows[0].nbytes, int(rows.offset)


def evict(paths: list[Path]) -> float:
    """Drop the page cache of these files (posix_fadvise DONTNEED); seconds it took."""
    started_s = time.perf_counter()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - started_s


# -- the reader ----------------------------------------------------------------------------------

def _reader_main(connection) -> None:
    """A persistent reader: ("open", path) maps the .npy; ("read", order) reads its rows in
    that order and answers (seconds, bytes, digest)."""
    import xxhash

    rows = None
    while True:
        task = connection.recv()
        if task is None:
            return
        kind, value = task
        try:
            if kind == "open":
                rows = np.load(value, mmap_mode="r")
                connection.send(("ok", None))
                continue
            assert rows is not None
            digest = xxhash.xxh3_128()
            started_s = time.perf_counter()
            for index in value.tolist():
                digest.update(rows[index])  # the row's pages, faulted in as a trainer would
            connection.send(("ok", (time.perf_counter() - started_s, len(value) * rows[0].nbytes,
                                    digest.hexdigest())))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            connection.send(("error", repr(exc)))


class Reader:
    """One memmap reader in a child process (fork: no import cost in the timing)."""

    def __init__(self):
        context = multiprocessing.get_context("fork")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_reader_main, args=(child,), daemon=True)
        self._process.start()
        child.close()

    def _ask(self, task):
        self._connection.send(task)
        status, value = self._connection.recv()
        if status != "ok":
            raise BenchError(f"the reader failed: {value}")
        return value

    def open(self, path: Path) -> None:
        self._ask(("open", str(path)))

    def read(self, order: np.ndarray) -> tuple[float, int, str]:
        return self._ask(("read", order))

    def close(self) -> None:
        self._connection.send(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


# -- publishing, as a trainer without cachefs's code would ----------------------------------------

def write_order(mountpoint: Path, epoch: int, current: np.ndarray, nxt: np.ndarray,
                table: tuple[int, int, int]) -> dict:
    """Write the order file with the keys of cachefs-order(5) (temporary name, fsync, rename)
    and return its identity, as the daemon reports it once it takes the file."""
    rows, row_bytes, header = table
    path = Path(os.fsdecode(os.getxattr(mountpoint, "user.cachefs.order_file")))
    fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, version=1, epoch=epoch, current=current, next=nxt,
                 files=np.array([FILE_NAME.encode()]),
                 item_file=np.zeros(rows, np.int64),
                 item_offset=header + np.arange(rows, dtype=np.int64) * row_bytes,
                 item_length=np.full(rows, row_bytes, np.int64))
        f.flush()
        os.fsync(f.fileno())
        st = os.fstat(f.fileno())
    os.rename(temporary, path)
    return {"ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "size": st.st_size}


def wait_accepted(mountpoint: Path, identity: dict) -> None:
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    while time.monotonic() < deadline:
        stats = ctrl.read_stats(mountpoint)
        if (stats.get("order") or {}).get("file") == identity:
            return
        for rejection in stats.get("rejections") or ():
            if rejection.get("file") == identity:
                raise BenchError(f"the order was rejected: {rejection.get('reason')}")
        time.sleep(0.02)
    raise BenchError("the daemon did not take the order file")


# -- the run -------------------------------------------------------------------------------------

def run_direct(args, reader: Reader, orders: list[np.ndarray]) -> list[dict]:
    records = []
    source_file = args.source / FILE_NAME
    for epoch in range(args.epochs):
        gap_s = evict([source_file, args.source_backing / FILE_NAME])
        reader.open(source_file)
        wall_s, nbytes, digest = reader.read(orders[epoch])
        records.append(record("direct", epoch, wall_s, nbytes, len(orders[epoch]), digest,
                              gap_s=round(gap_s, 3)))
    return records


def run_cachefs(args, reader: Reader, orders: list[np.ndarray], table) -> list[dict]:
    records = []
    file_bytes = (args.source / FILE_NAME).stat().st_size
    ram_bytes = max(int(args.ram_fraction * file_bytes), 1 << 20)
    evict([args.source / FILE_NAME, args.source_backing / FILE_NAME])
    with benchlib.cachefs_mount(args.source, args.workdir / "mnt", args.workdir / "state",
                                ram_bytes=ram_bytes, extra_args=args.mount_args.split()
                                ) as mount:
        benchlib.wait_for_manifest(mount)
        for epoch in range(args.epochs):
            gap_s = evict([args.source / FILE_NAME, args.source_backing / FILE_NAME]) \
                if epoch else 0.0
            wait_accepted(mount.mountpoint, write_order(mount.mountpoint, epoch, orders[epoch],
                                                        orders[epoch + 1], table))
            if epoch == 0:
                reader.open(mount.mountpoint / FILE_NAME)
            before = mount.totals()
            daemon_cpu = benchlib.DaemonCpu(mount)
            wall_s, nbytes, digest = reader.read(orders[epoch])
            delta = stats_delta(before, mount.settled_totals(before, len(orders[epoch])))
            delta.update(daemon_cpu.per_file_ms(len(orders[epoch])))  # per row
            snapshot = mount.stats()
            records.append(record("cachefs", epoch, wall_s, nbytes, len(orders[epoch]), digest,
                                  gap_s=round(gap_s, 3), stats=delta, ram_bytes=ram_bytes,
                                  ram_hit_rate=delta["hits_ram"] / delta["reads"]
                                  if delta["reads"] else None,
                                  prefetch=snapshot["prefetch"], kernel=snapshot["kernel"]))
        reader.open(args.source_backing / FILE_NAME)  # let go of the mount's file
    return records


def record(contender: str, epoch: int, wall_s: float, nbytes: int, rows: int, digest: str,
           **extra) -> dict:
    result = {"contender": contender, "epoch": epoch, "wall_s": round(wall_s, 4),
              "rows_per_s": round(rows / wall_s, 1), "mb_per_s": round(nbytes / 1e6 / wall_s, 1),
              "digest": digest, **extra}
    log.info("%-8s epoch %d: %7.2f s, %7.0f rows/s%s", contender, epoch, wall_s,
             rows / wall_s, f", RAM hits {extra['ram_hit_rate']:.3f}"
             if extra.get("ram_hit_rate") is not None else "")
    return result


def verdict(direct: list[dict], cached: list[dict]) -> dict:
    """The issue's done-when bars, from this run's figures."""
    speedups = [d["wall_s"] / c["wall_s"] for d, c in zip(direct, cached, strict=True)]
    later_hits = [c["ram_hit_rate"] for c in cached[1:]]
    return {
        "speedup_by_epoch": [round(s, 2) for s in speedups],
        "epoch1_speedup_ok": speedups[0] >= EPOCH1_SPEEDUP,
        "later_ram_hits_ok": bool(later_hits) and min(later_hits) >= LATER_RAM_HITS,
        "bytes_identical": all(d["digest"] == c["digest"]
                               for d, c in zip(direct, cached, strict=True)),
    }


def markdown(direct: list[dict], cached: list[dict], result: dict) -> str:
    rows = []
    for d, c in zip(direct, cached, strict=True):
        stats = c["stats"]
        rows.append([c["epoch"] + 1, d["wall_s"], c["wall_s"], f"{d['wall_s'] / c['wall_s']:.2f}x",
                     c["rows_per_s"], stats["hits_ram"], stats["prefetched"], stats["misses"],
                     stats["backend_bytes"] / 1e6, stats["stall_s"],
                     f"{c['ram_hit_rate']:.3f}", "yes" if d["digest"] == c["digest"] else "NO"])
    table = benchlib.markdown_table(
        ["epoch", "direct s", "cachefs s", "speedup", "cachefs rows/s", "hits_ram",
         "prefetched", "misses", "backend MB", "stall s", "RAM hit rate", "bytes identical"],
        rows)
    bars = (f"epoch 1 >= {EPOCH1_SPEEDUP:g}x direct: "
            f"{'met' if result['epoch1_speedup_ok'] else 'NOT met'}; epochs 2+ >= "
            f"{LATER_RAM_HITS:.0%} RAM hits: {'met' if result['later_ram_hits_ok'] else 'NOT met'}"
            f"; bytes identical: {'yes' if result['bytes_identical'] else 'NO'}")
    return f"{table}\n\n{bars}"


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    row_bytes = args.row_kb * 1000
    ensure_rows(args.source_backing, args.rows, row_bytes, args.seed)
    if not (args.source / FILE_NAME).is_file():
        print(f"bench_ranges: no {FILE_NAME} under {args.source}", file=sys.stderr)
        return 2
    table = row_table(args.source / FILE_NAME)
    orders = [permutation(table[0], args.seed, epoch) for epoch in range(args.epochs + 1)]
    reader = Reader()
    try:
        direct = run_direct(args, reader, orders) if "direct" in args.contenders else []
        cached = (run_cachefs(args, reader, orders, table) if "cachefs" in args.contenders
                  else [])
    except BenchError as exc:
        print(f"bench_ranges: {exc}", file=sys.stderr)
        return 1
    finally:
        reader.close()
    if not direct or not cached:
        print("\n".join(json.dumps(r) for r in direct + cached))
        return 0
    result = verdict(direct, cached)
    header = (f"{table[0]} rows of {table[1]} bytes in one .npy ({table[0] * table[1] / 1e6:.0f}"
              f" MB) at {args.source}; one numpy.memmap reader in the published order; RAM "
              f"{args.ram_fraction:g} of the file; {args.epochs} epochs")
    report = f"{header}\n\n{markdown(direct, cached, result)}"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ranges.md").write_text(report + "\n")
    benchlib.write_json(args.out / "bench_ranges.json", {
        "benchmark": "bench_ranges", "machine": benchlib.machine_info(), "description": header,
        "args": vars(args), "records": direct + cached, "result": result})
    return 0 if result["bytes_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
