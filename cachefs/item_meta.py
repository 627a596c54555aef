"""The source identity of every item of the manifest in force, as last seen: numpy arrays
indexed by item (size, mtime_ns, inode and when each was seen: when the source was asked, on
cachefs/freshness.py's clock), no object per item. The prefetcher keeps one per manifest
(cachefs/prefetch.py: a new manifest renumbers every file, so a new one replaces it) and
trusts an identity as long as the freshness rule does; the running total of the known sizes
sizes the automatic read-ahead window.

Looks land in any order: a look asked before the recorded one was asked (`asked_s`) never
replaces it, and one that saw another version leaves neither trusted (`seen_s` is NEVER_S)
until a look asked after both settles it (`record`, freshness.compare_look)."""

from __future__ import annotations

import numpy as np

from cachefs.freshness import LOOK_CONFLICT, LOOK_OLDER, NEVER_S, Freshness, compare_look, now_s
from cachefs.source import SourceIdentity


class ItemMeta:
    """Source identity of every manifest item, as last seen; -1 where unknown."""

    def __init__(self, manifest_len: int):
        self.size = np.full(manifest_len, -1, np.int64)
        self.mtime_ns = np.zeros(manifest_len, np.int64)
        self.ino = np.zeros(manifest_len, np.int64)
        # freshness.now_s() when the recorded look was asked: what the freshness rule trusts
        # from (NEVER_S: not to be trusted), and what a later look must come after
        self.seen_s = np.full(manifest_len, NEVER_S)
        self.asked_s = np.full(manifest_len, NEVER_S)
        # running totals of the known sizes, so that mean_size is O(1): the automatic window
        # is recomputed as sizes become known (see Prefetcher._start_fetches)
        self._known_count = 0
        self._known_bytes = 0

    def record(self, item: int, identity: SourceIdentity, seen_s: float | None = None
               ) -> bool:
        """Record that the source was seen to hold `identity`, asked at `seen_s` (now if
        None). A look asked before the recorded one changes nothing; False if it saw another
        version (freshness.compare_look), and neither is trusted now."""
        seen_s = now_s() if seen_s is None else seen_s
        recorded = self.identity(item)
        look = compare_look(recorded, self.asked_s[item], identity, seen_s)
        if look == LOOK_CONFLICT:
            # in doubt, unless it was no look at the source (NEVER_S: a copy of a version the
            # caller named, the SSD tier's)
            if seen_s > NEVER_S:
                self.seen_s[item] = NEVER_S
            return False
        if look == LOOK_OLDER:
            return True
        if recorded is None:
            self._known_count += 1
        self._known_bytes += identity.size - (0 if recorded is None else recorded.size)
        self.size[item], self.mtime_ns[item], self.ino[item] = identity
        self.seen_s[item] = self.asked_s[item] = seen_s
        return True

    def trusted_identity(self, item: int, freshness: Freshness) -> SourceIdentity | None:
        """The item's identity, if `freshness` still trusts it."""
        identity = self.identity(item)
        return identity if identity is not None and freshness.trusted(self.seen_s[item]) \
            else None

    def identity_not_due(self, item: int, freshness: Freshness, at_s: float | None = None
                         ) -> SourceIdentity | None:
        """The item's identity, unless `freshness` calls it due for a refresh at `at_s` (now
        if None; the walk reads the clock once) (or unknown)."""
        if self.refresh_due(item, freshness, at_s):
            return None
        return self.identity(item)

    def refresh_due(self, item, freshness: Freshness, at_s: float | None = None):
        """Whether `freshness` calls the item's identity due for a refresh at `at_s` (now if
        None); for an array of items, of each."""
        return freshness.refresh_due(self.seen_s[item], at_s)

    def identity(self, item: int) -> SourceIdentity | None:
        """The item's identity as last seen, however long ago; None if never seen."""
        if self.size[item] < 0:
            return None
        return SourceIdentity(int(self.size[item]), int(self.mtime_ns[item]), int(self.ino[item]))

    def mean_size(self, default: int) -> int:
        return self._known_bytes // self._known_count if self._known_count else default
