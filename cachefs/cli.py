"""The `cachefs` command: a click group, one function per subcommand, no logic of its own.

Each command parses its options, builds a config or calls the package, and turns domain errors
into a message and an exit code (documented in the man pages under man/). Only this module
prints. What a command does not handle itself, an OSError (a directory the user cannot write,
a file gone) or a cachefs error, the group turns into one line on stderr and exit status 1
(`_Group.invoke`), never a traceback. Every option can also be given as an environment
variable CACHEFS_<COMMAND>_<OPTION> (click's auto_envvar_prefix; the option's name with dashes
as underscores), e.g. CACHEFS_MOUNT_RAM_CACHE=8GiB.

`cachefs SRC MNT -o OPTS`, as mount(8) runs it for an fstab line or `mount -t fuse.cachefs`
(and `mount.cachefs SRC MNT -o OPTS`), is read as the `cachefs mount` command it stands for
(cachefs/mount_helper.py) and then runs as that command.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from cachefs import __version__, errors, mount_helper, stats_table
from cachefs import state_dir as state_dirs
from cachefs.client import (abort_fuse_connection, daemon_killed, fusermount_unmount,
                            process_exited)
from cachefs.config import (DATA_PLANES, INT64_MAX, MISS_BATCH_ITEMS, SOURCE_THREADS, CacheConfig,
                            MountConfig, PrefetchConfig, default_state_dir, parse_address,
                            parse_size)
from cachefs.mountinfo import CACHEFS_FSTYPE, listed_path, mount_at, mounted_paths

if TYPE_CHECKING:
    import numpy as np  # numpy is imported where it is used: `cachefs --help` stays quick

log = logging.getLogger(__name__)

MOUNT_WAIT_S = 60.0
XATTR_NAME_MAX = 255  # the kernel's limit on an extended attribute's name
UMOUNT_WAIT_S = 20.0
FUSE_OPTIONS = ("allow_other",)  # the values `cachefs mount -o` accepts
_ARGV = "cachefs.argv"  # click's ctx.meta key: the command line as the group parsed it


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


class AddressType(click.ParamType):
    name = "HOST:PORT"

    def convert(self, value, param, ctx):
        try:
            return value if isinstance(value, tuple) else parse_address(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _fail(message: str, code: int = errors.EXIT_ERROR) -> NoReturn:
    exc = click.ClickException(message)
    exc.exit_code = code
    raise exc


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _Group(click.Group):
    """The `cachefs` group: every error a command leaves unhandled is one line (module
    docstring)."""

    def parse_args(self, ctx, args):
        # kept for a daemonized mount, which runs the same command line again (_mount_daemon)
        ctx.meta[_ARGV] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise  # a closed stdout: click's main() ends quietly
            log.debug("unhandled error", exc_info=True)
            _fail(_os_error_message(exc))
        except errors.CachefsError as exc:
            log.debug("unhandled error", exc_info=True)
            _fail(str(exc))


def _os_error_message(exc: OSError) -> str:
    """'PATH: Permission denied', as the C tools say it."""
    reason = exc.strerror or str(exc)
    if exc.filename is None:
        return reason
    names = os.fsdecode(exc.filename)
    if exc.filename2 is not None:
        names += f" -> {os.fsdecode(exc.filename2)}"
    return f"{names}: {reason}"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cachefs")
def cli():
    """Order-aware read-only FUSE cache for deep-learning data sets."""


# -- mount -------------------------------------------------------------------------------------

@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--foreground", "-f", is_flag=True, help="Stay attached; log to stderr.")
@click.option("--systemd", is_flag=True,
              help="For a systemd Type=notify service: stay in the foreground and send "
                   "READY=1 to $NOTIFY_SOCKET once the mount serves.")
@click.option("--debug", is_flag=True, help="Log debug messages.")
@click.option("-o", "fuse_options", multiple=True, metavar="OPT",
              help="FUSE mount option; only allow_other is accepted.")
@click.option("--order-file", type=click.Path(path_type=Path),
              help="Order file to watch [default: STATE_DIR/order.npz].")
@click.option("--state-dir", type=click.Path(path_type=Path),
              help="Directory for the order file, log and pid file.")
@click.option("--resume-order", is_flag=True,
              help="Adopt the order files present at start (left from an earlier run).")
@click.option("--ram-cache", type=SIZE, default="1GiB", show_default=True,
              help="RAM tier budget.")
@click.option("--block-size", type=SIZE, default="4MiB", show_default=True,
              help="Unit of caching (power of two).")
@click.option("--lookahead", type=click.IntRange(min=0), default=0, show_default=True,
              help="Read-ahead window in files of the order; 0 = automatic.")
@click.option("--source-threads", type=click.IntRange(min=1), default=SOURCE_THREADS,
              show_default=True,
              help="Parallel reads of the source.")
@click.option("--miss-batch", type=click.IntRange(min=1), default=MISS_BATCH_ITEMS,
              show_default=True,
              help="Files of its storage target a demand miss reads at once; 1 = the file only.")
@click.option("--ssd-cache", type=click.Path(path_type=Path),
              help="Directory of the persistent cache-once tier.")
@click.option("--ssd-size", type=SIZE, default="0",
              help="Budget of the SSD tier.")
@click.option("--source-delay-ms", type=click.FloatRange(min=0), default=0.0,
              help="Testing aid: latency added to every source open, read and batch of "
                   "re-checks.")
@click.option("--metadata-ttl", type=click.FloatRange(min=0), default=60.0,
              show_default=True, help="Seconds a checked source identity is trusted.")
@click.option("--kernel-timeout", type=click.FloatRange(min=0),
              default=300.0, show_default=True,
              help="Seconds the kernel caches entries and attributes.")
@click.option("--fuse-tasks", type=click.IntRange(min=1), default=16, show_default=True,
              help="Concurrent FUSE requests.")
@click.option("--data-plane", type=click.Choice(DATA_PLANES), default="auto",
              show_default=True, help="Who serves cached bytes: the kernel's page cache "
                                      "with no request, with OPEN/RELEASE, or the daemon.")
@click.option("--cpus", default="auto", show_default=True, metavar="auto|all|LIST",
              help="CPUs of the daemon's threads: one if few, all, or a list (1, 2-3).")
@click.option("--metrics", type=AddressType(),
              help="Serve Prometheus metrics at http://HOST:PORT/metrics.")
def mount(source, mountpoint, foreground, systemd, debug, fuse_options, order_file, state_dir,
          resume_order, ram_cache, block_size, lookahead, source_threads, miss_batch, ssd_cache,
          ssd_size, source_delay_ms, metadata_ttl, kernel_timeout, fuse_tasks, data_plane, cpus,
          metrics):
    """Mount SOURCE read-only at MOUNTPOINT."""
    unknown = [opt for opt in fuse_options if opt not in FUSE_OPTIONS]
    if unknown:
        raise click.BadParameter(f"unsupported -o option(s): {', '.join(unknown)}",
                                 param_hint="-o")
    state_dir = state_dir or default_state_dir(mountpoint)
    try:
        config = MountConfig(
            source=source.absolute(), mountpoint=mountpoint.absolute(), state_dir=state_dir,
            order_file=(order_file or state_dir / "order.npz").absolute(),
            cache=CacheConfig(ram_bytes=ram_cache, block_bytes=block_size,
                              ssd_dir=ssd_cache.absolute() if ssd_cache else None,
                              ssd_bytes=ssd_size),
            prefetch=PrefetchConfig(lookahead_items=lookahead, source_threads=source_threads,
                                    miss_batch_items=miss_batch),
            allow_other="allow_other" in fuse_options, debug=debug, fuse_tasks=fuse_tasks,
            kernel_timeout_s=kernel_timeout, metadata_ttl_s=metadata_ttl, cpus=cpus,
            source_delay_s=source_delay_ms / 1000.0, data_plane=data_plane,
            resume_order=resume_order, metrics_address=metrics, notify_systemd=systemd)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if foreground or systemd:
        _mount_foreground(config)
    else:
        _mount_daemon(config)


def _mount_foreground(config: MountConfig) -> None:
    from cachefs import mount as mount_mod  # imports pyfuse3: only where a mount runs

    _setup_logging(config.debug)
    try:
        code = mount_mod.run(config)
    except errors.StartupError as exc:
        _fail(str(exc), exc.exit_code)
    sys.exit(code)


def _mount_daemon(config: MountConfig) -> None:
    """Start the foreground mount in a new session and return once it is mounted."""
    from cachefs import mount as mount_mod

    try:
        mount_mod.check_startup(config)  # fail fast, in the user's terminal
        state_dirs.prepare(config)  # before the log is opened there
    except errors.StartupError as exc:
        _fail(str(exc), exc.exit_code)
    log_path = config.state_dir / "daemon.log"
    command = click.get_current_context().meta[_ARGV]  # as typed, or read from the helper form
    args = [sys.executable, "-m", "cachefs", *command, "--foreground"]
    try:
        log_fd = state_dirs.open_log(log_path)
    except errors.StartupError as exc:
        _fail(str(exc), exc.exit_code)
    except OSError as exc:
        _fail(f"cannot write the daemon's log {log_path}: {exc.strerror}")
    with os.fdopen(log_fd, "ab") as log_file:
        child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    # a daemon that logs is making progress (an SSD tier reconciled after a crash, a few
    # minutes for millions of entries): the wait ends once it was silent for MOUNT_WAIT_S
    deadline = time.monotonic() + MOUNT_WAIT_S
    logged_bytes = log_path.stat().st_size
    mountpoint = listed_path(config.mountpoint)
    while time.monotonic() < deadline:
        if (size := log_path.stat().st_size) != logged_bytes:
            logged_bytes, deadline = size, time.monotonic() + MOUNT_WAIT_S
        code = child.poll()
        if code is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            _fail("mount failed:\n  " + "\n  ".join(tail), code or errors.EXIT_ERROR)
        if mountpoint in mounted_paths():
            click.echo(f"mounted {config.source} at {config.mountpoint} "
                       f"(pid {child.pid}, log {log_path})")
            return
        time.sleep(0.02)
    child.terminate()
    _fail(f"mount did not come up, its daemon silent for {MOUNT_WAIT_S:.0f} s; see {log_path}")


# -- umount ------------------------------------------------------------------------------------

@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--state-dir", type=click.Path(path_type=Path),
              help="State directory given to mount, if not the default.")
def umount(mountpoint, state_dir):
    """Unmount MOUNTPOINT, also one whose daemon died."""
    real = listed_path(mountpoint)  # no realpath: it would stat a possibly stuck mount
    mount = mount_at(real)
    if mount is None:
        _fail(f"{mountpoint} is not mounted")
    if mount.fstype != CACHEFS_FSTYPE:
        # as root, fusermount3 unmounts any mount at all (it checks the owner of FUSE mounts
        # only for other users), and the fallback below would detach a busy one
        _fail(f"{mountpoint} is not a cachefs mount (a {os.fsdecode(mount.fstype)} mount); "
              "use umount(8) for it")
    pid = _daemon_pid(state_dir or default_state_dir(mountpoint))
    if pid is not None and daemon_killed(pid) and not process_exited(pid):
        # killed while a thread waited in the kernel on a READ it can no longer answer: the
        # mount hangs every request until its connection is aborted (cachefs/client.py)
        abort_fuse_connection(real)
    status, message = fusermount_unmount(real)
    if status is None:
        _fail(f"could not unmount {mountpoint}: {message}")  # aborted, and still in the kernel
    if status != 0:
        # a dead daemon or a busy mount: detach it now, the kernel finishes when idle
        lazy_status, lazy_message = fusermount_unmount(real, "-z")
        if lazy_status != 0:
            _fail(f"could not unmount {mountpoint}: {lazy_message or message}")
    if pid is not None:
        _wait_for_exit(pid, UMOUNT_WAIT_S)
    click.echo(f"unmounted {mountpoint}")


def _daemon_pid(state_dir: Path) -> int | None:
    try:
        return int(json.loads(state_dirs.read_own_file(state_dir / "pid", 4096))["pid"])
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: JSON of another shape
        return None


def _wait_for_exit(pid: int, timeout_s: float) -> None:
    """Wait until the daemon has closed its tiers (the SSD index is written at exit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not process_exited(pid):
        time.sleep(0.05)


# -- publish -----------------------------------------------------------------------------------

@cli.command()
# MOUNTPOINT is not checked to exist here: the mount's own calls say what is wrong with it (a
# dead daemon's mount point fails to stat, and click called that "does not exist", exit 2)
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--epoch", type=click.IntRange(min=0, max=INT64_MAX), required=True,
              help="The epoch that --current describes.")
