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
started) lists it again, and the new listing replaces the old one for every handle: for an
unchanged directory the positions are the same; for a changed one, POSIX leaves open whether a
reader sees entries added or removed meanwhile.

Used from the trio thread only; the listing itself is read in a worker thread
(`Source.listdir`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import trio

from cachefs.freshness import NEVER_S, Freshness, now_s

Entries = list[tuple[bytes, os.stat_result]]


@dataclass
class _Dir:
    handles: int = 0
    entries: Entries | None = None
    listed_at_s: float = NEVER_S  # freshness.now_s() when the listing in `entries` was started
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

    async def open(self, relpath: bytes) -> None:
        """A handle of `relpath` opens: list it, unless a listing still trusted is held;
        the listing's error (OSError) is the open's."""
        held = self._dirs.setdefault(relpath, _Dir())
        held.handles += 1
        try:
            await self._listed(relpath, held, check=True)
        except BaseException:
            self.close(relpath)
            raise

    async def entries(self, relpath: bytes) -> tuple[Entries, float]:
        """The listing of an open directory (the one held, of any age), and when it was
        started (freshness.now_s(): how old its lstat results are)."""
        held = self._dirs[relpath]
        entries = await self._listed(relpath, held, check=False)
        return entries, held.listed_at_s

    def close(self, relpath: bytes) -> None:
        held = self._dirs.get(relpath)
        if held is None:
            return
        held.handles -= 1
        if held.handles <= 0:
            del self._dirs[relpath]  # a listing still in flight completes into nothing

    async def _listed(self, relpath: bytes, held: _Dir, *, check: bool) -> Entries:
        """`held`'s entries; `check`: from a listing trusted when this call was made (one
        started since counts, however long it took)."""
        asked_s = now_s()
        while held.entries is None or (
                check and not self._freshness.trusted(held.listed_at_s, at_s=asked_s)):
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
            held.entries, held.listed_at_s = entries, started_s
        return held.entries
