"""The overlay through the kernel: bytes, metadata, errors and the mount's life cycle."""

from __future__ import annotations

import contextlib
import errno
import glob
import multiprocessing
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachefs import scheduling
from conftest import mounted_paths, run_cachefs, sha256, wait_for, write_file

MIB = 1 << 20


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Nested dirs, odd names, empty / 1-byte / 20 MiB files, symlinks, a 10k-entry dir."""
    root = tmp_path_factory.mktemp("src")
    write_file(root / "a" / "b" / "c" / "deep.bin", 3000, seed=1)
    write_file(root / "naïve café" / "日本語 ファイル.txt", 5000, seed=2)
    write_file(root / "with space.bin", 777, seed=3)
    (root / "empty").write_bytes(b"")
    (root / "one").write_bytes(b"x")
    write_file(root / "big.bin", 20 * MIB + 12345, seed=4)
    os.symlink("with space.bin", root / "link_to_file")
    os.symlink("a/b", root / "link_to_dir")
    many = root / "many"
    many.mkdir()
    for i in range(10_000):
        (many / f"f{i:05d}").write_bytes(i.to_bytes(4, "little"))
    np.save(root / "array.npy", np.arange(100_000, dtype=np.float64))
    return root


def source_files(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every regular file (not through symlinks)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out[str(path.relative_to(root))] = sha256(path)
    return out


def hash_all(args) -> dict[str, str]:
    root, relpaths = args
    return {rel: sha256(Path(root) / rel) for rel in relpaths}


def test_every_file_is_byte_identical(tree, mounter):
    mount = mounter(tree)
    expected = source_files(tree)
    assert source_files(mount.mountpoint) == expected


def test_four_concurrent_reader_processes(tree, mounter):
    mount = mounter(tree)
    expected = source_files(tree)
    relpaths = sorted(expected)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(hash_all, [(mount.mountpoint, relpaths)] * 4)
    for result in results:
        assert result == expected


@pytest.mark.parametrize("started_under", ["the default policy", "chrt --idle 0"])
def test_every_thread_of_the_daemon_runs_as_batch_work(tree, mounter, started_under):
    """The daemon's threads do not preempt the storage client's on wake-up (SCHED_BATCH,
    cachefs/scheduling.py): those that exist at start and every one started after, by
    the read pool, the page cache's workers and trio's thread cache once files are read.
    A daemon started under a policy of its caller's choice keeps it."""
    if started_under == "the default policy":
        mount, expected = mounter(tree), os.SCHED_BATCH
    else:
        mount, expected = mounter(tree, prefix=started_under.split()), os.SCHED_IDLE
    assert _of_every_thread(mount, tree, os.sched_getscheduler) == {expected}


@pytest.mark.parametrize("cpus", ["auto", "one", "all"])
def test_every_thread_of_the_daemon_runs_on_the_cpus_asked(tree, mounter, cpus):
    """`--cpus` (cachefs/scheduling.py): on a machine of few CPUs the default puts every
    thread of the daemon on the last of them, those there at start and every one started
    after; a list puts them there, `all` leaves them floating; `cachefs stats` tells which."""
    allowed = os.sched_getaffinity(0)
    if cpus == "auto":
        mount = mounter(tree)
        expected = {max(allowed)} if len(allowed) <= scheduling.AUTO_ONE_CPU_MAX else allowed
    elif cpus == "one":
        expected = {min(allowed)}
        mount = mounter(tree, "--cpus", str(min(allowed)))
    else:
        mount, expected = mounter(tree, "--cpus", "all"), allowed
    assert _of_every_thread(mount, tree, lambda tid: frozenset(os.sched_getaffinity(tid))
                            ) == {frozenset(expected)}
    assert mount.stats()["mount"]["cpus"] == sorted(expected)


def _of_every_thread(mount, tree: Path, look) -> set:
    """`look(tid)` of every thread of the daemon, once it has read every file (the read
    pool's threads, the page cache's workers and trio's thread cache are there then)."""
    assert source_files(mount.mountpoint) == source_files(tree)
    tasks = os.listdir(f"/proc/{mount.process.pid}/task")
    assert len(tasks) > 4  # the threads of the reads are there too
    seen = set()
    for task in tasks:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            seen.add(look(int(task)))
    return seen


