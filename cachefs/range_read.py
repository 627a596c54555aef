"""READs of a file whose samples are byte-range items: served by item, consumed by item.

When the order in force has byte-range items (cachefs.order_items), a READ of a file that holds
items is served here (the reader hands it over, cachefs/reader.py): the bytes of each item it
overlaps come from the item's RAM entry, from its fetch in flight, or from a fetch of the span
of the missing items (one source read, kept by their priorities, cachefs/range_cache.py). An
entry holds the whole pages its item touches (but for a trimmed one, kept from the last epoch),
so the bytes of a page the item shares with a neighbour not in RAM, or with bytes of no item,
come from it too. Other bytes, of no item (a `.npy` header, tar headers) or of an item not
held, are read from the source as they are asked for, not cached. A READ that spans cached and
uncached bytes gets each from where it is.

Consumption (docs/design.md §2, §4). The kernel tells the daemon nothing of a reader's page
faults on pages it holds, and a `numpy.memmap` reader faults pages in with the kernel's
read-around, which brings bytes of neighbouring samples. So "its bytes have been read" is
observed through one page per item, its *sentinel* (`range_cache.sentinel_page`): never pushed
into the page cache, it is read by a READ, and with the kernel's read-ahead off while an order
of ranges is in force (mount.py), only when the reader itself touches it. An item is consumed
when a READ covers its sentinel page: its class (stats.py) is that of its bytes, the costliest
origin among the READs that touched it and its entry (RAM if retained and read before, read
ahead, or a miss the reader waited for, with the wait as its stall), and it counts as one read
of `item_length` bytes in the epoch in force. Items smaller than a page share pages: a READ of a
shared sentinel counts for every item whose sentinel it is. Without root (keep-cache mode) the
kernel's read-ahead stays on: its read-around can then reach a neighbour's sentinel, which is
counted early (the bytes served are right whatever is counted).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Iterator

from cachefs import errors
from cachefs import stats as stats_mod
from cachefs.cache.ram import PAGE_BYTES
from cachefs.freshness import now_s
from cachefs.order_items import Items
from cachefs.planner import Planner
from cachefs.range_cache import RangeCache, entry_extent, page_extent, sentinel_page, spans
from cachefs.ranking import Ranking
from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)

RETRY_S = 1.0  # at most this long after its item's consumption is a sentinel's READ a retry
READERS_SEEN = 8  # consumptions by READs that say where the readers are (`_catch_up`)
MAX_FILES_REMEMBERED = 65536  # files whose `file_of` is remembered


class RangeReader:
    def __init__(self, planner: Planner, ranking: Ranking, cache: RangeCache,
                 stats: stats_mod.Stats, on_consumed: Callable[[int], None]):
        self._planner = planner
        self._ranking = ranking
        self._cache = cache
        self._stats = stats
        self._on_consumed = on_consumed  # the prefetcher's: the plan moves on
        # items touched by READs and not consumed yet: [costliest origin, stall seconds], for
        # the table and epoch of `_touched_plan`; at most the window's items and a few more
        # the item the last READ consumed, and when (a READ of its sentinel again, before
        # any other item's, is the kernel asking again: `_consume_sentinels`)
        self._last: tuple[int, float] = (-1, -math.inf)
        # positions of the last items consumed by READs, in this epoch (`_catch_up`)
        self._positions: collections.deque[int] = collections.deque(maxlen=READERS_SEEN)
        self._positions_epoch = -1
        self._files_of: Items | None = None  # the table `_file_index` is of
        self._file_index: dict[bytes, int] = {}  # relpath -> file_of (the manifest's index)
        self._touched: dict[int, list] = {}
        self._touched_plan: tuple[Items | None, int] = (None, -1)  # items, epoch serial

    def file_of(self, relpath: bytes) -> int:
        """The file's index in the manifest in force if the order's items include ranges of
        it (its READs are served here), else -1. Remembered per table: every READ asks."""
        items, manifest = self._ranking.items, self._ranking.manifest
        if items is None or manifest is None:
            return -1
        if self._files_of is not items:
            self._files_of, self._file_index = items, {}
        file_index = self._file_index.get(relpath)
        if file_index is None:
            file_index = manifest.index_of(relpath)
            if file_index < 0 or not len(items.in_file(file_index)):
                file_index = -1
            if len(self._file_index) < MAX_FILES_REMEMBERED:
                self._file_index[relpath] = file_index
        return file_index

    async def read(self, relpath: bytes, identity: SourceIdentity, file_index: int,
                   offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of this version of the file (module docstring)."""
        end = min(offset + size, identity.size)
        if offset >= end:
            return b""
        self._cache.reads += 1
        items = self._ranking.items
        assert items is not None  # file_of found the file among the items
        plan = (items, self._planner.epoch_serial)
        if self._touched_plan[0] is not items or self._touched_plan[1] != plan[1]:
            self._touched, self._touched_plan = {}, plan
        hits = items.overlapping(file_index, offset, end).tolist()
        found = await self._item_bytes(relpath, identity, items, hits, offset, end)
        if self._ranking.items is not items:
            # another table came in force while this READ waited: its item numbers, and
            # the keys made of them, are not this READ's; the source serves it whole
            found = {}
        # Each item found holds its own bytes and, unless trimmed, its neighbours' in its edge
        # pages: a READ of a page it shares with an item not in RAM needs no source read.
        parts: list = []
        gaps: list[tuple[int, int]] = []
        position = offset  # bytes before it are in `parts` or `gaps`
        for data_lo, data in sorted(found.values(), key=lambda held: held[0]):
            data_hi = data_lo + len(data)
            if data_hi <= position:
                continue
            if position < data_lo:  # every entry found overlaps the READ: data_lo < end
                gaps.append((position, data_lo - position))
                parts.append(len(gaps) - 1)  # the gap's place, filled below
                position = data_lo
            taken = min(data_hi, end)
            parts.append(data[position - data_lo:taken - data_lo])
            position = taken
            if position >= end:
                break
        if position < end:
            gaps.append((position, end - position))
            parts.append(len(gaps) - 1)
        if gaps:
            gap_bytes = await self._gaps(relpath, identity, gaps)
            parts = [gap_bytes[part] if isinstance(part, int) else part for part in parts]
        self._consume_sentinels(relpath, items, hits, offset, end)
        return b"".join(parts)

    @contextlib.contextmanager
    def waiting(self, relpath: bytes, offset: int, size: int) -> Iterator[None]:
        """A READ of bytes [offset, offset + size) of the file waits for its answer
        in this block, from its arrival (before a check of the file at the source, fuse_ops
        `_read_without_open`) to its answer: no store goes into its pages, nor does the
        overdue pass drop them (RangeCache.reading, RangeCache.drop_overdue_pages). Nothing
        for a file that holds no items."""
        if self.file_of(relpath) < 0:
            yield
            return
        self._cache.reading(relpath, offset, offset + size, add=True)
        try:
            yield
        finally:
            self._cache.reading(relpath, offset, offset + size, add=False)

    async def _item_bytes(self, relpath: bytes, identity: SourceIdentity, items: Items,
                          hits: list[int], offset: int, end: int
                          ) -> dict[int, tuple[int, memoryview]]:
        """Each item's bytes as its entry holds them (`entry_extent`: file offset, bytes): from
        RAM, from a fetch in flight, or fetched now (a miss:
        the READ's wait is the first missing item's stall). A missing item the READ only
        touches the edge of (a page it shares with the item read) is left out, unless it is
        due soon (in the read-ahead window): one sample is not fetched whole for a few of its
        bytes, which come from the entry of the item read, or with the gaps."""
        found: dict[int, tuple[int, memoryview]] = {}
        missing = []
        window_end = self._planner.window_end()
        for item in hits:
            key = self._cache.key_of(item)
            block = self._cache.entry(key, identity)
            if block is not None and block.data is not None:
                self._touch(item, stats_mod.ORIGIN_RAM if block.served else block.origin, 0.0)
                self._ranking.ram.touch(key, block)
                found[item] = entry_extent(block, *key[1])
            elif (self._covers_sentinel(items, item, offset, end)
                  or self._planner.next_use(item) < window_end
                  or self._cache.key_of(item) in self._cache.inflight):
                missing.append(item)
        if not missing:
            return found
        started_s = now_s()
        to_fetch = []
        for item in missing:
            key = self._cache.key_of(item)
            result = await self._cache.flight_result(key)
            if self._ranking.items is not items:
                return {}  # another table: read() serves the READ from the source
            if result is None:
                to_fetch.append(item)
                continue
            self._check_version(relpath, identity, result[1])
            found[item] = self._own(result[0], key)
        if to_fetch:
            wants = [self._cache.want(item, self._cache.reserve(
                item, self._ranking.priority_of(item, 0, identity))) for item in to_fetch]
            try:
                for span in spans(wants):
                    read, extents = await self._cache.fetch(relpath, span, identity,
                                                            demand=True)
                    if self._ranking.items is not items:
                        return {}  # another table: read() serves the READ from the source
                    self._check_version(relpath, identity, read)
                    for want in span:
                        key = self._cache.key_of(want.item)
                        if want.item in extents:
                            found[want.item] = self._own(extents[want.item], key)
                            block = self._cache.entry(key, identity)
                            if block is not None:  # its other pages: no READ for each
                                self._cache.push(want.item, block)
                        else:  # fetched by another meanwhile, or beyond the file's end now
                            found[want.item] = await self._again(relpath, identity, key)
                            if self._ranking.items is not items:
                                return {}  # another table: read() serves it from the source
            finally:
                # a span that failed (the source's error, a changed file) leaves the RAM
                # reserved for the spans after it: given back, or the budget shrank for good
                self._cache.give_back(wants)
        waited_s = now_s() - started_s
        # the wait is the stall of the item the READ is for, the one whose sentinel it covers,
        # not of a neighbour it touched at its edge (due soon, and read whole later)
        stalled = next((item for item in missing
                        if self._covers_sentinel(items, item, offset, end)), missing[0])
        for item in missing:
            self._touch(item, stats_mod.ORIGIN_MISS, waited_s if item == stalled else 0.0)
        return found

    async def _again(self, relpath: bytes, identity: SourceIdentity, key: tuple
                     ) -> tuple[int, memoryview]:
        """An item another fetch got to first: from RAM, or from that fetch."""
        block = self._cache.entry(key, identity)
        if block is not None and block.data is not None:
            return entry_extent(block, *key[1])
        result = await self._cache.flight_result(key)
        if result is None:  # the file is shorter now
            raise errors.StaleFileError(f"{relpath!r} changed in the source")
        self._check_version(relpath, identity, result[1])
        return self._own(result[0], key)

    @staticmethod
    def _own(extent: bytes, key: tuple) -> tuple[int, memoryview]:
        """(file offset, bytes) of the item's extent as fetched (cut at the file's end)."""
        return page_extent(*key[1])[0], memoryview(extent)

    @staticmethod
    def _check_version(relpath: bytes, identity: SourceIdentity, read: SourceIdentity) -> None:
        if read != identity:
            # one handle, one version (errors.StaleFileError): the kernel holds this size
            raise errors.StaleFileError(f"{relpath!r} changed in the source while it was read")

    async def _gaps(self, relpath: bytes, identity: SourceIdentity,
                    gaps: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of no item, from the source (not cached), in one read."""
        block = await self._cache.read_source(relpath, gaps, demand=True)
        self._check_version(relpath, identity, block.identity)
        out, position = [], 0
        for _, length in gaps:
            out.append(block.data[position:position + length])
            position += length
        return out

    def _touch(self, item: int, origin: int, stall_s: float) -> None:
        touched = self._touched.get(item)
        if touched is None:
            self._touched[item] = [origin, stall_s]
        else:
            touched[0] = max(touched[0], origin)
            touched[1] += stall_s

    @staticmethod
    def _covers_sentinel(items: Items, item: int, offset: int, end: int) -> bool:
        page = sentinel_page(int(items.offset[item]), int(items.length[item]))
        return page * PAGE_BYTES < end and offset < (page + 1) * PAGE_BYTES

    def _consume_sentinels(self, relpath: bytes, items: Items, hits: list[int], offset: int,
                           end: int) -> None:
        """Consume the items whose sentinel page this READ covers (module docstring), but for
        a READ of the sentinel of the item consumed last, a moment ago: the kernel asks again
        for a page that a drop of the file's pages took while its first READ was answered
        (the drop at the end of an epoch follows the READ of its last item at once), and that
        is no read of the item in the new epoch. (An item read last in one epoch and first in
        the next is then counted when the readers have passed it, `_catch_up`.)"""
        now = now_s()
        for item in hits:
            if not self._covers_sentinel(items, item, offset, end):
                continue
            pos_cur = self._planner.pos_cur  # (a consumption may have switched the epoch)
            origin, stall_s = self._touched.pop(item, (stats_mod.ORIGIN_MISS, 0.0))
            if self._ranking.items is not items or item >= len(pos_cur) or pos_cur[item] < 0:
                continue  # not to be read in this epoch (read again, or another plan)
            if item == self._last[0] and now - self._last[1] < RETRY_S:
                continue
            self._last = (item, now)
            self._positions.append(int(pos_cur[item]))
            self._consume(relpath, items, item, origin, stall_s)
        self._catch_up(items)

    def _consume(self, relpath: bytes, items: Items, item: int, origin: int,
                 stall_s: float) -> None:
        block = self._ranking.ram.get(self._cache.key_of(item))
        if block is not None:
            block.served = True
        self._stats.file_read(origin, stall_s, int(items.length[item]),
                              record=self._stats.current)
        self._cache.note_consumed(relpath, item)
        self._on_consumed(item)

    def _catch_up(self, items: Items) -> None:
        """Items the readers passed by without a READ of their sentinel, so far that the
        window (at most `max_span_items` from its start) could no longer reach a lookahead
        past them, are taken as read: their sentinel was in the kernel's pages after all (the
        kernel failed to drop them, or a reader read the item before the order came), and an
        item never consumed would hold the window's start, and the read-ahead, there. Where
        the readers are is the lowest position among the last `READERS_SEEN` items consumed
        by their READs: one stray READ far ahead does not move it."""
        planner = self._planner
        if len(self._positions) < READERS_SEEN or self._positions_epoch != planner.epoch_serial:
            if self._positions_epoch != planner.epoch_serial:
                self._positions.clear()
                self._positions_epoch = planner.epoch_serial
            return
        behind = min(self._positions) - max(1, planner.max_span_items - planner.lookahead_items)
        serial = planner.epoch_serial
        # not into the next epoch: the last item caught up may switch to it, whose cursor
        # starts again at 0 (it went on to consume the new epoch's first `behind` positions)
        while (planner.cursor < behind and self._ranking.items is items
               and planner.epoch_serial == serial):
            item = int(planner.current[planner.cursor])
            block = self._ranking.ram.get(self._cache.key_of(item))
            origin = (stats_mod.ORIGIN_MISS if block is None else stats_mod.ORIGIN_RAM
                      if block.served else block.origin)
            self._cache.caught_up += 1
            self._consume(self._cache.key_of(item)[0], items, item, origin, 0.0)