@click.option("--current", type=click.Path(dir_okay=False, path_type=Path),
              help="This epoch's order: .npy or text, one index per line.")
@click.option("--next", "next", type=click.Path(dir_okay=False, path_type=Path),
              help="The next epoch's order, same format.")
@click.option("--files", type=click.Path(dir_okay=False, path_type=Path),
              help="Manifest: text file of relative paths, one per line.")
@click.option("--items", type=click.Path(dir_okay=False, path_type=Path),
              help="Byte-range items the indices number: .npz, or text (file offset length).")
@click.option("--seed", type=click.IntRange(min=0),
              help="Draw both orders with the documented generator instead.")
@click.option("--rank", type=click.IntRange(min=0),
              help="This rank: publishes its own file, merged with the other ranks' files.")
@click.option("--world-size", type=click.IntRange(min=1), help="Number of ranks.")
@click.option("--targets", type=click.Path(dir_okay=False, path_type=Path),
              help="Storage target of each manifest file: .npy or text, one per line.")
@click.option("--timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds to wait for the daemon to accept the order.")
def publish(mountpoint, epoch, current, next, files, items, seed, rank, world_size,  # noqa: A002
            targets, timeout):
    """Publish the read order of MOUNTPOINT and wait until the daemon accepts it."""
    from cachefs import publish as publishing
    from cachefs.order import permutation

    if seed is not None and (current or next):
        raise click.UsageError("--seed draws the orders itself: do not give --current or --next")
    if seed is None and current is None:
        raise click.UsageError("give --current (and optionally --next), or --seed")
    if (rank is None) != (world_size is None):
        raise click.UsageError("give --rank and --world-size together, or neither")
    try:
        manifest, ranges = publishing.read_inputs(files, items)
        if seed is not None:
            n = publishing.order_length(mountpoint, manifest, ranges)
            current_order = permutation(n, seed, epoch)
            next_order: np.ndarray | None = permutation(n, seed, epoch + 1)
        else:
            current_order = publishing.read_index_file(current)
            next_order = publishing.read_index_file(next) if next else None
        placement = publishing.read_index_file(targets) if targets else None
        status = publishing.publish(mountpoint, epoch, current_order, next=next_order,
                                    files=manifest, rank=rank, world_size=world_size,
                                    timeout_s=timeout, targets=placement, items=ranges)
    except errors.OrderRejected as exc:
        _fail(f"order rejected: {exc}")
    except errors.OrderError as exc:  # the mount, a timeout, an input file: not the order's fault
        _fail(f"publish failed: {exc}")
    click.echo(f"epoch {status['epoch']}: {status['length']} of {status['total_length']} "
               f"items accepted{stats_table.merged_ranks(status)}")


