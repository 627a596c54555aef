"""Counters a user reads with `cachefs stats`: per epoch, per tier, and stalls.

Every figure is counted where the event happens (the reader classifies each opened file when it
is released; the fetcher adds backend bytes) and only read here. The JSON snapshot is the
documented interface (man/cachefs-stats.1); keys are only ever added, never renamed.

How an opened file is classified (one of the four, so they add up to `reads`):
- `misses`: some block of it had to wait for the source (the reader stalled; `stall_s` adds
  the wait);
- `hits_ssd`: otherwise, some block came from the SSD tier for this use;
- `prefetched`: otherwise, some block was read from the source ahead of the reader in this
  epoch;
- `hits_ram`: every block was already in RAM before this epoch needed it (retained across the
  epoch boundary, or read again).

`refetched_blocks` says how often the cache threw away a block it then had to read again in
the same epoch (read-ahead evicted before use, a fetch not de-duplicated). Its memory is
bounded whatever the epoch's length (with no order, the epoch never ends): block 0 of the
manifest's items is remembered in a bitmap (a byte per item, like the manifest itself), any
other block only among the last `refetch_window_blocks` distinct blocks read from the source,
twice what the RAM tier holds and at least `MIN_REFETCH_WINDOW_BLOCKS`. A block read again
after that many others is not counted: the RAM tier could not have kept it for that long
anyway, unless in place of more useful blocks.

`Stats.totals` sums the epoch records since the mount started: what the Prometheus metrics
(metrics.py) and `cachefs stats --watch` read, exact even when a long run's oldest records are
left out of the snapshot (ctrl.py).

`Histogram` is a distribution in fixed buckets, for the latency of source reads
(`Source.read_seconds`): a dozen integers, no per-read memory, and the same buckets in the
JSON snapshot and in Prometheus, which wants cumulative counts per upper bound. The storage
targets time their requests in one each too, with finer buckets for their p99
(cachefs/targets.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from itertools import accumulate


# Origins of the data a reader got, in order of increasing cost; a file's class is the
# costliest origin among its blocks.
ORIGIN_RAM = 0
ORIGIN_PREFETCHED = 1
ORIGIN_SSD = 2
ORIGIN_MISS = 3
_CLASS_BY_ORIGIN = {ORIGIN_RAM: "hits_ram", ORIGIN_PREFETCHED: "prefetched",
                    ORIGIN_SSD: "hits_ssd", ORIGIN_MISS: "misses"}

# At least this many recent source reads are remembered to count refetches (about 200 bytes
# each): 13 MB.
MIN_REFETCH_WINDOW_BLOCKS = 1 << 16


def refetch_window_blocks(ram_bytes: int, block_bytes: int) -> int:
    """How many distinct recent source reads `Stats` remembers (see the module docstring)."""
    return max(MIN_REFETCH_WINDOW_BLOCKS, 2 * (ram_bytes // block_bytes))


@dataclass
class EpochStats:
    epoch: int | None  # None: reads before any order was published
    reads: int = 0
    hits_ram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    prefetched: int = 0
    backend_bytes: int = 0  # bytes read from the source
    backend_reads: int = 0  # blocks read from the source
    refetched_blocks: int = 0  # blocks read from the source more than once in this epoch
    ssd_bytes_read: int = 0
    bytes_served: int = 0
    stall_s: float = 0.0
    # reads that found pages gone that only the kernel held (reclaimed): part of `misses` or
    # `hits_ssd`, the file having been kept in RAM (cachefs-stats(1))
    kernel_reclaimed: int = 0


# the counters of an epoch record (every field but its epoch), summed by Stats.totals
COUNTER_FIELDS = tuple(field.name for field in fields(EpochStats) if field.name != "epoch")

# Upper bounds of the source-read latency buckets, seconds: from a local disk's 0.1 ms to an
# overloaded network store's 10 s, about 2.5x apart (as Prometheus's default buckets are).
READ_SECONDS_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                       0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts of observed values in fixed buckets, and their sum. `counts[i]` counts the
    values at most `bounds_s[i]` and above the bound before it; the last count, those above
    every bound. Single-threaded, like `Stats`."""

    def __init__(self, bounds_s: tuple[float, ...] = READ_SECONDS_BOUNDS):
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += value_s

    @property
    def mean_s(self) -> float | None:
        count = sum(self.counts)
        return self.sum_s / count if count else None

    def quantile_s(self, fraction: float) -> float | None:
        """The upper bound of the bucket holding the `fraction` quantile (the last bound if
        it is above them all); None before any value."""
        cumulative = list(accumulate(self.counts))
        if not cumulative[-1]:
            return None
        bucket = bisect_left(cumulative, fraction * cumulative[-1])
        return self.bounds_s[min(bucket, len(self.bounds_s) - 1)]

    def snapshot(self) -> dict:
        return {"bounds_s": list(self.bounds_s), "counts": list(self.counts),
                "count": sum(self.counts), "sum_s": round(self.sum_s, 6)}


