"""The FUSE handlers called directly, without a kernel (issue 16): what they may touch of the
read path, and how they age what the source told them.

The read path is the real one (`build_read_path` over a `Source` of a temporary directory);
time is a `trio.testing.MockClock` that only moves when a test jumps it.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
import trio
import trio.testing

from cachefs.cache.ram import RamTier, page_bytes
from cachefs.ctrl import Control
from cachefs.freshness import NEVER_S, Freshness
from cachefs.fuse_ops import LISTED_ITEMS, Operations
from cachefs.kernel_invalidation import KernelInvalidation
from cachefs.inodes import ROOT_INODE, InodeTable
from cachefs.manifest import scan_source
from cachefs.order import Order
from cachefs.read_path import build_read_path
from cachefs.reader import Reader
from cachefs.source import Source
from cachefs.stats import Stats
from cachefs.targets import Targets

from conftest import write_file

BLOCK_BYTES = 64 * 1024
TTL_S = 60.0


class PublicOnly:
    """The reader as fuse_ops may use it: the public methods and properties of `Reader`,
    nothing it holds (reaching through to the tiered cache or the prefetcher fails)."""

    def __init__(self, reader: Reader):
        self._reader = reader

    def __getattr__(self, name: str):
        member = getattr(Reader, name, None)
        if name.startswith("_") or not (callable(member) or isinstance(member, property)):
            raise AttributeError(f"fuse_ops reached for Reader.{name}, which is no public "
                                 f"method of it")
        return getattr(self._reader, name)


class KernelDrops:
    """What `KernelInvalidation` has the kernel drop, recorded (there is no kernel here)."""

    def __init__(self):
        self.entries: list[tuple[int, bytes]] = []  # (directory inode, name)
        self.pages: list[int] = []  # inodes
        # what tells it (`operations`); its entry drops run once its `run` does
        self.invalidation: KernelInvalidation | None = None
        self.entry_gate: threading.Event | None = None  # set: an entry drop may end

    def drop_entry(self, parent_inode: int, name: bytes) -> None:
        """The kernel's `invalidate_entry`, which blocks while a request in the directory is
        answered (the gate stands for that)."""
        if self.entry_gate is not None:
            self.entry_gate.wait()
        self.entries.append((parent_inode, name))

    def invalidate(self, inode: int, keep=None) -> bool:
        self.pages.append(inode)
        return False


def operations(src: Path, ttl_s: float = TTL_S, changed: list | None = None,
               stats: Stats | None = None, drops: KernelDrops | None = None) -> Operations:
    """The operations over a read path as a mount wires them: a change the read path finds
    goes to `KernelInvalidation` (what it has the kernel drop, to `drops`), and its path to
    `changed`."""
    source = Source(src, threads=2)
    freshness = Freshness(ttl_s)
    inodes = InodeTable(os.lstat(src), source.identity_of, freshness.trusted)
    source.on_look = inodes.confirm
    drops = drops if drops is not None else KernelDrops()
    invalidation = drops.invalidation = KernelInvalidation(
        inodes, drops, invalidate_entry=drops.drop_entry)  # type: ignore[arg-type]

    def source_changed(relpath: bytes, identity, asked_s: float | None) -> None:
        if changed is not None:
            changed.append(relpath)
        invalidation.source_changed(relpath, identity, asked_s)
    read_path = build_read_path(
        source, stats or Stats(), RamTier(16 * BLOCK_BYTES, block_bytes=BLOCK_BYTES), None,
        freshness,
        block_bytes=BLOCK_BYTES, source_threads=2, lookahead_items=0, sequential_blocks=0,
        on_source_changed=source_changed)
    control = Control(lambda: {}, src / "order", lambda request: {})
    ops = Operations(source, PublicOnly(read_path.reader), control, inodes, None, freshness,
                     kernel_timeout_s=1.0,
                     entry_drops_landed=invalidation.entry_drops_landed)
    ops.decide_mode(no_open=False)
    return ops


async def read_file(ops: Operations, inode: int) -> bytes:
    """Open, read and release as the kernel would: up to the last page of the size it was
    told (the inode table's), never past it."""
    info = await ops.open(inode, os.O_RDONLY, None)
    data = await ops.read(info.fh, 0, page_bytes(ops.inodes.get(inode).stat.st_size))
    await ops.release(info.fh)
    return data


def test_the_handlers_use_only_the_readers_public_methods(tmp_path):
    """Lookup, open, read (twice: from the source, then from RAM), release, an open that finds
    the file changed (ESTALE, then the new version under a new inode after a lookup), and
    forget: the operations need nothing of the read path but the reader's public methods
    (before, they reached through it to the tiered cache and the prefetcher)."""
    src = tmp_path / "src"
    write_file(src / "a", 100_000, seed=1)
    changed: list[bytes] = []
    ops = operations(src, ttl_s=1.0, changed=changed)
    clock = trio.testing.MockClock()

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        assert await read_file(ops, inode) == (src / "a").read_bytes()
        assert await read_file(ops, inode) == (src / "a").read_bytes()
        write_file(src / "a", 50_000, seed=2)
        clock.jump(2.0)  # past the TTL: the open checks the file at the source
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await read_file(ops, inode)
        assert raised.value.errno == errno.ESTALE
        assert changed == [b"a"]
        new = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        assert new != inode and ops.inodes.get(new).stat.st_size == 50_000
        assert await read_file(ops, new) == (src / "a").read_bytes()
        ops.forget([(inode, 1), (new, 1)])

    trio.run(main, clock=clock)


@pytest.mark.parametrize("found_by", ["getattr", "open", "read", "lookup"])
def test_an_inode_is_one_version_of_its_file(tmp_path, found_by):
    """The kernel has one size and one page cache per inode. When a file's inode took on its
    new version, a reader with it open read pages of the old version and then bytes of the
    new one (a size that grew between two reads; an old page beside a new READ): a mix of
    two, which scripts/soak.py found several times in four minutes of rewrites. Now a change
    found (here by each request that can find it) retires the inode: that request and every
    later one on it but forget is answered ESTALE, which the kernel meets with a lookup anew,
    and the lookup gives the new version an inode of its own. A directory, whose identity
    changes with its entries, stays one inode."""
    src = tmp_path / "src"
    write_file(src / "d" / "a", 2 * BLOCK_BYTES, seed=1)
    changed: list[bytes] = []
    drops = KernelDrops()
    ops = operations(src, ttl_s=1.0, changed=changed, drops=drops)
    if found_by == "read":
        ops.decide_mode(no_open=True)
    clock = trio.testing.MockClock()

    async def estale(request) -> None:
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await request
        assert raised.value.errno == errno.ESTALE

    async def requests():
        directory = (await ops.lookup(ROOT_INODE, b"d", None)).st_ino
        old = (await ops.lookup(directory, b"a", None)).st_ino
        if found_by == "read":
            assert await ops.read(old, 0, BLOCK_BYTES) == (src / "d" / "a").read_bytes()[
                :BLOCK_BYTES]
        write_file(src / "d" / "a", 2 * BLOCK_BYTES, seed=2)  # the same size: new bytes
        os.utime(src / "d" / "a", ns=(0, 10**9))
        clock.jump(2.0)  # past the TTL: the next look asks the source
        if found_by == "getattr":
            await estale(ops.getattr(old, None))
        elif found_by == "open":
            await estale(ops.open(old, os.O_RDONLY, None))
        elif found_by == "read":
            await estale(ops.read(old, BLOCK_BYTES, BLOCK_BYTES))  # the rest of the old
        else:  # the lookup finds it, and the kernel's entry of the name is the new inode
            assert not ops.inodes.get(old).retired
            new = (await ops.lookup(directory, b"a", None)).st_ino
            # a LOOKUP waits for no drop: the kernel holds the directory the drop needs
            await ops.entry_drops_landed()
        assert changed == [b"d/a"]  # the old version's copies go, and its pages
        assert ops.inodes.get(old).retired and drops.pages == [old]
        # the kernel's entry of the name is dropped, so that its next lookup asks (even if a
        # lookup found the change: a listing's reply may end before the name); an ESTALE is
        # answered once it is, so that the reader's next open looks the name up anew
        assert drops.entries == [(directory, b"a")]
        if found_by != "lookup":
            new = (await ops.lookup(directory, b"a", None)).st_ino
        assert new != old and ops.inodes.inode_of(b"d/a") == new
        await estale(ops.getattr(old, None))
        if found_by != "read":
            await estale(ops.open(old, os.O_RDONLY, None))
            assert await read_file(ops, new) == (src / "d" / "a").read_bytes()
        else:
            await estale(ops.read(old, 0, BLOCK_BYTES))
            assert await ops.read(new, 0, 2 * BLOCK_BYTES) == (src / "d" / "a").read_bytes()
        assert (await ops.getattr(new, None)).st_mtime_ns == 10**9
        # a directory's identity changes with its entries: it stays one inode
        write_file(src / "d" / "b", 10)
        os.utime(src / "d", ns=(0, 5 * 10**9))
        clock.jump(2.0)
        assert (await ops.getattr(directory, None)).st_mtime_ns == 5 * 10**9
        assert (await ops.lookup(ROOT_INODE, b"d", None)).st_ino == directory
        ops.forget([(old, 1)])  # the retired inode goes, and nothing of the file with it
        with pytest.raises(KeyError):
            ops.inodes.get(old)
        assert ops.inodes.inode_of(b"d/a") == new

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(drops.invalidation.run)
            await requests()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_an_estale_is_answered_once_the_kernel_dropped_the_name(tmp_path):
    """With no OPEN (the zero-request mode), a reader who got ESTALE and opens the name again
    is given the inode the kernel's entry names: if its drop had not landed, the retired one,
    whose first READ got ESTALE again (tests/test_overdue.py's held-open test failed so, on a
    loaded machine). The READ that found the change is answered once the drop landed."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    drops = KernelDrops()
    drops.entry_gate = threading.Event()
    ops = operations(src, ttl_s=1.0, drops=drops)
    ops.decide_mode(no_open=True)
    clock = trio.testing.MockClock()
    answered: list[int] = []

    async def read_the_rest(inode: int) -> None:
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.read(inode, BLOCK_BYTES, BLOCK_BYTES)
        answered.append(raised.value.errno)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(drops.invalidation.run)
            inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
            await ops.read(inode, 0, BLOCK_BYTES)
            write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
            os.utime(src / "a", ns=(0, 10**9))
            clock.jump(2.0)  # past the TTL: the READ asks the source
            nursery.start_soon(read_the_rest, inode)
            while not ops.inodes.get(inode).retired:
                await trio.sleep(0)
            await trio.to_thread.run_sync(time.sleep, 0.2)
            assert answered == [] and drops.entries == []  # the drop blocks: so does the READ
            drops.entry_gate.set()
            while not answered:
                await trio.sleep(0)
            assert answered == [errno.ESTALE] and drops.entries == [(ROOT_INODE, b"a")]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_attributes_age_on_trios_clock(tmp_path):
    """What the source said of a file is trusted for the TTL on trio's clock, the one the
    simulator and these tests move (before, inode stamps were on time.monotonic and virtual
    time never aged them)."""
    src = tmp_path / "src"
    write_file(src / "a", 10)
    ops = operations(src)
    clock = trio.testing.MockClock()

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        write_file(src / "a", 20)
        clock.jump(TTL_S / 2)
        assert (await ops.getattr(inode, None)).st_size == 10  # still trusted
        clock.jump(TTL_S)
        with pytest.raises(pyfuse3.FUSEError) as raised:  # asked again: another version
            await ops.getattr(inode, None)
        assert raised.value.errno == errno.ESTALE
        assert (await ops.lookup(ROOT_INODE, b"a", None)).st_size == 20

    trio.run(main, clock=clock)


def test_reads_without_open_of_a_changed_file_read_the_new_inode_with_one_handle(tmp_path):
    """The zero-request mode: the first READ finds the file changed to a new version of the
    same size: ESTALE (the kernel may hold pages of the old one), and the lookup that follows
    gives the new version its inode, whose READs stay on one handle (they once made one
    each, and read every block again), and whose close counts the file once, with every
    byte served; the close of the old inode, whose READ failed, serves nothing."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    stats = Stats()
    ops = operations(src, stats=stats)
    ops.decide_mode(no_open=True)

    async def main():
        old = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
        os.utime(src / "a", ns=(0, 10**9))
        new = (src / "a").read_bytes()
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.read(old, 0, BLOCK_BYTES)
        assert raised.value.errno == errno.ESTALE
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        for offset in (0, BLOCK_BYTES, 0):  # the last: the kernel reads block 0 again
            assert await ops.read(inode, offset, BLOCK_BYTES) == new[offset:offset + BLOCK_BYTES]
        ops.closed([inode, old])

    trio.run(main)
    totals = stats.totals()
    assert totals["bytes_served"] == 3 * BLOCK_BYTES
    # each block once: the old inode's READ found the change with block 0 of the new version,
    # kept for the new inode's
    assert totals["backend_reads"] == 2


def _two_files_read_without_open(tmp_path):
    """Operations over files a and b of 100 bytes, in the zero-request mode, and its Stats."""
    src = tmp_path / "src"
    write_file(src / "a", 100)
    write_file(src / "b", 100)
    stats = Stats()
    ops = operations(src, stats=stats)
    ops.decide_mode(no_open=True)
    return ops, stats


def test_a_close_whose_accounting_fails_does_not_stop_the_others(tmp_path, caplog):
    ops, stats = _two_files_read_without_open(tmp_path)
    reader = ops.reader._reader  # the reader behind fuse_ops' view (PublicOnly)
    settle_pages = reader._settle_pages

    def failing_settle_pages(handle):
        if handle.relpath == b"a":
            raise RuntimeError("accounting bug")
        return settle_pages(handle)

    reader._settle_pages = failing_settle_pages

    async def main():
        inodes = [(await ops.lookup(ROOT_INODE, name, None)).st_ino for name in (b"a", b"b")]
        for inode in inodes:
            await ops.read(inode, 0, 100)
        ops.closed(inodes)

    trio.run(main)
    assert stats.totals()["reads"] == 2  # b's close was counted, after a's failed
    assert "accounting bug" in caplog.text


def test_a_batch_of_closes_whose_accounting_fails_is_logged_not_raised(tmp_path, caplog):
    """The close watcher hands a batch to `closed` on the trio thread with `run_sync_soon`,
    where an exception ends the trio run and the mount with it: a failure anywhere in a
    batch's accounting is logged, and the next batch is counted."""
    ops, stats = _two_files_read_without_open(tmp_path)
    close_tokens = ops.inodes.close_tokens

    def failing_close_tokens(inodes):
        if len(inodes) == 2:
            raise RuntimeError("close tokens bug")
        return close_tokens(inodes)

    ops.inodes.close_tokens = failing_close_tokens

    async def main():
        inodes = [(await ops.lookup(ROOT_INODE, name, None)).st_ino for name in (b"a", b"b")]
        for inode in inodes:
            await ops.read(inode, 0, 100)
        ops.closed(inodes)  # the batch is lost, and said so
        assert stats.totals()["reads"] == 0
        ops.closed(inodes[1:])

    trio.run(main)
    assert stats.totals()["reads"] == 1
    assert "close tokens bug" in caplog.text


def test_a_read_of_a_file_open_across_a_change_found_is_estale_in_either_mode(tmp_path):
    """Once a change is found (here by a sweep, which retires the inode), a READ of a handle
    opened before it is answered ESTALE in the keep-cache mode too, as in the zero-request
    mode: it was served from whatever RAM held, which a fetch in flight at the change could
    fill with the old version after the drop. The files open are the sweeps' to re-check
    (revalidate.py), whatever RAM holds of them."""
    src = tmp_path / "src"
    write_file(src / "a", 3 * BLOCK_BYTES, seed=1)
    ops = operations(src)

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        info = await ops.open(inode, os.O_RDONLY, None)
        assert await ops.read(info.fh, 0, BLOCK_BYTES) == (src / "a").read_bytes()[
            :BLOCK_BYTES]
        assert ops.open_files() == [b"a"]
        ops.inodes.retire(inode)  # a sweep found the file changed
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.read(info.fh, BLOCK_BYTES, BLOCK_BYTES)
        assert raised.value.errno == errno.ESTALE
        await ops.release(info.fh)
        assert ops.open_files() == []

    trio.run(main)


def test_a_read_without_open_past_the_ttl_checks_the_source_first(tmp_path):
    """The zero-request mode: the first READ of a file the kernel was told of over a TTL ago
    checks the source, as an open does in the keep-cache mode. Here the copy no sweep checks
    is RAM's (no revalidation task runs); on a mount it is the SSD tier's, which the sweeps
    leave alone and which was served stale for as long as the kernel kept the attributes."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    write_file(src / "b", 2 * BLOCK_BYTES, seed=3)
    ops = operations(src, ttl_s=1.0)
    ops.decide_mode(no_open=True)
    clock = trio.testing.MockClock()

    async def main():
        a, b = [(await ops.lookup(ROOT_INODE, name, None)).st_ino for name in (b"a", b"b")]
        for inode, name in ((a, "a"), (b, "b")):
            assert await ops.read(inode, 0, BLOCK_BYTES) == (src / name).read_bytes()[
                :BLOCK_BYTES]
        ops.closed([a, b])
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)  # the same size
        os.utime(src / "a", ns=(0, 10**9))
        write_file(src / "b", BLOCK_BYTES, seed=4)  # another size
        clock.jump(2.0)
        for inode, name in ((a, b"a"), (b, b"b")):  # ESTALE, then the new version's inode
            with pytest.raises(pyfuse3.FUSEError) as raised:
                await ops.read(inode, 0, BLOCK_BYTES)
            assert raised.value.errno == errno.ESTALE
            new = (await ops.lookup(ROOT_INODE, name, None)).st_ino
            assert await ops.read(new, 0, BLOCK_BYTES) == (src / name.decode()).read_bytes()[
                :BLOCK_BYTES]

    trio.run(main, clock=clock)


def test_reads_of_a_file_held_open_past_the_ttl_check_it_once_together(tmp_path):
    """The zero-request mode: a file held open (its handle made by a first READ, no close
    since) is checked again by a READ once its version was unseen for a TTL; the READs that
    come meanwhile wait for that one check. Unchanged, all read on; changed, all get ESTALE
    (before, they were served the old version from RAM with no check)."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    ops = operations(src, ttl_s=1.0)
    ops.decide_mode(no_open=True)
    clock = trio.testing.MockClock()
    source = ops.source

    async def main():
        a = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        old = (src / "a").read_bytes()
        assert await ops.read(a, 0, BLOCK_BYTES) == old[:BLOCK_BYTES]
        results: list = []

        async def read_second_block():
            try:
                results.append(await ops.read(a, BLOCK_BYTES, BLOCK_BYTES))
            except pyfuse3.FUSEError as exc:
                results.append(exc.errno)

        for change in (False, True):
            if change:
                write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
                os.utime(src / "a", ns=(0, 10**9))
            clock.jump(2.0)
            checks = source.requests["identity_check"]
            results.clear()
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(read_second_block)
            assert source.requests["identity_check"] == checks + 1
            expected = errno.ESTALE if change else old[BLOCK_BYTES:]
            assert results == [expected] * 4

    trio.run(main, clock=clock)


def test_an_older_stat_does_not_replace_a_newer_one(tmp_path):
    """A directory listing of some age (cachefs/dirs.py lists once per open directory) must
    not take a file back to the version it had then: the kernel would be told the old size."""
    write_file(tmp_path / "a", 10)
    old = os.lstat(tmp_path / "a")
    write_file(tmp_path / "a", 20)
    new = os.lstat(tmp_path / "a")
    inodes = InodeTable(os.lstat(tmp_path))
    inode = inodes.remember(b"a", new, lookup=True, stat_time_s=10.0)
    assert inodes.remember(b"a", old, lookup=False, stat_time_s=5.0) == inode
    assert inodes.get(inode).stat.st_size == 20 and inodes.get(inode).stat_time_s == 10.0
    # newer: it is the file now, another version, under an inode of its own (inodes.py)
    now = inodes.remember(b"a", old, lookup=False, stat_time_s=11.0)
    assert now != inode and inodes.get(now).stat.st_size == 10
    assert inodes.get(inode).stat.st_size == 20 and inodes.get(inode).retired


def test_what_a_close_is_counted_by_is_forgotten_when_its_file_changes(tmp_path):
    """The token a file's next close is counted by with no look at its entry (cachefs/
    inodes.py `close_tokens`) holds while the kernel keeps the inode and the file's identity
    stays: either changing puts its next close back through a look at the file (a close
    counted from a stale token would count a changed file as a RAM hit)."""
    for name in (b"a", b"b", b"c"):
        write_file(tmp_path / name.decode(), 10)
    inodes = InodeTable(os.lstat(tmp_path))
    a, b, c = (inodes.remember(name, os.lstat(tmp_path / name.decode()), lookup=True,
                               stat_time_s=1.0) for name in (b"a", b"b", b"c"))
    for inode in (a, b, c):
        inodes.remember_close(inode, f"token {inode}")
    assert inodes.close_tokens([a, b, c, 10**6]) == [f"token {a}", f"token {b}", f"token {c}",
                                                     None]
    inodes.update_stat(a, os.lstat(tmp_path / "a"), stat_time_s=2.0)  # re-checked, the same
    assert inodes.close_tokens([a]) == [f"token {a}"]
    write_file(tmp_path / "a", 10, seed=5)
    os.utime(tmp_path / "a", ns=(0, 123))  # another version of the same size
    inodes.update_stat(a, os.lstat(tmp_path / "a"), stat_time_s=3.0)
    inodes.retire(b)  # the source changed, as a sweep or a READ found
    assert inodes.close_tokens([a, b, c]) == [None, None, f"token {c}"]
    assert inodes.forget(c, 1) == b"c"
    inodes.remember_close(c, "late")  # forgotten: nothing to remember it by
    assert inodes.close_tokens([c]) == [None]


def test_a_lookup_tells_the_kernel_the_newest_stat_the_table_holds(tmp_path):
    """A lookup answered from the source's memo of an older stat, while the inode table held
    a newer one (a directory listing since): the kernel was told the old size, and its
    READs cut or padded at it."""
    src = tmp_path / "src"
    write_file(src / "a", 10)
    ops = operations(src)
    clock = trio.testing.MockClock()

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino  # the memo: 10 bytes
        write_file(src / "a", 20)
        clock.jump(1.0)
        ops.inodes.remember(b"a", os.lstat(src / "a"), lookup=False,
                            stat_time_s=trio.current_time())  # as a listing does
        attrs = await ops.lookup(ROOT_INODE, b"a", None)
        assert attrs.st_ino != inode and attrs.st_size == 20  # another version: a new inode

    trio.run(main, clock=clock)


def test_a_listing_gives_its_files_their_item_numbers_and_no_read_searches_again(
        tmp_path, monkeypatch):
    """Under an order, READDIRPLUS finds the item numbers of the files it lists in one search
    of the manifest per stretch of entries (more than one stretch here), the ones a search per
    file finds; the files' reads then search the manifest no more: neither the READ's own
    lookup of its item, nor the storage targets' count of the source read it makes."""
    src = tmp_path / "src"
    count = LISTED_ITEMS + 44
    for index in range(count):
        write_file(src / "d" / f"f{index:04d}", 10, seed=index)
    write_file(src / "top", 10, seed=1)
    targets = Targets()  # told of every source request, as in a mount
    source = Source(src, threads=2, requests=targets)
    freshness = Freshness(TTL_S)
    read_path = build_read_path(
        source, Stats(), RamTier(16 * BLOCK_BYTES, block_bytes=BLOCK_BYTES), None, freshness,
        block_bytes=BLOCK_BYTES, source_threads=2, lookahead_items=0, sequential_blocks=0,
        targets=targets, on_source_changed=None)
    ops = Operations(source, PublicOnly(read_path.reader), Control(lambda: {}, src / "order",
                                                                   lambda request: {}),
                     InodeTable(os.lstat(src), source.identity_of), None, freshness,
                     kernel_timeout_s=1.0)
    ops.decide_mode(no_open=False)
    manifest = scan_source(src).prepare()
    shuffled = np.random.default_rng(0).permutation(len(manifest))
    read_path.prefetcher.set_order(Order(
        epoch=0, current=shuffled, next=None, manifest=manifest, rank=None, world_size=None,
        total_length=len(manifest), file=None))
    listed: list[tuple[bytes, int]] = []

    def reply(token, name, attrs, next_id):
        """A reply holds 24 entries: the 25th is refused, and listed again by the next."""
        if len(listed) - token == 24:
            return False
        listed.append((name, attrs.st_ino))
        return True
    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def main():
        directory = (await ops.lookup(ROOT_INODE, b"d", None)).st_ino
        fh = await ops.opendir(directory, None)
        while True:
            before = len(listed)
            await ops.readdir(fh, before, before)  # the token: where this reply starts
            if len(listed) == before:
                break
        await ops.releasedir(fh)
        assert len(listed) == count
        for name, inode in listed:
            entry = ops.inodes.get(inode)
            assert entry.manifest_index == manifest.index_of(b"d/" + name)

        def searched(*args):
            raise AssertionError("the manifest was searched for a listed file")
        monkeypatch.setattr(manifest, "index_of", searched)
        for name, inode in listed[::50]:
            assert await read_file(ops, inode) == (src / "d" / os.fsdecode(name)).read_bytes()
        assert sum(target.requests for target in read_path.targets.all) == len(listed[::50])

    trio.run(main)


def test_a_late_report_of_an_older_version_keeps_the_newer_inode(tmp_path):
    """A source read that saw an older version can land after a lookup gave a newer one its
    inode (the file changed twice while it read): its report drops the older copies, but the
    inode of the version seen after it stays the path's, trusted no more (the read may have
    looked after the lookup: freshness.compare_look); a report asked after the inode's stat
    retires it. Either way the kernel drops its entry of the name and the pages of every
    retired inode of another version."""
    src = tmp_path / "src"
    stats = []
    for seed, mtime_s in ((1, 1), (2, 2), (3, 3)):
        write_file(src / "a", 100, seed=seed)
        os.utime(src / "a", ns=(0, mtime_s * 10**9))
        stats.append(os.lstat(src / "a"))
    source = Source(src, threads=1)
    v1, v2, v3 = (source.identity_of(st) for st in stats)
    inodes = InodeTable(os.lstat(src), source.identity_of)
    drops = KernelDrops()
    invalidation = KernelInvalidation(
        inodes, drops, invalidate_entry=lambda parent, name: drops.entries.append(
            (parent, name)))  # type: ignore[arg-type]

    async def changes():
        first = inodes.remember(b"a", stats[0], lookup=True, stat_time_s=1.0)
        third = inodes.remember(b"a", stats[2], lookup=True, stat_time_s=3.0)  # a lookup: v3
        assert third != first and inodes.get(first).retired
        invalidation.source_changed(b"a", v2, asked_s=2.0)  # a read of v2, landing late
        assert inodes.inode_of(b"a") == third and not inodes.get(third).retired
        # which of the two looks saw the file later cannot be told: the inode is asked again at
        # its next use, and its pages go meanwhile
        assert inodes.get(third).stat_time_s == NEVER_S
        await invalidation.entry_drops_landed()
        assert drops.pages == [third, first] and drops.entries == [(ROOT_INODE, b"a")]
        invalidation.source_changed(b"a", v1, asked_s=4.0)  # asked after the lookup's stat
        assert inodes.inode_of(b"a") is None and inodes.get(third).retired
        assert drops.pages == [third, first, third]
        assert v3 == inodes.identity(third)

    async def main():  # on trio's clock: a distrust is stamped (InodeTable.distrust)
        async with trio.open_nursery() as nursery:
            await nursery.start(invalidation.run)
            await changes()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock())


