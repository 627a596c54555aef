"""Directory listings for readdir: at most one per directory, shared by all its open handles.

Why. Each open directory handle used to hold a listing of its own, an lstat result per entry
(some 650 bytes each): a directory of a million files opened ten times held ten copies, and
any local user of an `allow_other` mount can open a directory as often as they like. Now the
daemon holds at most one listing per directory, whatever the number of handles and however
many open it at the same moment (one listing in flight per directory), and drops it with the
directory's last handle. Memory follows the directories of the source that are open, not how
often they are opened.

A listing is sorted by name, and readdir offsets are positions in it. An opendir of a directory
whose listing is no longer trusted (cachefs/freshness.py: --metadata-ttl after the listing was
started) lists it again, and the new listing is what later opens share; a handle keeps the
listing it was opened with (`open` returns it) until it rewinds (a read from offset 0, as
rewinddir(3) makes, past the TTL: `reopened`, the directory as it is then). When the new
listing replaced the old one for every handle, a reader part-way through a directory that
changed meanwhile had its offsets land on other entries: entries before its position added or
removed made it skip or repeat entries that had not changed (POSIX leaves open only whether
the changed ones are seen). So two listings of a directory are held at once only while a
handle opened before a relisting is open.

Used from the trio thread only; the listing itself is read in a worker thread
(`Source.listdir`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import trio

from cachefs.freshness import Freshness, now_s

Entries = list[tuple[bytes, os.stat_result]]


@dataclass(frozen=True)
class Listing:
    entries: Entries
    listed_at_s: float  # freshness.now_s() when the listing was started


@dataclass
class _Dir:
    handles: int = 0
    listing: Listing | None = None  # the newest, which opens share
    in_flight: trio.Event | None = None  # set when the listing being read is done


class DirListings:
    def __init__(self, source, freshness: Freshness):
        self._source = source
        self._freshness = freshness
        self._dirs: dict[bytes, _Dir] = {}

    @property
    def held(self) -> int:
        """Directories whose listing is held (for tests and stats)."""
        return len(self._dirs)

    async def open(self, relpath: bytes) -> Listing:
        """A handle of `relpath` opens: its listing, a new one unless one still trusted is
        held, which the handle keeps to its end (module docstring); the listing's error
        (OSError) is the open's."""
        held = self._dirs.setdefault(relpath, _Dir())
        held.handles += 1
        try:
            return await self._listed(relpath, held)
        except BaseException:
            self.close(relpath)
            raise

    async def reopened(self, relpath: bytes) -> Listing:
        """A listing trusted now for a handle of `relpath` already open (`open`), which
        rewinds (rewinddir(3): the directory as it is then, not as it was at the open)."""
        return await self._listed(relpath, self._dirs.setdefault(relpath, _Dir(handles=1)))

    def close(self, relpath: bytes) -> None:
        held = self._dirs.get(relpath)
        if held is None:
            return
        held.handles -= 1
        if held.handles <= 0:
            del self._dirs[relpath]  # a listing still in flight completes into nothing

    async def _listed(self, relpath: bytes, held: _Dir) -> Listing:
        """`held`'s listing, one trusted when this call was made (one started since counts,
        however long it took)."""
        asked_s = now_s()
        while held.listing is None or not self._freshness.trusted(held.listing.listed_at_s,
                                                                  at_s=asked_s):
            if held.in_flight is not None:
                await held.in_flight.wait()  # then look again: it may have failed
                continue
            held.in_flight = trio.Event()
            started_s = now_s()
            try:
                entries = await self._source.listdir(relpath)
            finally:
                held.in_flight.set()
                held.in_flight = None
            held.listing = Listing(entries, started_s)
        return held.listing
