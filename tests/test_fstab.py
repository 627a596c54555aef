"""Mounting as system tools do: `mount -t fuse.cachefs`, an fstab line, `mount -t cachefs`,
`umount`, and a systemd Type=notify service (`cachefs mount --systemd`).

mount(8) runs mount.fuse3, which runs `cachefs SRC MNT -o OPTS` through /bin/sh with PATH
removed from the environment (cachefs/mount_helper.py): the shell searches its default path.
A `pip install` as root puts the console script in /usr/local/bin, on that path; a virtual
environment's is not, so `cachefs_on_mount_path` links this environment's console script into
the first directory of the shell's default path for the test (and removes the link after),
unless the shell already finds that script. The daemon started that way keeps the test's
PYTHONPATH (mount(8) does not remove it), so it runs this checkout.

`cachefs mount --systemd` is checked against a datagram socket the test binds as systemd
would, with NOTIFY_SOCKET naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from cachefs.client import process_exited
from cachefs.mountinfo import mountinfo
from conftest import make_flat_dataset, mounted_paths, run_cachefs

MIB = 1 << 20
EXIT_WAIT_S = 20.0

needs_root_and_mount = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None or shutil.which("mount.fuse3") is None,
    reason="mount(8) of a FUSE type needs root, util-linux's mount and fuse3's mount.fuse3")


def console_script(name: str) -> Path | None:
    """The console script `name` of the environment running the tests, if installed."""
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = Path(directory) / name
        if path.is_file():
            return path
    return None


def shell_default_path() -> list[str]:
    """The directories /bin/sh searches when PATH is unset, as under mount.fuse3."""
    done = subprocess.run(["env", "-i", "/bin/sh", "-c", 'echo "$PATH"'], capture_output=True,
                          text=True, check=True)
    return [d for d in done.stdout.strip().split(":") if d]


def linked_into(directory: Path, script: Path):
    """Make `directory/script.name` run `script` for the test's duration; a file of that name
    already there that is not `script` skips the test (it is not ours to replace)."""
    link = directory / script.name
    if os.path.lexists(link):
        if os.path.realpath(link) == os.path.realpath(script):
            yield
            return
        pytest.skip(f"{link} exists and is not this environment's {script.name}")
    link.symlink_to(script)
    try:
        yield
    finally:
        link.unlink()


@pytest.fixture
def cachefs_on_mount_path():
    """`cachefs` as mount.fuse3's /bin/sh finds it: this environment's console script."""
    script = console_script("cachefs")
    if script is None:
        pytest.skip("the cachefs console script is not installed (pip install -e .)")
    found = subprocess.run(["env", "-i", "/bin/sh", "-c", "command -v cachefs"],
                           capture_output=True, text=True).stdout.strip()
    if found and os.path.realpath(found) == os.path.realpath(script):
        yield
        return
    yield from linked_into(Path(shell_default_path()[0]), script)


@pytest.fixture
def mount_cachefs_helper():
    """/sbin/mount.cachefs, mount(8)'s helper for `mount -t cachefs`: this environment's
    `mount.cachefs` console script, linked there for the test."""
    script = console_script("mount.cachefs")
    if script is None:
        pytest.skip("the mount.cachefs console script is not installed (pip install -e .)")
    yield from linked_into(Path("/sbin"), script)


@pytest.fixture
def system_mounts():
    """Mount points mounted with mount(8) by a test: unmounted at the end if still there."""
    points: list[Path] = []
    yield points
    for point in points:
        if str(point) in mounted_paths():
            subprocess.run(["umount", str(point)], capture_output=True)
        if str(point) in mounted_paths():
            subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)


@pytest.fixture
def dataset(tmp_path) -> tuple[Path, list[str]]:
    src = tmp_path / "src"
    return src, make_flat_dataset(src, 20, 100_000)


def run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120,
                          **kwargs)


def daemon_pid(state: Path) -> int:
    return json.loads((state / "pid").read_text())["pid"]


def mount_options(mnt: Path) -> list[str]:
    """The mount's options (its flags, then the file system's), as /proc/self/mountinfo lists
    them."""
    for mount in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = mount.split()
        if fields[4] == str(mnt):  # no spaces in these test paths: nothing escaped
            return fields[5].split(",") + fields[fields.index("-") + 3].split(",")
    raise AssertionError(f"{mnt} is not mounted")


def process_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not process_exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def check_served_then_umount(src: Path, relpaths: list[str], mnt: Path,
                             ram_bytes: int) -> None:
    """The mount is a cachefs mount with the given RAM budget, serves the source's bytes, and
    `umount` takes it down and ends its daemon."""
    from cachefs import ctrl

    assert str(mnt) in mounted_paths()
    fstypes = [m.fstype for m in mountinfo() if m.point == os.fsencode(mnt)]
    assert fstypes == [b"fuse.cachefs"]
    for relpath in relpaths:
        assert (mnt / relpath).read_bytes() == (src / relpath).read_bytes(), relpath
    stats = ctrl.read_stats(mnt)
    assert stats["ram"]["budget"] == ram_bytes
    pid, state = stats["mount"]["pid"], Path(stats["order_file"]).parent
    assert daemon_pid(state) == pid
    done = run("umount", mnt)
    assert done.returncode == 0, done.stderr
    assert str(mnt) not in mounted_paths()
    assert process_gone(pid, EXIT_WAIT_S), "the daemon did not exit after umount"
    assert not (state / "pid").exists()  # it ended normally
    assert "unmounted" in (state / "daemon.log").read_text()


@needs_root_and_mount
def test_mount_t_fuse_cachefs_serves_and_umount_ends_the_daemon(
        dataset, tmp_path, cachefs_on_mount_path, system_mounts):
    """The issue's command as it stands; the default state directory follows
    XDG_RUNTIME_DIR, which mount(8) passes on, so the daemon's log lands under tmp_path."""
    src, relpaths = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    system_mounts.append(mnt)
    done = run("mount", "-t", "fuse.cachefs", src, mnt, "-o", "ram_cache=64MiB",
               env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    # mount.fuse3 appended dev,suid; dropped: a cachefs mount is read-only, nosuid, nodev
    assert {"ro", "nosuid", "nodev"} <= set(mount_options(mnt))
    check_served_then_umount(src, relpaths, mnt, 64 * MIB)
    assert (tmp_path / "cachefs").is_dir()


@needs_root_and_mount
def test_an_fstab_line_with_fstab_only_options_mounts(dataset, tmp_path, cachefs_on_mount_path,
                                                       system_mounts):
    """The README's fstab line (here in a file of its own: `mount -T FILE MNT`), with the
    options that mean something only to mount(8), systemd or the kernel's flags."""
    src, relpaths = dataset
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    system_mounts.append(mnt)
    options = ("defaults,noauto,nofail,_netdev,users,noatime,noexec,nodev,nosuid,"
               "x-systemd.automount,x-systemd.requires-mounts-for=/tmp,comment=cachefs,"
               f"ram-cache=32MiB,block_size=1MiB,allow_other,state_dir={state}")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# a comment\n{src}  {mnt}  fuse.cachefs  {options}  0  0\n")
    done = run("mount", "-T", fstab, mnt)
    assert done.returncode == 0, done.stderr
    assert "allow_other" in mount_options(mnt)
    check_served_then_umount(src, relpaths, mnt, 32 * MIB)
    assert (state / "daemon.log").is_file()


@needs_root_and_mount
def test_the_helper_form_drops_what_any_mount_version_may_pass(dataset, tmp_path,
                                                               system_mounts):
    """`cachefs SRC MNT -o OPTS` as mount.fuse3 runs it, with every fstab-only option (this
    mount(8) drops x-* and comment= itself; others pass them on)."""
    from cachefs.mount_helper import IGNORED

    src, relpaths = dataset
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    system_mounts.append(mnt)
    options = ",".join([*sorted(IGNORED), "x-systemd.automount", "comment=x",
                        "ram_cache=16MiB", f"state_dir={state}"])
    done = run_cachefs(src, mnt, "-o", options)
    assert done.returncode == 0, done.stderr
    check_served_then_umount(src, relpaths, mnt, 16 * MIB)
    assert (state / "daemon.log").is_file()


@needs_root_and_mount
def test_mount_refuses_an_unknown_option_in_the_terminal(dataset, tmp_path,
                                                         cachefs_on_mount_path, system_mounts):
    src, _ = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    system_mounts.append(mnt)
    done = run("mount", "-t", "fuse.cachefs", src, mnt, "-o", "ram_cache=64MiB,bogus=1")
    assert done.returncode == 2
    assert "cachefs: unknown mount option 'bogus'" in done.stderr
    assert str(mnt) not in mounted_paths()


@needs_root_and_mount
def test_an_error_of_the_daemon_reaches_the_terminal_of_mount(dataset, tmp_path,
                                                              cachefs_on_mount_path,
                                                              system_mounts):
    """The command goes to the background only once the mount exists: a daemon that fails
    first (here, an SSD directory that is a file) is reported to mount(8) with its reason."""
    src, _ = dataset
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    system_mounts.append(mnt)
    (tmp_path / "not-a-dir").write_bytes(b"x")
    done = run("mount", "-t", "fuse.cachefs", src, mnt, "-o",
               f"ssd_cache={tmp_path / 'not-a-dir'},ssd_size=1MiB,state_dir={state}")
    assert done.returncode == 7, done.stderr  # man/cachefs-mount.1: the SSD directory
    assert "mount failed" in done.stderr and "not-a-dir" in done.stderr
    assert str(mnt) not in mounted_paths()
    done = run("mount", "-t", "fuse.cachefs", tmp_path / "nope", mnt, "-o", "ram_cache=1G")
    assert done.returncode == 3 and "does not exist" in done.stderr


@needs_root_and_mount
def test_mount_t_cachefs_runs_the_mount_cachefs_helper(dataset, tmp_path, mount_cachefs_helper,
                                                       system_mounts):
    src, relpaths = dataset
    mnt, state = tmp_path / "mnt", tmp_path / "state"
    mnt.mkdir()
    system_mounts.append(mnt)
    done = run("mount", "-v", "-t", "cachefs", src, mnt, "-o",
               f"ram_cache=48MiB,nofail,state_dir={state}")
    assert done.returncode == 0, done.stderr
    check_served_then_umount(src, relpaths, mnt, 48 * MIB)
    assert (state / "daemon.log").is_file()


# -- systemd, Type=notify ----------------------------------------------------------------------

def receive(sock: socket.socket, timeout_s: float) -> dict[str, str]:
    sock.settimeout(timeout_s)
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


@pytest.mark.parametrize("address", ["path", "abstract"])
def test_systemd_gets_ready_once_the_mount_serves_and_stopping(dataset, tmp_path, mounter,
                                                               monkeypatch, address):
    src, relpaths = dataset
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if address == "path":
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    else:
        name = f"@cachefs-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name[1:])
    with sock:
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        mount = mounter(src, "--systemd")
        ready = receive(sock, 30)
        assert ready["READY"] == "1"
        assert ready["STATUS"] == f"serving {src} at {mount.mountpoint}"
        # the foreground process is the daemon (systemd's main PID)
        assert daemon_pid(mount.state_dir) == mount.process.pid
        assert (mount.mountpoint / relpaths[0]).read_bytes() == (src / relpaths[0]).read_bytes()
        mount.process.send_signal(signal.SIGTERM)  # systemctl stop
        assert receive(sock, 15) == {"STOPPING": "1"}
        assert mount.process.wait(timeout=15) == 0
        assert not mount.mounted


def test_systemd_without_notify_socket_says_so(dataset, mounter, monkeypatch):
    src, relpaths = dataset
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    mount = mounter(src, "--systemd")
    assert (mount.mountpoint / relpaths[0]).read_bytes() == (src / relpaths[0]).read_bytes()
    assert "--systemd: $NOTIFY_SOCKET is not set" in mount.log()
