"""The kernel data plane through real mounts: files served from the kernel's page cache.

What a user sees: the same bytes as the source whether the kernel or the daemon serves them,
hits counted the same (the simulator on the same order agrees), no stale bytes after a source
file changes (within --metadata-ttl), memory within --ram-cache, numpy.memmap working, and a
kernel that forgot an inode costing nothing but speed.
"""

from __future__ import annotations

import json
import errno
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from cachefs.cache.ram import page_bytes
from cachefs.client import page_cache_bytes
from cachefs.sim import SimConfig, simulate
from conftest import (epoch_record, flat_dataset_fixture, make_flat_dataset, read_epoch, wait_for,
                      write_file)

N_FILES = 120
FILE_BYTES = 50_000
BLOCK = 64 * 1024


dataset = flat_dataset_fixture(N_FILES, FILE_BYTES, vary=False)


def read_all(mount, relpaths: list[str]) -> None:
    """Read every file once, with no order published, checking each against the source."""
    for relpath in relpaths:
        assert (mount.mountpoint / relpath).read_bytes() == (mount.source / relpath).read_bytes()


def kernel(mount) -> dict:
    return mount.stats()["kernel"]


def settled(mount, key: str, minimum: int, timeout_s: float = 10.0) -> dict:
    """The kernel counters once `key` reached `minimum` (the pusher thread runs behind)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = kernel(mount)
        if status[key] >= minimum or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def served_whole_or_reclaimed(status: dict) -> int:
    """Files the kernel served whole from its pages, plus blocks it had to ask for again
    because it reclaimed them (these VMs reclaim page cache proactively, even pages stored a
    moment ago: `kernel_reclaimed` in man/cachefs-stats.1): in the zero-request mode a file
    the kernel held whole is one or the other. Closes are reported just after they happen:
    wait for the count."""
    return status["whole_file_opens"] + status["reclaimed_blocks"]


PLANES = pytest.mark.parametrize("plane", ["no-open", "keep-cache"])


@PLANES
def test_pushed_files_are_read_with_the_source_bytes(dataset, mounter, plane):
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2, "--data-plane", plane)
    read_epoch(mount, relpaths, 0)  # read ahead, kept: every file is due in the next epoch
    opens_before = kernel(mount)["whole_file_opens"]
    reclaimed = 0
    for epoch in (1, 2):
        record = read_epoch(mount, relpaths, epoch)  # compares every file with the source
        # every file a RAM hit, but for those whose pages the kernel, holding the only copy,
        # reclaimed (these VMs reclaim page cache proactively, even pages stored a moment
        # ago): read from the source again, and counted as such
        assert record["hits_ram"] + record["kernel_reclaimed"] == N_FILES, record
        assert record["misses"] == record["kernel_reclaimed"], record
        reclaimed += record["kernel_reclaimed"]
    status = kernel(mount)
    assert status["reclaimed_blocks"] >= reclaimed
    # epochs 1 and 2 were served by the kernel: no READ reached the daemon for them, but for
    # a file whose reader got to it before the pusher thread stored it (served by READs, with
    # the same bytes and the same count), and the reclaimed
    assert status["whole_file_opens"] - opens_before >= 2 * N_FILES - 5 - reclaimed
    assert status["held_bytes"] == N_FILES * page_bytes(FILE_BYTES)  # whole pages


def test_the_daemons_threads_are_named_in_the_kernel(dataset, mounter):
    """ps -L, top -H, perf and /proc name each of the daemon's threads by its job (page
    stores, the page cache's FIFO, lookups, the read pool), not as the program: the daemon's
    CPU can be told apart by thread (scripts/benchlib.py, DaemonCpu.by_thread_ms)."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2)
    read_epoch(mount, relpaths, 0)  # the read pool starts with the first source read
    task = Path(f"/proc/{mount.process.pid}/task")
    names = {(task / tid / "comm").read_text().strip() for tid in os.listdir(task)}
    assert {"cachefs-store", "cachefs-pages", "cachefs-read"} <= names, names
    if kernel(mount)["mode"] == "no-open":
        assert "cachefs-closes" in names, names


@PLANES
def test_files_pushed_ahead_of_the_reader_are_stored_and_dropped_once_read(dataset, mounter,
                                                                         plane):
    src, relpaths = dataset
    # room for a quarter of the files: the next epoch's head is kept, the rest dropped
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES // 4, "--source-threads", 4,
                    "--data-plane", plane)
    os.listdir(mount.mountpoint)  # the kernel learns every inode (readdirplus): pushes can land
    for name in {r.split("/")[0] for r in relpaths}:
        os.listdir(mount.mountpoint / name)
    for epoch in range(3):
        read_epoch(mount, relpaths, epoch)
    status = settled(mount, "stores", 1)
    assert status["stores"] > 0 and status["store_failures"] == 0
    assert status["invalidations"] > 0  # consumed files the next epoch does not need soon
    assert status["whole_file_opens"] > 0
    assert mount.stats()["ram"]["bytes"] <= N_FILES * FILE_BYTES // 4