# -- stats -------------------------------------------------------------------------------------

def read_stats(mountpoint: Path) -> dict:
    from cachefs import ctrl

    try:
        return ctrl.read_stats(mountpoint)
    except errors.CachefsError as exc:
        _fail(str(exc))


@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))  # see publish's
@click.option("--json", "as_json", is_flag=True, help="Print the full JSON snapshot.")
@click.option("--watch", is_flag=True,
              help="Show rates per interval, redrawn in place, until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1),
              help="Seconds per interval of --watch [default: 1].")
@click.option("--count", type=click.IntRange(min=1), help="Stop --watch after N intervals.")
def stats(mountpoint, as_json, watch, interval, count):
    """Show hit rates per tier and epoch, backend bytes, stalls and the active order."""
    if not watch and (interval is not None or count is not None):
        raise click.UsageError("--interval and --count go with --watch")
    if watch and as_json:
        raise click.UsageError("--watch shows rates; --json prints one snapshot: give one")
    if watch:
        _watch_stats(mountpoint, 1.0 if interval is None else interval, count)
        return
    snapshot = read_stats(mountpoint)
    if as_json:
        click.echo(json.dumps(snapshot, indent=2))
        return
    click.echo(stats_table.format_stats(snapshot))


def _watch_stats(mountpoint: Path, interval_s: float, count: int | None) -> None:
    """Snapshots `interval_s` apart, shown as rates (cachefs/watch.py): a table redrawn in
    place on a terminal, a line per interval otherwise; Ctrl-C ends it with status 0."""
    import collections
    import itertools

    from rich.console import Console
    from rich.live import Live

    from cachefs import watch as watching

    console = Console()
    live = Live(console=console, auto_refresh=False) if sys.stdout.isatty() else None
    rows: collections.deque = collections.deque(maxlen=max(5, console.size.height - 8))
    title = f"cachefs stats {mountpoint}, every {interval_s:g} s (Ctrl-C to stop)"
    try:
        before, before_s = read_stats(mountpoint), time.monotonic()
        due_s = before_s
        if live is None:
            click.echo(watching.plain_header())
        else:
            live.start()
        for shown in itertools.count(1):
            due_s += interval_s
            time.sleep(max(0.0, due_s - time.monotonic()))
            after, after_s = read_stats(mountpoint), time.monotonic()
            row = watching.interval(before, after, after_s - before_s, time.time())
            if live is None:
                click.echo(watching.plain_line(row))
            else:
                rows.append(row)
                live.update(watching.table(rows, title), refresh=True)
            before, before_s = after, after_s
            if count is not None and shown >= count:
                return
    except KeyboardInterrupt:
        return  # how a watch is meant to end
    finally:
        if live is not None:
            live.stop()