def test_cpus_the_daemon_may_not_use_are_refused(tree, tmp_path):
    """A CPU outside those the daemon may use: exit status 2 and the CPUs it may use, with
    nothing mounted; a list that is none: the same status, saying what a list is."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    beyond = max(os.sched_getaffinity(0)) + 1
    for cpus, says in ((str(beyond), f"CPU {beyond} is not among those the daemon may use"),
                       ("two", "auto, all, or CPU numbers")):
        result = run_cachefs("mount", tree, mountpoint, "--state-dir", tmp_path / "state",
                             "--cpus", cpus)
        assert result.returncode == 2, result
        assert says in result.stderr
        assert not os.path.ismount(mountpoint)


def test_metadata_walk_glob_symlinks(tree, mounter):
    mount = mounter(tree)
    mnt = mount.mountpoint

    def walk(root):
        return sorted((str(Path(d).relative_to(root)), sorted(ds), sorted(fs))
                      for d, ds, fs in os.walk(root))

    assert walk(mnt) == walk(tree)
    assert sorted(os.listdir(mnt / "many")) == sorted(os.listdir(tree / "many"))
    assert len(os.listdir(mnt / "many")) == 10_000
    assert os.readlink(mnt / "link_to_file") == "with space.bin"
    assert os.path.islink(mnt / "link_to_dir")
    assert (mnt / "link_to_dir" / "c" / "deep.bin").read_bytes() == \
        (tree / "a" / "b" / "c" / "deep.bin").read_bytes()
    assert sorted(glob.glob(str(mnt / "naïve café" / "*.txt"))) == \
        [str(mnt / "naïve café" / "日本語 ファイル.txt")]
    for name in ("big.bin", "empty", "one", "a/b/c/deep.bin"):
        src, via = os.stat(tree / name), os.stat(mnt / name)
        assert (via.st_size, via.st_mode, via.st_mtime_ns) == \
            (src.st_size, src.st_mode, src.st_mtime_ns)
    assert os.statvfs(mnt).f_blocks == os.statvfs(tree).f_blocks


def test_open_handles_of_a_directory_share_one_listing(tree, mounter):
    """Issue 15, item 14: forty open handles of a 10k-entry directory, one listing held."""
    mount = mounter(tree)
    many = mount.mountpoint / "many"
    expected = sorted(os.listdir(tree / "many"))
    assert sorted(os.listdir(many)) == expected  # the kernel has looked the directory up
    listed_before = mount.stats()["source"]["requests"]["listdir"]
    handles = [os.open(many, os.O_RDONLY | os.O_DIRECTORY) for _ in range(40)]
    try:
        listed = mount.stats()["source"]["requests"]["listdir"] - listed_before
        assert listed == 1
        for fd in handles[::13]:  # each handle reads the whole directory
            assert sorted(os.listdir(fd)) == expected
    finally:
        for fd in handles:
            os.close(fd)


def test_a_connection_the_kernel_tore_down_mid_read_ends_the_mount_quietly():
    """An unmount racing a request the daemon was reading (a FORGET or RELEASE of the
    unmount itself) reaches pyfuse3's loop as ECONNABORTED, not libfuse's ENODEV: the daemon
    logged it as a traceback (a CI run, at the end of the test above), though the mount had
    ended as it should. That one error, alone or all of an exception group, ends the mount;
    any other still propagates."""
    from cachefs.mount import _connection_ended

    aborted = ConnectionAbortedError(errno.ECONNABORTED, "fuse_session_receive_buf failed")
    assert _connection_ended(aborted)
    if sys.version_info >= (3, 11):  # as trio's nurseries raise it
        nested = ExceptionGroup("nursery", [ExceptionGroup("loop", [aborted])])  # noqa: F821
        assert _connection_ended(nested)
        mixed = ExceptionGroup("nursery", [aborted, OSError(errno.EIO, "x")])  # noqa: F821
        assert not _connection_ended(mixed)
    assert not _connection_ended(OSError(errno.EIO, "fuse_session_receive_buf failed"))
    assert not _connection_ended(ValueError())


def test_random_offsets_short_reads_and_memmap(tree, mounter):
    mount = mounter(tree)
    data = (tree / "big.bin").read_bytes()
    rng = np.random.default_rng(0)
    with open(mount.mountpoint / "big.bin", "rb", buffering=0) as f:
        for _ in range(200):
            offset = int(rng.integers(0, len(data) + 100))
            size = int(rng.integers(1, 3 * MIB))
            assert os.pread(f.fileno(), size, offset) == data[offset:offset + size]
    array = np.load(mount.mountpoint / "array.npy", mmap_mode="r")
    assert np.array_equal(array, np.arange(100_000, dtype=np.float64))
    assert (mount.mountpoint / "empty").read_bytes() == b""
    assert (mount.mountpoint / "one").read_bytes() == b"x"


def test_xattrs_are_passed_through(tmp_path, mounter):
    src = tmp_path / "src"
    write_file(src / "tagged", 10)
    try:
        os.setxattr(src / "tagged", "user.label", b"cat")
    except OSError:
        pytest.skip("the temporary file system has no user xattrs")
    mount = mounter(src)
    assert os.getxattr(mount.mountpoint / "tagged", "user.label") == b"cat"
    assert "user.label" in os.listxattr(mount.mountpoint / "tagged")
    with pytest.raises(OSError) as info:
        os.getxattr(mount.mountpoint / "tagged", "user.absent")
    assert info.value.errno == errno.ENODATA


@pytest.mark.parametrize("operation", [
    lambda m: open(m / "one", "wb"),
    lambda m: open(m / "one", "ab"),
    lambda m: open(m / "new_file", "wb"),
    lambda m: os.mkdir(m / "newdir"),
    lambda m: os.unlink(m / "one"),
    lambda m: os.rmdir(m / "a"),
    lambda m: os.rename(m / "one", m / "two"),
    lambda m: os.chmod(m / "one", 0o777),
    lambda m: os.truncate(m / "one", 0),
    lambda m: os.symlink("one", m / "sym"),
    lambda m: os.link(m / "one", m / "hard"),
    lambda m: os.setxattr(m / "one", "user.x", b"1"),
    lambda m: os.utime(m / "one", (1, 1)),
], ids=["write", "append", "create", "mkdir", "unlink", "rmdir", "rename", "chmod", "truncate",
        "symlink", "link", "setxattr", "utime"])
def test_writes_get_erofs(tree, mounter, operation):
    mount = mounter(tree)
    with pytest.raises(OSError) as info:
        operation(mount.mountpoint)
    assert info.value.errno == errno.EROFS
    assert (tree / "one").read_bytes() == b"x"


def test_vanished_and_unreadable_files_do_not_take_the_mount_down(tmp_path, mounter):
    src = tmp_path / "src"
    write_file(src / "gone", 1000, seed=1)
    write_file(src / "secret", 1000, seed=2)
    write_file(src / "fine", 1000, seed=3)
    os.chmod(src / "secret", 0)
    # as root the daemon would read a mode-000 file; without the DAC capabilities it cannot
    mount = mounter(src, "--metadata-ttl", "0", prefix=[
        "setpriv", "--inh-caps=-dac_override,-dac_read_search",
        "--bounding-set=-dac_override,-dac_read_search"])
    mnt = mount.mountpoint
    assert sorted(os.listdir(mnt)) == ["fine", "gone", "secret"]
    os.unlink(src / "gone")
    with pytest.raises(OSError) as info:
        (mnt / "gone").read_bytes()
    assert info.value.errno == errno.ENOENT
    with pytest.raises(OSError) as info:
        (mnt / "secret").read_bytes()
    assert info.value.errno in (errno.EACCES, errno.EIO)
    assert (mnt / "fine").read_bytes() == (src / "fine").read_bytes()
    assert mount.process.poll() is None


# The daemon, with listing the source's root failing with EIO while the file SOURCE.broken
# exists: a source whose root errors (a failing disk, a network file system's outage).
FAILING_ROOT = """
import errno, os, runpy, sys
args = sys.argv[sys.argv.index('cachefs') + 1:]
root = os.path.realpath(args[2])  # mount --foreground SOURCE ...
real_scandir = os.scandir
def scandir(path='.'):
    where = os.readlink(f'/proc/self/fd/{path}') if isinstance(path, int) else os.fsdecode(path)
    if os.path.realpath(where) == root and os.path.exists(root + '.broken'):
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)
    return real_scandir(path)