@PLANES
def test_stats_count_the_requests_a_pass_costs(dataset, mounter, plane):
    """`fuse_requests` in `cachefs stats` counts the requests answered, by handler. A second
    pass over files the kernel holds costs no READ and no LOOKUP; in the zero-request mode no
    request at all, in the keep-cache mode an OPEN and a RELEASE per file."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2, "--data-plane", plane)
    # the kernel's RELEASE comes after the reader's close returns
    releases = N_FILES if plane == "keep-cache" else 0

    def requests(passes: int) -> dict:
        def counted() -> dict | None:
            counts = mount.stats()["fuse_requests"]
            return counts if counts.get("release", 0) >= passes * releases else None
        return wait_for(counted)

    read_all(mount, relpaths)  # no order: each file read whole stays in the page cache
    first = requests(1)
    assert first["lookup"] >= N_FILES and first["read"] >= N_FILES, first
    reclaimed_before = kernel(mount)["reclaimed_blocks"]
    read_all(mount, relpaths)
    time.sleep(0.3)  # nothing more is on its way
    second = requests(2)
    # (GETXATTR: `cachefs stats` asks the daemon through an attribute of the mountpoint)
    added = {name: count - first.get(name, 0) for name, count in second.items()
             if count != first.get(name, 0) and name != "getxattr"}
    expected = {"open": N_FILES, "release": N_FILES} if releases else {}
    # but for a file whose pages the kernel reclaimed (these VMs reclaim page cache
    # proactively: `served_whole_or_reclaimed`): its one block is asked for again by one READ,
    # and counted as reclaimed
    reclaimed = kernel(mount)["reclaimed_blocks"] - reclaimed_before
    if reclaimed:
        expected["read"] = reclaimed
    assert added == expected, (added, reclaimed)


@PLANES
def test_files_no_reader_opened_yet_are_looked_up_and_stored_ahead(dataset, mounter, plane):
    """The first epoch: the read-ahead has files the kernel never looked up (no listing, no
    open), so a store would fail; the daemon has the kernel look each up (pagecache.py
    `look_up`: the first lookup in a directory lists it through the mount, once) and stores
    it, and the reader's pass is served from the kernel's pages."""
    from cachefs import order
    from cachefs.publish import publish

    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2, "--lookahead", N_FILES,
                    "--data-plane", plane)
    current = order.permutation(N_FILES, 0, 0)
    publish(mount.mountpoint, 0, current, next=order.permutation(N_FILES, 0, 1))
    status = settled(mount, "stores", N_FILES, timeout_s=30)
    directories = {relpath.rpartition("/")[0] for relpath in relpaths}
    # the listings run beside the lookups (their own threads): the last may end after the
    # files' stores
    status = settled(mount, "listings", len(directories))
    assert status["listings"] == len(directories), status
    assert 0 < status["lookups"] <= N_FILES and status["lookup_failures"] == 0, status
    assert status["stores"] == N_FILES and status["store_failures"] == 0, status
    for index in current:
        relpath = relpaths[index]
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
    record = epoch_record(mount, 0, reads=N_FILES)
    assert record["prefetched"] == N_FILES and record["misses"] == record["kernel_reclaimed"]
    # every file served whole by the kernel, but for those whose pages it reclaimed at once:
    # read again from the source, or from RAM with a READ if the daemon still held its copy
    # (it keeps a pushed file until the file is read; counted then as neither)
    def all_served() -> dict | None:
        status = kernel(mount)
        reads = mount.stats()["fuse_requests"].get("read", 0)
        return status if served_whole_or_reclaimed(status) + reads >= N_FILES else None

    assert wait_for(all_served)["whole_file_opens"] >= N_FILES // 2


def _look_up_all(pages, relpaths: list[bytes], until=lambda: True) -> list[bytes]:
    """Start `pages`, have it look each of `relpaths` up, and return the paths whose `then`
    ran (each on the trio thread), once all have and `until()` holds; the threads stopped
    after."""
    import threading

    import trio

    async def main() -> list[bytes]:
        pages.start()
        done, ran = trio.Event(), []
        trio_thread = threading.get_ident()

        def then(relpath: bytes) -> None:
            assert threading.get_ident() == trio_thread
            ran.append(relpath)
            if len(ran) == len(relpaths):
                done.set()
        for relpath in relpaths:
            pages.look_up(relpath, lambda relpath=relpath: then(relpath))
        with trio.fail_after(10):
            await done.wait()
            while not until():
                await trio.sleep(0.01)
        return ran

    try:
        return trio.run(main)
    finally:
        pages.stop()


def test_lookups_list_a_directory_once_the_read_ahead_goes_through_it(monkeypatch):
    """KernelPages.look_up with recording fakes (no FUSE): a directory is listed once, with
    the cap, at the lookup that reaches one per LOOKUPS_PER_LISTING of its files (the first
    for a small one); one too large, or not scanned yet, is never listed; every file is still
    looked up (a listing can stop at the cap, or fail); each `then` runs on the trio thread;
    the counters say what happened."""
    import threading

    from cachefs import pagecache
    from cachefs.pagecache import LISTED_MAX_ENTRIES, LOOKUPS_PER_LISTING, KernelPages

    # the jobs in order: counts exact, listings in the order decided
    monkeypatch.setattr(pagecache, "LOOKUP_THREADS", 1)
    monkeypatch.setattr(pagecache, "LISTING_THREADS", 1)
    listed, looked_up, lock = [], [], threading.Lock()
    files = {b"a": 3, b"big": 3 * LOOKUPS_PER_LISTING + 1, b"huge": LISTED_MAX_ENTRIES + 1,
             b"unscanned": None, b"": 2, b"broken": 2}

    def list_fn(directory: bytes, max_entries: int) -> None:
        with lock:
            listed.append((directory, max_entries))
        if directory == b"broken":
            raise PermissionError("no listing here")

    def lookup_fn(relpath: bytes) -> None:
        with lock:
            looked_up.append(relpath)

    relpaths = ([b"a/1", b"a/2", b"a/3"] + [b"big/%d" % i for i in range(6)]
                + [b"huge/%d" % i for i in range(3)] + [b"unscanned/1", b"top", b"broken/1",
                                                        b"broken/2"])
    pages = KernelPages(lambda inode, offset, data: None, lambda inode: None, lookup_fn,
                        list_fn, files.get)
    ran = _look_up_all(pages, relpaths, until=lambda: pages.status()["listings"] == 3)
    assert sorted(ran) == sorted(relpaths) and sorted(looked_up) == sorted(relpaths)
    # a at its first lookup, big at its fourth (4 x 32 >= 97), the top directory, and the
    # broken one (whose listing fails); never huge (over the cap) nor unscanned
    assert listed == [(d, LISTED_MAX_ENTRIES) for d in [b"a", b"big", b"", b"broken"]]
    status = pages.status()
    assert status["listings"] == 3 and status["lookups"] == len(relpaths), status


def test_a_listing_for_stores_holds_up_no_lookup(monkeypatch):
    """KernelPages.look_up with fakes: a listing of a directory for stores runs while the
    lookups go on, including the one that decided it and those queued behind it. Made in
    the lookup thread, a listing over a slow source (seconds) held its lookups up, and with
    a few listings at an epoch's start all of them: the files that landed meanwhile were read
    by READs instead of from stored pages."""
    import threading

    from cachefs import pagecache
    from cachefs.pagecache import KernelPages

    monkeypatch.setattr(pagecache, "LOOKUP_THREADS", 1)  # one thread: nothing gets round it
    listing_may_end = threading.Event()

    def list_fn(directory: bytes, max_entries: int) -> None:
        assert listing_may_end.wait(10)

    pages = KernelPages(lambda inode, offset, data: None, lambda inode: None,
                        lambda relpath: None, list_fn, {b"d": 2, b"e": 100}.get)
    relpaths = [b"d/1", b"e/1", b"e/2", b"d/2"]

    def still_listing() -> bool:  # once every file is looked up
        assert pages.status()["listings"] == 0
        listing_may_end.set()
        return True
    try:
        assert sorted(_look_up_all(pages, relpaths, until=still_listing)) == sorted(relpaths)
    finally:
        listing_may_end.set()


@pytest.mark.parametrize("ranged", [True, False], ids=["range-patch", "no-range-patch"])
def test_an_invalidation_keeps_the_extents_asked_for_where_the_kernel_drops_ranges(ranged):
    """KernelPages with recording fakes: given extents to keep, the ranges outside them are
    dropped (the last one to the file's end, length 0); without `invalidate_inode_range` (an
    unpatched pyfuse3) the whole file is, and `drops_ranges` says which."""
    from cachefs.pagecache import KernelPages

    calls = []
    pages = KernelPages(lambda inode, offset, data: None, lambda inode: calls.append((inode,)),
                        invalidate_range_fn=(lambda inode, offset, length: calls.append(
                            (inode, offset, length))) if ranged else None)
    assert pages.drops_ranges == ranged
    assert pages.invalidate(7, [(4096, 12288), (8192, 16384), (40960, 45056)]) == ranged
    assert not pages.invalidate(7)  # all of it
    if ranged:  # overlapping extents merge; nothing before a first extent at 0
        assert calls == [(7, 0, 4096), (7, 16384, 24576), (7, 45056, 0), (7,)]
    else:
        assert calls == [(7,), (7,)]
    assert pages.status()["invalidations"] == 2


def test_a_store_waiting_on_a_page_holds_up_no_other_and_invalidations_keep_their_place():
    """KernelPages with recording fakes (no FUSE): a store that waits (as on a page whose READ
    the trio thread has not answered) does not hold up the stores queued after it; an
    invalidation of its inode waits for it, and a store of that inode queued after the
    invalidation lands after it; `drain` returns once everything queued before it ran."""
    import threading

    import trio

    from cachefs.pagecache import KernelPages

    events, lock = [], threading.Lock()
    page_answered = threading.Event()  # the READ holding inode 1's page is answered

    def store_fn(inode: int, offset: int, data: bytes) -> None:
        if (inode, offset) == (1, 0):
            assert page_answered.wait(10)
        with lock:
            events.append(("store", inode, offset))

    def invalidate_fn(inode: int) -> None:
        with lock:
            events.append(("invalidate", inode, 0))

    pages = KernelPages(store_fn, invalidate_fn)

    async def main() -> None:
        pages.start()
        pages.store(1, 0, b"x" * 4096)  # waits until the page is answered
        pages.store(2, 0, b"y" * 4096)
        pages.invalidate(1)
        pages.store(1, 4096, b"z" * 4096)
        with trio.fail_after(10):
            while ("store", 2, 0) not in events:  # not held up by inode 1's store
                await trio.sleep(0.01)
        assert events == [("store", 2, 0)], events  # inode 1's invalidation waits
        page_answered.set()
        with trio.fail_after(10):
            await pages.drain()
        # everything queued before the drain ran
        assert events[1:] == [("store", 1, 0), ("invalidate", 1, 0), ("store", 1, 4096)], events

    try:
        trio.run(main)
    finally:
        pages.stop()
    assert pages.pending == 0
    status = pages.status()
    assert (status["stores"], status["stored_bytes"], status["invalidations"]) == (
        3, 3 * 4096, 1), status


def test_a_drain_for_one_inode_waits_for_no_store_of_another():
    """An OPEN in the keep-cache mode that drops the file's pages drains the stores queued
    before it (fuse_ops.Operations._open). It drained every inode's: a store waiting on a page
    whose READ waits on a stuck source held the OPENs of every other file that drained. Now
    it waits for its own inode's jobs alone, in order: those handed to the store threads and
    those still in the FIFO behind an invalidation."""
    import threading

    from cachefs.pagecache import KernelPages

    page_answered = threading.Event()  # the READ holding inode 1's page is answered
    stored: list[int] = []

    def store_fn(inode: int, offset: int, data: bytes) -> None:
        if inode == 1:
            assert page_answered.wait(10)
        stored.append(inode)

    pages = KernelPages(store_fn, lambda inode: None)

    async def main() -> None:
        pages.start()
        pages.store(1, 0, b"x" * 4096)  # stuck on its page
        pages.store(2, 0, b"y" * 4096)
        with trio.fail_after(5):
            await pages.drain(2)
            await pages.drain(3)  # nothing of it queued: no trip through the FIFO
        assert 2 in stored
        with trio.move_on_after(0.2) as waited:
            await pages.drain(1)
        assert waited.cancelled_caught and 1 not in stored
        pages.invalidate(1)  # in the FIFO, waiting for inode 1's store
        pages.store(2, 4096, b"z" * 4096)  # behind it in the FIFO: inode 2 has a job there
        page_answered.set()
        with trio.fail_after(5):
            await pages.drain(2)
        assert stored.count(2) == 2 and 1 in stored

    try:
        trio.run(main)
    finally:
        pages.stop()


def test_a_lookup_for_a_store_that_fails_unexpectedly_leaves_the_lookups_going(caplog):
    """A lookup thread whose lookup raised something other than an OSError ended, silently:
    the file's push waited for an answer forever (`TieredCache._looking_up`), and once every
    lookup thread had ended, no file was looked up for a store any more. It is logged, the
    file's follow-up runs, and the next lookups are made."""
    from cachefs.pagecache import LOOKUP_THREADS, KernelPages

    def lookup_fn(relpath: bytes) -> None:
        if relpath.startswith(b"bad"):
            raise RuntimeError("lookup bug")

    pages = KernelPages(lambda inode, offset, data: None, lambda inode: None, lookup_fn)
    relpaths = [b"bad%d" % i for i in range(LOOKUP_THREADS)] + [b"good"]
    assert sorted(_look_up_all(pages, relpaths)) == sorted(relpaths)
    assert "lookup bug" in caplog.text


