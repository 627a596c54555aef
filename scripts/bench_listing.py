"""Listing large directories of busy storage: cachefs against the source and the bare passthrough.

Why. A reader's `ls -l` (a scandir and an lstat of every entry: os.walk with stats, a data set
indexing its files) through the mount makes cachefs list the source directory
(cachefs/source.py `listdir`), and cachefs lists a directory through its own mount once the
read-ahead's stores reach it (cachefs/pagecache.py: the READDIRPLUS that spares a LOOKUP per
file). On network storage each lstat is a request that waits its turn behind the reads in
flight, which the read-ahead keeps at the source threads' count; one lstat at a time, a
directory of 1,000 files took seconds.

What runs. `--load-threads` threads read the source's files for the whole run, each file's
pages evicted after its read, so the storage stays as busy as under a read-ahead. Each pass
lists every directory of `--dirs` with each contender (their order rotated pass by pass),
the kernel's dentries and inodes dropped first (`echo 2 > /proc/sys/vm/drop_caches`, root) and
the metadata TTL let run out, so each listing asks the storage again:
- `direct`: the source directory itself (what `ls -l` there costs);
- `bare`: through scripts/passthrough.py, the bare pyfuse3 + trio stack (an lstat per entry,
  inline);
- `cachefs`: through a cachefs mount.
Reported: the median seconds per directory of each contender, and each against direct and
against the bare passthrough.

Usage:
    python scripts/bench_listing.py --source DIR [--dirs REL ...] [--load-threads 64]
        [--passes 5] [--mount-args '...'] [--workdir DIR] [--json out.json] [--smoke]
Without --source (or with --smoke), a generated local data set (no network: a check that the
script works, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import DatasetSpec, passthrough_mount  # noqa: E402

log = logging.getLogger("bench_listing")

CONTENDERS = ("direct", "bare", "cachefs")
SMOKE = {"passes": 1, "load_threads": 2, "files": 200}
TTL_WAIT_S = 1.2  # past cachefs's default --metadata-ttl (1 s): a listing asks the source again


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path,
                        help="the storage to list (default: a generated local data set)")
    parser.add_argument("--dirs", nargs="+", default=None,
                        help="directories to list, relative to the source (default: every "
                             "directory that holds files)")
    parser.add_argument("--files", type=int, default=2_000,
                        help="files of the generated data set (without --source)")
    parser.add_argument("--load-threads", type=int, default=64,
                        help="threads reading the source meanwhile (0: an idle source)")
    parser.add_argument("--passes", type=int, default=5, help="timed rounds")
    parser.add_argument("--mount-args", default="", help="extra arguments for cachefs mount")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-listing"),
                        help="mount points, state, and the generated data set")
    parser.add_argument("--json", type=Path, help="write every figure here")
    return benchlib.parse_args_with_smoke(
        parser, argv, SMOKE, "a small local data set, one pass: checks that the script works")


def list_like_ls(directory: Path) -> int:
    """What `ls -l` asks of a directory: its names, and an lstat of each. Entries listed."""
    count = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            entry.stat(follow_symlinks=False)
            count += 1
    return count


def drop_dentries() -> None:
    """The kernel's dentries and inodes (and so the attributes it holds) dropped, as root."""
    with contextlib.suppress(OSError):
        benchlib.drop_caches(2)


@contextlib.contextmanager
def busy_source(source: Path, threads: int):
    """`threads` threads reading the source's files, each evicted after its read."""
    files = [path for path in source.rglob("*") if path.is_file()]
    stop = threading.Event()
    reads = [0]

    def read_loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set() and files:
            path = rng.choice(files)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                while os.read(fd, 1 << 20):
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            reads[0] += 1

    workers = [threading.Thread(target=read_loop, args=(seed,), daemon=True)
               for seed in range(threads)]
    for worker in workers:
        worker.start()
    started_s = time.monotonic()
    try:
        yield reads
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        log.info("load: %d files read in %.1f s", reads[0], time.monotonic() - started_s)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    workdir = args.workdir
    if args.source is None or args.smoke:
        source = workdir / "data"
        benchlib.generate_dataset(source, DatasetSpec("small", args.files, 4096))
    else:
        source = args.source
    dirs = args.dirs or sorted(
        str(Path(root).relative_to(source)) for root, _, names in os.walk(source) if names)
    mounts = {"bare": workdir / "mnt-bare", "cachefs": workdir / "mnt-cachefs"}
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    entries = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(passthrough_mount(source, mounts["bare"], keep_cache=False))
        stack.enter_context(benchlib.cachefs_mount(
            source, mounts["cachefs"], workdir / "state", ram_bytes=64 << 20,
            extra_args=args.mount_args.split()))
        stack.enter_context(busy_source(source, args.load_threads))
        roots = {"direct": source, **mounts}
        for number in range(args.passes):
            for name in benchlib.rotated(CONTENDERS, number):
                for relpath in dirs:
                    time.sleep(TTL_WAIT_S)
                    drop_dentries()
                    started_s = time.monotonic()
                    count = list_like_ls(roots[name] / relpath)
                    seconds[name].append(time.monotonic() - started_s)
                    entries = max(entries, count)
                    log.info("pass %d %-8s %s: %d entries in %.3f s", number, name, relpath,
                             count, seconds[name][-1])
    medians = {name: benchlib.median(values) for name, values in seconds.items()}
    rows = [[name, f"{medians[name]:.3f}", f"{medians['direct'] / medians[name]:.2f}x",
             f"{medians['bare'] / medians[name]:.2f}x"] for name in CONTENDERS]
    print(f"source {source}: {len(dirs)} directories of up to {entries} entries, "
          f"{args.load_threads} threads reading the source meanwhile, {args.passes} passes\n")
    print(benchlib.markdown_table(
        ["contender", "median s per directory", "speed / direct", "speed / bare"], rows))
    if args.json:
        benchlib.write_json(args.json, {"source": str(source), "dirs": dirs,
                                        "load_threads": args.load_threads,
                                        "seconds": seconds, "medians_s": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