os.scandir = scandir
sys.argv = ['cachefs', *args]
runpy.run_module('cachefs', run_name='__main__')
"""


def test_a_source_that_cannot_be_scanned_at_start_keeps_the_mount(tmp_path, mounter):
    """Issue 15, item 4: the start-up scan of the source ended the mount when the source's
    root could not be listed. The root's listing gets EIO and the daemon says why; once the
    source answers again, the mount serves it and an order can be published."""
    from cachefs.publish import publish
    from cachefs.errors import OrderError

    src = tmp_path / "src"
    write_file(src / "d" / "f", 1000, seed=1)
    broken = tmp_path / "src.broken"
    broken.touch()
    mount = mounter(src, prefix=[sys.executable, "-c", FAILING_ROOT, "--"])
    deadline = time.monotonic() + 10
    while "cannot scan the source" not in mount.log():
        assert time.monotonic() < deadline and mount.process.poll() is None, mount.log()
        time.sleep(0.05)
    with pytest.raises(OSError) as info:
        os.listdir(mount.mountpoint)
    assert info.value.errno == errno.EIO
    with pytest.raises(OrderError, match="the source cannot be listed: Input/output error"):
        publish(mount.mountpoint, 1, [0])
    assert (mount.mountpoint / "d" / "f").read_bytes() == (src / "d" / "f").read_bytes()
    broken.unlink()
    assert os.listdir(mount.mountpoint) == ["d"]
    assert publish(mount.mountpoint, 2, [0])["epoch"] == 2  # scanned again, now whole
    assert mount.process.poll() is None


def test_changed_source_file_is_served_new(tmp_path, mounter):
    src = tmp_path / "src"
    write_file(src / "f", 5000, seed=1)
    mount = mounter(src, "--metadata-ttl", "0")
    assert (mount.mountpoint / "f").read_bytes() == (src / "f").read_bytes()
    write_file(src / "f", 5000, seed=2)  # same size, new bytes
    os.utime(src / "f", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert (mount.mountpoint / "f").read_bytes() == (src / "f").read_bytes()


def test_sigterm_unmounts_and_exits_zero(tree, mounter):
    mount = mounter(tree)
    mount.process.send_signal(signal.SIGTERM)
    assert mount.process.wait(timeout=15) == 0
    assert not mount.mounted


def test_a_detach_that_leaves_the_session_unmounts(tree, mounter):
    """The unmount the daemon makes when a page cache thread is still in a FUSE call at the
    end (cachefs/mount.py `_detach_leaving_session`: the session is not freed under it)
    takes the mount away, and the daemon then exits as after any unmount."""
    from cachefs.mount import _detach_leaving_session

    mount = mounter(tree)
    _detach_leaving_session(mount.mountpoint)
    assert not mount.mounted
    assert mount.process.wait(timeout=15) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_unmounts_while_a_source_call_hangs(tree, mounter, signum):
    """A read waits on a source that does not answer (here each source call sleeps 60 s):
    SIGTERM, and SIGHUP (the terminal of `cachefs mount -f` closed), unmount and end the
    daemon at once. The daemon waited for the source call, and SIGHUP killed it, leaving a
    dead mount."""
    mount = mounter(tree, "--source-delay-ms", 60_000)
    reader = subprocess.Popen([sys.executable, "-c", f"open({str(mount.mountpoint / 'one')!r}, "
                               f"'rb').read()"], stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # the READ waits in the source call
        assert reader.poll() is None
        mount.process.send_signal(signum)
        assert mount.process.wait(timeout=15) == 0
        wait_for(lambda: not mount.mounted)
    finally:
        reader.kill()
        reader.wait()


def test_kill_9_then_umount_recovers_the_mountpoint(tree, mounter):
    mount = mounter(tree)
    mount.process.kill()
    mount.process.wait()
    assert mount.mounted  # the kernel mount outlives the daemon
    # the commands that talk to the daemon say so, with exit 1 (click's check that the path
    # exists failed first on the dead mount: "does not exist", the usage code 2)
    for command in (["stats"], ["publish", "--epoch", "0", "--seed", "1"], ["warm"]):
        done = run_cachefs(command[0], mount.mountpoint, *command[1:])
        assert done.returncode == 1, (command, done.stderr)
        assert "the cachefs daemon is not running" in done.stderr, (command, done.stderr)
    done = run_cachefs("umount", mount.mountpoint, "--state-dir", mount.state_dir)
    assert done.returncode == 0, done.stderr
    assert not mount.mounted
    assert os.listdir(mount.mountpoint) == []


def test_umount_does_not_wait_for_a_killed_daemon_nobody_reaped(tree, mounter):
    """A daemon killed but not yet reaped by its parent (a zombie: here the test's own child;
    in a container, a daemon under a PID 1 that reaps nothing) has exited and closed its tiers:
    `cachefs umount` returns at once instead of waiting out its 20 s for it."""
    from cachefs.cli import UMOUNT_WAIT_S

    mount = mounter(tree)
    mount.process.kill()  # no wait(): the daemon stays a zombie
    deadline = time.monotonic() + 10
    while Path(f"/proc/{mount.process.pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started_s = time.monotonic()
    done = run_cachefs("umount", mount.mountpoint, "--state-dir", mount.state_dir)
    assert done.returncode == 0, done.stderr
    assert not mount.mounted
    assert time.monotonic() - started_s < UMOUNT_WAIT_S / 2


# a process whose main thread ends (pthread_exit) while another thread lives on: /proc shows
# its leader a zombie, as for a daemon killed while one of its threads waits in the kernel
LEADER_GONE = ("import ctypes, threading, time; "
               "threading.Thread(target=time.sleep, args=(3,)).start(); "
               "ctypes.CDLL(None).pthread_exit(None)")


def test_a_daemon_whose_main_thread_is_gone_is_killed_but_has_not_exited():
    from cachefs.client import daemon_killed, process_exited

    process = subprocess.Popen([sys.executable, "-c", LEADER_GONE])
    try:
        deadline = time.monotonic() + 10
        while not daemon_killed(process.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not process_exited(process.pid)  # its other thread still runs
    finally:
        process.kill()
        process.wait()
    assert daemon_killed(process.pid) and process_exited(process.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may abort a FUSE connection")
def test_umount_aborts_the_connection_of_a_killed_daemon_with_a_thread_left(tree, mounter):
    """`cachefs umount` of a mount whose daemon's main thread is gone while a thread of it
    waits in the kernel (here a stand-in process in the pid file) aborts the mount's FUSE
    connection: requests then fail with ENOTCONN instead of hanging, and the mount goes."""
    mount = mounter(tree)
    stand_in = subprocess.Popen([sys.executable, "-c", LEADER_GONE])
    pid_file = mount.state_dir / "pid"
    try:
        pid_file.write_text(json.dumps({"pid": stand_in.pid,
                                        "mountpoint": str(mount.mountpoint)}))
        from cachefs.client import daemon_killed
        deadline = time.monotonic() + 10
        while not daemon_killed(stand_in.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # a file held open: a lazy unmount alone would leave the daemon serving it
        fd = os.open(mount.mountpoint / "with space.bin", os.O_RDONLY)
        try:
            done = run_cachefs("umount", mount.mountpoint, "--state-dir", mount.state_dir)
            assert done.returncode == 0, done.stderr
            assert not mount.mounted
            with pytest.raises(OSError) as raised:
                os.pread(fd, 10, 0)
            assert raised.value.errno == errno.ENOTCONN
        finally:
            os.close(fd)
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may abort a FUSE connection")
def test_umount_aborts_the_connection_when_fusermount_does_not_return(tree, mounter, tmp_path):
    """A fusermount3 that does not return (in the kernel, the teardown of a mount whose FUSE
    connection nobody answers; here a stand-in that sleeps) has the mount's connection aborted
    after FUSERMOUNT_WAIT_S, and `cachefs umount` fails in bounded time with exit 1, naming it,
    instead of hanging; requests to the mount then fail with ENOTCONN, and a second `cachefs
    umount` removes it."""
    from cachefs.client import FUSERMOUNT_WAIT_S

    mount = mounter(tree)
    stuck = tmp_path / "bin"
    stuck.mkdir()
    (stuck / "fusermount3").write_text("#!/bin/sh\nexec sleep 600\n")
    (stuck / "fusermount3").chmod(0o755)
    fd = os.open(mount.mountpoint / "with space.bin", os.O_RDONLY)
    try:
        started_s = time.monotonic()
        done = run_cachefs("umount", mount.mountpoint, "--state-dir", mount.state_dir,
                           env={**os.environ, "PATH": f"{stuck}:{os.environ['PATH']}"})
        assert time.monotonic() - started_s < 2 * FUSERMOUNT_WAIT_S + 10
        assert done.returncode == 1
        assert "fusermount3 (pid" in done.stderr and "has not returned" in done.stderr
        assert "the mount's FUSE connection aborted" in done.stderr
        os.kill(int(done.stderr.split("(pid ")[1].split(")")[0]), signal.SIGKILL)
        with pytest.raises(OSError) as raised:
            os.pread(fd, 10, 0)
        assert raised.value.errno == errno.ENOTCONN
    finally:
        os.close(fd)
    done = run_cachefs("umount", mount.mountpoint, "--state-dir", mount.state_dir)
    assert done.returncode == 0, done.stderr
    assert not mount.mounted


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may set a device's read-ahead")
def test_the_mount_reads_ahead_one_mebibyte(tree, mounter):
    """man/cachefs-mount.1: run as root, the daemon sets the mount's kernel read-ahead to
    1 MiB, after the kernel has applied its own at FUSE_INIT."""
    from cachefs.mountinfo import mountinfo

    mount = mounter(tree)
    assert (mount.mountpoint / "one").read_bytes() == b"x"
    target = os.fsencode(mount.mountpoint)
    device = [m.device for m in mountinfo() if m.point == target][-1]
    read_ahead = Path(f"/sys/class/bdi/{device}/read_ahead_kb")
    deadline = time.monotonic() + 10
    while read_ahead.read_text().strip() != "1024":
        assert time.monotonic() < deadline, read_ahead.read_text()
        time.sleep(0.05)


def test_daemon_mode_returns_when_mounted(tree, tmp_path):
    """... with its log readable by its user alone: the log names source files, which other
    users of the mount may not be allowed to list (it was readable by all, in a state
    directory readable by all), and one planted there by another user (a FIFO blocked the
    mount, a file of theirs got the log) is refused."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / "daemon.log")
    try:
        done = run_cachefs("mount", tree, mnt, "--state-dir", state)
    finally:
        (state / "daemon.log").unlink()  # or the check of the test's logs would wait on it
    assert done.returncode == 1 and f"daemon's log {state / 'daemon.log'}" in done.stderr
    (state / "daemon.log").write_bytes(b"")
    os.chown(state / "daemon.log", 65534, 65534)  # root runs the tests
    done = run_cachefs("mount", tree, mnt, "--state-dir", state)
    assert done.returncode == 1 and "is not a file of this user's" in done.stderr
    (state / "daemon.log").unlink()
    (state / "daemon.log").write_bytes(b"an earlier version's log\n")
    (state / "daemon.log").chmod(0o644)
    try:
        done = run_cachefs("mount", tree, mnt, "--state-dir", state)
        assert done.returncode == 0, done.stderr
        assert str(mnt) in mounted_paths()
        assert (mnt / "one").read_bytes() == b"x"
        assert (state / "daemon.log").stat().st_mode & 0o777 == 0o600
        done = run_cachefs("umount", mnt, "--state-dir", state)
        assert done.returncode == 0, done.stderr
        assert str(mnt) not in mounted_paths()
        assert not (state / "pid").exists()  # the daemon exited
    finally:
        if str(mnt) in mounted_paths():
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)])