class Stats:
    """The counters of one mount. Single-threaded: only the trio thread touches it."""

    def __init__(self, refetch_window_blocks: int = MIN_REFETCH_WINDOW_BLOCKS):
        self.epochs: list[EpochStats] = [EpochStats(None)]
        self.ssd_errors = 0
        self.read_errors = 0
        # Blocks fetched from the source in the current epoch, to count refetches: block 0 of
        # manifest items in a byte per item (no per-item Python objects at ImageNet scale; a
        # bytearray, not numpy's: an element of a numpy array read or written costs a scalar
        # made and an index parsed), other blocks (large files, files outside the manifest) in
        # a bounded window, oldest first.
        self._fetched_first_blocks = bytearray()
        self._fetched_other_blocks: OrderedDict = OrderedDict()
        self._refetch_window_blocks = refetch_window_blocks

    @property
    def current(self) -> EpochStats:
        return self.epochs[-1]

    def start_epoch(self, epoch: int) -> None:
        if self.current.epoch == epoch:
            return
        if self.current.epoch is None and self.current.reads == 0:
            self.epochs.pop()  # no reads happened before the first order: no empty record
        self.epochs.append(EpochStats(epoch))
        self._fetched_first_blocks = bytearray(len(self._fetched_first_blocks))
        self._fetched_other_blocks.clear()

    def track_items(self, manifest_len: int) -> None:
        """A new manifest: item numbers change, so refetch tracking starts over."""
        self._fetched_first_blocks = bytearray(manifest_len)
        self._fetched_other_blocks.clear()

    def file_read(self, origin: int, stall_s: float, bytes_served: int,
                  record: EpochStats | None = None, kernel_reclaimed: bool = False,
                  files: int = 1) -> None:
        """Count one opened file in `record` (the epoch that consumed it), else the current.
        `kernel_reclaimed`: its READs found pages gone that only the kernel held. `files`:
        that many files of one origin, with no READ reclaimed, counted together (`stall_s`
        and `bytes_served` are their sums)."""
        record = record if record is not None else self.current
        record.reads += files
        record.kernel_reclaimed += kernel_reclaimed
        name = _CLASS_BY_ORIGIN[origin]
        setattr(record, name, getattr(record, name) + files)
        record.stall_s += stall_s
        record.bytes_served += bytes_served

    def stalled(self, stall_s: float) -> None:
        """A reader waited `stall_s` for the source where no file read counts the wait: the
        open of a file of byte-range items, whose items count as they are read."""
        self.current.stall_s += stall_s

    def source_fetched(self, item: int, key, size_bytes: int) -> None:
        record = self.current
        record.backend_bytes += size_bytes
        record.backend_reads += 1
        if key[1] == 0 and 0 <= item < len(self._fetched_first_blocks):
            again = self._fetched_first_blocks[item]
            self._fetched_first_blocks[item] = 1
        else:
            recent = self._fetched_other_blocks
            again = key in recent
            recent[key] = None
            recent.move_to_end(key)
            if len(recent) > self._refetch_window_blocks:
                recent.popitem(last=False)
        if again:
            record.refetched_blocks += 1

    def ssd_read(self, size_bytes: int) -> None:
        self.current.ssd_bytes_read += size_bytes

    def totals(self) -> dict:
        """Every counter of the epoch records, summed since the mount started."""
        totals = dict.fromkeys(COUNTER_FIELDS, 0)
        for record in self.epochs:
            for name in COUNTER_FIELDS:
                totals[name] += getattr(record, name)
        totals["stall_s"] = round(totals["stall_s"], 6)
        return totals

    def snapshot(self) -> list[dict]:
        out = []
        for record in self.epochs:
            item = asdict(record)
            item["stall_s"] = round(record.stall_s, 6)
            out.append(item)
        return out
