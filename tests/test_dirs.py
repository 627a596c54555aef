"""DirListings: one listing per directory, whatever the number of handles (issue 15, item 14)."""

from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing

from cachefs.dirs import DirListings
from cachefs.freshness import Freshness


class SlowSource:
    """Source.listdir's interface; counts listings, each taking a while, or failing."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self.listings = 0
        self.error: OSError | None = None

    async def listdir(self, relpath: bytes):
        self.listings += 1
        await trio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return [(b"%s-%d" % (relpath, self.listings), os.lstat("/"))]


def test_concurrent_opens_share_one_listing_dropped_with_the_last_handle():
    source = SlowSource()
    dirs = DirListings(source, Freshness(60.0))

    async def main():
        listings = []

        async def open_one():
            listings.append(await dirs.open(b"d"))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(open_one)  # all before the first listing is done
        assert source.listings == 1 and dirs.held == 1
        assert all(listing is listings[0] for listing in listings)
        (name, _st), = listings[0].entries
        assert name == b"d-1"
        for _ in range(50):
            dirs.close(b"d")
        assert dirs.held == 0
        await dirs.open(b"d")
        assert source.listings == 2

    trio.run(main)


def test_an_open_after_the_ttl_lists_again_and_older_handles_keep_theirs():
    """A handle part-way through a directory whose listing was replaced under it (an open by
    another process after the TTL) had its offsets land on other entries: it skipped or
    repeated unchanged ones. It keeps the listing it was opened with."""
    source = SlowSource(delay_s=0)
    dirs = DirListings(source, Freshness(0.05))

    async def main():
        first = await dirs.open(b"d")
        assert await dirs.open(b"d") is first  # within the TTL: shared
        assert source.listings == 1
        await trio.sleep(0.1)
        newer = await dirs.open(b"d")
        assert source.listings == 2
        assert newer.entries[0][0] == b"d-2" and first.entries[0][0] == b"d-1"
        assert await dirs.open(b"d") is newer  # what later opens share

    # on trio's virtual clock: on the real one, two opens 50 ms apart on a busy machine fell
    # on either side of the TTL
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_listing_ages_on_trios_clock():
    """The TTL runs on trio's clock (cachefs/freshness.py), which the simulator and tests move:
    virtual time ages a listing as real time does in a mount (before, listings were stamped
    with time.monotonic, and an hour of virtual time left them fresh)."""
    source = SlowSource(delay_s=0)
    dirs = DirListings(source, Freshness(60.0))

    async def main():
        await dirs.open(b"d")
        await trio.sleep(30)
        await dirs.open(b"d")
        assert source.listings == 1
        await trio.sleep(3600)
        await dirs.open(b"d")
        assert source.listings == 2

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failed_listing_fails_the_open_and_holds_nothing():
    source = SlowSource()
    source.error = PermissionError(errno.EACCES, "Permission denied")
    dirs = DirListings(source, Freshness(60.0))

    async def main():
        with pytest.raises(PermissionError):
            await dirs.open(b"d")
        assert dirs.held == 0

    trio.run(main)