def test_a_mount_point_named_through_links_mounts_and_unmounts(tree, tmp_path):
    """The mount table lists real paths: a mount point named through a linked directory, or
    that is a link itself, was 'not mounted' to umount, and mount waited its whole timeout
    for a mount that had come up, then took it down."""
    (tmp_path / "real").mkdir()
    mnt = tmp_path / "real" / "mnt"
    mnt.mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "mnt-link").symlink_to(mnt)
    state = tmp_path / "state"
    try:
        for name in (tmp_path / "linked" / "mnt", tmp_path / "mnt-link"):
            done = run_cachefs("mount", tree, name, "--state-dir", state)
            assert done.returncode == 0, done.stderr
            assert str(mnt) in mounted_paths() and (mnt / "one").read_bytes() == b"x"
            done = run_cachefs("umount", name, "--state-dir", state)
            assert done.returncode == 0, done.stderr
            assert str(mnt) not in mounted_paths()
    finally:
        if str(mnt) in mounted_paths():
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)])


def test_startup_errors_have_documented_exit_codes(tree, tmp_path, mounter):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = run_cachefs("mount", tmp_path / "nope", mnt, "--foreground")
    assert done.returncode == 3
    assert "source" in done.stderr and "does not exist" in done.stderr
    (tmp_path / "file").write_text("x")
    done = run_cachefs("mount", tmp_path / "file", mnt, "--foreground")
    assert done.returncode == 3 and "is not a directory" in done.stderr
    done = run_cachefs("mount", tree, tmp_path / "nomnt", "--foreground")
    assert done.returncode == 4 and "mount point" in done.stderr
    mount = mounter(tree)
    done = run_cachefs("mount", tree, mount.mountpoint, "--foreground")
    assert done.returncode == 5 and "already a mount point" in done.stderr
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"))
    (tmp_path / "empty-bin").mkdir()
    done = subprocess.run([sys.executable, "-m", "cachefs", "mount", str(tree), str(mnt),
                           "--foreground"], capture_output=True, text=True, env=env)
    assert done.returncode == 6 and "fusermount3" in done.stderr
    done = run_cachefs("mount", tree, mnt, "--ram-cache", "lots")
    assert done.returncode == 2 and "not a size" in done.stderr
    done = run_cachefs("mount", tree, mnt, "--ram-cache", "9" * 40)  # a float's inf: a traceback
    assert done.returncode == 2 and "size too large" in done.stderr
    done = run_cachefs("umount", mnt)
    assert done.returncode == 1 and "not mounted" in done.stderr