# -- warm --------------------------------------------------------------------------------------

@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))  # see publish's
@click.option("--files", type=click.Path(exists=True, dir_okay=False, readable=True,
                                        path_type=Path),
              help="Warm these files (relative paths, one per line), in this order.")
@click.option("--order", is_flag=True, help="Warm the published order's files, in its order.")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar [default: when stderr is a terminal].")
def warm(mountpoint, files, order, progress):
    """Fill the SSD tier of MOUNTPOINT ahead of training; resumable, stops at the budget."""
    import uuid

    from cachefs import ctrl
    from cachefs.ctrl import WARM_START

    if files and order:
        raise click.UsageError("give --files or --order, not both")
    mode = "files" if files else "order" if order else "all"
    request = {"mode": mode, "id": uuid.uuid4().hex}
    if files:
        request["files_path"] = str(files.absolute())
    name = WARM_START + json.dumps(request, separators=(",", ":")).encode()
    if len(name) > XATTR_NAME_MAX:
        _fail(f"the path of --files is too long to pass to the daemon; move {files} to a "
              f"shorter path")
    try:
        status = json.loads(ctrl.read_attr(mountpoint, name))
    except errors.CachefsError as exc:
        _fail(str(exc))
    if status["state"] == "rejected":
        _fail(f"warm refused: {status['error']}")
    show = sys.stderr.isatty() if progress is None else progress
    status = _follow_warm(mountpoint, request["id"], show)
    click.echo(_warm_summary(status))
    if status["state"] == "failed" or status.get("errors"):
        sys.exit(errors.EXIT_ERROR)