def test_nothing_reaches_the_kernel_once_the_page_cache_threads_are_stopped():
    """After `KernelPages.stop` (the mount going down), a store, a drop or a drain that comes
    late (a batch of closes handed over during the unmount) reaches no kernel call: with its
    threads gone it ran the job inline, on the trio thread, through a session pyfuse3 may
    have freed already. A drain still returns."""
    import trio

    from cachefs.pagecache import KernelPages

    calls: list[tuple] = []
    pages = KernelPages(lambda inode, offset, data: calls.append(("store", inode)),
                        lambda inode: calls.append(("invalidate", inode)))
    pages.start()
    pages.stop()

    async def main() -> None:
        pages.store(1, 0, b"x" * 4096)
        pages.invalidate(1)
        with trio.fail_after(10):
            await pages.drain()

    trio.run(main)
    assert calls == []


def test_stop_says_whether_a_thread_is_still_in_a_session_call():
    """`KernelPages.stop` is True once every thread that calls into the FUSE session has
    ended, and False while a store is still stuck in its call (a page whose READ nobody
    answers at unmount): the mount then leaves the session unfreed (cachefs/mount.py
    `_detach_leaving_session`), where freeing it under that thread crashed the daemon."""
    import threading

    import trio

    from cachefs.pagecache import KernelPages

    pages = KernelPages(lambda inode, offset, data: None, lambda inode: None)
    pages.start()
    assert pages.stop() is True

    stuck, release = threading.Event(), threading.Event()

    def store_fn(inode: int, offset: int, data: bytes) -> None:
        stuck.set()
        release.wait(10)

    pages = KernelPages(store_fn, lambda inode: None)
    pages.start()

    async def main() -> None:
        pages.store(1, 0, b"x" * 4096)

    trio.run(main)
    assert stuck.wait(10)
    try:
        assert pages.stop(timeout_s=0.2) is False
    finally:
        release.set()


def test_a_store_of_an_inode_with_nothing_queued_skips_a_busy_fifo():
    """KernelPages with recording fakes: while the FIFO's thread is held by an invalidation,
    a store of another inode lands (it has nothing queued to keep order with), and a store
    of the inode being invalidated lands after the invalidation."""
    import threading

    import trio

    from cachefs.pagecache import KernelPages

    events, lock = [], threading.Lock()
    drop_may_finish = threading.Event()

    def store_fn(inode: int, offset: int, data: bytes) -> None:
        with lock:
            events.append(("store", inode))

    def invalidate_fn(inode: int) -> None:
        assert drop_may_finish.wait(10)
        with lock:
            events.append(("invalidate", inode))

    pages = KernelPages(store_fn, invalidate_fn)

    async def main() -> None:
        pages.start()
        pages.invalidate(3)  # holds the FIFO's thread
        pages.store(3, 0, b"x" * 4096)  # behind it
        pages.store(4, 0, b"y" * 4096)  # nothing of inode 4 queued: straight to a store thread
        with trio.fail_after(10):
            while ("store", 4) not in events:
                await trio.sleep(0.01)
        assert events == [("store", 4)], events
        drop_may_finish.set()
        with trio.fail_after(10):
            await pages.drain()
        assert events == [("store", 4), ("invalidate", 3), ("store", 3)], events
        pages.store(3, 4096, b"z" * 4096)  # the invalidation has run: straight through too
        with trio.fail_after(10):
            await pages.drain()

    try:
        trio.run(main)
    finally:
        pages.stop()
    assert pages.pending == 0
    assert pages.status()["stores"] == 3