def test_the_source_scan_counts_the_files_under_a_directory(tmp_path):
    """SourceManifest.files_in, which decides whether a directory is small enough to list for
    the read-ahead's stores (pagecache.py): the files under it, its subdirectories' included,
    and no others (a sibling whose name extends it, or sorts right after its slash); None
    before the scan."""
    from cachefs.mount import SourceManifest

    for relpath in ["a/1", "a/2", "a/sub/3", "a.b/4", "a0/5", "ab/6", "top"]:
        write_file(tmp_path / relpath, 1)
    manifest = SourceManifest(tmp_path)
    assert manifest.files_in(b"a") is None
    manifest.get()
    assert manifest.files_in(b"a") == 3
    assert manifest.files_in(b"a/sub") == 1
    assert manifest.files_in(b"ab") == 1 and manifest.files_in(b"a0") == 1
    assert manifest.files_in(b"missing") == 0
    assert manifest.files_in(b"") == 7


def test_umount_leaves_a_mount_of_another_file_system_alone(tmp_path):
    """`cachefs umount` of a path where something else is mounted (the source typed for the
    mount point): as root, fusermount3 unmounts any mount, and the lazy fallback would
    detach a busy one. Refused with exit 1, the mount still there."""
    point = tmp_path / "other"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], check=True)
    try:
        done = run_cachefs("umount", point)
        assert done.returncode == 1, done.stderr
        assert "is not a cachefs mount (a tmpfs mount)" in done.stderr
        assert str(point) in mounted_paths()
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_an_order_directory_every_user_may_write_is_refused(tree, tmp_path):
    """Publishing is writing a file in the order file's directory: one that every user may
    write (as /tmp) would let any of them steer this mount."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = run_cachefs("mount", tree, mnt, "--foreground", "--order-file", shared / "order.npz")
    assert done.returncode == 1
    assert "is writable by every user" in done.stderr and str(shared) in done.stderr
    assert str(mnt) not in mounted_paths()


def test_a_state_directory_another_user_could_replace_is_refused(tree, tmp_path):
    """The daemon (often root) writes its pid file and log in the state directory and reads
    orders there: one another user owns, or whose parent another user may write to (not
    sticky), could be swapped for theirs, with links where the daemon writes. Refused before
    anything is written there."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    done = run_cachefs("mount", tree, mnt, "--state-dir", open_parent / "state")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "which other users may write to" in done.stderr
    assert not (open_parent / "state" / "daemon.log").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # root runs the tests
    done = run_cachefs("mount", tree, mnt, "--state-dir", theirs)
    assert done.returncode == 1 and "belongs to user 65534" in done.stderr
    assert str(mnt) not in mounted_paths()