def _follow_warm(mountpoint: Path, request_id: str, show: bool) -> dict:
    """Poll the daemon's warm status until it ends; show its progress on stderr (rich: a bar
    redrawn in place on a terminal, its last state once otherwise)."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    progress = Progress(TextColumn("warm"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("files, {task.fields[written_mb]:.1f} MB written"),
                        TimeElapsedColumn(), TimeRemainingColumn(),
                        console=Console(stderr=True), disable=not show)
    with progress:
        task = progress.add_task("warm", total=None, written_mb=0.0)
        while True:
            status = read_stats(mountpoint)["warm"]
            if status.get("request_id") != request_id:
                _fail("another warm request replaced this one")
            if "files_total" in status:
                progress.update(task, total=status["files_total"],
                                completed=status["files_done"],
                                written_mb=status["bytes_admitted"] / 1e6)
            if status["state"] not in ("starting", "running"):
                return status
            time.sleep(0.2)


def _warm_summary(status: dict) -> str:
    endings = {"done": "done", "full": "stopped: the SSD tier is full (its budget is reached)",
               "disabled": "stopped: SSD admission is disabled (disk full or I/O error; see log)",
               "failed": f"failed: {status.get('error')}"}
    text = endings.get(status["state"], status["state"])
    if "files_total" in status:
        text += (f"; {status['files_done']}/{status['files_total']} files, "
                 f"{status['bytes_admitted'] / 1e6:.1f} MB written, "
                 f"{status['bytes_present'] / 1e6:.1f} MB already cached, "
                 f"{status.get('errors', 0)} unreadable, {status.get('elapsed_s', 0):.1f} s")
    return "warm " + text


# -- demo --------------------------------------------------------------------------------------

# The demo's settings and their defaults, here only (man/cachefs-demo.1 documents them):
# option, type, default, help. cachefs.demo.DemoConfig checks them again; it is not imported
# before the command runs, since it loads numpy.
_DEMO_SETTINGS = (
    ("--files", click.IntRange(min=1), 2000, "Files in the generated data set."),
    ("--file-kb", click.FloatRange(min=0, min_open=True), 100.0,
     "Mean file size in KiB (sizes vary from 0.5x to 1.5x)."),
    ("--epochs", click.IntRange(min=1), 3, "Epochs read each way."),
    ("--workers", click.IntRange(min=1), 4, "Reader threads, like a DataLoader's workers."),
    ("--ram-fraction", click.FloatRange(min=0, min_open=True), 0.5,
     "RAM budget as a fraction of the data set's bytes."),
    ("--ssd-fraction", click.FloatRange(min=0), 0.0,
     "SSD tier budget as a fraction of the data set; 0 = no SSD tier."),
    # 10 ms: a disk seek, an object store's first byte
    ("--delay-ms", click.FloatRange(min=0), 10.0,
     "Latency of the slow source per open and per read."),
    ("--seed", click.IntRange(min=0), 0, "Seed of the data set and of the epochs' orders."),
)


def _demo_settings(command):
    """The options of _DEMO_SETTINGS on `command`, listed in the table's order."""
    for name, kind, default, text in reversed(_DEMO_SETTINGS):
        command = click.option(name, type=kind, default=default, show_default=True,
                               help=text)(command)
    return command


