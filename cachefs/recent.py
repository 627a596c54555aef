"""A dict that remembers only its most recently put keys: the daemon's short memories.

Two hot paths keep what they just learnt for the request that follows a few milliseconds
later: the source's latest stat of each path (a lookup after the read-ahead's fstat) and the
prefetcher's manifest index of each file it read ahead (an open after its lookup, without
hashing the path again). Both only need the last few thousand entries; unbounded, they would
grow with the data set. An OrderedDict drops its oldest entry in O(1) (`popitem(last=False)`).
A plain dict does not: `next(iter(d))` walks past every slot deleted from the front since the
dict was last compacted, up to `limit` of them, so a put cost 4 us instead of 0.3 at 8,192
entries, on every file a reader opened outside the read-ahead and every block read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class RecentMap(OrderedDict[K, V]):
    """At most `limit` entries; `put` makes a key the newest and drops the oldest beyond."""

    def __init__(self, limit: int):
        super().__init__()
        if limit < 1:
            raise ValueError(f"RecentMap needs a limit of at least 1, got {limit}")
        self.limit = limit

    def put(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)  # the newest now
        if len(self) > self.limit:
            self.popitem(last=False)