def test_a_change_seen_after_the_invalidations_ended_starts_nothing(tmp_path):
    """With no kernel page cache of ours, a kernel drop is a task of the invalidation's
    run; once the mount stops and that run ends, a source read landing late that finds a
    change retires the inode and starts no task (a closed nursery raised)."""
    src = tmp_path / "src"
    write_file(src / "a", 100, seed=1)
    old = os.lstat(src / "a")
    write_file(src / "a", 200, seed=2)
    source = Source(src, threads=1)
    inodes = InodeTable(os.lstat(src), source.identity_of)
    invalidation = KernelInvalidation(inodes, None, invalidate_entry=lambda *_: None)

    async def main():
        inode = inodes.remember(b"a", old, lookup=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(invalidation.run)
            nursery.cancel_scope.cancel()  # as the mount's end cancels it
        invalidation.source_changed(b"a", source.identity_of(os.lstat(src / "a")))
        assert inodes.get(inode).retired and inodes.inode_of(b"a") is None

    trio.run(main)


def test_the_source_remembers_the_stat_asked_last_whichever_lands_last(tmp_path):
    """Two looks at a file that changed between them can land in either order; the lookup
    answered from the memo must get the later one's, or it made an inode of the version the
    source replaced, and the reader's next open of it got ESTALE (cachefs/inodes.py)."""
    write_file(tmp_path / "a", 10)
    old = os.lstat(tmp_path / "a")
    write_file(tmp_path / "a", 20)
    new = os.lstat(tmp_path / "a")
    source = Source(tmp_path, threads=1)
    source._remember(b"a", new, 5.0)
    source._remember(b"a", old, 4.0)  # asked before, landed after
    clock = trio.testing.MockClock()

    async def main():
        clock.jump(5.0)
        st, asked_s = await source.lstat_recent(b"a", Freshness(TTL_S))
        assert (st.st_size, asked_s) == (20, 5.0)

    trio.run(main, clock=clock)


def test_a_close_of_a_retired_inode_counts_its_read_and_settles_nothing(tmp_path):
    """The zero-request mode: a reader read part of a file, which then changed; its close
    comes after the new version's inode was read. The old handle counts its read, but does
    not settle the kernel's pages: by path, that dropped the new version's pages, which the
    kernel may hold alone."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    stats = Stats()
    ops = operations(src, ttl_s=1.0, stats=stats)
    ops.decide_mode(no_open=True)
    reader = ops.reader._reader
    settled: list = []
    settle_pages = reader._settle_pages

    def recording_settle_pages(handle):
        settled.append(handle.inode)
        return settle_pages(handle)
    reader._settle_pages = recording_settle_pages
    clock = trio.testing.MockClock()

    async def main():
        old = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        assert await ops.read(old, 0, BLOCK_BYTES) == (src / "a").read_bytes()[:BLOCK_BYTES]
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
        os.utime(src / "a", ns=(0, 10**9))
        clock.jump(2.0)
        new = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        assert new != old
        assert await ops.read(new, 0, 2 * BLOCK_BYTES) == (src / "a").read_bytes()
        ops.closed([old, new])
        assert settled == [new]

    trio.run(main, clock=clock)
    assert stats.totals()["reads"] == 2  # both reads are counted


def test_the_lookup_after_an_open_found_a_change_gives_the_new_version(tmp_path):
    """The keep-cache mode: an open checks a file whose inode's version was last seen past
    the TTL, while the source's stat memo (an lstat a sweep took since, of a second version)
    is not; the check finds a third: ESTALE, and the kernel looks the file up again, once.
    That lookup was answered from the memo, of the version the source replaced: an inode of
    it, whose open was ESTALE again, and the reader's open(2) failed. The check's stat is the
    memo's now."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    ops = operations(src, ttl_s=10.0)
    clock = trio.testing.MockClock()

    async def main():
        old = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        clock.jump(6.0)
        write_file(src / "a", 2 * BLOCK_BYTES, seed=3)
        os.utime(src / "a", ns=(0, 5 * 10**8))
        await ops.source.lstat(b"a")  # a sweep's look at a second version: the memo
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
        os.utime(src / "a", ns=(0, 10**9))
        clock.jump(5.0)  # the inode's version was seen past the TTL, the memo's is not
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.open(old, os.O_RDONLY, None)
        assert raised.value.errno == errno.ESTALE
        new = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino  # the kernel's one retry
        assert new != old
        assert await read_file(ops, new) == (src / "a").read_bytes()

    trio.run(main, clock=clock)


def test_a_close_reported_while_a_read_waits_counts_that_read(tmp_path):
    """The zero-request mode learns of a close from fanotify, which may report it while a READ
    of the file still waits in the daemon (the kernel's read-ahead sends READs the reader
    never waits for). The handle was released at the close, and the READ's bytes, its wait and
    its miss counted nowhere (the file a RAM hit of no bytes, and not consumed). Now the
    handle is released when its last READ ends."""
    src = tmp_path / "src"
    write_file(src / "a", 100_000, seed=1)
    stats = Stats()
    ops = operations(src, stats=stats)
    ops.decide_mode(no_open=True)
    ops.source.delay_s = 0.2  # the source answers slowly: the READ waits

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                got.append(await ops.read(inode, 0, 131072))
            nursery.start_soon(read)
            await trio.sleep(0.05)  # the READ waits for the source
            ops.closed([inode])  # the close is reported meanwhile
            assert stats.current.reads == 0  # counted once its READ ends, not before
        assert got == [(src / "a").read_bytes()]
        record = stats.current
        assert (record.reads, record.misses, record.bytes_served) == (1, 1, 100_000)
        assert record.stall_s > 0.1

    trio.run(main)


def test_marks_that_never_land_hold_threads_of_their_own(tmp_path, monkeypatch):
    """A directory's fanotify mark is made in a thread that a request stops waiting for after
    MARK_WAIT_S, and the thread stays until the mark lands. Those threads held tokens of trio's
    default limiter, the one an order file's load takes (order_watch.py): marks that never
    land (a marker stuck) starved it. Now they hold MARK_THREADS of their own; a request in
    a new directory is still answered, after MARK_WAIT_S, without its mark."""
    from cachefs import fuse_ops

    monkeypatch.setattr(fuse_ops, "MARK_WAIT_S", 0.05)
    ops = operations(tmp_path)
    stuck = threading.Event()
    ops.decide_mode(no_open=True, mark_directory=lambda relpath: stuck.wait())

    async def main():
        default = trio.to_thread.current_default_thread_limiter()
        try:
            for index in range(fuse_ops.MARK_THREADS + 2):
                with trio.fail_after(5):
                    await ops._closes_reported(100 + index, f"d{index}".encode())
            assert default.borrowed_tokens == 0
            assert ops._mark_limiter.borrowed_tokens == fuse_ops.MARK_THREADS
            assert await trio.to_thread.run_sync(lambda: "loaded") == "loaded"
        finally:
            stuck.set()

    trio.run(main)