@PLANES
@pytest.mark.parametrize("publish", [True, False], ids=["order", "no-order"])
def test_a_rewritten_source_file_is_never_served_stale(dataset, mounter, publish, plane):
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2, "--metadata-ttl", 1,
                    "--data-plane", plane)
    for epoch in range(2):  # the second pass is served by the kernel
        if publish:
            read_epoch(mount, relpaths, epoch)
        else:
            read_all(mount, relpaths)
    changed = relpaths[:3]
    write_file(src / changed[0], FILE_BYTES, seed=999)  # same size, new bytes
    write_file(src / changed[1], FILE_BYTES // 2, seed=998)  # shorter
    write_file(src / changed[2], FILE_BYTES * 3, seed=997)  # longer
    time.sleep(1.6)  # past --metadata-ttl: the revalidation has seen the change
    for relpath in changed:
        assert (mount.mountpoint / relpath).read_bytes() == (src / relpath).read_bytes()
        assert os.stat(mount.mountpoint / relpath).st_size == os.stat(src / relpath).st_size
    assert mount.stats()["revalidation"]["changed"] >= 3


@pytest.mark.parametrize("new_bytes", [BLOCK, 4 * BLOCK, 6 * BLOCK],
                         ids=["shrunk", "same-size", "grown"])
@pytest.mark.parametrize("plane", ["no-open", "keep-cache", "daemon"])
def test_a_reader_with_a_file_open_across_its_change_reads_one_version(tmp_path, mounter,
                                                                       plane, new_bytes):
    """A reader that has read the first block of a file when the source replaces it reads on
    in the old version (the bytes the kernel still holds) or gets ESTALE, never the new
    version's bytes after the old one's: the file's inode is one version (cachefs/inodes.py).
    Before, the change retold the inode's size to the kernel and it served the new bytes from
    where the reader was (scripts/soak.py's mixes). A new open reads the new version whole,
    with its size, with no error (the kernel meets the ESTALE of an open or stat of the old
    inode with a new lookup)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    old, new = (rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                for size in (4 * BLOCK, new_bytes))
    (src / "a").write_bytes(old)
    mount = mounter(src, "--ram-cache", 64 * BLOCK, "--block-size", BLOCK,
                    "--metadata-ttl", 1, "--data-plane", plane)
    path = mount.mountpoint / "a"
    assert path.read_bytes() == old
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.read(fd, BLOCK) == old[:BLOCK]
        (tmp_path / "new").write_bytes(new)
        os.utime(tmp_path / "new", ns=(0, 10**9))  # another version even within a second
        (tmp_path / "new").rename(src / "a")
        changed_s = time.monotonic()
        # the sweeps find the change (within --metadata-ttl), and the kernel's pages go
        wait_for(lambda: mount.stats()["revalidation"]["changed"] >= 1)
        rest = b""
        try:  # to the end, as a reader does: the part the kernel still held, then ESTALE
            while part := os.read(fd, len(old) + len(new)):
                rest += part
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
        assert old[BLOCK:].startswith(rest), (
            f"{len(rest)} bytes after the old version's first block, the new version's from "
            f"there: {rest == new[BLOCK:BLOCK + len(rest)]}")
        try:
            assert os.fstat(fd).st_size == len(old)
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
    finally:
        os.close(fd)
    # past the contract (a version is trusted for --metadata-ttl after its check, which was
    # before the change, and a quarter of a second more in the zero-request mode), with a
    # quarter of a second to spare: the kernel's drop of the old pages, queued when the
    # change was found, may land a moment after the counter moved
    time.sleep(max(0.0, changed_s + 1.0 + 0.25 + 0.25 - time.monotonic()))
    assert path.read_bytes() == new
    assert os.stat(path).st_size == len(new)
    assert mount.stats()["revalidation"]["changed"] >= 1


def test_with_metadata_ttl_0_a_change_is_seen_at_the_next_open(dataset, mounter):
    """In the keep-cache mode every open of a cached file checks it (the zero-request mode
    has no open; its re-checks are the sweeps the test above waits for)."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2, "--metadata-ttl", 0,
                    "--data-plane", "keep-cache")
    for _ in range(2):
        read_all(mount, relpaths)
    write_file(src / relpaths[5], FILE_BYTES, seed=12345)
    assert (mount.mountpoint / relpaths[5]).read_bytes() == (src / relpaths[5]).read_bytes()


@PLANES
def test_stats_with_pushed_files_match_the_simulator(tmp_path, mounter, plane):
    """One reader in the order over a fast source, RAM for half the files: the RAM hits per
    epoch the mount counts (the kernel serving most files) are those the simulator counts for
    the same order, budget and block size."""
    src = tmp_path / "src"
    n, size = 200, 40_000
    relpaths = make_flat_dataset(src, n, size, vary=False)
    ram_bytes = n * size // 2
    mount = mounter(src, "--ram-cache", ram_bytes, "--data-plane", plane)
    mounted = [read_epoch(mount, relpaths, epoch) for epoch in range(3)]
    simulated = simulate(SimConfig(items=n, item_bytes=size, ram_bytes=ram_bytes, epochs=3,
                                   latency_s=0.0001, consume_s=0.0002, seed=0))
    assert kernel(mount)["mode"] == plane
    assert kernel(mount)["whole_file_opens"] > n  # the kernel served the later epochs
    for record, sim in zip(mounted, simulated.epochs, strict=True):
        assert record["reads"] == sim.reads == n
        # the mount reads epochs 0, 1, 2 and the simulator 1, 2, 3 of the same seed: the
        # retained head is as long either way
        # (a file whose pages the kernel reclaimed is a miss the simulator cannot foresee)
        assert abs(record["hits_ram"] + record["kernel_reclaimed"] - sim.hits_ram) <= 2, \
            (record, sim.row())


