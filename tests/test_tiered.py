"""The tiered cache's fetches, with fakes for the source and the SSD tier (no FUSE)."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from cachefs import read_pool
from cachefs import stats as stats_mod
from cachefs.cache.ram import RamTier
from cachefs.cache.tiered import TieredCache
from cachefs.source import BlockData, SourceIdentity

OLD = SourceIdentity(10, 1, 5)
NEW = SourceIdentity(10, 2, 5)  # the same file rewritten: same size, a later mtime


class Ranking:
    def priority_of(self, item, block_index, identity):
        return 1.0

    def item_now(self, relpath, item, manifest):
        return item, manifest


class SlowSsdOfTheOldVersion:
    """Holds the old version's block, and takes a while to read it."""

    def contains(self, key, identity):
        return identity == OLD

    def holds_other_version(self, key, identity):
        return identity != OLD

    def read(self, key, identity):
        return b"o" * 10 if identity == OLD else None

    def has_room(self, nbytes):
        return False


class SourceOfTheNewVersion:
    async def read_block(self, relpath, block_index, block_bytes, background=False, item=None,
                         expected_bytes=0):
        return BlockData(b"n" * 10, NEW, None, 0.0)


def test_a_read_of_a_new_version_does_not_take_a_fetch_of_the_old_in_flight():
    """A read-ahead of the old version is in flight (from the SSD tier) when a reader of the
    new version, which an open has just learnt, asks for the same block: it joined that
    fetch and was handed the old bytes (and the daemon recorded the old identity as fresh
    again). It fetches the block of its own version."""
    async def slow_ssd_call(fn, *args):
        await trio.sleep(0.05)
        return fn(*args)

    tiered = TieredCache(RamTier(1 << 20, block_bytes=4096), SourceOfTheNewVersion(),
                         stats_mod.Stats(), 4096, Ranking(), ssd=SlowSsdOfTheOldVersion(),
                         run_ssd=slow_ssd_call)
    got = {}

    async def main():
        async with trio.open_nursery() as nursery:
            async def read_ahead():
                got["read-ahead"] = await tiered.fetch((b"f", 0), OLD, 0, None, demand=False)
            nursery.start_soon(read_ahead)
            await trio.sleep(0.01)  # the read-ahead's fetch is in flight
            got["reader"] = await tiered.fetch((b"f", 0), NEW, 0, None, demand=True)

    trio.run(main)
    assert (got["read-ahead"].identity, got["read-ahead"].data) == (OLD, b"o" * 10)
    assert (got["reader"].identity, got["reader"].data) == (NEW, b"n" * 10)


def test_a_report_of_another_version_leaves_the_source_no_stat_to_answer_from(tmp_path):
    """A change reported (a read that saw another version, perhaps landing after a lookup
    asked later) drops the source's remembered stat of another version: a lookup answered
    from it gave the kernel that version for a TTL. A report of the remembered version
    keeps it."""
    from cachefs.freshness import Freshness
    from cachefs.source import Source

    (tmp_path / "a").write_bytes(b"x" * 10)
    source = Source(tmp_path, threads=1)
    tiered = TieredCache(RamTier(1 << 20, block_bytes=4096), source, stats_mod.Stats(), 4096,
                         Ranking())
    freshness = Freshness(60.0)

    async def main():
        st, _ = await source.lstat_recent(b"a", freshness)
        await source.lstat_recent(b"a", freshness)
        assert source.requests["lstat"] == 1  # the second from the memo
        tiered.source_changed(b"a", source.identity_of(st))
        await source.lstat_recent(b"a", freshness)
        assert source.requests["lstat"] == 1
        tiered.source_changed(b"a", SourceIdentity(11, 1, 1), asked_s=0.0)
        await source.lstat_recent(b"a", freshness)
        assert source.requests["lstat"] == 2  # asked again

    trio.run(main)


def test_a_change_is_counted_once_a_version_whoever_finds_it(tmp_path):
    """`revalidation.changed` (man/cachefs-stats.1) counts every change acted on: a sweep, a
    lookup, the read-ahead's check or a read may each find one, and often several find the
    same one; it counted the sweeps' alone, and a change the read-ahead found first was
    never counted. Each new version of a file counts once."""
    from cachefs.source import Source

    source = Source(tmp_path, threads=1)
    tiered = TieredCache(RamTier(1 << 20, block_bytes=4096), source, stats_mod.Stats(), 4096,
                         Ranking())
    tiered.source_changed(b"a", NEW)  # the read-ahead's check
    tiered.source_changed(b"a", NEW, asked_s=0.0)  # a read of the same version
    tiered.source_changed(b"b", NEW)
    assert tiered.changes_found == 2
    tiered.source_changed(b"a", OLD)  # rewritten again
    assert tiered.changes_found == 3


