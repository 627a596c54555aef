"""Byte-range items in the RAM tier and the kernel's pages: fetched by span, kept by item.

An order of byte-range items (cachefs.order_items) names samples inside large files, and the
policy is the one of whole files (docs/design.md §2) with an item for a file. Blocks do not fit
it: a 100 KB row of a `.npy` straddles blocks shared with rows used at other times, so a block
cache reads several times the bytes a sample needs and keeps bytes of samples it does not want,
which costs the head of the next epoch most of the RAM that should hold it (docs/design.md §3,
"Byte-range items"). So each item is a RAM-tier entry of its own:

- Key ``(relpath, RangeKey(offset, length))``, the item's range; the entry's `item` is its
  number in the order in force (found again by the range when the table changes,
  cachefs/ranking.py) and its priority is the item's next use, nothing else. The SSD tier holds
  no ranges.
- Bytes: while the item is unconsumed the entry holds its *page extent*, the whole pages its
  range touches (the bytes of its neighbours in its first and last page included), because the
  kernel only takes whole pages (`push`). Once consumed, a retained entry (the next epoch's
  head) is trimmed to the item's own bytes, so that what RAM holds across the boundary is
  samples and nothing else; when the window reaches it again the few bytes of its edge pages
  are read from the source (`complete`), off the reader's path.
- Fetching: the read-ahead and the readers hand `fetch` a *span*, items whose extents touch,
  read in one source read (adjacent ranges merged, up to `MAX_SPAN_BYTES`), then split into
  entries; one fetch per item at a time (a dict of in-flight fetches by range key, which a
  reader waits on instead of reading again). RAM is reserved per item before the read, by the
  caller's priority, as blocks are (cachefs/cache/tiered.py).

The kernel's pages (docs/design.md §4). A memmap reader reads with page faults: pages the kernel
holds cost no request, so the window's items are stored into the page cache (`push`, from a
worker thread: cachefs/pagecache.py) as they land, but for one page each, the item's *sentinel*
(the last page wholly inside it). The reader's fault on it is the one READ the item costs, and
that READ is how the daemon learns the item was read (cachefs/range_read.py). With the kernel's
read-ahead off (the mount sets it to 0 while an order of ranges is in force, mount.py), a
fault reads that page alone: no bytes of neighbouring items are fetched behind the reader's
back, and a READ of a sentinel means that sample, not a neighbour. Pages stay in the kernel
after their item was consumed; so that a sample read again is seen again, and the kernel holds
no more than the window and a few recently read items beyond the RAM budget, pages are
dropped every `DROP_EVERY_ITEMS` (128) consumed items in all files (the pages of each file
with one consumed since; sooner for items so large that theirs would exceed a
`DROP_AT_BUDGET_FRACTION` of the budget) and whenever a new epoch or plan starts. At a new
epoch or plan all of them go, and the window's items are pushed again from RAM. Every 128
items, where the kernel can drop a range (`invalidate_inode_range`, a patch of
ours to pyfuse3), the extents of the items pushed and not yet read stay, and only the pages
outside them go (about one range per item of the window): dropping the whole file there cost
the stores of the window again, some 1,500 of 11,300 an epoch, and the reader, one item past
the drop, met the pages of the next items before their stores landed, each a READ (5,000 rows
of 100 KB over slowfs: 6,500-7,100 READs an epoch where 5,000 are the sentinels'; with the
window's extents kept and the window at three times the source threads, cachefs/prefetch.py,
5,300-5,650, and 10,100 stores). Without the patch the whole file goes, as at an epoch's start.

A file whose version was not seen at the source within the TTL loses its pages to the overdue
pass (cachefs/revalidate.py, "Overdue", `drop_overdue_pages`), but for those of READs waiting
for their answer (`reading`, from the READ's arrival: fuse_ops.read): each such READ checked
the file first, and its answer fills them. Dropped, they went the moment it landed (the drop
waits on their lock), before the reader had them, and the reader asked again; where every
READ took longer than the pass's interval (a source slower than the TTL) that went on for
good: with the daemon on one CPU, a read of a `.npy` never ended. Where the kernel cannot drop
a range, a file with a READ waiting is left to the next pass.

Pure trio and the injected kernel calls: no pyfuse3 here.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import trio

from cachefs import stats as stats_mod
from cachefs.cache.ram import PAGE_BYTES, RamBlock, RamTier
from cachefs.cache.tiered import KernelInodes
from cachefs.freshness import (
    LOOK_CONFLICT,
    LOOK_OLDER,
    NEVER_S,
    REFRESH_AGE_FRACTION,
    Freshness,
    compare_look,
    now_s,
)
from cachefs.order_items import Items
from cachefs.pagecache import KernelPages
from cachefs.ranking import Ranking
from cachefs.recent import RecentMap
from cachefs.source import Source, SourceIdentity
from cachefs.stats import Stats


# `drop_file_pages(relpath, keep)`: the kernel drops the file's pages, all of them (keep None)
# or all but the byte extents [lo, hi) in `keep` (sorted) where it can drop a range; True if
# those extents stay
DropFilePages = Callable[[bytes, "list[tuple[int, int]] | None"], bool]

MAX_SPAN_BYTES = 4 << 20  # one source read covers adjacent items up to this many bytes
# consumed items whose pages the kernel may still hold, in all files: then the pages of each
# file with one go (module docstring); and at most this share of the RAM budget in their
# page extents' bytes (items of megabytes each)
DROP_EVERY_ITEMS = 128
DROP_AT_BUDGET_FRACTION = 4
KEYS_REMEMBERED = 16384  # items whose RAM-tier key is remembered (`key_of`)


class RangeKey(NamedTuple):
    """Where a range entry's item lies in its file (the second half of its RAM-tier key)."""

    offset: int
    length: int


