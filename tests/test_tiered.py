"""The tiered cache's fetches, with fakes for the source and the SSD tier (no FUSE)."""

from __future__ import annotations

import trio

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