@cli.command()
@_demo_settings
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=".",
              show_default=True, help="Directory for cachefs-demo.json and cachefs-demo.png.")
@click.option("--keep", is_flag=True, help="Keep the generated data set.")
def demo(files, file_kb, epochs, workers, ram_fraction, ssd_fraction, delay_ms, seed, output,
         keep):
    """Read a generated slow data set for a few epochs, with and without cachefs."""
    from cachefs import demo as demo_mod

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = demo_mod.DemoConfig(files=files, file_kb=file_kb, epochs=epochs,
                                     workers=workers, ram_fraction=ram_fraction,
                                     ssd_fraction=ssd_fraction, delay_ms=delay_ms, seed=seed,
                                     output=output, keep=keep)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        result = demo_mod.run(config, progress=lambda message: click.echo(message, err=True))
    except errors.CachefsError as exc:
        _fail(f"demo failed: {exc}")
    click.echo(demo_mod.format_table(result))
    click.echo(f"wrote {demo_mod.write_json(result, output / demo_mod.JSON_NAME)}")
    try:
        click.echo(f"wrote {demo_mod.plot(result, output / demo_mod.PNG_NAME)}")
    except ImportError:
        click.echo("no plot: matplotlib is not installed (pip install 'cachefs[demo]')",
                   err=True)
    if result.kept_dataset:
        click.echo(f"data set kept in {result.kept_dataset}")


# -- the mount(8) helper form ----------------------------------------------------------------

def _helper_options() -> dict[str, mount_helper.MountOption]:
    return mount_helper.options_of(cli.commands["mount"], FUSE_OPTIONS)


def _helper_command_line(argv: list[str]) -> list[str]:
    try:
        return mount_helper.command_line(argv, _helper_options())
    except mount_helper.HelperArgsError as exc:
        click.echo(f"cachefs: {exc}", err=True)
        sys.exit(errors.EXIT_USAGE)


def main():
    """The `cachefs` command; `cachefs SRC MNT -o OPTS` is the helper form of `cachefs mount`."""
    argv = sys.argv[1:]
    if mount_helper.is_helper_form(argv, cli.commands):
        argv = _helper_command_line(argv)
    cli.main(args=argv, auto_envvar_prefix="CACHEFS")


def mount_main():
    """`mount.cachefs SRC MNT -o OPTS`: mount(8)'s helper for `mount -t cachefs`."""
    cli.main(args=_helper_command_line(sys.argv[1:]), prog_name="cachefs",
             auto_envvar_prefix="CACHEFS")


if __name__ == "__main__":
    main()