def test_closes_counted_from_the_arrays_are_exact_and_a_changed_file_is_looked_at(
        dataset, mounter):
    """The zero-request mode with the order, RAM for every file: from the third epoch on the
    kernel alone holds each file, and its closes are counted from its block, with no look
    at the file (cachefs/reader.py `AloneFile`). Each epoch still counts every file once, as a RAM
    hit; a file changed in the source is read fresh and is no RAM hit in the epoch after
    (its copies went, and a close counted from stale facts would call it one)."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 3, "--metadata-ttl", 1,
                    "--data-plane", "no-open")
    for epoch in range(4):
        overdue_before = mount.stats()["revalidation"]["overdue_files"]
        record = read_epoch(mount, relpaths, epoch)
        assert record["reads"] == N_FILES
        if epoch >= 2:  # a file whose pages the kernel reclaimed was read again: a miss
            # (and one whose pages went as overdue: the re-checks held up a TTL, a stall of
            # the daemon on a busy machine; cachefs/revalidate.py)
            overdue = mount.stats()["revalidation"]["overdue_files"] - overdue_before
            assert (record["hits_ram"] + record["kernel_reclaimed"] + overdue
                    >= N_FILES - 2), record
    status = wait_for(lambda: (kernel(mount) if kernel(mount)["closes_counted_alone"]
                               >= N_FILES else None))
    assert status["closes_counted_alone"] <= status["whole_file_opens"]
    changed = relpaths[:4]
    write_file(src / changed[0], FILE_BYTES, seed=901)  # same size, new bytes
    write_file(src / changed[1], FILE_BYTES // 2, seed=902)  # shorter
    # within --metadata-ttl (and a quarter of a second) a sweep sees the changes
    wait_for(lambda: mount.stats()["revalidation"]["changed"] >= 2)
    record = read_epoch(mount, relpaths, 4)  # every file checked against the source
    assert record["reads"] == N_FILES
    assert record["hits_ram"] <= N_FILES - 2, record


def test_without_an_order_closes_counted_from_their_blocks_keep_the_lru_order(dataset,
                                                                              mounter):
    """No order: a file only the kernel holds is counted from its block as well, and its
    close still makes it the most recently used (a close that did not would leave it to be
    evicted first): files read again and again stay in a RAM tier of about 25 files while a
    stream of files read once goes through it."""
    src, relpaths = dataset
    hot, cold = relpaths[:8], relpaths[8:88]
    mount = mounter(src, "--ram-cache", 24 * (FILE_BYTES + 8192), "--data-plane", "no-open")
    passes = [hot, hot]
    for start in range(0, len(cold), 8):
        passes += [hot, cold[start:start + 8]]

    def totals(reads: int) -> dict | None:
        records = mount.stats()["epochs"]
        summed = {key: sum(record[key] for record in records)
                  for key in ("reads", "hits_ram", "misses", "prefetched", "kernel_reclaimed")}
        return summed if summed["reads"] >= reads else None

    reads = 0
    for relpaths_read in passes:
        read_all(mount, relpaths_read)
        reads += len(relpaths_read)
        # two closes of a file queued at once are one event (fanotify.py): the next pass
        # starts once this one's are counted (a pause of 50 ms was not always enough)
        counted = wait_for(functools.partial(totals, reads))
    assert counted["reads"] == reads
    # from the source: each file once (and a file whose pages the kernel reclaimed)
    from_source = counted["misses"] + counted["prefetched"]
    assert from_source - counted["kernel_reclaimed"] <= len(hot) + len(cold) + 2, counted
    assert kernel(mount)["closes_counted_alone"] >= len(cold) // 8 * len(hot) - 4


def test_memory_stays_within_the_budget(dataset, mounter):
    src, relpaths = dataset
    ram_bytes = N_FILES * FILE_BYTES // 3
    mount = mounter(src, "--ram-cache", ram_bytes)
    read_all(mount, relpaths)  # no order: LRU
    for epoch in range(2):
        read_epoch(mount, relpaths, epoch)
    stats = mount.stats()
    assert stats["ram"]["bytes"] <= ram_bytes
    assert stats["kernel"]["held_bytes"] <= stats["ram"]["bytes"]
    # what the kernel holds for the mount, counted by the kernel (this opens each file again)
    assert page_cache_bytes(os.fsencode(mount.mountpoint), list(map(os.fsencode, relpaths))) \
        <= ram_bytes


def test_numpy_memmap_of_a_file_the_kernel_holds(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2)
    for epoch in range(2):
        read_epoch(mount, relpaths, epoch)
    before = served_whole_or_reclaimed(kernel(mount))
    for relpath in relpaths[:10]:
        mapped = np.memmap(mount.mountpoint / relpath, dtype=np.uint8, mode="r")
        assert mapped.tobytes() == (src / relpath).read_bytes()
        del mapped
    # each counted once its close is reported
    wait_for(lambda: served_whole_or_reclaimed(kernel(mount)) >= before + 10)


def test_a_kernel_that_forgot_the_inodes_is_served_by_the_daemon(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2)
    for epoch in range(2):
        read_epoch(mount, relpaths, epoch)
    # drop the kernel's dentries, inodes and page cache: every inode is forgotten (FORGET),
    # with its pages; pushes for them would fail (ENOENT) and none may be assumed to hold
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    deadline = time.monotonic() + 10
    while kernel(mount)["held_bytes"] and time.monotonic() < deadline:
        os.stat(mount.mountpoint)  # FORGETs arrive in batches, with other requests
        time.sleep(0.05)
    assert kernel(mount)["held_bytes"] == 0
    record = read_epoch(mount, relpaths, 2)  # every byte compared with the source
    # what only the kernel held went with it, and is read again: counted, never assumed
    assert record["reads"] == N_FILES
    assert record["hits_ram"] + record["prefetched"] + record["misses"] == N_FILES
    assert record["backend_bytes"] > 0


def test_pages_the_kernel_reclaimed_are_misses_and_the_head_stays_with_the_daemon(dataset,
                                                                                 mounter):
    """Page cache is reclaimable while the inode stays (memory pressure; these VMs reclaim cold
    page cache on their own): a file whose only copy was the kernel's is read again, counted
    as a miss and in `kernel_reclaimed`; from then on the daemon keeps its own copy of the
    next epoch's head, so the same loss costs no miss."""
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2)
    read_epoch(mount, relpaths, 0)
    read_epoch(mount, relpaths, 1)  # the kernel holds the only copy of epoch 2's files
    assert kernel(mount)["kernel_losses"] == 0 or pytest.skip("reclaimed before the test")

    def reclaim_page_cache():
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")  # pages only: the inodes stay

    reclaim_page_cache()
    record = read_epoch(mount, relpaths, 2)  # every byte compared with the source
    assert record["kernel_reclaimed"] > 0, record
    assert record["misses"] == record["kernel_reclaimed"], record
    assert record["hits_ram"] + record["misses"] == N_FILES, record
    status = kernel(mount)
    assert status["kernel_losses"] > 0 and status["reclaimed_blocks"] >= record["misses"]
    reclaim_page_cache()  # epoch 3's files: in the daemon too this time
    record = read_epoch(mount, relpaths, 3)
    assert record["hits_ram"] == N_FILES and record["kernel_reclaimed"] == 0, record


@PLANES
def test_a_block_read_in_part_stays_with_the_daemon(tmp_path, mounter, plane):
    """A reader that reads the head of a file's one big block and closes it leaves the kernel
    only the pages it read (and its read-ahead's): the daemon keeps the block. It handed the
    block over as if the kernel held it whole, so the next read of the file read it again from
    the source and counted a page loss the kernel never had."""
    src = tmp_path / "src"
    write_file(src / "big.bin", 3 << 20, seed=9)  # one block (4 MiB by default)
    mount = mounter(src, "--ram-cache", 16 << 20, "--data-plane", plane)
    with open(mount.mountpoint / "big.bin", "rb") as reader:
        assert reader.read(64 << 10) == (src / "big.bin").read_bytes()[:64 << 10]
    wait_for(lambda: mount.stats()["totals"]["reads"] == 1)
    assert (mount.mountpoint / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    totals = wait_for(lambda: (lambda t: t if t["reads"] == 2 else None)(
        mount.stats()["totals"]))
    assert totals["backend_reads"] == 1 and totals["kernel_reclaimed"] == 0, totals
    assert kernel(mount)["kernel_losses"] == 0


# -- which data plane runs --------------------------------------------------------------------

def test_auto_runs_the_zero_request_mode_as_root_with_the_patched_pyfuse3(dataset, mounter):
    src, relpaths = dataset
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2)
    read_all(mount, relpaths)
    # two closes of a file queued at once are one event (fanotify.py): the first pass's
    # counted before the second's come
    settled(mount, "close_events", N_FILES)
    read_all(mount, relpaths)  # from the kernel's pages, with no request
    status = settled(mount, "close_events", 2 * N_FILES)  # reported just after each close
    assert status["mode"] == "no-open"
    assert status["close_events"] >= 2 * N_FILES
    # all but a few of the second pass, or pages the kernel reclaimed (a READ now and then
    # for a file the kernel should hold, seen before reclaim was counted: its bytes are right)
    wait_for(lambda: served_whole_or_reclaimed(kernel(mount)) >= N_FILES - 5)
    assert "zero-request mode: files the kernel holds" in mount.log()


# runs the CLI given after it with close events taken the older way, one fd per event (a kernel
# older than 6.8 refuses FUSE's zero fsid to a group reporting file handles)
EVENTS_WITH_FDS = ("import runpy, sys, cachefs.fanotify as f; "
                   "f.open_close_events.__defaults__ = (False,); "
                   "args = sys.argv[1:]; args = args[args.index('cachefs') + 1:]; "
                   "sys.argv = ['cachefs', *args]; "
                   "runpy.run_module('cachefs', run_name='__main__')")


