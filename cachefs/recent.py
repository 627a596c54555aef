"""A dict that remembers only its most recently put keys: the daemon's short memories.

Two hot paths keep what they just learnt for the request that follows a few milliseconds
later: the source's latest stat of each path (a lookup after the read-ahead's fstat) and the
prefetcher's manifest index of each file it read ahead (an open after its lookup, without
hashing the path again). Both only need the last few thousand entries; unbounded, they would
grow with the data set. A plain dict keeps insertion order, so dropping the oldest is
`next(iter(d))`, O(1), with no per-entry bookkeeping.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class RecentMap(dict[K, V]):
    """At most `limit` entries; `put` makes a key the newest and drops the oldest beyond."""

    def __init__(self, limit: int):
        super().__init__()
        if limit < 1:
            raise ValueError(f"RecentMap needs a limit of at least 1, got {limit}")
        self.limit = limit

    def put(self, key: K, value: V) -> None:
        self.pop(key, None)  # re-inserted last: it is the newest now
        self[key] = value
        if len(self) > self.limit:
            del self[next(iter(self))]