def page_extent(offset: int, length: int, size_bytes: int | None = None) -> tuple[int, int]:
    """The whole pages bytes [offset, offset + length) touch, cut at the file's end."""
    lo = offset // PAGE_BYTES * PAGE_BYTES
    hi = -(-(offset + length) // PAGE_BYTES) * PAGE_BYTES
    return lo, hi if size_bytes is None else min(hi, size_bytes)


def sentinel_page(offset: int, length: int) -> int:
    """The page whose READ says the item was read: the last page wholly inside it, or, for an
    item with no whole page, the page of its last byte (shared with a neighbour: a READ of it
    then counts for both, docs/design.md §4)."""
    last_whole = (offset + length) // PAGE_BYTES - 1
    if last_whole * PAGE_BYTES >= offset:
        return last_whole
    return (offset + length - 1) // PAGE_BYTES


@dataclass
class Want:
    """One item to fetch: its number, range, page extent and the RAM reserved for it."""

    item: int
    offset: int
    length: int
    reserved: int = 0  # bytes of RAM reserved (0: the bytes are not kept)

    @property
    def extent(self) -> tuple[int, int]:
        return page_extent(self.offset, self.length)


def spans(wants: list[Want]) -> list[list[Want]]:
    """`wants` of one file (any order) as spans: by offset, extents that touch, at most
    `MAX_SPAN_BYTES` each; each span is one source read."""
    out: list[list[Want]] = []
    for want in sorted(wants, key=lambda w: w.offset):
        lo, hi = want.extent
        if out:
            span_lo, span_hi = out[-1][0].extent[0], out[-1][-1].extent[1]
            if lo <= span_hi and hi - span_lo <= MAX_SPAN_BYTES:
                out[-1].append(want)
                continue
        out.append([want])
    return out


class _Flight:
    __slots__ = ("done", "data", "identity", "error")

    def __init__(self):
        self.done = trio.Event()
        self.data: bytes | None = None  # the item's extent (cut at the file's end)
        self.identity: SourceIdentity | None = None
        self.error: OSError | None = None


def entry_extent(block: RamBlock, offset: int, length: int) -> tuple[int, memoryview]:
    """(file offset, bytes) of what the item's entry holds: its page extent, its neighbours'
    bytes in its edge pages included, or, trimmed, its own bytes."""
    assert block.data is not None  # range entries are never only in the kernel
    data_lo = offset if len(block.data) == length else page_extent(offset, length)[0]
    return data_lo, memoryview(block.data)


def item_bytes(block: RamBlock, offset: int, length: int) -> memoryview:
    """The item's own bytes in its entry (`entry_extent`)."""
    data_lo, data = entry_extent(block, offset, length)
    return data[offset - data_lo:offset - data_lo + length]


class RangeCache:
    """The range entries of the order in force, their fetches, and the kernel's pages of them."""

    def __init__(self, ram: RamTier, source: Source, stats: Stats, ranking: Ranking,
                 freshness: Freshness, *, kernel: KernelPages | None,
                 kernel_inodes: KernelInodes | None,
                 source_changed: Callable[[bytes, SourceIdentity, float | None], None],
                 drop_file_pages: DropFilePages):
        self.ram = ram
        self.source = source
        self.stats = stats
        self.ranking = ranking
        self.freshness = freshness
        self.kernel = kernel
        self.kernel_inodes = kernel_inodes
        self._source_changed = source_changed
        self._drop_file_pages = drop_file_pages
        self.inflight: dict[tuple, _Flight] = {}
        # each file's identity as last read, and when (freshness.now_s); by relpath
        # relpath -> (identity, trusted from (NEVER_S: in doubt), asked at): record_identity
        self._identities: dict[bytes, tuple[SourceIdentity, float, float]] = {}
        # items whose extent the kernel holds (stored, or queued to be), since the file's
        # pages went whole (`drop_pages`)
        self.pushed: set[int] = set()
        # trimmed items whose inside pages are stored, since then (`push`)
        self._inside_pushed: set[int] = set()
        # the item numbering (Ranking.numbering) those two sets number items of: another
        # table's numbers index its arrays out of range, or name other items (`_pushed_now`)
        self._pushed_numbering = -1
        # the kernel's store failures at the last drop: a store that failed since (the kernel
        # forgot the inode) left `pushed` naming pages it does not hold, and the next drop
        # takes the whole file, so that the window is stored again
        self._store_failures_at_drop = 0
        # (relpath, page) of READs waiting for their answer (range_read.py), and how many
        self._reading: collections.Counter[tuple[bytes, int]] = collections.Counter()
        # files whose pages the kernel may hold (pushed or read in this plan), and those with
        # an item consumed since their pages last went
        self._paged_files: set[bytes] = set()
        self._consumed_files: set[bytes] = set()
        # consumed since the last drops, in all files: items, and their page extents' bytes
        self._consumed_items = 0
        self._consumed_bytes = 0
        self.pushes = 0  # items stored into the kernel's pages
        self.drops = 0  # files' pages dropped
        self.caught_up = 0  # items taken as read with no READ of their sentinel (range_read)
        self.reads = 0  # READs of files that hold items (range_read.py): one an item, ideally
        # RAM-tier keys of the items used lately, for the table `_keys_of` (a READ, a push
        # and a consumption each ask for them several times)
        self._keys: RecentMap[int, tuple] = RecentMap(KEYS_REMEMBERED)
        self._keys_of: Items | None = None

    # -- the order in force ------------------------------------------------------------------

    @property
    def items(self) -> Items | None:
        return self.ranking.items

    def path_of(self, item: int) -> bytes:
        items, manifest = self.ranking.items, self.ranking.manifest
        assert items is not None and manifest is not None
        return manifest.path(int(items.file[item]))

    def key_of(self, item: int) -> tuple:
        items = self.ranking.items
        assert items is not None
        if self._keys_of is not items:
            self._keys, self._keys_of = RecentMap(KEYS_REMEMBERED), items
        key = self._keys.get(item)
        if key is None:
            key = (self.path_of(item),
                   RangeKey(int(items.offset[item]), int(items.length[item])))
            self._keys.put(item, key)
        return key

    def want(self, item: int, reserved: int = 0) -> Want:
        items = self.ranking.items
        assert items is not None
        return Want(item, int(items.offset[item]), int(items.length[item]), reserved)

    def new_plan(self) -> None:
        """A new epoch or plan: every file's pages are dropped, so that what is read again is
        seen again, and the window is pushed anew."""
        for relpath in list(self._paged_files):
            self.drop_pages(relpath)

    # -- identities ------------------------------------------------------------------------

    def identity(self, relpath: bytes) -> SourceIdentity | None:
        """The file's identity as last read, if the freshness rule does not call it due."""
        known = self._identities.get(relpath)
        if known is None or self.freshness.refresh_due(known[1]):
            return None
        return known[0]

    def record_identity(self, relpath: bytes, identity: SourceIdentity, asked_s: float
                        ) -> bool:
        """A look at the file, asked at `asked_s`. Looks land in any order: one asked before
        the recorded one changes nothing, and if it saw another version (False) neither is
        trusted until a look asked after both (freshness.compare_look)."""
        known = self._identities.get(relpath)
        look = compare_look(None if known is None else known[0],
                            NEVER_S if known is None else known[2], identity, asked_s)
        if look == LOOK_CONFLICT:
            assert known is not None  # only a recorded look conflicts
            self._identities[relpath] = (known[0], NEVER_S, known[2])
            return False
        if look == LOOK_OLDER:
            return True
        self._identities[relpath] = (identity, asked_s, asked_s)
        if known is not None and known[0] != identity:
            # with when it was asked: the kernel's inode of the file may be of a look asked
            # after it (a lookup), which this one must not retire (TieredCache.source_changed)
            self._source_changed(relpath, identity, asked_s)
        return True

    async def refresh_identity(self, relpath: bytes) -> SourceIdentity:
        """A fresh stat of the file (its entries are only good for the identity read)."""
        asked_s = now_s()
        st = await self.source.lstat(relpath, background=True)
        identity = self.source.identity_of(st)
        self.record_identity(relpath, identity, asked_s)
        return identity

    # -- entries ---------------------------------------------------------------------------

    def entry(self, key: tuple, identity: SourceIdentity | None) -> RamBlock | None:
        """The item's entry if it holds this version of the file; one of another goes."""
        block = self.ram.get(key)
        if block is not None and identity is not None and block.identity != identity:
            self.ram.drop(key)
            return None
        return block

    def rerank(self, item: int) -> None:
        """New priority for the item's entry (after its consumption, or a new order): dropped
        if not to be kept, trimmed to its own bytes if kept for a later use."""
        key = self.key_of(item)
        block = self.ram.get(key)
        if block is None:
            return
        priority = self.ranking.priority_of(item, 0, block.identity)
        if priority is None:
            self.ram.drop(key)
            return
        offset, length = key[1]
        if block.data is not None and len(block.data) != length \
                and priority >= self.ranking.planner.length:
            # kept for the next epoch: its neighbours' bytes go (module docstring)
            trimmed = RamBlock(bytes(item_bytes(block, offset, length)), block.identity,
                               block.item, block.origin, served=block.served)
            self._replace(key, trimmed, priority)
        else:
            self.ram.set_priority(key, priority)

    def _replace(self, key: tuple, block: RamBlock, priority: float) -> bool:
        """Put `block` in place of the key's entry; False (nothing kept) if it cannot fit."""
        self.ram.drop(key)
        block.priority = priority
        charge = self.ram.charge_of(block.nbytes)
        return self.ram.reserve(charge, priority) and self.ram.insert(key, block, charge)

    async def flight_result(self, key: tuple) -> tuple[bytes, SourceIdentity] | None:
        """Wait for the item's fetch in flight, if any: its extent and identity."""
        flight = self.inflight.get(key)
        if flight is None:
            return None
        await flight.done.wait()
        if flight.error is not None:
            raise OSError(flight.error.errno, flight.error.strerror, key[0])
        if flight.data is None or flight.identity is None:
            return None
        return flight.data, flight.identity

    # -- fetching --------------------------------------------------------------------------

    async def fetch(self, relpath: bytes, span: list[Want], identity: SourceIdentity | None,
                    *, demand: bool) -> tuple[SourceIdentity, dict[int, bytes]]:
        """Read one span (`spans`) from the source and keep each item whose RAM was reserved
        and still earns it. Returns the identity read and each item's extent. Items of
        another plan than the one in force when it lands are not kept."""
        items = self.ranking.items
        # an item a reader or another fetch got to first (between the caller's look and now)
        # is not read again: the caller finds it in RAM or in flight
        taken = [want for want in span if self.key_of(want.item) in self.inflight
                 or self.entry(self.key_of(want.item), identity) is not None]
        self.give_back(taken)
        span = [want for want in span if want not in taken]
        if not span:
            return identity or self.source.identity_of(
                await self.source.lstat(relpath, background=not demand)), {}
        keys = [self.key_of(want.item) for want in span]
        flights = []
        for key in keys:
            flight = self.inflight[key] = _Flight()
            flights.append(flight)
        lo, hi = span[0].extent[0], span[-1].extent[1]
        try:
            asked_s = now_s()
            block = await self.read_source(relpath, [(lo, hi - lo)], demand=demand)
            identity = block.identity
            # a change drops the file's copies; a look older than one recorded keeps nothing
            current = self.record_identity(relpath, identity, asked_s - block.look_age_s)
            origin = stats_mod.ORIGIN_MISS if demand else stats_mod.ORIGIN_PREFETCHED
            out: dict[int, bytes] = {}
            for index, (want, key, flight) in enumerate(zip(span, keys, flights, strict=True)):
                self.stats.source_fetched(-1, key, len(block.data) if index == 0 else 0)
                if want.offset + want.length > identity.size:
                    continue  # the file shrank: its reader gets ESTALE (range_read.py)
                want_lo, want_hi = page_extent(want.offset, want.length, identity.size)
                data = block.data[want_lo - lo:want_hi - lo]
                out[want.item] = flight.data = data
                flight.identity = identity
                if current and want.reserved and self.ranking.items is items:
                    self._keep(key, RamBlock(data, identity, want.item, origin), want)
            return identity, out
        except BaseException as exc:
            error = exc if isinstance(exc, OSError) else OSError(5, "fetch interrupted")
            for flight in flights:
                flight.error = error
            raise
        finally:
            self.give_back(span)
            for key, flight in zip(keys, flights, strict=True):
                if self.inflight.get(key) is flight:
                    del self.inflight[key]
                flight.done.set()

    def give_back(self, wants: list[Want]) -> None:
        """The RAM reserved for wants not kept goes back to the budget."""
        for want in wants:
            if want.reserved:
                self.ram.unreserve(want.reserved)
                want.reserved = 0

    async def read_source(self, relpath: bytes, ranges: list[tuple[int, int]], *,
                          demand: bool):
        """Ranges of one file from the source, through a descriptor kept open for its next
        range reads as long as its identity is trusted without a re-check
        (cachefs/held_files.py)."""
        return await self.source.read_ranges(
            relpath, ranges, background=not demand,
            hold_s=self.freshness.ttl_s * REFRESH_AGE_FRACTION)

    def _keep(self, key: tuple, block: RamBlock, want: Want) -> None:
        priority = self.ranking.priority_of(want.item, 0, block.identity)
        if priority is None:
            return
        block.priority = priority
        reserved, want.reserved = want.reserved, 0
        self.ram.insert(key, block, reserved)

    def reserve(self, item: int, priority: float | None) -> int:
        """RAM for the item's extent at `priority`; the bytes reserved (0: no room)."""
        if priority is None:
            return 0
        lo, hi = page_extent(*self.key_of(item)[1])
        charge = self.ram.charge_of(hi - lo)
        return charge if self.ram.reserve(charge, priority) else 0

    async def complete(self, item: int, identity: SourceIdentity) -> bool:
        """Give a trimmed entry its extent again (its edge pages' neighbour bytes, read from
        the source: a few KB), so that it can be pushed; False if it is gone or cannot grow."""
        key = self.key_of(item)
        offset, length = key[1]
        lo, hi = page_extent(offset, length, identity.size)
        left, right = (lo, offset - lo), (offset + length, hi - offset - length)
        asked_s = now_s()
        parts = await self.read_source(key[0], [left, right], demand=False)
        if parts.identity != identity:
            self.record_identity(key[0], parts.identity, asked_s - parts.look_age_s)
            return False
        block = self.entry(key, identity)
        if block is None or block.data is None or len(block.data) != length:
            return block is not None  # gone, or completed meanwhile
        whole = parts.data[:left[1]] + block.data + parts.data[left[1]:]
        grown = RamBlock(whole, identity, block.item, block.origin, served=block.served)
        # its rank as the plan has it now: the tier's may be a re-rank behind (put off until
        # the tier's order is next read, RamTier.defer_ranks); by the entry's item number, which
        # a new item table that came while the source was read renumbered (`item` is of the
        # table before it)
        priority = self.ranking.priority_of(block.item, 0, identity)
        if priority is None:
            self.ram.drop(key)
            return False
        return self._replace(key, grown, priority)

    # -- the kernel's pages ------------------------------------------------------------------

    def _pushed_now(self) -> None:
        """Empty `pushed` and `_inside_pushed` if they number items of another table than the
        one in force (a new item table or manifest: a drop with the old numbers indexed the
        new table out of range, and failed the publication for good)."""
        if self._pushed_numbering != self.ranking.numbering:
            self.pushed.clear()
            self._inside_pushed.clear()
            self._pushed_numbering = self.ranking.numbering

    def is_pushed(self, item: int) -> bool:
        """The kernel holds the item's extent (stored, or queued to be) since the last drop."""
        self._pushed_now()
        return item in self.pushed

    def push(self, item: int, block: RamBlock) -> bool:
        """Store the item's extent into the kernel's pages but for the sentinel pages in it;
        False if the kernel does not take it, or if the entry is trimmed: then only the whole
        pages inside the item go now, and the rest once `complete` gave it its edges back
        (a reader that gets there first then faults two pages, not every one)."""
        self._pushed_now()
        items, manifest = self.ranking.items, self.ranking.manifest
        if self.kernel is None or self.kernel_inodes is None or items is None \
                or manifest is None or block.data is None:
            return False
        relpath, (offset, length) = self.key_of(item)
        lo, hi = page_extent(offset, length, block.identity.size)
        trimmed = len(block.data) != hi - lo
        if trimmed and (len(block.data) != length or item in self._inside_pushed):
            return False
        inode = self.kernel_inodes.store_target(relpath, block.identity)
        if inode is None:
            return False
        near = items.overlapping(int(items.file[item]), lo, hi)
        skip = {sentinel_page(int(items.offset[i]), int(items.length[i])) for i in near.tolist()}
        # and the pages a READ is being answered for: the kernel holds them locked until the
        # answer, a store into them would wait for it, and the reader would overtake the
        # store page by page (each a READ), where a store around them is done before it
        skip.update(page for (path, page) in self._reading if path == relpath
                    and lo <= page * PAGE_BYTES < hi)
        data_lo = offset if trimmed else lo  # the file offset of block.data[0]
        if trimmed:  # the whole pages inside the item
            lo = -(-offset // PAGE_BYTES) * PAGE_BYTES
            hi = max(lo, (offset + length) // PAGE_BYTES * PAGE_BYTES)
        runs = []
        start = lo
        for page in sorted(skip):
            page_lo = page * PAGE_BYTES
            if page_lo + PAGE_BYTES <= lo or page_lo >= hi:
                continue  # a neighbour's sentinel outside this extent
            if page_lo > start:
                runs.append((start, page_lo))
            start = max(start, page_lo + PAGE_BYTES)
        if start < hi:
            runs.append((start, hi))
        if not trimmed and item in self._inside_pushed:  # the inside went before: the edges
            edges = ((lo, lo + PAGE_BYTES), (hi - PAGE_BYTES, hi))
            runs = [(max(run_lo, edge_lo), min(run_hi, edge_hi)) for run_lo, run_hi in runs
                    for edge_lo, edge_hi in edges if run_lo < edge_hi and edge_lo < run_hi]
            self._inside_pushed.discard(item)
        for run_lo, run_hi in runs:
            self.kernel.store(inode, run_lo, block.data[run_lo - data_lo:run_hi - data_lo])
        self._paged_files.add(relpath)
        if trimmed:
            self._inside_pushed.add(item)
            return False
        self.pushed.add(item)
        self.pushes += 1
        return True

    def reading(self, relpath: bytes, lo: int, hi: int, add: bool) -> None:
        """A READ of bytes [lo, hi) of the file waits for its answer (`add`), or has it."""
        # the kernel keeps the pages of its answer: at its end too, if a drop of the file's
        # pages came while it waited (`drop_pages` forgot the file, and its answer landed)
        self._paged_files.add(relpath)
        for page in range(lo // PAGE_BYTES, -(-hi // PAGE_BYTES)):
            key = (relpath, page)
            if add:
                self._reading[key] += 1
            elif self._reading[key] <= 1:
                del self._reading[key]
            else:
                self._reading[key] -= 1

    def note_consumed(self, relpath: bytes, item: int) -> None:
        """An item of the file was consumed; every `DROP_EVERY_ITEMS` consumed items (or a
        `DROP_AT_BUDGET_FRACTION` of the RAM budget in their extents), in all files, the pages
        of each file with one consumed since go. Counted per file, a shuffle over many files,
        each of which had fewer than 128 items consumed in an epoch, left every item's pages
        in the kernel until the epoch's end, however many and large: the whole epoch beyond
        the budget. (Dropping each item's pages alone, with FUSE_NOTIFY_INVAL_INODE over its
        range, was measured: two notifications an item cost the daemon a third more CPU, in
        the kernel unmapping the reader's pages, than the drops every 128 items and the
        window pushed again after each; the drops now keep the window's pages, module
        docstring.)"""
        self._pushed_now()
        self.pushed.discard(item)
        self._inside_pushed.discard(item)
        self._paged_files.add(relpath)
        self._consumed_files.add(relpath)
        self._consumed_items += 1
        lo, hi = page_extent(*self.key_of(item)[1])
        self._consumed_bytes += hi - lo
        if (self._consumed_items >= DROP_EVERY_ITEMS
                or self._consumed_bytes * DROP_AT_BUDGET_FRACTION >= self.ram.budget_bytes):
            for path in list(self._consumed_files):
                self.drop_pages(path, keep_pushed=True)

    def drop_pages(self, relpath: bytes, *, keep_pushed: bool = False) -> None:
        """The kernel drops the file's pages: all of them, and the window's items are pushed
        again; or, `keep_pushed`, all but the extents of the items pushed and not yet read,
        where the kernel can drop a range (module docstring)."""
        self._pushed_now()
        failures = self.kernel.store_failures if self.kernel is not None else 0
        keep = (self._pushed_extents(relpath)
                if keep_pushed and failures == self._store_failures_at_drop else None)
        self._store_failures_at_drop = failures
        self._drop(relpath, keep, keeps_pushed=keep is not None)

    def drop_overdue_pages(self, relpath: bytes) -> bool:
        """The kernel drops the file's pages, its version not seen at the source within the
        TTL, but those of READs waiting for their answer (module docstring); True if they
        went, False if left to the next pass."""
        reading = sorted((page * PAGE_BYTES, (page + 1) * PAGE_BYTES)
                         for path, page in self._reading if path == relpath)
        if not reading:
            self.drop_pages(relpath)
        elif self.kernel is not None and self.kernel.drops_ranges:
            self._pushed_now()
            self._drop(relpath, reading, keeps_pushed=False)
        else:
            return False
        return True

    def _drop(self, relpath: bytes, keep: list[tuple[int, int]] | None, *,
              keeps_pushed: bool) -> None:
        """`drop_file_pages`; unless the pages kept are the pushed items' (`keeps_pushed`),
        the window's items are walked, and pushed, again."""
        kept = self._drop_file_pages(relpath, keep)
        if keep is None:
            self._paged_files.discard(relpath)  # until a push or a READ brings pages back
        self._consumed_files.discard(relpath)
        if not self._consumed_files:
            self._consumed_items = self._consumed_bytes = 0
        self.drops += 1
        if kept and keeps_pushed:
            return
        planner = self.ranking.planner
        planner.scan = planner.cursor  # the window's items are walked, and pushed, again
        if self.ranking.items is None:
            self.pushed.clear()
            self._inside_pushed.clear()
            return
        for held in (self.pushed, self._inside_pushed):
            held -= set(self._of_file(held, relpath).tolist())

    def paged_files(self) -> list[bytes]:
        """The files whose pages the kernel may hold (pushed or read in this plan); one whose
        inode the kernel forgot holds none, and is forgotten here too (else the overdue pass,
        cachefs/revalidate.py, looked at it until the next plan)."""
        if self.kernel_inodes is not None:
            inode_of = self.kernel_inodes.inode_of
            self._paged_files = {relpath for relpath in self._paged_files
                                 if inode_of(relpath) is not None}
        return list(self._paged_files)

    def _of_file(self, held: set[int], relpath: bytes) -> np.ndarray:
        """The items of `held` (`pushed` or `_inside_pushed`) that are ranges of the file."""
        items, manifest = self.ranking.items, self.ranking.manifest
        file_index = manifest.index_of(relpath) if manifest is not None else -1
        if items is None or file_index < 0 or not held:
            return np.zeros(0, np.int64)
        in_held = np.fromiter(held, np.int64, len(held))
        return in_held[items.file[in_held] == file_index]

    def _pushed_extents(self, relpath: bytes) -> list[tuple[int, int]]:
        """The page extents of the file's items whose pages the kernel holds, by offset."""
        items = self.ranking.items
        if items is None:
            return []
        pushed = np.concatenate([self._of_file(held, relpath)
                                 for held in (self.pushed, self._inside_pushed)])
        return sorted(page_extent(int(items.offset[item]), int(items.length[item]))
                      for item in pushed.tolist())

    def status(self) -> dict:
        return {"pushed_items": self.pushes, "page_drops": self.drops,
                "caught_up": self.caught_up, "reads": self.reads}