@pytest.mark.parametrize("events_by", ["handle", "fd"])
def test_every_close_in_nested_directories_is_counted(tmp_path, mounter, events_by):
    """Reads in directories the kernel has just looked up, first the deepest: each counted
    once in the epoch's record, whichever way the kernel reports closes (cachefs/fanotify.py;
    by handle, a directory is marked before the kernel learns of a file in it)."""
    src = tmp_path / "src"
    relpaths = sorted((f"a{i % 3}/b{i % 5}/c{i % 2}/f{i:03d}" for i in range(60)),
                      key=os.fsencode)
    for i, relpath in enumerate(relpaths):
        write_file(src / relpath, 3000 + i, seed=i)
    prefix = [] if events_by == "handle" else [sys.executable, "-c", EVENTS_WITH_FDS, "--"]
    mount = mounter(src, "--ram-cache", 10 * 2**20, prefix=prefix)
    for epoch in range(2):
        record = read_epoch(mount, relpaths, epoch)
        assert record["reads"] == len(relpaths)
    status = kernel(mount)
    assert status["mode"] == "no-open" and status["close_events_by"] == events_by
    assert status["close_events"] == 2 * len(relpaths)


# runs the CLI given after it (`-- [python -m cachefs] ARGS`) with pyfuse3's patch mark removed
UNPATCHED = ("import runpy, sys, pyfuse3; del pyfuse3.READ_FH_IS_INODE_WITHOUT_OPEN; "
             "args = sys.argv[1:]; "
             "args = args[args.index('cachefs') + 1:] if 'cachefs' in args else args[1:]; "
             "sys.argv = ['cachefs', *args]; runpy.run_module('cachefs', run_name='__main__')")


def test_an_unpatched_pyfuse3_falls_back_to_the_keep_cache_mode(dataset, mounter):
    src, relpaths = dataset
    # the daemon's pyfuse3 lacks the patch's mark, as a stock pyfuse3 does
    mount = mounter(src, "--ram-cache", N_FILES * FILE_BYTES * 2,
                    prefix=[sys.executable, "-c", UNPATCHED, "--"])
    for epoch in range(2):
        read_epoch(mount, relpaths, epoch)  # bytes compared with the source
    status = kernel(mount)
    assert status["mode"] == "keep-cache"
    assert status["whole_file_opens"] >= N_FILES  # the kernel still served epoch 1
    assert "zero-request mode unavailable (the installed pyfuse3 does not pass" in mount.log()


def test_no_open_asked_for_without_the_patch_is_a_usage_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "mnt").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", UNPATCHED, "--", "mount", "--foreground", tmp_path / "src",
         tmp_path / "mnt", "--state-dir", tmp_path / "state", "--data-plane", "no-open"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--data-plane no-open: the installed pyfuse3 does not pass" in done.stderr


NON_ROOT_RUN = """
import hashlib, json, subprocess, sys
from pathlib import Path
from cachefs import ctrl
src, mnt, state = map(Path, sys.argv[1:4])
cachefs = [sys.executable, "-m", "cachefs"]
subprocess.run([*cachefs, "mount", src, mnt, "--state-dir", state], check=True,
               stdout=subprocess.DEVNULL)
try:
    paths = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    same = all((mnt / p).read_bytes() == (src / p).read_bytes() for _ in range(2) for p in paths)
    print(json.dumps({"same": same, "files": len(paths), "stats": ctrl.read_stats(mnt),
                      "log": (state / "daemon.log").read_text()}))
finally:
    subprocess.run([*cachefs, "umount", mnt, "--state-dir", state], check=True,
                   stdout=subprocess.DEVNULL)
"""


def test_a_mount_without_cap_sys_admin_falls_back_to_the_keep_cache_mode(tmp_path):
    """A daemon without CAP_SYS_ADMIN (here: root of a new user namespace, as an unprivileged
    user's mount is; fanotify needs the capability in the initial one) mounts in the keep-cache
    mode, says why, and serves the source's bytes."""
    src = tmp_path / "src"
    make_flat_dataset(src, 20, 30_000, vary=False)
    (tmp_path / "mnt").mkdir()
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                           "-c", NON_ROOT_RUN, src, tmp_path / "mnt", tmp_path / "state"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["same"] and report["files"] == 20
    assert report["stats"]["kernel"]["mode"] == "keep-cache"
    assert report["stats"]["kernel"]["whole_file_opens"] >= 20  # the second pass's
    assert "fanotify needs CAP_SYS_ADMIN" in report["log"]


def _sweeper_holding(tmp_path, source, identity, item: int, record_identity):
    """A revalidator over `source` (at tmp_path) whose RAM tier holds block 0 of `held` at
    `identity` for `item`, and the list the identities it reports changed go to."""
    from cachefs import stats as stats_mod
    from cachefs.cache.ram import RamBlock, RamTier
    from cachefs.freshness import Freshness
    from cachefs.inodes import InodeTable
    from cachefs.revalidate import Revalidator

    ram = RamTier(1 << 20, block_bytes=1 << 20)
    data = b"x" * identity.size
    assert ram.reserve(len(data), 0.0)
    ram.insert((b"held", 0), RamBlock(data, identity, item, stats_mod.ORIGIN_PREFETCHED),
               len(data))
    changed: list = []
    revalidator = Revalidator(source, ram, InodeTable(os.lstat(tmp_path)), Freshness(60.0),
                              record_identity=record_identity,
                              source_changed=lambda relpath, new: changed.append(new))
    return ram, revalidator, changed


def test_a_revalidated_file_is_recorded_under_its_ram_blocks_item(tmp_path):
    """The sweep hands the read-ahead each fresh identity with the item its RAM block
    carries (renumbered with every manifest), so a held file is not searched by path; a file
    RAM no longer holds is left to the search (None)."""
    from cachefs.source import Source

    (tmp_path / "held").write_bytes(b"x" * 10)
    (tmp_path / "gone").write_bytes(b"y" * 20)
    source = Source(tmp_path, threads=1)
    st = os.lstat(tmp_path / "held")
    identity = source.identity_of(st)
    recorded = []
    _, revalidator, _ = _sweeper_holding(tmp_path, source, identity, 7,
                                         lambda *args: recorded.append(args) or True)
    revalidator._apply(b"held", st, 0.0)
    revalidator._apply(b"gone", os.lstat(tmp_path / "gone"), 0.5)
    assert recorded == [(b"held", identity, 7, 0.0),
                        (b"gone", source.identity_of(os.lstat(tmp_path / "gone")), None, 0.5)]


def test_a_sweep_look_older_than_a_recorded_one_drops_nothing(tmp_path):
    """A sweep's lstat saw the old version of a file that a reader's check, asked after it,
    saw changed since (the read-ahead refuses the older look: ItemMeta.record). The sweep
    went on as if its look were news: it dropped the newer version's copies as 'changed'."""
    from cachefs.source import Source, SourceIdentity

    (tmp_path / "held").write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=1)
    st = os.lstat(tmp_path / "held")
    old = source.identity_of(st)
    new = SourceIdentity(old.size + 1, old.mtime_ns + 1, old.ino)
    ram, revalidator, changed = _sweeper_holding(tmp_path, source, new, 7,
                                                 lambda *args: False)
    revalidator._apply(b"held", st, 0.0)
    assert changed == []
    assert ram.get((b"held", 0)) is not None


