"""First lookups of the files of one directory by several threads at once, through a mount.

What a first epoch's opens of files the read-ahead has not reached cost, or any first pass that
stats a data set file by file: each file's first open is a LOOKUP, which the daemon answers
with an lstat at the source. Whether the kernel sends the LOOKUPs of one directory together
or one at a time is the file system's to say at INIT (FUSE_PARALLEL_DIROPS), and libfuse
before 3.17 never said it (scripts/patches/pyfuse3-parallel-dirops.patch): over network
storage each lookup then waited for the round trip of the one before.

Side by side in one run, `--rounds` times, medians reported: `--threads` threads stat `--files`
files of one directory of `--source` directly, through a fresh cachefs mount of it, and
through the bare pyfuse3 passthrough (scripts/passthrough.py, whose LOOKUP is an lstat on its
event loop: one at a time whatever the kernel sends). Before each timed pass, `--settle-s`
seconds go by, so that the storage client's cache of the directory's attributes (sshfs keeps
them 20 s after a listing, the mount's scan of the source makes one) has expired. The report
says whether this pyfuse3 carries the patch.

Usage: python scripts/bench_lookups.py --source DIR [--dir SUBDIR] [--files 1000]
           [--threads 8] [--rounds 3] [--settle-s 22] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import pyfuse3

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

SMOKE = {"files": 40, "threads": 4, "rounds": 1, "settle_s": 0.5}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path,
                        help="the data set (default: --files small files made in --workdir)")
    parser.add_argument("--dir", default="",
                        help="the directory of --source whose files are looked up (default: "
                             "the first with --files files)")
    parser.add_argument("--files", type=int, default=1000, help="files looked up a pass")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--settle-s", type=float, default=22.0,
                        help="seconds before each timed pass (the storage client's attribute "
                             "cache expires)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cachefs-bench-lookups"))
    parser.add_argument("--json", type=Path, help="write every figure here")
    return benchlib.parse_args_with_smoke(parser, argv, SMOKE, "tiny sizes, one round")


def directory_of(args) -> tuple[Path, Path, list[str]]:
    """(the source, its directory looked up in, the names of its first --files files)."""
    source = args.source
    if source is None:
        source = args.workdir / "data"
        (source / "d").mkdir(parents=True, exist_ok=True)
        for index in range(args.files):
            path = source / "d" / f"f{index:06d}"
            if not path.exists():
                path.write_bytes(b"x")
    subdir = args.dir
    if not subdir:
        subdir = next((os.path.relpath(path, source) for path, _, files in os.walk(source)
                       if len(files) >= args.files), "")
    names = sorted(entry.name for entry in os.scandir(source / subdir) if entry.is_file())
    if len(names) < args.files:
        raise benchlib.BenchError(f"{source / subdir} has {len(names)} files, not --files "
                                  f"{args.files}")
    return source, Path(subdir), names[:args.files]


def stat_all(directory: Path, names: list[str], threads: int) -> float:
    """Seconds for `threads` threads to stat `names` of `directory`, each a share."""
    failures: list[OSError] = []

    def share(part: list[str]) -> None:
        try:
            for name in part:
                os.stat(directory / name)
        except OSError as exc:
            failures.append(exc)
    workers = [threading.Thread(target=share, args=(names[start::threads],))
               for start in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise benchlib.BenchError(f"stat failed: {failures[0]}")
    return time.perf_counter() - started


def one_round(args, source: Path, subdir: Path, names: list[str]) -> dict[str, float]:
    """Files/s of each contender, once."""
    mountpoint = args.workdir / "mnt"
    figures = {}
    time.sleep(args.settle_s)
    figures["direct"] = len(names) / stat_all(source / subdir, names, args.threads)
    for contender in ("cachefs", "bare"):
        if contender == "cachefs":
            mount_cm = benchlib.cachefs_mount(source, mountpoint, args.workdir / "state",
                                              ram_bytes=64 << 20)
        else:
            mount_cm = benchlib.passthrough_mount(source, mountpoint, keep_cache=False)
        with mount_cm:
            time.sleep(args.settle_s)
            figures[contender] = len(names) / stat_all(mountpoint / subdir, names, args.threads)
    return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        source, subdir, names = directory_of(args)
        rounds = [one_round(args, source, subdir, names) for _ in range(args.rounds)]
    except benchlib.BenchError as exc:
        print(f"bench_lookups: {exc}", file=sys.stderr)
        return 1
    medians = {name: benchlib.median([figures[name] for figures in rounds])
               for name in rounds[0]}
    parallel = bool(getattr(pyfuse3, "PARALLEL_DIROPS", False))
    print(f"First lookups: {len(names)} files of {source / subdir}, {args.threads} threads, "
          f"medians of {args.rounds} rounds; pyfuse3 "
          f"{'with' if parallel else 'without'} scripts/patches/pyfuse3-parallel-dirops.patch\n")
    print(benchlib.markdown_table(
        ["contender", "files/s", "/ direct", "/ bare"],
        [[name, f"{rate:,.0f}", f"{rate / medians['direct']:.2f}",
          f"{rate / medians['bare']:.2f}"] for name, rate in medians.items()]))
    if args.json:
        benchlib.write_json(args.json, {"args": vars(args), "parallel_dirops": parallel,
                                        "rounds": rounds, "medians": medians,
                                        "machine": benchlib.machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
