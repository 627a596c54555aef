"""Directory listings for readdir: at most one per directory, shared by all its open handles.

Why. Each open directory handle used to hold a listing of its own, an lstat result per entry
(some 650 bytes each): a directory of a million files opened ten times held ten copies, and
any local user of an `allow_other` mount can open a directory as often as they like. Now the
daemon holds at most one listing per directory, whatever the number of handles and however
many open it at the same moment (one listing in flight per directory), and drops it with the
directory's last handle. Memory follows the directories of the source that are open, not how
often they are opened.

A listing is sorted by name, and readdir offsets are positions in it. An opendir more than
`ttl_s` (--metadata-ttl) after the directory was listed lists it again, and the new listing
replaces the old one for every handle: for an unchanged directory the positions are the same;
for a changed one, POSIX leaves open whether a reader sees entries added or removed meanwhile.

Used from the trio thread only; the listing itself is read in a worker thread
(`Source.listdir`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import trio

Entries = list[tuple[bytes, os.stat_result]]


@dataclass
class _Dir:
    handles: int = 0
    entries: Entries | None = None
    listed_at_s: float = -math.inf  # when the listing in `entries` was started
    in_flight: trio.Event | None = None  # set when the listing being read is done


class DirListings:
    def __init__(self, source, ttl_s: float):
        self._source = source
        self._ttl_s = ttl_s
        self._dirs: dict[bytes, _Dir] = {}

    @property
    def held(self) -> int:
        """Directories whose listing is held (for tests and stats)."""
        return len(self._dirs)

    async def open(self, relpath: bytes) -> None:
        """A handle of `relpath` opens: list it, unless a listing younger than ttl_s is held;
        the listing's error (OSError) is the open's."""
        held = self._dirs.setdefault(relpath, _Dir())
        held.handles += 1
        try:
            await self._listed(relpath, held, self._ttl_s)
        except BaseException:
            self.close(relpath)
            raise

    async def entries(self, relpath: bytes) -> tuple[Entries, float]:
        """The listing of an open directory (the one held, of any age), and when it was
        started (time.monotonic(): how old its lstat results are)."""
        held = self._dirs[relpath]
        entries = await self._listed(relpath, held, math.inf)
        return entries, held.listed_at_s

    def close(self, relpath: bytes) -> None:
        held = self._dirs.get(relpath)
        if held is None:
            return
        held.handles -= 1
        if held.handles <= 0:
            del self._dirs[relpath]  # a listing still in flight completes into nothing

    async def _listed(self, relpath: bytes, held: _Dir, max_age_s: float) -> Entries:
        """`held`'s entries, from a listing started at most max_age_s before this call."""
        asked_s = time.monotonic()
        while held.entries is None or held.listed_at_s < asked_s - max_age_s:
            if held.in_flight is not None:
                await held.in_flight.wait()  # then look again: it may have failed
                continue
            held.in_flight = trio.Event()
            started_s = time.monotonic()
            try:
                entries = await self._source.listdir(relpath)
            finally:
                held.in_flight.set()
                held.in_flight = None
            held.entries, held.listed_at_s = entries, started_s
        return held.entries