def test_a_sweep_checks_every_file_ram_holds_a_block_of_and_every_file_open(tmp_path,
                                                                           monkeypatch):
    """A reader holding a large file open is served its blocks from RAM (the first evicted
    first, as the least recently used), from the SSD tier or by the kernel's pages: the
    sweeps looked at files by their first block in RAM, and at no file open in the keep-cache
    mode, so such a reader read the old version after a change for as long as it kept the file
    open. Now a file RAM holds any block of, and every file open, is re-checked; all due
    batches at once, a few calls in flight."""
    from cachefs import revalidate
    from cachefs import stats as stats_mod
    from cachefs.cache.ram import RamBlock, RamTier
    from cachefs.freshness import Freshness
    from cachefs.inodes import InodeTable
    from cachefs.revalidate import Revalidator
    from cachefs.source import Source

    monkeypatch.setattr(revalidate, "BATCH_FILES", 8)  # six batches
    names = [b"big", b"open", b"fresh"] + [b"f%d" % i for i in range(40)]
    for name in names:
        (tmp_path / name.decode()).write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=2)
    inodes = InodeTable(os.lstat(tmp_path))
    stat_of = {name: os.lstat(tmp_path / name.decode()) for name in names}
    ram = RamTier(1 << 20, block_bytes=4)
    held = [(b"big", 2)] + [(name, 0) for name in names[3:]]  # "big": its third block only
    for key in held:
        assert ram.reserve(4, 0.0)
        ram.insert(key, RamBlock(b"x" * 4, source.identity_of(stat_of[key[0]]), -1,
                                 stats_mod.ORIGIN_PREFETCHED), 4)
    changed: list = []
    revalidator = Revalidator(source, ram, inodes, Freshness(60.0),
                              record_identity=lambda *args: True,
                              source_changed=lambda relpath, new: changed.append(relpath),
                              open_files=lambda: [b"open", b"fresh"])

    async def main():
        for name in names:  # told to the kernel long ago, all but "fresh" (just now)
            inodes.remember(name, stat_of[name], lookup=True,
                            stat_time_s=trio.current_time() - (0 if name == b"fresh" else 50))
        assert set(revalidator._due()) == set(names) - {b"fresh"}
        for name in (b"big", b"open"):  # replaced in the source
            (tmp_path / name.decode()).write_bytes(b"y" * 20)
        calls: list = []
        real = source.lstat_many

        async def counted(relpaths):
            calls.append(len(relpaths))
            return await real(relpaths)

        monkeypatch.setattr(source, "lstat_many", counted)
        await revalidator.sweep()
        assert sorted(changed) == [b"big", b"open"]
        assert sum(calls) == len(names) - 1 == revalidator.checked and len(calls) == 6

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_sweep_look_asked_before_the_inodes_is_no_change(tmp_path):
    """A sweep's lstat saw the old version; then a reader's check found the change and a
    lookup gave the new version an inode, asked after the sweep's look. The sweep's look
    landed last, and taken for a change (the file outside the order, whose identities the
    read-ahead does not record) it retired the current inode, a spurious ESTALE for its
    reader, and dropped the current version's copies."""
    from cachefs.source import Source

    (tmp_path / "held").write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=1)
    old = os.lstat(tmp_path / "held")
    (tmp_path / "held").write_bytes(b"y" * 20)
    new = os.lstat(tmp_path / "held")
    ram, revalidator, changed = _sweeper_holding(tmp_path, source, source.identity_of(new), -1,
                                                 lambda *args: True)
    inode = revalidator.inodes.remember(b"held", new, lookup=True, stat_time_s=10.0)
    revalidator._apply(b"held", old, 9.0)  # asked before the inode's look
    revalidator._apply(b"held", FileNotFoundError(errno.ENOENT, "gone"), 9.5)
    assert changed == [] and not revalidator.inodes.get(inode).retired
    assert ram.get((b"held", 0)) is not None
    revalidator._apply(b"held", old, 11.0)  # asked after it: a change
    assert changed == [revalidator.source.identity_of(old)]


def test_a_recheck_that_fails_for_the_source_keeps_the_copies(tmp_path):
    """A sweep's lstat failing with EIO (a timeout, a stale NFS handle) says nothing of the
    file: its copies stay and it is asked again; ENOENT drops them (it dropped them for any
    error, and a cache-once SSD tier never got them back)."""
    from cachefs.revalidate import GONE
    from cachefs.source import Source

    (tmp_path / "held").write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=1)
    identity = source.identity_of(os.lstat(tmp_path / "held"))
    _, revalidator, changed = _sweeper_holding(tmp_path, source, identity, 0,
                                               lambda *args: True)
    revalidator._apply(b"held", OSError(errno.EIO, "I/O error"), 0.0)
    revalidator._apply(b"held", OSError(errno.ETIMEDOUT, "timed out"), 0.0)
    assert changed == []
    revalidator._apply(b"held", FileNotFoundError(errno.ENOENT, "gone"), 0.0)
    assert changed == [GONE]