def test_the_daemons_log_and_pid_file_are_never_written_through_a_link(tree, tmp_path):
    """A link planted where the daemon writes its log (a state directory shared with the
    mount's users) is not followed: the mount fails, saying why, and the file the link names
    is left as it was. One planted as its pid file is replaced by the pid file, and the file
    it names is left as it was too."""
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (state / "daemon.log").symlink_to(victim)
    done = run_cachefs("mount", tree, mnt, "--state-dir", state)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cannot write the daemon's log" in done.stderr
    (state / "daemon.log").unlink()
    (state / "pid").symlink_to(victim)
    done = run_cachefs("mount", tree, mnt, "--state-dir", state)
    try:
        assert done.returncode == 0, done.stderr
        pid_file = os.lstat(state / "pid")
        assert stat.S_ISREG(pid_file.st_mode) and pid_file.st_mode & 0o777 == 0o644
        assert victim.read_bytes() == b"keep me"
    finally:
        run_cachefs("umount", mnt, "--state-dir", state)
    assert str(mnt) not in mounted_paths()


def test_a_fifo_planted_as_the_pid_file_holds_neither_mount_nor_umount(tree, tmp_path):
    """A FIFO where the daemon writes its pid file held the mount's start until someone read
    it, and one where `cachefs umount` reads it held the umount forever: the mount replaces
    it, and the umount reads no pid from it and unmounts."""
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    state.mkdir()
    os.mkfifo(state / "pid")
    done = run_cachefs("mount", tree, mnt, "--state-dir", state)
    assert done.returncode == 0, done.stderr
    try:
        assert stat.S_ISREG(os.lstat(state / "pid").st_mode)
        (state / "pid").unlink()
        os.mkfifo(state / "pid")
    finally:
        done = run_cachefs("umount", mnt, "--state-dir", state)
    assert done.returncode == 0, done.stderr
    assert str(mnt) not in mounted_paths()


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns a file to another user")
def test_the_pid_file_is_read_only_from_a_regular_file_of_a_trusted_owner(tmp_path,
                                                                          monkeypatch):
    """`cachefs umount` reads the pid file (state_dir.read_own_file) if it is a regular file:
    root reads one of any user's (it unmounts their mounts), another user only one of their
    own or root's; a FIFO is refused at once, never waited on."""
    from cachefs import state_dir

    pid_file = tmp_path / "pid"
    pid_file.write_text('{"pid": 7}')
    os.chown(pid_file, 65534, 65534)
    assert state_dir.read_own_file(pid_file, 4096) == b'{"pid": 7}'  # root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(OSError):
        state_dir.read_own_file(pid_file, 4096)
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    assert state_dir.read_own_file(pid_file, 4096) == b'{"pid": 7}'
    pid_file.unlink()
    os.mkfifo(pid_file)
    with pytest.raises(OSError):
        state_dir.read_own_file(pid_file, 4096)


