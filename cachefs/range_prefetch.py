"""Read-ahead of an order of byte-range items: the planner's window, fetched in spans.

The prefetcher (cachefs/prefetch.py) hands its loop over to this module while the order in
force has byte-range items (cachefs.order_items): the same window of the same planner, with an
item for a file. Each pass walks the window nearest first and, for each item:

- in RAM with the file's current identity: store it into the kernel's pages if it is not there
  (`RangeCache.push`); a trimmed entry (kept from the last epoch) first gets the edges of its
  pages back (`RangeCache.complete`, a few KB from the source);
- in RAM but the file's identity is due for a re-check (cachefs/freshness.py): stat the file
  first, in the background, since the entries are only good for the identity they were read
  with;
- missing: reserve its RAM at its priority (Cao et al.'s rule, as for files: only by
  displacing an entry used later), and stop the walk when that fails.

The missing items of a pass are grouped by file into spans of touching page extents
(`range_cache.spans`) and each span is one source read: adjacent items in the order (a
sequential reader, or a shuffle within a shard) cost one round trip. Fetches in flight are at
most `WINDOW_READS` times the source threads (the source runs as many at once as it has
threads, the rest wait their turn, nearest first), and the window holds as many items
(cachefs/prefetch.py): an item lands in the reader's pages a source read and a page store after
it entered the window, and one memmap reader goes through a few items a millisecond. With the
window at the source threads' number (32), the reader met the pages of 1,000-1,500 items an
epoch still on their way, each a READ; at three times, 300-650 (5,000 rows of 100 KB over
slowfs, with the drops that keep the window's pages, cachefs/range_cache.py). Past the
window's end, the items that follow the last one wanted both in its file and in the order join
its read (`_extend`), so that a reader going through a file in order is read ahead in requests
of up to 4 MiB. When a span lands, its
items are pushed to the kernel, but for their sentinel pages (cachefs/range_read.py counts the
reads by those).

Item numbers are the plan's: a task that outlives its plan (another item table came into
force meanwhile) keeps nothing and leaves the new plan's bookkeeping alone (`_items_then`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from cachefs.cache.ram import PAGE_BYTES
from cachefs.order_items import Items
from cachefs.planner import Planner
from cachefs.range_cache import MAX_SPAN_BYTES, RangeCache, Want, spans
from cachefs.ranking import Ranking
from cachefs.source import SourceIdentity

log = logging.getLogger(__name__)

WINDOW_READS = 3  # fetches in flight (and the window's items), in source threads (docstring)


class RangePrefetcher:
    def __init__(self, planner: Planner, ranking: Ranking, cache: RangeCache, *,
                 source_threads: int):
        self.planner = planner
        self.ranking = ranking
        self.cache = cache
        self.max_inflight = source_threads * WINDOW_READS
        self._busy: set[int] = set()  # items being fetched or completed, of `_busy_items`
        self._tasks = 0  # fetches and completions running: source reads in flight
        self._busy_items: Items | None = None
        self._stating: set[bytes] = set()  # files being stat'ed
        self._mean_of: Items | None = None  # the table `_mean_bytes` is of
        self._mean_bytes = -1
        self.errors = 0

    def mean_item_bytes(self) -> int:
        """What an unconsumed item holds in RAM on average (its extent), for the window's
        size (cachefs/prefetch.py)."""
        items = self.ranking.items
        if items is None or not len(items):
            return -1
        if self._mean_of is not items:
            self._mean_of, self._mean_bytes = items, int(items.length.mean()) + PAGE_BYTES
        return self._mean_bytes

    def new_epoch(self) -> None:
        """A new epoch or plan came into force: every file's pages are dropped (what is
        read again must be seen again, range_cache.py) and the window pushed anew."""
        self.cache.new_plan()

    def rerank(self, item: int) -> None:
        self.cache.rerank(item)

    def start_fetches(self, nursery: trio.Nursery, poke: Callable[[], None]) -> None:
        """One pass over the window (module docstring); `poke` wakes the prefetcher's loop
        when a task ends."""
        items, planner, cache = self.ranking.items, self.planner, self.cache
        if items is None:
            return
        if self._busy_items is not items:
            self._busy, self._busy_items = set(), items
        wanted: dict[bytes, list[Want]] = {}
        new_reads = 0  # source reads this pass will start, at most (one per item wanted)
        held = False  # a position below is to be walked again (its pages are not pushed)
        last: tuple[int, int] | None = None  # (position, item) of the last item wanted
        walked_all = True
        for position, item in planner.window():
            if self._tasks + new_reads >= self.max_inflight:
                walked_all = False
                break
            if item not in self._busy:
                key = cache.key_of(item)
                relpath = key[0]
                identity = cache.identity(relpath)
                block = cache.ram.get(key)
                if block is not None and identity is None:
                    self._stat(nursery, relpath, poke)
                    walked_all = False
                    break  # back here once the file's identity is known
                block = cache.entry(key, identity)
                if block is not None:
                    if not cache.is_pushed(item) and cache.kernel is not None \
                            and not cache.push(item, block):
                        if block.data is not None and len(block.data) == key[1].length:
                            self._start(nursery, self._complete, [item], poke, item,
                                        block.identity)
                        else:
                            # the kernel does not take its pages now (it has not looked the
                            # file up yet, or a reader holds it open in the keep-cache
                            # mode): walk it again on the next pass
                            held = True
                else:
                    reserved = cache.reserve(item, self.ranking.priority_of(item, 0, None))
                    if not reserved:
                        walked_all = False
                        break  # RAM holds only nearer uses: wait for a consumption
                    wanted.setdefault(relpath, []).append(cache.want(item, reserved))
                    self._busy.add(item)
                    new_reads += 1
                    last = (position, item)
            if not held:
                planner.scan = position + 1
        if walked_all and last is not None:
            self._extend(wanted, *last, held)
        for relpath, wants in wanted.items():
            for span in spans(wants):
                self._busy.difference_update(want.item for want in span)
                self._start(nursery, self._fetch, [want.item for want in span], poke,
                            relpath, span, cache.identity(relpath))

    def _extend(self, wanted: dict[bytes, list[Want]], position: int, item: int,
                held: bool) -> None:
        """Past the window's end, the items that follow the last one wanted both in its file
        and in the order (a reader going through a file in order) join its source read, up to
        `MAX_SPAN_BYTES` and the window's largest span: adjacent ranges in one request, not one
        per window step, and never so far ahead that the window's own items would have to
        evict them before their use."""
        items, planner, cache = self.ranking.items, self.planner, self.cache
        assert items is not None
        relpath = cache.key_of(item)[0]
        span_bytes = sum(want.length for want in wanted[relpath])
        while span_bytes < MAX_SPAN_BYTES:
            following = items.next_in_file(item)
            if following < 0 or planner.item_at(position + 1) != following \
                    or planner.next_use(following) != position + 1 \
                    or following in self._busy or cache.key_of(following) in cache.ram:
                return
            if position + 1 >= planner.cursor + planner.max_span_items:
                return  # no further than the window may ever span (a quarter of RAM)
            reserved = cache.reserve(following, self.ranking.priority_of(following, 0, None))
            if not reserved:
                return
            wanted[relpath].append(cache.want(following, reserved))
            self._busy.add(following)
            position, item = position + 1, following
            span_bytes += int(items.length[item])
            if not held:
                planner.scan = max(planner.scan, position + 1)

    def _start(self, nursery: trio.Nursery, task, items: list[int], poke, *args) -> None:
        self._busy.update(items)
        self._tasks += 1
        nursery.start_soon(self._run, task, items, self.ranking.items, poke, *args)

    async def _run(self, task, items: list[int], items_then: Items | None, poke, *args) -> None:
        try:
            if self.ranking.items is items_then:
                # else another table came in force before the task ran: its wants are ranges
                # of the old one, which the task would key by the new table's numbers
                await task(*args)
        except OSError as exc:
            # the reader meets the same error on demand and gets its errno
            self.errors += 1
            log.debug("read-ahead of items %s failed: %s", items[:4], exc)
        except Exception:  # noqa: BLE001 - one read-ahead never ends the mount's
            self.errors += 1
            log.exception("unexpected error reading items %s ahead", items[:4])
        finally:
            self._tasks -= 1
            if self._busy_items is items_then:
                self._busy.difference_update(items)
            poke()

    async def _fetch(self, relpath: bytes, span: list[Want],
                     identity: SourceIdentity | None) -> None:
        items = self.ranking.items
        read, _ = await self.cache.fetch(relpath, span, identity, demand=False)
        if self.ranking.items is not items or self.cache.kernel is None:
            return
        for want in span:
            block = self.cache.entry(self.cache.key_of(want.item), read)
            if block is not None:
                self.cache.push(want.item, block)

    async def _complete(self, item: int, identity: SourceIdentity) -> None:
        items = self.ranking.items
        if await self.cache.complete(item, identity) and self.ranking.items is items:
            block = self.cache.entry(self.cache.key_of(item), identity)
            if block is not None:
                self.cache.push(item, block)

    def _stat(self, nursery: trio.Nursery, relpath: bytes, poke) -> None:
        if relpath in self._stating:
            return
        self._stating.add(relpath)

        async def stat() -> None:
            try:
                await self.cache.refresh_identity(relpath)
            except OSError as exc:
                self.errors += 1
                log.debug("stat of %r failed: %s", relpath, exc)
            except Exception:  # noqa: BLE001 - one file's stat never ends the read-ahead
                self.errors += 1
                log.exception("unexpected error checking %r", relpath)
            finally:
                self._stating.discard(relpath)
                poke()
        nursery.start_soon(stat)

    def status(self) -> dict:
        """`cachefs stats`'s `prefetch` while an order of ranges is in force."""
        return {"inflight": self._tasks, "errors": self.errors,
                "ranges": self.cache.status()}