def test_a_close_with_no_read_just_after_its_pages_were_dropped_is_counted(monkeypatch):
    """The zero-request mode: the daemon forgets a block (LRU eviction) before the drop of its
    pages lands, and a reader that opened the file meanwhile reads those pages with no READ.
    Its close is counted as a read from RAM; a close of a file whose pages were not dropped
    and that the kernel does not hold, or dropped longer ago than DROPPED_READ_S, reads
    nothing."""
    from cachefs import pagecache
    from cachefs.sim import EpochResult, run_script

    config = SimConfig(items=4, item_bytes=5000, ram_bytes=1 << 20, latency_s=0.0, epochs=1,
                       check_identity_at_open=False, consume_s=0.0)

    async def script(sim):
        result = EpochResult(1, items=np.arange(4), origins=np.full(4, -1, np.int8),
                             stall_by_position=np.zeros(4))

        async def read(item):
            handle = await sim._open(item, result)
            if not handle.kernel_whole:
                await sim.reader.read(handle, 0, handle.identity.size)
            sim.reader.release(handle)

        def close_without_reads(item) -> dict:
            before = sim.stats.totals()
            relpath = sim.paths[item]
            sim.reader.closed([(item + 2, relpath, item, sim.source.identity(relpath))])
            after = sim.stats.totals()
            return {name: after[name] - before[name] for name in ("reads", "hits_ram")}

        for item in (0, 1):
            await read(item)
        assert sim.ram.get((sim.paths[0], 0)).in_kernel  # the kernel holds it, as pages
        sim.ram.drop((sim.paths[0], 0))  # evicted: its pages are dropped (queued)
        assert sim.ram.get((sim.paths[0], 0)) is None
        counted = close_without_reads(0)
        never_held = close_without_reads(3)
        sim.ram.drop((sim.paths[1], 0))
        monkeypatch.setattr(pagecache, "DROPPED_READ_S", -1.0)  # that drop is long past
        too_late = close_without_reads(1)
        return counted, never_held, too_late

    counted, never_held, too_late = run_script(config, script)
    assert counted == {"reads": 1, "hits_ram": 1}
    assert never_held == {"reads": 0, "hits_ram": 0}
    assert too_late == {"reads": 0, "hits_ram": 0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_of_closes_counts_each_file_in_the_epoch_that_consumed_it(seed):
    """The zero-request mode: one fanotify batch mixes files only the kernel held (counted
    with no handle, one by one or in runs counted from their blocks: fuse_ops.Operations.
    closed)
    and files whose READs came to the daemon (handles), and crosses the end of the order.
    It is consumed in one step of the planner, in the batch's order: the files up to the
    order's last count in their epoch, the ones after it in the next, each once, though the
    order's end falls inside a run."""
    import trio

    from cachefs.reader import AloneFile, OpenFile
    from cachefs.sim import run_script

    config = SimConfig(items=48, item_bytes=5000, ram_bytes=1 << 22, latency_s=0.0,
                       epochs=2, check_identity_at_open=False, consume_s=0.0, seed=seed)

    async def script(sim):
        await sim._epochs()  # the kernel holds every file now, most of them alone
        order = sim.order(3)
        sim.prefetcher.set_order(order)
        await trio.sleep(0.01)
        rng = np.random.default_rng(seed)
        closes = []
        kernel_alone = 0
        # the whole order, then the next order's first five: the batch crosses the end
        batch = [*order.current.tolist(), *order.next[:5].tolist()]
        for position, item in enumerate(batch):
            relpath = sim.paths[item]
            identity = sim.source.identity(relpath)
            if position >= len(batch) - 8 or 0.3 <= rng.random() < 0.5:
                # counted from its block, in a run with the files next to it of that kind
                key = (relpath, 0)
                closes.append(AloneFile(key, sim.tiered.ram.blocks[key]))
                continue
            if rng.random() < 0.4:  # this reader's READs came to the daemon
                handle = sim.reader.handle_without_open(item + 2, relpath, item, identity)
                await sim.reader.read(handle, 0, identity.size)
                closes.append(handle)
                continue
            blocks = sim.tiered.kernel_holds_all(relpath, identity)
            kernel_alone += blocks is not None and all(b.data is None for _, b in blocks)
            closes.append((item + 2, relpath, item, identity))
        steps = []  # the planner's steps: the items each consumption was handed
        consumed_many = sim.prefetcher.consumed_many

        def step(items, sizes_bytes):
            steps.append(len(items))
            return consumed_many(items, sizes_bytes)

        sim.prefetcher.consumed_many = step
        assert sum(isinstance(close, AloneFile) for close in closes) >= 10
        sim.reader.closed(closes)
        handles = sum(isinstance(close, OpenFile) for close in closes)
        reads = {record.epoch: record.reads for record in sim.stats.epochs}
        return (handles, kernel_alone, steps, reads, sim.planner.consumed_count,
                sim.planner.cursor)

    handles, kernel_alone, steps, reads, consumed, cursor = run_script(config, script)
    assert handles > 0 and kernel_alone > 0  # both kinds in the batch
    # one step for the batch; the order's end splits it, and the rest goes to the next
    assert len(steps) == 2 and steps[0] > 48 and steps[1] == steps[0] - 48
    assert reads[3] == 48 and reads[4] == 5
    assert consumed == 5 and cursor == 5  # the next order, now in force: its first five


def test_a_file_read_with_no_open_is_rechecked_though_ram_let_it_go(tmp_path):
    """The zero-request mode: a reader holds a file open (an HDF5 or tar shard) whose READs'
    pages the kernel keeps, while RAM let its blocks go. The sweeps checked only what RAM
    holds, so after the file changed the kernel served its old pages to every reader, for
    as long as it stayed open; it is re-checked too, and the change reported."""
    import trio

    from cachefs.cache.ram import RamTier
    from cachefs.freshness import Freshness
    from cachefs.inodes import InodeTable
    from cachefs.revalidate import Revalidator
    from cachefs.source import Source

    (tmp_path / "shard").write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=1)
    inodes = InodeTable(os.lstat(tmp_path), source.identity_of)
    inodes.remember(b"shard", os.lstat(tmp_path / "shard"), lookup=True, stat_time_s=-100.0)
    (tmp_path / "shard").write_bytes(b"y" * 20)
    changed = []
    revalidator = Revalidator(source, RamTier(1 << 20, block_bytes=1 << 20), inodes,
                              Freshness(60.0), record_identity=lambda *args: True,
                              source_changed=lambda relpath, new: changed.append((relpath,
                                                                                  new.size)),
                              open_files=lambda: [b"shard"])
    trio.run(revalidator.sweep)
    assert changed == [(b"shard", 20)]
    for _ in range(3):  # until the kernel stats it again, the inode table has the old version
        trio.run(revalidator.sweep)
    assert changed == [(b"shard", 20)]  # reported once
    (tmp_path / "shard").write_bytes(b"z" * 30)
    trio.run(revalidator.sweep)
    assert changed == [(b"shard", 20), (b"shard", 30)]  # a change after it, reported


def _close_event(inode: int, handle_type: int | None = None) -> bytes:
    """A FAN_CLOSE_NOWRITE event by file handle as the kernel writes it for a FUSE mount's file
    (`handle_type`: the handle's type, FUSE's by default)."""
    import struct

    from cachefs import fanotify

    if handle_type is None:
        handle_type = fanotify.FILEID_INO64_GEN
    handle = struct.pack("=II", inode >> 32, inode & 0xFFFFFFFF) + struct.pack("=I", 7)
    info = struct.pack("=BBHiiIi", fanotify.FAN_EVENT_INFO_TYPE_FID, 0,
                       fanotify._INFO_FID.size + len(handle), 0, 0, len(handle),
                       handle_type) + handle
    size = fanotify._METADATA.size + len(info)
    return fanotify._METADATA.pack(size, 3, 0, fanotify._METADATA.size,
                                   fanotify.FAN_CLOSE_NOWRITE, fanotify.FAN_NOFD, 1234) + info


def test_close_events_are_read_as_the_kernel_writes_them():
    """cachefs/fanotify.py's reading of a batch of events by handle: the node ids of a FUSE
    mount's events (large ones too), an overflow among them (no handle, shorter) counted, and
    a handle that is not FUSE's skipped."""
    from cachefs import fanotify

    overflow = fanotify._METADATA.pack(fanotify._METADATA.size, 3, 0, fanotify._METADATA.size,
                                       fanotify.FAN_Q_OVERFLOW, fanotify.FAN_NOFD, 0)
    watcher = fanotify.CloseWatcher(-1, marker=object(), deliver=lambda inodes: None)
    try:
        uniform = b"".join(_close_event(inode) for inode in (2, 3, (5 << 32) + 9))
        assert watcher._parse(uniform) == ([], [2, 3, (5 << 32) + 9])
        mixed = (_close_event(4) + overflow + _close_event(11)
                 + _close_event(12, handle_type=1) + _close_event(13))
        assert watcher._parse(mixed) == ([], [4, 11, 13])
        assert (watcher.events, watcher.overflows) == (6, 1)
    finally:
        os.close(watcher._stop_read), os.close(watcher._stop_write)


def test_a_batch_of_closes_that_fails_to_be_handed_over_does_not_stop_the_watcher(caplog):
    """cachefs/fanotify.py: a batch whose hand-over to the trio thread raises is logged and
    lost, and the watcher goes on counting the next ones (it ended, silently: every later
    close went uncounted, and every new order waited for a flush nobody answered). A pipe
    stands in for the fanotify descriptor."""
    from cachefs import fanotify

    class Marker:
        def close(self) -> None:
            pass

    events_read, events_write = os.pipe()
    handed: list[list[int]] = []

    def deliver(inodes: list[int]) -> None:
        handed.append(list(inodes))
        if len(handed) == 1:
            raise RuntimeError("handing over failed")

    watcher = fanotify.CloseWatcher(events_read, marker=Marker(), deliver=deliver)
    watcher.start()
    try:
        os.write(events_write, _close_event(2))
        wait_for(lambda: len(handed) == 1, timeout_s=10)
        os.write(events_write, _close_event(3))
        wait_for(lambda: len(handed) == 2, timeout_s=10)
        assert handed == [[2], [3]]
        assert "handing over failed" in caplog.text
    finally:
        watcher.stop()
        os.close(events_write)
