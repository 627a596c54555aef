"""Publishing orders to a real mount: the CLI, the Python API, rejection, and stats."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from cachefs import order
from cachefs.errors import OrderError
from cachefs.publish import publish
from conftest import cachefs_cmd, flat_dataset_fixture, run_cachefs, wait_for

N_FILES = 60


dataset = flat_dataset_fixture(N_FILES, 2000)


def test_publish_with_seed_is_accepted_and_reported(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    done = run_cachefs("publish", mount.mountpoint, "--epoch", 2, "--seed", 7)
    assert done.returncode == 0, done.stderr
    assert f"epoch 2: {N_FILES} of {N_FILES} items accepted" in done.stdout
    stats = mount.stats()
    assert stats["order"]["epoch"] == 2
    assert stats["order"]["length"] == N_FILES
    assert stats["order"]["has_next"] is True
    assert stats["order"]["consumed"] == 0 and stats["order"]["cursor"] == 0
    assert stats["manifest"]["files"] == N_FILES
    assert stats["last_rejection"] is None
    text = run_cachefs("stats", mount.mountpoint)
    assert text.returncode == 0 and "order: epoch 2, 0/60 consumed" in text.stdout
    # reading in the published order consumes it
    for index in order.permutation(N_FILES, 7, 2)[:10]:
        assert (mount.mountpoint / relpaths[index]).read_bytes() == \
            (src / relpaths[index]).read_bytes()
    assert wait_for(lambda: mount.stats()["order"]["consumed"] == 10)


def test_publish_from_files_and_rank_slice(dataset, mounter, tmp_path):
    src, relpaths = dataset
    mount = mounter(src)
    current = tmp_path / "cur.txt"
    current.write_text("\n".join(map(str, range(N_FILES - 1, -1, -1))) + "\n")
    np.save(tmp_path / "next.npy", np.arange(N_FILES))
    listing = tmp_path / "files.txt"
    listing.write_text("\n".join(relpaths) + "\n")
    done = run_cachefs("publish", mount.mountpoint, "--epoch", 0, "--current", current,
                       "--next", tmp_path / "next.npy", "--files", listing,
                       "--rank", 1, "--world-size", 4)
    assert done.returncode == 0, done.stderr
    status = mount.stats()["order"]
    assert (status["rank"], status["world_size"]) == (1, 4)
    assert status["length"] == N_FILES // 4 and status["total_length"] == N_FILES


def test_bad_order_file_is_rejected_and_previous_stays(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    publish(mount.mountpoint, 1, order.permutation(N_FILES, 0, 1))
    # a trainer writing garbage directly (no validation on its side)
    tmp = mount.order_file.with_name(".garbage.tmp")
    tmp.write_bytes(b"this is not an npz archive")
    os.replace(tmp, mount.order_file)
    rejection = wait_for(lambda: mount.stats()["last_rejection"])
    assert "npz" in rejection["reason"] or "zip" in rejection["reason"]
    stats = mount.stats()
    assert stats["order"]["epoch"] == 1 and stats["order"]["length"] == N_FILES
    assert (mount.mountpoint / relpaths[0]).read_bytes() == (src / relpaths[0]).read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--current", "{bad_index}"], "out of range"),
    (["--current", "{dup_index}"], "duplicate"),
    (["--current", "{good}", "--next", "{short}"], "length"),
    (["--current", "{good}", "--files", "{missing_file}"], "does not exist under the source"),
    (["--current", "{good}", "--files", "{escaping_file}"], ".."),
    (["--current", "{good}", "--rank", "3", "--world-size", "2"], "rank"),
])
def test_cli_rejects_bad_orders_with_reason(dataset, mounter, tmp_path, args, message):
    src, relpaths = dataset
    mount = mounter(src)
    publish(mount.mountpoint, 5, order.permutation(N_FILES, 0, 5))
    paths = {
        "bad_index": [N_FILES + 3, *range(N_FILES - 1)],
        "dup_index": [0, 0, *range(2, N_FILES)],
        "good": list(range(N_FILES)),
        "short": list(range(N_FILES - 1)),
    }
    for name, values in paths.items():
        (tmp_path / f"{name}.txt").write_text("\n".join(map(str, values)) + "\n")
    (tmp_path / "missing_file.txt").write_text("\n".join(relpaths[:-1] + ["no/such.bin"]))
    (tmp_path / "escaping_file.txt").write_text("\n".join(relpaths[:-1] + ["../x.bin"]))
    argv = [a.format(**{k: tmp_path / f"{k}.txt" for k in (*paths, "missing_file",
                                                           "escaping_file")}) for a in args]
    done = run_cachefs("publish", mount.mountpoint, "--epoch", 6, *argv)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "order rejected:" in done.stderr  # whether the checks or the daemon refused it
    assert mount.stats()["order"]["epoch"] == 5  # the previous order stays in force
    assert (mount.mountpoint / relpaths[1]).read_bytes() == (src / relpaths[1]).read_bytes()


def test_python_publish_raises_the_daemon_reason(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    files = relpaths[:-1] + ["class0/absent.bin"]
    with pytest.raises(OrderError, match="absent.bin"):
        publish(mount.mountpoint, 0, np.arange(N_FILES), files=files)
    assert mount.stats()["last_rejection"] is not None
    assert mount.stats()["order"] is None


def test_an_order_is_written_only_into_a_directory_of_the_mounts_owner(dataset, mounter,
                                                                     tmp_path, monkeypatch):
    """The mount names where its order file is (`user.cachefs.order_file`), and the
    publisher, perhaps root, writes there: a FUSE file system that another user mounted with
    allow_other could name any directory (/etc), and the publish renamed a file over one of
    its files. An order goes only into a directory of the mount's owner, as the kernel lists
    the mount; a mount that is not in the mount table as a cachefs one is refused."""
    from cachefs import ctrl, publish as publish_mod

    src, _ = dataset
    mount = mounter(src)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "passwd").write_bytes(b"keep me")
    os.chown(theirs, 65534, 65534)  # root runs the tests, and owns the mount
    read_attr = ctrl.read_attr

    def order_file_elsewhere(mountpoint, name, error=OrderError):
        if name == ctrl.ORDER_FILE:
            return os.fsencode(theirs / "passwd")
        return read_attr(mountpoint, name, error)

    monkeypatch.setattr(ctrl, "read_attr", order_file_elsewhere)
    with pytest.raises(OrderError, match="belongs to user 65534, not to the mount's owner"):
        publish(mount.mountpoint, 0, np.arange(N_FILES))
    assert sorted(os.listdir(theirs)) == ["passwd"]
    assert (theirs / "passwd").read_bytes() == b"keep me"
    monkeypatch.undo()
    with pytest.raises(OrderError, match="not a cachefs mount"):
        publish_mod._owner_of(tmp_path)
    assert publish_mod._owner_of(mount.mountpoint) == os.geteuid()


def test_publish_to_a_directory_that_is_not_a_mount(tmp_path):
    done = run_cachefs("publish", tmp_path, "--epoch", 0, "--seed", 1)
    assert done.returncode == 1 and "not a cachefs mount" in done.stderr
    assert "order rejected" not in done.stderr  # nothing is wrong with the order
    done = run_cachefs("publish", tmp_path, "--epoch", 0, "--seed", 1, "--current", "x")
    assert done.returncode == 2
    # usage errors, exit 2, before anything is read: a rank needs its world size, and an
    # epoch must fit the order file's int64
    done = run_cachefs("publish", tmp_path, "--epoch", 0, "--seed", 1, "--rank", 1)
    assert done.returncode == 2 and "--world-size" in done.stderr
    done = run_cachefs("publish", tmp_path, "--epoch", 2**63, "--seed", 1)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    done = run_cachefs("publish", tmp_path / "absent", "--epoch", 0, "--seed", 1)
    assert done.returncode == 1 and "No such file or directory" in done.stderr


@pytest.mark.parametrize("option, content, message", [
    ("--items", b"PK\x03\x04 cut short", "not a usable npz of items"),
    ("--items", b"0 99999999999999999999 10\n", "line 1: not three 64-bit integers"),
    ("--current", None, "beyond int64"),
])
def test_publish_refuses_bad_input_files_with_one_line(tmp_path, option, content, message):
    bad = tmp_path / "bad"
    if content is None:  # uint64 indices beyond int64: refused, not wrapped to negatives
        np.save(tmp_path / "bad.npy", np.array([0, 2**63 + 5], np.uint64))
        bad = tmp_path / "bad.npy"
    else:
        bad.write_bytes(content)
    seed = ["--seed", 1] if option == "--items" else []
    done = run_cachefs("publish", tmp_path, "--epoch", 0, *seed, option, bad)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr


def test_two_ranks_publish_to_one_mount_at_once_with_the_cli(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src)
    publishers = [subprocess.Popen(cachefs_cmd("publish", mount.mountpoint, "--epoch", 3,
                                               "--seed", 5, "--rank", rank, "--world-size", 2),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for rank in (0, 1)]
    outputs = [publisher.communicate(timeout=60) for publisher in publishers]
    assert [publisher.returncode for publisher in publishers] == [0, 0], outputs
    assert sorted(p.name for p in mount.state_dir.glob("order*.npz")) == \
        ["order.rank0.npz", "order.rank1.npz"]
    stats = mount.stats()
    assert stats["order"]["ranks"] == [0, 1] and stats["order"]["length"] == N_FILES
    assert stats["order"]["epoch"] == 3 and stats["order"]["has_next"]
    assert run_cachefs("stats", mount.mountpoint).stdout.splitlines()[0] == \
        f"order: epoch 3, 0/{N_FILES} consumed, cursor 0, next known, ranks 0, 1 of 2 merged"
    # the node reads the whole permutation: both slices, interleaved
    for index in order.permutation(N_FILES, 5, 3)[:6]:
        assert (mount.mountpoint / relpaths[index]).read_bytes() == \
            (src / relpaths[index]).read_bytes()
    assert wait_for(lambda: mount.stats()["order"]["consumed"] == 6)
    assert mount.stats()["order"]["cursor"] == 6


def test_a_new_mount_sets_aside_the_order_left_from_an_earlier_run(dataset, mounter, tmp_path):
    """Issue 15, item 13: no stale order at start unless --resume-order says so."""
    src, _relpaths = dataset
    left = tmp_path / "earlier" / "order.npz"
    left.parent.mkdir()
    identity = order.write_order_file(left, epoch=3, current=order.permutation(N_FILES, 1, 3))
    fresh = mounter(src, "--order-file", left)
    time.sleep(0.3)  # the watcher's first check, and a few polls
    stats = fresh.stats()
    assert stats["order"] is None and stats["publications"] == []
    assert stats["set_aside"] == [{"path": "order.npz", "file": identity.to_json()}]
    assert "set aside" in fresh.log()
    fresh.stop()
    resumed = mounter(src, "--order-file", left, "--resume-order")
    stats = wait_for(lambda: (s := resumed.stats())["order"] is not None and s)
    assert stats["order"]["epoch"] == 3 and stats["order"]["file"] == identity.to_json()
    assert stats["set_aside"] == []
