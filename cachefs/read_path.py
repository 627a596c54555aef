"""The read path's wiring: the one wiring of the mount and the simulator.

Planner, ranking, tiered cache, range cache, prefetcher and reader (cachefs/reader.py), each
built after the objects it uses and given them at construction, so that no object is told of
another after it is built, and what the simulator tests is what the mount runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cachefs import stats as stats_mod
from cachefs.cache.ram import RamTier
from cachefs.cache.tiered import KernelInodes, TieredCache
from cachefs.config import MISS_BATCH_ITEMS
from cachefs.freshness import Freshness
from cachefs.pagecache import KernelPages
from cachefs.planner import Planner
from cachefs.prefetch import Prefetcher
from cachefs.range_cache import DropFilePages, RangeCache
from cachefs.range_prefetch import RangePrefetcher
from cachefs.range_read import RangeReader
from cachefs.ranking import Ranking
from cachefs.reader import Reader
from cachefs.source import SourceIdentity
from cachefs.targets import Targets
from cachefs.threads import RunSync


@dataclass(frozen=True)
class ReadPath:
    """The read path's objects (build_read_path), for whoever runs their services and reports
    their state (mount.py, sim.py)."""

    planner: Planner
    ranking: Ranking
    tiered: TieredCache
    prefetcher: Prefetcher
    reader: Reader
    targets: Targets
    range_cache: RangeCache


def build_read_path(source, stats: stats_mod.Stats, ram: RamTier, ssd, freshness: Freshness,
                    *, block_bytes: int, source_threads: int, lookahead_items: int,
                    sequential_blocks: int, targets: Targets | None = None,
                    miss_batch_items: int = MISS_BATCH_ITEMS, per_target: bool = True,
                    retain_by_cost: bool = True, kernel: KernelPages | None = None,
                    kernel_inodes: KernelInodes | None = None,
                    on_source_changed: Callable[[bytes, SourceIdentity, float | None], None]
                    | None = None,
                    run_ssd: RunSync | None = None,
                    drop_file_pages: DropFilePages | None = None) -> ReadPath:
    """Planner, ranking, tiered cache, prefetcher and reader, wired in that order (each is
    given the ones it uses when it is built); the one wiring used by the mount and the
    simulator, so that what the simulator tests is what the mount runs. `targets`: the storage
    targets' lists and counters (cachefs/targets.py; the source reports its requests to them,
    so it is built before the source; None: new ones, which no source reports to).
    `miss_batch_items`, `per_target`, `retain_by_cost`: the read-ahead's
    (cachefs/prefetch.py). `kernel` and `kernel_inodes`: the kernel data plane (None: the
    daemon serves every READ).
    `on_source_changed(relpath, identity, asked_s)`: a file changed at the source (its cached
    copies are gone; TieredCache.source_changed). `run_ssd`: the worker-thread hop of the SSD
    tier's calls (None: threads).
    `drop_file_pages(relpath, keep)`: the kernel drops a file's pages (the range cache's drops,
    cachefs/range_cache.py; None: nothing to drop)."""
    targets = targets if targets is not None else Targets()
    planner = Planner(lookahead_items or 1)
    ranking = Ranking(planner, ram, ssd, block_bytes=block_bytes)
    tiered = TieredCache(ram, source, stats, block_bytes, ranking, ssd=ssd, run_ssd=run_ssd,
                         kernel=kernel, kernel_inodes=kernel_inodes,
                         on_source_changed=on_source_changed)
    range_cache = RangeCache(ram, source, stats, ranking, freshness, kernel=kernel,
                             kernel_inodes=kernel_inodes, source_changed=tiered.source_changed,
                             drop_file_pages=drop_file_pages or (lambda relpath, keep: False))
    prefetcher = Prefetcher(planner, ranking, tiered, ram, source, stats, freshness, targets,
                            block_bytes=block_bytes, source_threads=source_threads,
                            lookahead_items=lookahead_items, miss_batch_items=miss_batch_items,
                            per_target=per_target, retain_by_cost=retain_by_cost,
                            ranges=RangePrefetcher(planner, ranking, range_cache,
                                                   source_threads=source_threads))
    reader = Reader(planner, ranking, tiered, prefetcher, stats, block_bytes=block_bytes,
                    sequential_blocks=sequential_blocks,
                    ranges=RangeReader(planner, ranking, range_cache, stats,
                                       prefetcher.consumed))
    return ReadPath(planner, ranking, tiered, prefetcher, reader, targets, range_cache)