def test_a_mount_under_umask_000_makes_a_state_directory_it_accepts(tree, tmp_path):
    """Under umask 000 (some containers and batch jobs) the state directory a mount made was
    writable by every user, and the mount then refused it as its order directory."""
    mnt, state = tmp_path / "mnt", tmp_path / "new" / "state"
    mnt.mkdir()
    done = run_cachefs("mount", tree, mnt, "--state-dir", state,
                       preexec_fn=lambda: os.umask(0))
    try:
        assert done.returncode == 0, done.stderr
        assert state.stat().st_mode & 0o777 == 0o755
        assert state.parent.stat().st_mode & 0o777 == 0o755  # made with it, so too
        assert (mnt / "with space.bin").read_bytes() == (tree / "with space.bin").read_bytes()
    finally:
        run_cachefs("umount", mnt)
    assert str(mnt) not in mounted_paths()


def test_two_mounts_cannot_share_a_state_directory(tree, tmp_path, mounter):
    """Two mounts on one state directory watched one order file (a publication to one
    steered the other) and overwrote each other's pid file."""
    mount = mounter(tree)
    other = tmp_path / "other"
    other.mkdir()
    done = run_cachefs("mount", tree, other, "--foreground", "--state-dir", mount.state_dir)
    assert done.returncode == 1
    assert "is in use by another cachefs mount" in done.stderr
    assert str(other) not in mounted_paths()
    assert mount.stats()["order"] is None  # the first mount serves on


