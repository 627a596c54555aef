"""The FUSE handlers called directly, without a kernel (issue 16): what they may touch of the
read path, and how they age what the source told them.

The read path is the real one (`build_read_path` over a `Source` of a temporary directory);
time is a `trio.testing.MockClock` that only moves when a test jumps it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
import trio
import trio.testing

from cachefs.cache.ram import RamTier, page_bytes
from cachefs.ctrl import Control
from cachefs.freshness import Freshness
from cachefs.fuse_ops import LISTED_ITEMS, Operations
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


def operations(src: Path, ttl_s: float = TTL_S, changed: list | None = None,
               stats: Stats | None = None) -> Operations:
    source = Source(src, threads=2)
    freshness = Freshness(ttl_s)
    read_path = build_read_path(
        source, stats or Stats(), RamTier(16 * BLOCK_BYTES, block_bytes=BLOCK_BYTES), None,
        freshness,
        block_bytes=BLOCK_BYTES, source_threads=2, lookahead_items=0, sequential_blocks=0,
        on_source_changed=None if changed is None else (
            lambda relpath, identity: changed.append(relpath)))
    control = Control(lambda: {}, src / "order", lambda request: {})
    ops = Operations(source, PublicOnly(read_path.reader), control,
                     InodeTable(os.lstat(src), source.identity_of), None, freshness,
                     kernel_timeout_s=1.0)
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
    the file changed to another size (ESTALE, then the new version after a stat), and forget:
    the operations need nothing of the read path but the reader's public methods (before, they
    reached through it to the tiered cache and the prefetcher)."""
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
        # the kernel holds the old size, which would cut or pad the new bytes: ESTALE, and
        # the next stat learns the new version, whose open then reads it whole
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await read_file(ops, inode)
        assert raised.value.errno == errno.ESTALE
        assert changed == [b"a"]
        assert (await ops.getattr(inode, None)).st_size == 50_000
        assert await read_file(ops, inode) == (src / "a").read_bytes()
        ops.forget([(inode, 1)])

    trio.run(main, clock=clock)


def test_a_read_past_the_new_size_of_a_file_just_shrunk_is_refused(tmp_path):
    """The kernel reads only within the size it holds. Just after a file shrank, a READ past
    the last page of the new size comes from a kernel that still holds the old one (its
    update of the attributes lost a race): answered short, the kernel zero-filled the rest up
    to its size, and a reader got the new bytes, then zeros (the soak, once in several runs).
    ESTALE, and the kernel is told again; a read past the end of a file whose size did not
    change (O_DIRECT asks unclamped) is answered as ever."""
    src = tmp_path / "src"
    write_file(src / "a", 100_000, seed=1)
    write_file(src / "b", 30_000, seed=3)
    changed: list[bytes] = []
    ops = operations(src, ttl_s=1.0, changed=changed)
    clock = trio.testing.MockClock()

    async def read(inode: int, size: int) -> bytes:
        info = await ops.open(inode, os.O_RDONLY, None)
        try:
            return await ops.read(info.fh, 0, size)
        finally:
            await ops.release(info.fh)

    async def main():
        a = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        b = (await ops.lookup(ROOT_INODE, b"b", None)).st_ino
        assert await read(b, 4 * BLOCK_BYTES) == (src / "b").read_bytes()  # unchanged
        write_file(src / "a", 50_000, seed=2)
        clock.jump(2.0)  # past the TTL
        assert (await ops.getattr(a, None)).st_size == 50_000  # the table now holds it
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await read(a, page_bytes(100_000))  # a kernel still at the old size
        assert raised.value.errno == errno.ESTALE and changed == [b"a"]
        assert await read(a, page_bytes(50_000)) == (src / "a").read_bytes()
        clock.jump(60.0)  # long after the change: O_DIRECT's unclamped reads are served
        assert await read(a, 4 * BLOCK_BYTES) == (src / "a").read_bytes()

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
        assert (await ops.getattr(inode, None)).st_size == 20  # asked again

    trio.run(main, clock=clock)


def test_reads_without_open_of_a_file_changed_to_the_same_size_keep_one_handle(tmp_path):
    """The zero-request mode: the first READ finds the file changed to a new version of the
    size the kernel holds and serves it; the next READs stay on that one handle (they made a
    new one each, with the old version, and read every block again, the first handles never
    counted), and the close counts the file once, with every byte served."""
    src = tmp_path / "src"
    write_file(src / "a", 2 * BLOCK_BYTES, seed=1)
    stats = Stats()
    ops = operations(src, stats=stats)
    ops.decide_mode(no_open=True)

    async def main():
        inode = (await ops.lookup(ROOT_INODE, b"a", None)).st_ino
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)
        new = (src / "a").read_bytes()
        for offset in (0, BLOCK_BYTES, 0):  # the last: the kernel reads block 0 again
            assert await ops.read(inode, offset, BLOCK_BYTES) == new[offset:offset + BLOCK_BYTES]
        ops.closed([inode])

    trio.run(main)
    totals = stats.totals()
    assert totals["reads"] == 1 and totals["bytes_served"] == 3 * BLOCK_BYTES
    assert totals["backend_reads"] == 2  # each block once


def test_a_close_whose_accounting_fails_does_not_stop_the_others(tmp_path, caplog):
    src = tmp_path / "src"
    write_file(src / "a", 100)
    write_file(src / "b", 100)
    stats = Stats()
    ops = operations(src, stats=stats)
    ops.decide_mode(no_open=True)
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
        write_file(src / "a", 2 * BLOCK_BYTES, seed=2)  # the same size: served new
        write_file(src / "b", BLOCK_BYTES, seed=4)  # another size: ESTALE, then looked up
        clock.jump(2.0)
        assert await ops.read(a, 0, BLOCK_BYTES) == (src / "a").read_bytes()[:BLOCK_BYTES]
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.read(b, 0, BLOCK_BYTES)
        assert raised.value.errno == errno.ESTALE

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
    inodes.remember(b"a", old, lookup=False, stat_time_s=11.0)  # newer: it is the file now
    assert inodes.get(inode).stat.st_size == 10


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
    inodes.expire(b)  # the source changed, as a sweep or a READ found
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
        assert (attrs.st_ino, attrs.st_size) == (inode, 20)

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
