"""Driving a daemonized mount from a program: start it, read its counters, stop it for sure.

`cachefs demo` and the benchmarks (`scripts/benchlib.py`) mount with the real CLI, as a user
does, and must never leave a mount behind, whatever happens while they run. This module is
that one piece of code:

- `MountProcess.start` runs `cachefs mount` (which returns once the kernel lists the mount) in
  a session of its own, so that a Ctrl-C in the terminal cannot kill it half-way through
  starting a daemon that would then mount after the caller has cleaned up;
- `MountProcess.stop` lets a start still under way finish, then unmounts with
  `cachefs umount` (which waits for the daemon to exit), and detaches lazily with
  `fusermount3 -u -z` if that fails; a mount still there after that is a MountError, never
  left behind in silence. It also takes down a stale mount left at the mount point by an
  earlier, interrupted run;
- whether a mount is up is read from the kernel's mount table (`cachefs.mountinfo`, which the
  daemon shares), which never touches a mount, so it cannot hang on a stuck daemon;
- `process_exited` tells a daemon that exited, also one killed and not reaped yet (a zombie),
  which `cachefs umount` must not wait for; `daemon_killed` one whose main thread is gone
  while a thread of it still waits in the kernel, whose mount `cachefs umount` unblocks with
  `abort_fuse_connection`; `fusermount_unmount` runs fusermount3 for `cachefs umount` in
  bounded time, aborting the connection of a mount whose teardown it waits on;
- `stats_totals` gives the per-epoch counters of a `cachefs stats` snapshot summed (an epoch
  switch in the middle of a pass splits the pass between two records); `stats_delta` subtracts
  two sums;
  `MountProcess.settled_totals` waits for the last files of a pass to be counted;
- `page_cache_bytes` asks the kernel (mincore(2)) how much of some files' pages it holds: the
  memory the kernel data plane uses for a mount, as the benchmarks and tests measure it.

No pyfuse3 import: the CLI's `umount`, the demo and the benchmarks use this without loading
the FUSE binding.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from cachefs import ctrl
from cachefs.mountinfo import listed_path, mount_at, mounted_paths

log = logging.getLogger(__name__)

# `cachefs mount` waits for its daemon as long as it logs (60 s of silence at most); this
# harness (benchmarks, tests: small SSD tiers) gives up after this long in all
MOUNT_WAIT_S = 90.0
UMOUNT_WAIT_S = 30.0
SETTLE_S = 5.0  # how long settled_totals waits for the last closes of a pass to be counted
SETTLE_POLL_S = 0.01
# the per-epoch counters of `cachefs stats` (man/cachefs-stats.1) that stats_totals gives
COUNTERS = ("reads", "hits_ram", "hits_ssd", "prefetched", "misses", "backend_bytes",
            "stall_s", "kernel_reclaimed")


class MountError(Exception):
    """`cachefs mount` failed or did not return; the message says why."""


def _task_states(pid: int) -> list[str]:
    """The states (proc(5): the field after the command name) of the process's threads, the
    leader's first; [] if it is gone."""
    states = []
    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda tid: int(tid) != pid)
    except OSError:
        return []
    for tid in tasks:
        try:
            states.append(Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                          .rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            pass
    return states


def process_exited(pid: int) -> bool:
    """Whether process `pid` has exited: gone, or a zombie that its parent has not reaped yet
    (it has closed its files; a container's PID 1 may never reap it). A process whose main
    thread is a zombie while another thread is still in the kernel has not (`daemon_killed`)."""
    return all(state in ("Z", "X") for state in _task_states(pid))


def daemon_killed(pid: int) -> bool:
    """Whether the daemon's main thread is gone (it was killed, or it died), even if one of
    its threads is still in the kernel: one storing into the page cache can wait there for a
    READ that the dead daemon will never answer, and hold the mount's /dev/fuse open until the
    connection is aborted (`abort_fuse_connection`)."""
    states = _task_states(pid)
    return not states or states[0] in ("Z", "X")


# fusermount3's unmount waits in the kernel for the mount's teardown, which a FUSE connection
# that nobody answers can hold up for good; one still running after this long has the
# connection aborted (`fusermount_unmount`)
FUSERMOUNT_WAIT_S = 5.0


def fusermount_unmount(mountpoint: str, *flags: str) -> tuple[int | None, str]:
    """`fusermount3 -u [flags]` of the mount at `mountpoint`: its exit status and message. One
    still running after FUSERMOUNT_WAIT_S waits in the kernel on the mount's FUSE connection (its
    daemon dead with the connection still open, or stuck): the connection is aborted, which ends
    that wait. If it still runs FUSERMOUNT_WAIT_S later, None and a message naming it; it is
    left running (a process in the kernel's uninterruptible wait cannot be reaped before it
    ends)."""
    # the connection is found before the unmount starts: the mount may have left the mount
    # table (mountinfo) by the time fusermount3 waits on its teardown
    device = fuse_device(mountpoint)
    process = subprocess.Popen(["fusermount3", "-u", *flags, mountpoint],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    aborted = False
    for attempt in range(2):
        try:
            status = process.wait(timeout=FUSERMOUNT_WAIT_S)
        except subprocess.TimeoutExpired:
            if attempt == 0:
                log.warning("fusermount3 -u %s has not returned in %.0f s: aborting the mount's "
                            "FUSE connection", mountpoint, FUSERMOUNT_WAIT_S)
                aborted = abort_fuse_connection(mountpoint, device)
            continue
        assert process.stderr is not None
        with process.stderr:
            return status, process.stderr.read().strip()
    return None, (f"fusermount3 (pid {process.pid}) has not returned in "
                  f"{2 * FUSERMOUNT_WAIT_S:.0f} s, "
                  + ("the mount's FUSE connection aborted" if aborted
                     else "and the mount's FUSE connection could not be aborted"))


def fuse_device(mountpoint: str) -> str | None:
    """The device ("major:minor") of the mount at `mountpoint` (the top one, which a path
    lookup and fusermount3 find), None if nothing is mounted there."""
    found = mount_at(mountpoint)
    return None if found is None else found.device


def abort_fuse_connection(mountpoint: str, device: str | None = None) -> bool:
    """Abort the FUSE connection of the mount at `mountpoint` (fusectl's `abort`): every
    request waiting on its daemon fails with ENOTCONN. `device`: the mount's, if looked up
    before (`fuse_device`). False if that could not be done (no such mount, fusectl missing
    and not mountable, not root)."""
    if device is None:
        device = fuse_device(mountpoint)
    if device is None:
        return False
    connections = Path("/sys/fs/fuse/connections")
    connection = connections / device.split(":")[1]  # named by the mount's minor number
    if not connection.exists():
        subprocess.run(["mount", "-t", "fusectl", "none", str(connections)],
                       capture_output=True)
    try:
        (connection / "abort").write_text("1")
    except OSError as exc:
        log.warning("could not abort the FUSE connection of %s: %s", mountpoint, exc)
        return False
    return True


def cachefs_command(*args) -> list[str]:
    """The CLI, run with this interpreter (so a virtualenv's cachefs is the one run)."""
    return [sys.executable, "-m", "cachefs", *map(str, args)]


def stats_totals(snapshot: dict) -> dict:
    """The epoch records' counters summed (by the daemon: `Stats.totals`)."""
    return {key: snapshot["totals"][key] for key in COUNTERS}


def stats_delta(before: dict, after: dict) -> dict:
    """The counters of `stats_totals` added between two snapshots (stall_s to the us)."""
    delta = {key: after[key] - before[key] for key in COUNTERS}
    delta["stall_s"] = round(delta["stall_s"], 6)
    return delta


class MountProcess:
    """One daemonized `cachefs mount SOURCE MOUNTPOINT --state-dir STATE_DIR ARGS...`."""

    def __init__(self, source: Path, mountpoint: Path, state_dir: Path, args=()):
        self.source = Path(source)
        self.mountpoint = Path(mountpoint)
        self.state_dir = Path(state_dir)
        self.args = [str(arg) for arg in args]
        self._starter: subprocess.Popen | None = None

    def start(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = cachefs_command("mount", self.source, self.mountpoint, "--state-dir",
                              self.state_dir, *self.args)
        log.debug("starting %s", cmd)
        self._starter = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = self._starter.communicate(timeout=MOUNT_WAIT_S)
        except subprocess.TimeoutExpired:
            raise MountError(f"cachefs mount did not return within {MOUNT_WAIT_S:.0f} s; see "
                             f"{self.state_dir / 'daemon.log'}") from None
        if self._starter.returncode != 0:
            raise MountError(f"cachefs mount failed (exit {self._starter.returncode}):\n"
                             + output.decode(errors="replace").strip())

    @property
    def mounted(self) -> bool:
        return listed_path(self.mountpoint) in mounted_paths()

    def stats(self) -> dict:
        return ctrl.read_stats(self.mountpoint)

    def totals(self) -> dict:
        return stats_totals(self.stats())

    def settled_totals(self, before: dict, reads: int, timeout_s: float = SETTLE_S) -> dict:
        """Totals once the daemon has counted `reads` more reads than `before`, or whatever
        it has counted after `timeout_s`: a file is counted when the kernel reports its close
        (a RELEASE, or a fanotify event), shortly after the reader's close() returned."""
        deadline = time.monotonic() + timeout_s
        while True:
            totals = self.totals()
            if totals["reads"] - before["reads"] >= reads or time.monotonic() > deadline:
                return totals
            time.sleep(SETTLE_POLL_S)

    def stop(self) -> None:
        """Unmount (see the module docstring); nothing to do if nothing is mounted."""
        if self._starter is not None and self._starter.poll() is None:
            # interrupted while the mount was coming up: let it finish, then take it down
            try:
                self._starter.communicate(timeout=MOUNT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._starter.kill()
                self._starter.communicate()
        if not self.mounted:
            return
        done = subprocess.run(cachefs_command("umount", os.path.abspath(self.mountpoint),
                                              "--state-dir", self.state_dir),
                              capture_output=True, text=True,
                              timeout=UMOUNT_WAIT_S + 2 * FUSERMOUNT_WAIT_S + 10,
                              start_new_session=True)
        if done.returncode != 0 or self.mounted:
            log.warning("cachefs umount %s failed (%s); detaching it", self.mountpoint,
                        (done.stderr or done.stdout).strip())
            status, message = fusermount_unmount(os.path.abspath(self.mountpoint), "-z")
            if self.mounted:
                raise MountError(f"could not unmount {self.mountpoint}: "
                                 f"{message or f'fusermount3 -u -z exit {status}'}")


# -- what the kernel holds -----------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_cache_bytes(root: bytes, relpaths: list[bytes]) -> int:
    """Bytes of the files' pages in the page cache, by mincore(2) on a mapping of each (which
    faults nothing in; through a FUSE mount, each file gets one more open)."""
    page = mmap.PAGESIZE
    total = 0
    for relpath in relpaths:
        fd = os.open(root + b"/" + relpath, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if not size:
                continue
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap failed", relpath)
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if _libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed", relpath)
                total += sum(1 for flag in vector if flag & 1) * page
            finally:
                _libc.munmap(address, size)
        finally:
            os.close(fd)
    return total
