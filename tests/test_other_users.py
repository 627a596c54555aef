"""Another user on the machine: what a mount made with `-o allow_other` lets them do.

The mounts run as root, as a daemon serving everyone would. The other user is uid 65534,
made with setpriv(1). The CLI needs the test's Python environment, which lives under /root
(mode 0700): where a command runs as that user, it keeps CAP_DAC_READ_SEARCH, so it can read
files, but it writes, and the daemon sees it, as uid 65534 (which is what is tested). Where
reading is what is tested, the command runs with no capability at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import cachefs_cmd, flat_dataset_fixture, mounts_in, release_fifo_readers, \
    write_file

NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
READ_ANYTHING = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
SSD_BYTES = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv(1) to act as another user")


def as_nobody(*args, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`cachefs ARGS` run by uid 65534 (module docstring)."""
    return subprocess.run([*SETPRIV, *READ_ANYTHING, *cachefs_cmd(*args)], capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.fixture
def open_dir():
    """A directory every user can enter (pytest's own tmp_path is root's alone)."""
    directory = Path(tempfile.mkdtemp(prefix="cachefs-test-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def shared_mounter(open_dir, request):
    """mounter(source, *args) -> Mount, like conftest's, with its mount point, state directory
    and log in `open_dir`, where the other user can reach them."""
    yield from mounts_in(open_dir, request)


dataset = flat_dataset_fixture(20, 5000)


def warm(*args, timeout_s: float = 20) -> subprocess.CompletedProcess:
    """`cachefs warm ARGS` run by root, given up after `timeout_s`."""
    return subprocess.run(cachefs_cmd("warm", *args), capture_output=True, text=True,
                          timeout=timeout_s)


def ssd_entries(mount) -> int:
    return mount.stats()["ssd"]["entries"]


def test_only_the_owner_or_root_may_send_commands(dataset, shared_mounter, open_dir):
    src, relpaths = dataset
    mount = shared_mounter(src, "-o", "allow_other", "--ssd-cache", open_dir / "ssd",
                           "--ssd-size", SSD_BYTES)
    listing = open_dir / "list.txt"
    listing.write_text("\n".join(relpaths[:5]) + "\n")
    done = as_nobody("stats", mount.mountpoint)  # reading the mount's state is for everyone
    assert done.returncode == 0, done.stderr
    for args in (["--files", listing], ["--order"], []):
        done = as_nobody("warm", mount.mountpoint, *args)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            f"Error: {mount.mountpoint}: permission denied: only the user who mounted it, or "
            f"root, may send it commands"]
    assert ssd_entries(mount) == 0 and mount.stats()["warm"]["state"] == "idle"
    done = warm(mount.mountpoint, "--files", listing)  # root, the owner
    assert done.returncode == 0, done.stderr
    assert ssd_entries(mount) == 5


def test_a_files_list_must_be_a_small_regular_file_and_is_never_quoted(dataset, mounter,
                                                                       tmp_path):
    src, relpaths = dataset
    mount = mounter(src, "--ssd-cache", tmp_path / "ssd", "--ssd-size", SSD_BYTES)
    # A FIFO: the daemon must not wait for a writer (a worker thread stuck in open() would
    # also hold the unmount). Without the fix, be that writer once the test has failed.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    try:
        done = warm(mount.mountpoint, "--files", fifo)
    except subprocess.TimeoutExpired:
        release_fifo_readers(fifo)
        pytest.fail("warm --files FIFO waited for a writer")
    assert done.returncode == 1 and "is not a regular file" in done.stdout, done
    # a refused line is named by its number: the warm's status is shown to every user
    secret = "SECRET-FIRST-LINE"
    listing = tmp_path / "list.txt"
    listing.write_text(f"{relpaths[0]}\n\n/{secret}\n")
    done = warm(mount.mountpoint, "--files", listing)
    assert done.returncode == 1 and "line 3 is not a path relative to the source" in done.stdout
    stats = json.dumps(mount.stats())
    assert secret not in stats and secret not in done.stdout + done.stderr
    # an endless "file"
    done = warm(mount.mountpoint, "--files", "/dev/zero")
    assert done.returncode == 1 and "/dev/zero is not a regular file" in done.stdout
    assert ssd_entries(mount) == 0 and mount.process.poll() is None


def test_warm_reads_nothing_through_a_link_out_of_the_source(dataset, mounter, tmp_path):
    src, relpaths = dataset
    secret = write_file(tmp_path / "outside" / "secret", 3000, seed=99).read_bytes()
    os.symlink(tmp_path / "outside", src / "etc")
    os.symlink("../../outside/secret", src / "class0" / "link")
    ssd_dir = tmp_path / "ssd"
    mount = mounter(src, "--ssd-cache", ssd_dir, "--ssd-size", SSD_BYTES)
    listing = tmp_path / "list.txt"
    listing.write_text(f"etc/secret\nclass0/link\n{relpaths[0]}\n")
    done = warm(mount.mountpoint, "--files", listing)
    assert done.returncode == 1 and "3/3 files" in done.stdout and "2 unreadable" in done.stdout
    assert ssd_entries(mount) == 1  # relpaths[0] only
    mount.stop()  # the index is written; no entry holds the secret's bytes
    for entry in (ssd_dir / "entries").rglob("*"):
        assert not entry.is_file() or secret[:1000] not in entry.read_bytes()


def test_the_ssd_tier_is_not_readable_by_other_users(dataset, mounter, open_dir):
    src, relpaths = dataset
    (src / relpaths[0]).chmod(0o600)  # a file only root may read
    ssd_dir = open_dir / "ssd"
    mount = mounter(src, "--ssd-cache", ssd_dir, "--ssd-size", SSD_BYTES)
    listing = open_dir / "list.txt"
    listing.write_text(relpaths[0] + "\n")
    assert warm(mount.mountpoint, "--files", listing).returncode == 0
    assert ssd_entries(mount) == 1
    entry = next(path for path in (ssd_dir / "entries").rglob("*") if path.is_file())
    for path in (entry, ssd_dir / "index"):
        done = subprocess.run([*SETPRIV, "cat", str(path)], capture_output=True)
        assert done.returncode != 0 and b"Permission denied" in done.stderr, path
        assert done.stdout == b""
    done = subprocess.run([*SETPRIV, "ls", str(ssd_dir)], capture_output=True)
    assert done.returncode != 0


def test_publish_by_a_user_who_cannot_write_the_order_directory(dataset, shared_mounter):
    src, relpaths = dataset
    mount = shared_mounter(src, "-o", "allow_other")
    deadline = time.monotonic() + 10
    while mount.stats()["manifest"]["files"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    done = as_nobody("publish", mount.mountpoint, "--epoch", 0, "--seed", 0)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in done.stderr
    assert lines[0].endswith(": Permission denied")
    assert str(mount.order_file.parent) in lines[0]
    assert mount.stats()["order"] is None
