"""Whether a source identity is still trusted: the metadata TTL rule, on one clock.

The contract (man/cachefs-mount.1, "Changed source files"): what the source said of a file (its
lstat, or the identity a read's fstat gave) is trusted for `--metadata-ttl` seconds after it
was asked; after that it is asked again before a cached copy of the file is served, or the
kernel is told its attributes. Every place that holds such an answer (the inode table, the
source's memo of recent stats, directory listings, the prefetcher's identities of the order's
items) stamps it with `now_s()` when it was asked, and asks `Freshness.trusted` whether it may
still be used; those that re-check ahead of time, so that no reader waits for the check (the
read-ahead, the revalidation sweeps), ask `refresh_due`.

Answers land in any order (a read-ahead read in flight while a reader's check comes and goes),
and each saw the file at some moment between its ask and its landing: `compare_look` says what
a new one is worth beside the one recorded, for every holder that keeps the latest (the
prefetcher's identities of the order's items, those of packed files' byte ranges).

The clock is trio's (`trio.current_time`): a mount runs it on trio's system clock, the
simulator (cachefs/sim.py) and tests on a `trio.testing.MockClock`, so that virtual time ages
identities exactly as real time does in a mount. Stamps and checks therefore happen inside a
trio run; a stamp taken before the run starts is `NEVER_S` (never trusted).
"""

from __future__ import annotations

import math

import trio

NEVER_S = -math.inf  # the stamp of an answer that is not to be trusted (nothing asked yet)
# Re-checks ahead of time start once an answer is this fraction of the TTL old: one made then
# is still trusted when the reader gets to the file a read-ahead window later.
REFRESH_AGE_FRACTION = 0.5


def now_s() -> float:
    """The one clock stamps and checks are on (module docstring)."""
    return trio.current_time()


class Freshness:
    """The metadata TTL rule; `ttl_s` is `--metadata-ttl`."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s

    def trusted(self, seen_s: float, at_s: float | None = None) -> bool:
        """An answer asked at `seen_s` may still be used (at `at_s`, default now)."""
        return (now_s() if at_s is None else at_s) - seen_s <= self.ttl_s

    def oldest_trusted_s(self, at_s: float) -> float:
        """The oldest stamp `trusted` accepts at `at_s`: a pass over many stamps compares each
        with it (a call per stamp was most of such a pass)."""
        return at_s - self.ttl_s

    def refresh_due(self, seen_s: float, at_s: float | None = None) -> bool:
        """An answer asked at `seen_s` is old enough to be asked again ahead of its use."""
        return (now_s() if at_s is None else at_s) - seen_s > self.ttl_s * REFRESH_AGE_FRACTION


# what a look at a file is worth beside the one recorded (`compare_look`)
LOOK_NEWS = "news"  # asked after the recorded one: it replaces it
LOOK_OLDER = "older"  # the same version, asked before: tells nothing newer
LOOK_CONFLICT = "conflict"  # another version, asked before or at the same time


def compare_look(recorded: object | None, recorded_asked_s: float, seen: object,
                 asked_s: float) -> str:
    """A look that saw `seen`, asked at `asked_s`, beside the recorded one (`recorded`, None if
    none, asked at `recorded_asked_s`). In a conflict which of the two saw the file later
    cannot be told: neither is to be trusted until a look asked after both (module docstring).
    A read-ahead read that looked before a file changed, landing after a check saw the new
    version, undid that check: the old version trusted for a TTL, the new one's copies
    dropped."""
    if recorded is not None and seen != recorded and asked_s <= recorded_asked_s:
        return LOOK_CONFLICT
    return LOOK_OLDER if asked_s < recorded_asked_s else LOOK_NEWS
