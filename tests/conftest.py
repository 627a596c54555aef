"""Shared fixtures: real mounts in a subprocess, and generated source trees.

`mounter` starts `cachefs mount --foreground` in a subprocess, waits until the kernel lists
the mount, and always takes it down in a finally: `fusermount3 -u`, then terminate, then kill,
then a lazy unmount, so no test leaves a stale mount even when it fails. A failed test prints
the daemon's log.

A daemon that logged a traceback fails its test, even if every check passed: the mount maps
any exception in a handler to EIO and a log line (fuse_ops._guarded), so a bug would otherwise
go unseen by the tests. Every daemon log a test leaves under its `tmp_path` is checked at its
teardown (`daemon_logs_without_tracebacks`): the mounter's, and `STATE/daemon.log` of a
daemonized mount (the CLI's, the benchmarks'); the demo checks its own (cachefs/demo.py). A
test that expects a traceback says so with `@pytest.mark.daemon_traceback("why")`.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.mountinfo import mounted_paths  # noqa: F401 - also used by the tests through conftest

pytest_plugins = ["pytester"]  # test_fixtures.py runs the fixtures in an inner session

MOUNT_TIMEOUT_S = 30.0
TRACEBACK = "Traceback (most recent call last)"  # also the tail of "Exception Group Traceback"
TRACEBACK_LINES_SHOWN = 60


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cachefs_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "cachefs", *map(str, args)]


def run_cachefs(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cachefs_cmd(*args), capture_output=True, text=True, timeout=120,
                          **kwargs)


class Mount:
    """One `cachefs mount --foreground` subprocess."""

    def __init__(self, source: Path, mountpoint: Path, state_dir: Path, log_path: Path,
                 args, prefix=()):
        self.source = source
        self.mountpoint = mountpoint
        self.state_dir = state_dir
        self.log_path = log_path
        self.order_file = state_dir / "order.npz"
        cmd = [*prefix, *cachefs_cmd("mount", "--foreground", source, mountpoint,
                                     "--state-dir", state_dir, *args)]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while str(mountpoint) not in mounted_paths():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mount did not come up:\n{self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def mounted(self) -> bool:
        return str(self.mountpoint) in mounted_paths()

    def stats(self) -> dict:
        from cachefs import ctrl

        return ctrl.read_stats(self.mountpoint)

    def stop(self) -> int | None:
        """Unmount and wait for the daemon; escalate until both are gone."""
        try:
            if self.mounted:
                subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
            try:
                return self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGTERM)
                try:
                    return self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    try:
                        return self.process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        # a thread left in the kernel, waiting on a READ the killed daemon
                        # cannot answer (cachefs/client.py, daemon_killed)
                        from cachefs.client import abort_fuse_connection
                        abort_fuse_connection(str(self.mountpoint))
                        return self.process.wait()
        finally:
            if self.mounted:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                               capture_output=True)
            self._log.close()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "daemon_traceback(reason): a daemon of this test is expected to log a "
        "traceback; without this mark, one fails the test")


def daemon_logs(directory: Path) -> list[Path]:
    """Logs of the daemons started under `directory`: the mounter's (daemonN.log) and those of
    daemonized mounts (STATE/daemon.log, STATE up to two levels down)."""
    return sorted({*directory.glob("daemon*.log"), *directory.glob("*/daemon.log"),
                   *directory.glob("*/*/daemon.log")})


def traceback_in(log_path: Path) -> str | None:
    """The first traceback in a log and what follows it (a few dozen lines), or None."""
    text = log_path.read_text(errors="replace")
    start = text.find(TRACEBACK)
    if start < 0:
        return None
    start = text.rfind("\n", 0, start) + 1
    return "\n".join(text[start:].splitlines()[:TRACEBACK_LINES_SHOWN])


@pytest.fixture(autouse=True)
def daemon_logs_without_tracebacks(request, tmp_path):
    """Fail the test if a daemon it started logged a traceback (module docstring). Autouse, so
    it is set up before, and torn down after, the fixtures that stop the daemons."""
    yield
    if request.node.get_closest_marker("daemon_traceback") is not None:
        return
    for log_path in daemon_logs(tmp_path):
        found = traceback_in(log_path)
        if found is not None:
            pytest.fail(f"the daemon logged a traceback ({log_path}):\n{found}",
                        pytrace=False)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture
def mounter(tmp_path, request):
    """mounter(source, *args) -> Mount; every mount is taken down after the test."""
    yield from mounts_in(tmp_path, request)


def mounts_in(directory: Path, request):
    """A mounter fixture's body: mount points, state directories and logs go in `directory`;
    after the test every mount is taken down, and its log printed if the test failed."""
    mounts: list[Mount] = []

    def start(source: Path, *args, prefix=()) -> Mount:
        index = len(mounts)
        mountpoint = directory / f"mnt{index}"
        mountpoint.mkdir(exist_ok=True)
        mount = Mount(Path(source), mountpoint, directory / f"state{index}",
                      directory / f"daemon{index}.log", args, prefix)
        mounts.append(mount)
        return mount

    yield start
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for mount in mounts:
        mount.stop()
        if failed:
            print(f"--- daemon log of {mount.mountpoint} ---\n{mount.log()}")


def default_sigint() -> None:
    """A Popen's preexec_fn: Ctrl-C reaches the child as a terminal sends it, whatever the
    caller ignores (a suite started as a background job of a shell runs with SIGINT ignored;
    an ignored signal stays ignored across exec, a default one is Python's to handle)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_in_terminal(cmd: list, timeout_s: float = 30.0, columns: int = 100
                    ) -> tuple[int, str]:
    """Run `cmd` with a pseudo-terminal as its stdin, stdout and stderr (as in an xterm of
    `columns` columns); its exit status and all it wrote there, escape sequences included."""
    import pty
    import select

    controller, terminal = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS=str(columns), LINES="30")
    process = subprocess.Popen([str(arg) for arg in cmd], stdin=terminal, stdout=terminal,
                               stderr=terminal, env=env)
    os.close(terminal)
    output = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not select.select([controller], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(controller)
    try:
        code = process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return code, output.decode(errors="replace")


def release_fifo_readers(fifo: Path) -> None:
    """Open `fifo` for writing once: a reader waiting in open() for a writer goes on. For tests
    of code that must never wait there, so that they fail instead of hanging."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # ENXIO: no reader is waiting


def write_file(path: Path, size_bytes: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return path


def flat_dataset_fixture(count: int, size_bytes: int, vary: bool = True):
    """A test module's `dataset` fixture: (source, relpaths) of `make_flat_dataset` under
    tmp_path/src, with these arguments."""
    @pytest.fixture(name="dataset")
    def dataset(tmp_path) -> tuple[Path, list[str]]:
        src = tmp_path / "src"
        return src, make_flat_dataset(src, count, size_bytes, vary)

    return dataset


def make_flat_dataset(root: Path, count: int, size_bytes: int, vary: bool = True) -> list[str]:
    """`count` files of about `size_bytes` in a few class directories; returns relpaths."""
    import numpy as np

    rng = np.random.default_rng(count)
    relpaths = []
    for i in range(count):
        relpath = f"class{i % 7}/sample_{i:06d}.bin"
        size = int(size_bytes * (0.5 + rng.random())) if vary else size_bytes
        write_file(root / relpath, size, seed=i)
        relpaths.append(relpath)
    return sorted(relpaths, key=os.fsencode)


def read_epoch(mount: Mount, relpaths: list[str], epoch: int, seed: int = 0,
               publish: bool = True) -> dict:
    """Publish epoch `epoch` (next = epoch + 1) and read every file in that order, checking
    each against the source; returns the mount's record of that epoch."""
    from cachefs import order
    from cachefs.publish import publish

    n = len(relpaths)
    current = order.permutation(n, seed, epoch)
    if publish:
        publish(mount.mountpoint, epoch, current, next=order.permutation(n, seed, epoch + 1))
    for index in current:
        relpath = relpaths[index]
        assert (mount.mountpoint / relpath).read_bytes() == (mount.source / relpath).read_bytes(), \
            relpath
    return epoch_record(mount, epoch, reads=n)


def wait_for(predicate, timeout_s=10.0):
    """`predicate()`'s value once it is true (the daemon acts a moment after the test's
    call); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def epoch_record(mount: Mount, epoch: int, reads: int | None = None) -> dict:
    """The stats record of `epoch`; with `reads`, once that many releases were counted
    (the kernel sends RELEASE after close() has returned)."""
    deadline = time.monotonic() + 10
    while True:
        records = [r for r in mount.stats()["epochs"] if r["epoch"] == epoch]
        if records and (reads is None or records[0]["reads"] >= reads):
            return records[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"epoch {epoch} record not complete: {records}")
        time.sleep(0.01)