def test_a_failing_drop_of_a_stale_ssd_entry_is_a_miss():
    """The SSD tier holds the old version of a block a reader asks for at the new one: the
    read that drops it failing (a device error, a bug) is a miss, counted, and the block
    comes from the source; it failed the reader's read with EIO."""
    class SsdFailingOnTheStaleEntry(SlowSsdOfTheOldVersion):
        def read(self, key, identity):
            raise OSError(5, "Input/output error")

    async def inline(fn, *args):
        return fn(*args)

    stats = stats_mod.Stats()
    tiered = TieredCache(RamTier(1 << 20, block_bytes=4096), SourceOfTheNewVersion(), stats,
                         4096, Ranking(), ssd=SsdFailingOnTheStaleEntry(), run_ssd=inline)

    async def main():
        return await tiered.fetch((b"f", 0), NEW, 0, None, demand=True)

    fetched = trio.run(main)
    assert (fetched.identity, fetched.data) == (NEW, b"n" * 10)
    assert stats.ssd_errors == 1


def test_a_fetch_begun_with_no_task_lands_in_ram_and_serves_the_reader_waiting_for_it(
        tmp_path):
    """`start_fetch` (the read-ahead's usual fetch): one source read begun now, whose
    landing keeps the block in RAM, is what a demand fetch of the block in flight waits for
    (a stall: it came from the source), and tells `on_done`. Not begun (False), with nothing
    reserved or in flight: the block in flight already, no room in RAM, no source thread
    free. A read that fails tells its error, and keeps nothing."""
    from cachefs.source import Source
    if not read_pool.available():
        pytest.skip("cachefs._readpool not built")
    data = os.urandom(5000)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "g").write_bytes(data)
    ram = RamTier(1 << 20, block_bytes=8192)
    tiered = TieredCache(ram, Source(tmp_path, threads=1), stats_mod.Stats(), 8192,
                         Ranking())
    told = []

    def on_done(fetched, error):
        told.append((fetched, error))

    async def main():
        assert tiered.start_fetch((b"f", 0), None, 0, None, expected_bytes=5000,
                                  on_done=on_done)
        assert (b"f", 0) in tiered.inflight and ram.reserved_bytes > 0
        assert not tiered.start_fetch((b"f", 0), None, 0, None, on_done=on_done)
        # the source's one thread is taken: nothing begun, nothing reserved for it
        reserved = ram.reserved_bytes
        assert not tiered.start_fetch((b"g", 0), None, 1, None, on_done=on_done)
        assert ram.reserved_bytes == reserved and (b"g", 0) not in tiered.inflight
        reader = await tiered.fetch((b"f", 0), None, 0, None, demand=True)
        assert (reader.data, reader.origin) == (data, stats_mod.ORIGIN_MISS)
        assert len(told) == 1
        fetched, error = told[0]
        assert error is None and fetched.data == data
        assert fetched.origin == stats_mod.ORIGIN_PREFETCHED
        # the reader's READ did not say it returns the whole block: the kernel is not
        # known to get its pages from the reply (prefetch.py pushes them)
        assert not fetched.read_whole_on_landing
        assert ram.get((b"f", 0)).data == data and ram.reserved_bytes == 0
        assert not tiered.inflight

        assert tiered.start_fetch((b"missing", 0), None, 2, None, expected_bytes=10,
                                  on_done=on_done)
        with trio.fail_after(5):
            while len(told) < 2:
                await trio.sleep(0.005)
        assert told[1][0] is None and told[1][1].errno == errno.ENOENT
        assert ram.reserved_bytes == 0 and (b"missing", 0) not in ram and not tiered.inflight

    trio.run(main)
    # no room: a RAM tier smaller than the block
    small = TieredCache(RamTier(100, block_bytes=8192), Source(tmp_path, threads=1),
                        stats_mod.Stats(), 8192, Ranking())

    async def no_room():
        assert not small.start_fetch((b"f", 0), None, 0, None, expected_bytes=5000,
                                     on_done=on_done)
        assert small.ram.reserved_bytes == 0 and not small.inflight

    trio.run(no_room)