def test_a_directory_read_part_way_is_not_shifted_by_anothers_relisting(tmp_path, mounter):
    """A reader part-way through a large directory, while another process opens it after
    the metadata TTL and files are added at its start: the reader's offsets indexed the new
    listing, and it saw unchanged entries twice. Each handle keeps its own listing."""
    src = tmp_path / "src"
    names = [f"m{i:05d}" for i in range(3000)]
    for name in names:
        write_file(src / "d" / name, 1)
    mount = mounter(src, "--metadata-ttl", "0.2")
    fd = os.open(mount.mountpoint / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = []
        with os.scandir(fd) as first:
            for entry in first:
                seen.append(entry.name)
                if len(seen) == 100:  # a kernel buffer or more in
                    for i in range(200):
                        write_file(src / "d" / f"a{i:05d}", 1)  # sorted before every name
                    time.sleep(0.4)  # past the TTL
                    assert len(os.listdir(mount.mountpoint / "d")) == 3200  # relisted
        assert len(seen) == len(set(seen)), "entries repeated"
        assert sorted(name for name in seen if name.startswith("m")) == names
    finally:
        os.close(fd)


def test_a_directory_handle_rewound_past_the_ttl_lists_the_directory_anew(tmp_path, mounter):
    """A handle keeps its listing (above), but a rewind (rewinddir, which os.listdir of a
    descriptor does at its end) reads the directory as it is then: a handle held open for
    long saw a file added since never."""
    src = tmp_path / "src"
    write_file(src / "d" / "old", 1)
    mount = mounter(src, "--metadata-ttl", "0.2")
    fd = os.open(mount.mountpoint / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(fd) == ["old"]
        write_file(src / "d" / "new", 1)
        time.sleep(0.4)  # past the TTL
        assert sorted(os.listdir(fd)) == ["new", "old"]  # the same handle, rewound
    finally:
        os.close(fd)


def test_one_directory_may_be_both_the_state_and_the_ssd_cache(tree, tmp_path, mounter):
    """The state directory's lock and the SSD tier's were one file ("lock") in a directory
    given as both, and the tier's flock failed in the daemon itself (exit 7)."""
    mount = mounter(tree, "--ssd-cache", tmp_path / "state0", "--ssd-size", "1MiB")
    assert mount.stats()["ssd"]["budget"] == 1 << 20


def test_closes_by_handle_reach_the_trio_thread_without_the_watcher_waiting_for_it():
    """The close watcher's thread hands a batch of closes by file handle over at once, even
    while the trio thread is busy, so that it goes back to the kernel's queue, where fanotify
    merges a file's waiting closes into one (a close lost from the stats); a batch with fds
    waits until it is accounted, as its fds pin the inodes until then."""
    import threading

    import trio

    from cachefs.fanotify import close_delivery

    accounted: list[list[int]] = []

    async def main():
        token = trio.lowlevel.current_trio_token()
        handed = {by_handle: threading.Event() for by_handle in (True, False)}

        def watcher(by_handle: bool, inodes: list[int]) -> None:
            close_delivery(token, accounted.append, by_handle=by_handle)(inodes)
            handed[by_handle].set()

        by_handle = threading.Thread(target=watcher, args=(True, [1, 2]))
        by_handle.start()
        # the trio thread is busy (this blocks it): the hand-over does not wait for it
        assert handed[True].wait(10)
        assert accounted == []
        with_fds = threading.Thread(target=watcher, args=(False, [3]))
        with_fds.start()
        time.sleep(0.3)  # busy still: this one waits
        assert not handed[False].is_set()
        await trio.to_thread.run_sync(handed[False].wait, 10)
        by_handle.join()
        with_fds.join()

    trio.run(main)
    assert accounted == [[1, 2], [3]]


@pytest.mark.skipif(os.geteuid() != 0, reason="fanotify needs CAP_SYS_ADMIN")
def test_a_flush_hands_over_the_closes_queued_before_it(tmp_path, monkeypatch):
    """`CloseWatcher.flushed` (awaited before a new order goes in force) returns once the
    closes the kernel queued before it are counted, without waiting for the end of the
    watcher's wait between two batches: a close of the last epoch's file counted after the
    next epoch's order was taken as a read of that file's place in it."""
    import trio

    from cachefs import fanotify

    monkeypatch.setattr(fanotify, "GATHER_S", 5.0)  # a long wait between batches
    monkeypatch.setattr(fanotify, "FLUSH_WAIT_S", 30.0)  # not a bar of speed: a loaded machine
    paths = [tmp_path / f"f{i}" for i in range(21)]
    for path in paths:
        path.write_bytes(b"x")
    # with an fd per event: a handle group's events carry ext4's handles, not FUSE's, which
    # the watcher does not read (fanotify.py); this marks the whole mount tmp_path is on
    fd, marker = fanotify.open_close_events(os.fsencode(tmp_path), by_handle=False)
    counted: list[int] = []

    async def main():
        token = trio.lowlevel.current_trio_token()
        watcher = fanotify.CloseWatcher(fd, marker, fanotify.close_delivery(
            token, counted.extend, by_handle=marker is not None))
        watcher.start()
        try:
            paths[0].read_bytes()
            with trio.fail_after(10):
                while os.stat(paths[0]).st_ino not in counted:
                    await trio.sleep(0.01)
            # the thread now waits 5 s before its next batch; these closes queue
            for path in paths[1:]:
                path.read_bytes()
            with trio.fail_after(10):
                assert await watcher.flushed()
            assert {os.stat(path).st_ino for path in paths} <= set(counted)
        finally:
            await trio.to_thread.run_sync(watcher.stop)

    trio.run(main)


def test_the_start_up_heap_is_frozen_and_cycles_made_later_are_still_collected():
    """cachefs/heap.py: what exists when the mount is built is left out of every later
    collection, young collections are rarer, and the collector still frees a cycle made
    afterwards by itself, once enough allocations have come (run in a process of its own:
    freezing is for the life of the process)."""
    code = (
        "import gc, weakref\n"
        "from cachefs import heap\n"
        "unfrozen = len(gc.get_objects())\n"
        "heap.settle()\n"
        "print(gc.get_freeze_count() >= unfrozen // 2, len(gc.get_objects()) < 1000,\n"
        "      gc.get_threshold()[0] == heap.YOUNG_OBJECTS)\n"
        "class Node: pass\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a\n"
        "gone = weakref.ref(a)\n"
        "del a, b\n"
        "kept = []\n"
        "for _ in range(heap.YOUNG_OBJECTS // 2):\n"
        "    kept.append([])\n"
        "print(gone() is not None)\n"
        "for _ in range(2 * heap.YOUNG_OBJECTS):\n"
        "    kept.append([])\n"
        "print(gone() is None)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    settled, before_young, after_young = done.stdout.splitlines()
    assert settled == "True True True"  # most of the heap frozen, the threshold set
    assert before_young == "True"  # no collection after 700 allocations, as before
    assert after_young == "True"  # the collector ran on its own and freed the cycle
