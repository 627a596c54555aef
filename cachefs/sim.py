"""Trace-driven simulator of the order-driven cache: the mount's own code, without FUSE.

Why it exists. The policy (docs/design.md §2) makes claims about time and memory: no stalls once
the read-ahead window is full, the head of every later epoch served from RAM, a budget that is
never exceeded, no block read twice in one epoch. Checking them against a real mount over slow
storage takes minutes and is noisy. Here the same claims are checked in a fraction of a second
of real time, on virtual time. Runs of one trace agree to within a few misses: trio shuffles
the tasks that are ready at one virtual instant (on purpose, and with a generator of its own
that the simulator leaves alone), so fetches landing at the same instant land in varying order.

What is real and what is simulated. `simulate` builds the real `Planner`, `Ranking`, `RamTier`,
`Prefetcher`, `TieredCache`, `Reader`, `Freshness` and `Stats` with
`cachefs.read_path.build_read_path`, the wiring `cachefs.mount.Mount` uses too. Only the edges are
fakes, passed in through that wiring (no library is patched):
- `SimSource` has the interface the code uses from `cachefs.source.Source` (`read_block`,
  `lstat`, `check_readable`, `identity_of`), and reports every request to the storage targets'
  counters as the source does. Every request holds one slot of a
  `trio.CapacityLimiter(parallelism)` (the source's threads) and sleeps `latency_s` (plus
  `size / bandwidth` when a per-request bandwidth is given). Payloads are zeros behind a short
  header naming the file and block, so the consumer checks that every read returns the right
  bytes.
- Storage targets (`target_latencies_s`): item i lives on target i mod T (the seed's striping),
  seen as the device of its file, as a mount sees several servers mounted under one source
  (cachefs/placement.py). A request to target t takes `target_latencies_s[t]` and, with
  `target_parallelism`, holds one of that target's own slots too (a server that serves so
  many requests at once; the others queue there, holding their source thread, as a thread
  blocked on a busy NFS or sshfs server does). `per_target=False` runs the read-ahead with one
  list for the whole order (one window), the baseline the per-target lists are measured
  against.
- `SimSsd` has the interface of `cachefs.cache.ssd.SsdTier` (`contains`,
  `holds_other_version`, `read`, `admit`, `has_room`, `drop_file`, `forget_file`,
  `unlink_forgotten`, `stats`, `close`): in memory, cache-once within a byte budget.
- The kernel's page cache is `KernelPages` with fake kernel calls that only count, and
  `SimKernelInodes`, a kernel that holds every file's inode: the read path decides what to
  push and drop exactly as in a mount, and a file whose open finds it whole in the kernel is
  read with no request (`Reader.open`'s `kernel_whole`), as the kernel would serve it.
- Time is trio's virtual clock (`MockClock(autojump_threshold=0)`), the one clock the read
  path times and ages identities on (cachefs/freshness.py): whenever every task waits, the
  clock jumps to the next deadline, so three epochs of thousands of items take well under a
  second. A real worker thread would let the clock jump while it runs, so the tiered cache is
  given a worker-thread hop (`run_ssd`) that runs its calls into the SimSsd inline after a
  virtual `ssd_latency_s` (`inline_ssd_calls`); nothing else uses threads.

The consumer plays the trainer. For each epoch it publishes an `Order` (current = this
epoch's permutation, next = the following one) through `prefetcher.set_order`, as the order
watcher does, then `workers` tasks take batches of `batch_items` positions in order from a
shared counter (1: one position at a time; more: a DataLoader's workers, each reading a batch of
its own) and, per item:
open (with the identity check `fuse_ops.open` makes: a source round trip unless the prefetcher
knows the file's identity from the last `metadata_ttl_s`), read the whole file in
`request_bytes` requests as the kernel would, release, then compute for `consume_s`. A seeded
random delay of up to `open_jitter_s` between taking a position and opening it makes several
workers read a little out of order, as DataLoader workers do. An epoch ends when every worker
is done; its wall time is in virtual seconds.

Samples inside large files (`ranges_per_file` > 0): the items are byte ranges of packed files
read as a `numpy.memmap` reader reads them, with a fake kernel page cache of those files
(cachefs/sim_ranges.py).

Per epoch the result carries the mount's own counters (from `Stats`) and what only a simulator
can see: the origin of every position (to check where RAM hits fall), the RAM blocks kept
across the epoch boundary and how many of them the SSD also holds, and the largest
`ram.used_bytes` observed after every reservation, insertion and consumer step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import trio
import trio.testing

from cachefs import stats as stats_mod
from cachefs.cache.ram import RamTier
from cachefs.config import KIB, MIB, MISS_BATCH_ITEMS
from cachefs.freshness import Freshness
from cachefs.order import Manifest, Order, permutation
from cachefs.order_items import Items
from cachefs.pagecache import KernelPages, file_pages_dropper
from cachefs.read_path import build_read_path
from cachefs.reader import OpenFile
from cachefs.sim_fakes import SimKernelInodes, SimSource, SimSsd, inline_ssd_calls, payload
from cachefs.sim_ranges import SimPages, packed, read_range_item
from cachefs.stats import Stats, refetch_window_blocks
from cachefs.targets import Targets

log = logging.getLogger(__name__)


ORIGIN_NAMES = {stats_mod.ORIGIN_RAM: "ram", stats_mod.ORIGIN_PREFETCHED: "prefetched",
                stats_mod.ORIGIN_SSD: "ssd", stats_mod.ORIGIN_MISS: "miss"}


@dataclass(frozen=True)
class SimConfig:
    """A trace and the machine it runs on. Sizes in bytes, times in (virtual) seconds."""

    items: int = 5000
    item_bytes: int = 110_000
    sizes_bytes: tuple[int, ...] | None = None  # per item; overrides items/item_bytes
    epochs: int = 3
    ram_bytes: int = 128 * MIB
    ssd_bytes: int = 0  # 0: no SSD tier
    block_bytes: int = 4 * MIB
    latency_s: float = 0.002  # per source request (stat or block read)
    parallelism: int = 32  # source requests in flight at once, and --source-threads
    bandwidth_bytes_s: float = 0.0  # per request; 0: unlimited
    ssd_latency_s: float = 0.0001  # per SSD read or write
    consume_s: float = 0.0005  # compute per item, after its file is released
    open_jitter_s: float = 0.0  # uniform(0, jitter) per item, seeded, before its open
    workers: int = 1  # concurrent readers
    # positions a worker takes at a time and reads in order: a DataLoader worker reads one
    # batch of batch_items files while the other workers read the next batches
    batch_items: int = 1
    lookahead_items: int = 0  # --lookahead; 0: automatic
    sequential_blocks: int = 4
    request_bytes: int = 128 * KIB  # one kernel read request
    metadata_ttl_s: float = 60.0  # MountConfig's default
    check_identity_at_open: bool = True  # model fuse_ops.open's identity check
    kernel_cache: bool = True  # the kernel data plane (cachefs mount --data-plane, not daemon)
    seed: int = 0
    # storage targets (module docstring): per-target latency (None: one target, latency_s),
    # and how many requests each serves at once (None: no limit of its own)
    target_latencies_s: tuple[float, ...] | None = None
    target_parallelism: tuple[int, ...] | None = None
    per_target: bool = True  # one read-ahead list per target (False: one for the order)
    # the next epoch's files kept by distance over their target's read cost (False: by
    # distance alone, the head of the next epoch whatever the targets; cachefs/ranking.py)
    retain_by_cost: bool = True
    miss_batch_items: int = MISS_BATCH_ITEMS  # --miss-batch
    # the readers skip this many positions at the start of every epoch (a job resumed in
    # mid-epoch): those are never consumed, and the rest is read outside the window
    skip_items: int = 0
    # > 0: the items are byte ranges, this many per packed file (module docstring)
    ranges_per_file: int = 0
    range_header_bytes: int = 128  # bytes of no item at the start of a packed file
    shuffle: bool = True  # a new permutation each epoch; False: every epoch in item order

    def sizes(self) -> np.ndarray:
        if self.sizes_bytes is not None:
            return np.asarray(self.sizes_bytes, np.int64)
        return np.full(self.items, self.item_bytes, np.int64)

    def __post_init__(self):
        if (self.epochs < 1 or self.workers < 1 or self.parallelism < 1
                or self.batch_items < 1):
            raise ValueError("epochs, workers, parallelism and batch_items must be >= 1")
        if self.request_bytes < 1 or self.block_bytes < 1:
            raise ValueError("request_bytes and block_bytes must be positive")
        if (self.target_parallelism is not None
                and len(self.target_parallelism) != len(self.target_latencies_s or ())):
            raise ValueError("target_parallelism needs one entry per target latency")

    @property
    def target_count(self) -> int:
        return len(self.target_latencies_s) if self.target_latencies_s else 1


@dataclass
class EpochResult:
    epoch: int
    wall_s: float = 0.0
    reads: int = 0
    hits_ram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    prefetched: int = 0
    backend_bytes: int = 0
    backend_reads: int = 0
    stall_s: float = 0.0  # the reader's own measure: time spent waiting on the source
    refetched_blocks: int = 0
    open_wait_s: float = 0.0  # time opens waited for the identity check at the source
    boundary_ram_blocks: int = 0  # blocks served last epoch and still in RAM at its start
    boundary_ram_on_ssd: int = 0  # ... of which the SSD tier holds a copy (should be 0)
    items: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # the order
    origins: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))  # per position
    stall_by_position: np.ndarray = field(default_factory=lambda: np.empty(0))
    completion: list[int] = field(default_factory=list)  # positions, in the order released

    @property
    def ram_hit_positions(self) -> np.ndarray:
        return np.flatnonzero(self.origins == stats_mod.ORIGIN_RAM)

    def stalled_positions(self) -> np.ndarray:
        return np.flatnonzero(self.stall_by_position > 0)

    def row(self) -> dict:
        return {"epoch": self.epoch, "wall_s": round(self.wall_s, 4), "reads": self.reads,
                "hits_ram": self.hits_ram, "hits_ssd": self.hits_ssd,
                "prefetched": self.prefetched, "misses": self.misses,
                "stall_s": round(self.stall_s, 4), "open_wait_s": round(self.open_wait_s, 4),
                "backend_MB": round(self.backend_bytes / 1e6, 1),
                "refetched": self.refetched_blocks}


@dataclass
class SimResult:
    config: SimConfig
    epochs: list[EpochResult]
    max_ram_used_bytes: int
    ram_budget_bytes: int
    lookahead_items: int  # the planner's window when the run ended
    ram_evictions: int
    ssd_bytes: int  # bytes held by the SSD tier at the end
    ssd_keys: frozenset  # (relpath, block_index) held by the SSD tier at the end
    data_errors: int  # reads whose bytes were not those of the file and block asked for
    targets: list[dict] = field(default_factory=list)  # `cachefs stats`'s targets at the end
    source_requests: int = 0  # stats, opens and reads the source answered

    def table(self) -> str:
        rows = [e.row() for e in self.epochs]
        headers = list(rows[0])
        widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in headers]
        lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
        lines += ["  ".join(str(r[h]).rjust(w) for h, w in zip(headers, widths, strict=True))
                  for r in rows]
        return "\n".join(lines)


# -- the fakes ---------------------------------------------------------------------------------


class _ObservedRamTier(RamTier):
    """The real RAM tier, noting the largest `used_bytes` after every change of it."""

    max_used_bytes = 0

    def observe(self) -> None:
        used = self.used_bytes
        if used > self.max_used_bytes:
            self.max_used_bytes = used
        if used > self.budget_bytes or self.reserved_bytes < 0:
            raise AssertionError(f"RAM budget broken: used {used} of {self.budget_bytes}")


def _observed(name: str):
    """`RamTier.<name>`, then `observe`: every method that changes what the tier uses."""
    method = getattr(RamTier, name)

    def observed(self, *args):
        try:
            return method(self, *args)
        finally:
            self.observe()
    return observed


for _name in ("reserve", "unreserve", "insert", "hand_to_kernel", "keep_kernel_copies"):
    setattr(_ObservedRamTier, _name, _observed(_name))


# -- the run -----------------------------------------------------------------------------------


class Sim:
    """The mount's objects wired as `cachefs.mount.Mount` wires them, over the fakes."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.sizes = config.sizes()
        n = len(self.sizes)
        self.items: Items | None = None
        self.pages: SimPages | None = None
        if config.ranges_per_file:
            self.items, file_sizes = packed(self.sizes, config.ranges_per_file,
                                            config.range_header_bytes)
            self.manifest = Manifest.from_paths(
                [b"packed%04d.bin" % i for i in range(len(file_sizes))]).prepare()
        else:
            file_sizes = self.sizes
            # item i on target i mod T, as the device of its file (module docstring)
            self.manifest = Manifest(
                Manifest.from_paths([b"d%02d/item%07d.bin" % (i % 16, i)
                                     for i in range(n)]).paths,
                devices=np.arange(n, dtype=np.int64) % config.target_count).prepare()
        self.paths = [self.manifest.path(i) for i in range(len(self.manifest))]
        self.stats = Stats(refetch_window_blocks(config.ram_bytes, config.block_bytes))
        self.targets = Targets()
        self.source = SimSource(self.manifest, file_sizes, latency_s=config.latency_s,
                                parallelism=config.parallelism,
                                bandwidth_bytes_s=config.bandwidth_bytes_s,
                                target_latencies_s=config.target_latencies_s,
                                target_parallelism=config.target_parallelism,
                                requests=self.targets, packed=self.items is not None)
        self.ssd = SimSsd(config.ssd_bytes) if config.ssd_bytes else None
        kernel_inodes = SimKernelInodes(self.manifest)
        drop_file_pages = None
        if self.items is not None:
            # a kernel that keeps the pages of packed files (module docstring); the daemon
            # drops them whatever its data plane
            pages = self.pages = SimPages({i + 2: int(size) for i, size in enumerate(file_sizes)})
            # the kernel calls, as the patched pyfuse3 has them (looked up at each call: a
            # test may stand in for one)
            self.kernel = KernelPages(
                lambda inode, offset, data: pages.store(inode, offset, data),
                lambda inode: pages.invalidate(inode),
                invalidate_range_fn=lambda inode, offset, length: pages.invalidate_range(
                    inode, offset, length)) if config.kernel_cache else None

            def drop_file_pages(relpath: bytes, keep: list[tuple[int, int]] | None) -> bool:
                inode = kernel_inodes.inode_of(relpath)
                if inode is None:
                    return False
                if self.kernel is None:  # no data plane: the mount drops every page
                    pages.invalidate(inode)
                    return False
                return self.kernel.invalidate(inode, keep)  # in order after the stores queued
        else:
            self.kernel = (KernelPages(lambda inode, offset, data: None, lambda inode: None)
                           if config.kernel_cache else None)
        self.ram = _ObservedRamTier(
            config.ram_bytes, block_bytes=config.block_bytes,
            drop_kernel_pages=file_pages_dropper(self.kernel, kernel_inodes.inode_of))
        read_path = build_read_path(
            self.source, self.stats, self.ram, self.ssd, Freshness(config.metadata_ttl_s),
            targets=self.targets, block_bytes=config.block_bytes, source_threads=config.parallelism,
            lookahead_items=config.lookahead_items, sequential_blocks=config.sequential_blocks,
            miss_batch_items=config.miss_batch_items, per_target=config.per_target,
            retain_by_cost=config.retain_by_cost,
            kernel=self.kernel, kernel_inodes=kernel_inodes,
            run_ssd=inline_ssd_calls(config.ssd_latency_s), drop_file_pages=drop_file_pages)
        self.planner = read_path.planner
        self.tiered = read_path.tiered
        self.prefetcher = read_path.prefetcher
        self.reader = read_path.reader
        rng = np.random.default_rng(config.seed)
        self.jitter_s = rng.uniform(0, config.open_jitter_s, (config.epochs, n))
        self.data_errors = 0
        self.handles: dict[int, OpenFile] = {}  # packed file -> its reader's handle

    def order(self, epoch: int) -> Order:
        n = len(self.sizes)

        def of(e: int) -> np.ndarray:
            return permutation(n, self.config.seed, e) if self.config.shuffle \
                else np.arange(n, dtype=np.int64)
        return Order(epoch=epoch, current=of(epoch), next=of(epoch + 1), manifest=self.manifest,
                     rank=None, world_size=None, total_length=n, file=None, items=self.items)

    async def main(self) -> list[EpochResult]:
        return await self.serving(self._epochs)

    async def serving(self, script):
        """`await script()` with the mount's services running (the tiered cache's and the
        prefetcher's tasks), as `cachefs.mount.Mount.serve` runs them; an exception in either
        ends the run, as it would end the mount."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.tiered.run)
            await nursery.start(self.prefetcher.run)
            result = await script()
            nursery.cancel_scope.cancel()
        return result

    async def _epochs(self) -> list[EpochResult]:
        return [await self._epoch(epoch) for epoch in range(1, self.config.epochs + 1)]

    async def _epoch(self, epoch: int) -> EpochResult:
        order = self.order(epoch)
        n = len(order.current)
        result = EpochResult(epoch, items=order.current, origins=np.full(n, -1, np.int8),
                             stall_by_position=np.zeros(n))
        result.boundary_ram_blocks, result.boundary_ram_on_ssd = self._retained()
        started_s = trio.current_time()
        self.prefetcher.set_order(order)
        self.ram.observe()
        batch = self.config.batch_items
        skip = min(self.config.skip_items, n)
        batches = iter([range(start, min(start + batch, n)) for start in range(skip, n, batch)])
        async with trio.open_nursery() as nursery:
            for _ in range(self.config.workers):
                nursery.start_soon(self._worker, epoch, order, batches, result)
        result.wall_s = trio.current_time() - started_s
        return result

    def _retained(self) -> tuple[int, int]:
        """RAM blocks already served to a reader (kept from an earlier epoch), and how many of
        them the SSD tier holds too."""
        kept = [key for key, block in self.ram.blocks.items() if block.served]
        on_ssd = sum(1 for key in kept if self.ssd is not None and key in self.ssd.entries)
        return len(kept), on_ssd

    async def _worker(self, epoch: int, order: Order, batches, result: EpochResult) -> None:
        for batch in batches:
            for position in batch:
                await self._read_position(epoch, order, position, result)

    async def _read_position(self, epoch: int, order: Order, position: int,
                             result: EpochResult) -> None:
        config = self.config
        item = int(order.current[position])
        if config.open_jitter_s:
            await trio.sleep(self.jitter_s[epoch - 1, position])
        if self.items is not None:
            await read_range_item(self, item, position, result)
            await trio.sleep(config.consume_s)
            return
        handle = await self._open(item, result)
        size = handle.identity.size
        # a file the kernel holds whole is read from its pages: no request reaches the daemon
        offset = size if handle.kernel_whole else 0
        while offset < size:
            request = min(config.request_bytes, size - offset)
            with self.reader.waiting(handle.relpath, offset, request):  # as fuse_ops.read
                data = await self.reader.read(handle, offset, request)
            self._check(item, offset, data, request)
            offset += request
            self.ram.observe()
        self.reader.release(handle)
        result.origins[position] = handle.origin
        result.completion.append(position)
        result.stall_by_position[position] = handle.stall_s
        self.ram.observe()
        await trio.sleep(config.consume_s)

    async def _open(self, item: int, result: EpochResult):
        """`fuse_ops.open`: the reader's identity check (a round trip when nothing recent is
        known), or, with check_identity_at_open off, the source's identity for free."""
        relpath = self.paths[item]
        recent = None if self.config.check_identity_at_open else self.source.identity(relpath)
        started_s = trio.current_time()
        # the kernel's pages are of the source's version (simulated files never change)
        handle = await self.reader.open(item + 2, relpath, item, recent,
                                        self.source.identity(relpath))
        result.open_wait_s += trio.current_time() - started_s
        return handle

    def _check(self, item: int, offset: int, data: bytes, request: int) -> None:
        block_bytes = self.config.block_bytes
        block_index = offset // block_bytes
        if offset % block_bytes == 0 and len(data) == request:
            head = payload(self.paths[item], block_index, 64)
            ok = data[:len(head)] == head[:len(data)]
        else:
            ok = len(data) == request
        if not ok:
            self.data_errors += 1
            log.error("item %d offset %d: wrong bytes", item, offset)

    def _take_counters(self, result: EpochResult) -> None:
        for record in self.stats.epochs:
            if record.epoch == result.epoch:
                for name in ("reads", "hits_ram", "hits_ssd", "misses", "prefetched",
                             "backend_bytes", "backend_reads", "stall_s", "refetched_blocks"):
                    setattr(result, name, getattr(record, name))


def simulate(config: SimConfig) -> SimResult:
    """Run the trace on virtual time; see the module docstring."""
    sim = Sim(config)
    epochs = trio.run(sim.main, clock=trio.testing.MockClock(autojump_threshold=0))
    # backend reads of the window's next-epoch items count in the epoch that made them, until
    # the switch; read the counters once the run is over
    for result in epochs:
        sim._take_counters(result)
    ssd_keys = frozenset(sim.ssd.entries) if sim.ssd is not None else frozenset()
    return SimResult(config, epochs, sim.ram.max_used_bytes, sim.ram.budget_bytes,
                     sim.planner.lookahead_items, sim.ram.evictions,
                     sim.ssd.bytes if sim.ssd is not None else 0, ssd_keys, sim.data_errors,
                     sim.targets.status(), sim.source.requests)


def run_script(config: SimConfig, script):
    """`await script(sim)` on virtual time, with a `Sim` of `config` serving: for event
    sequences the trainer of `simulate` does not make (orders over other manifests published
    while fetches are in flight). Returns what the script returns."""
    sim = Sim(config)
    return trio.run(sim.serving, lambda: script(sim),
                    clock=trio.testing.MockClock(autojump_threshold=0))


# -- command line ------------------------------------------------------------------------------


def main(argv=None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--items", default=5000, show_default=True, help="Files in the data set.")
    @click.option("--item-kb", default=110.0, show_default=True, help="File size, KB (1000 B).")
    @click.option("--ram-fraction", default=0.25, show_default=True,
                  help="RAM budget as a fraction of the data set.")
    @click.option("--ssd-fraction", default=0.0, show_default=True,
                  help="SSD budget as a fraction of the data set (0: no SSD tier).")
    @click.option("--epochs", default=3, show_default=True)
    @click.option("--latency-ms", default=2.0, show_default=True, help="Per source request.")
    @click.option("--parallelism", default=32, show_default=True,
                  help="Source requests in flight (--source-threads).")
    @click.option("--bandwidth-mbs", default=0.0, show_default=True,
                  help="Per-request source bandwidth, MB/s (0: unlimited).")
    @click.option("--consume-ms", default=0.5, show_default=True, help="Compute per item.")
    @click.option("--jitter-ms", default=0.0, show_default=True,
                  help="Random delay before each open.")
    @click.option("--workers", default=1, show_default=True, help="Concurrent readers.")
    @click.option("--batch-items", default=1, show_default=True,
                  help="Files a worker takes at a time and reads in order (a DataLoader batch).")
    @click.option("--lookahead", default=0, show_default=True, help="0: automatic.")
    @click.option("--block-kib", default=4096, show_default=True)
    @click.option("--metadata-ttl-s", default=60.0, show_default=True)
    @click.option("--seed", default=0, show_default=True)
    @click.option("--ranges-per-file", default=0, show_default=True,
                  help="Items are byte ranges of packed files, this many per file (0: files).")
    def command(items, item_kb, ram_fraction, ssd_fraction, epochs, latency_ms, parallelism,
                bandwidth_mbs, consume_ms, jitter_ms, workers, batch_items, lookahead,
                block_kib, metadata_ttl_s, seed, ranges_per_file):
        """Simulate a training run over cachefs on virtual time and print per-epoch figures."""
        item_bytes = int(item_kb * 1000)
        data_bytes = items * item_bytes
        config = SimConfig(
            items=items, item_bytes=item_bytes, epochs=epochs,
            ram_bytes=int(data_bytes * ram_fraction), ssd_bytes=int(data_bytes * ssd_fraction),
            block_bytes=block_kib * KIB, latency_s=latency_ms / 1e3, parallelism=parallelism,
            bandwidth_bytes_s=bandwidth_mbs * 1e6, consume_s=consume_ms / 1e3,
            open_jitter_s=jitter_ms / 1e3, workers=workers, batch_items=batch_items,
            lookahead_items=lookahead,
            metadata_ttl_s=metadata_ttl_s, seed=seed, ranges_per_file=ranges_per_file)
        result = simulate(config)
        click.echo(result.table())
        click.echo(f"RAM budget {result.ram_budget_bytes / 1e6:.1f} MB, max used "
                   f"{result.max_ram_used_bytes / 1e6:.1f} MB, lookahead "
                   f"{result.lookahead_items} items, data errors {result.data_errors}")
        for epoch in result.epochs:
            hits = epoch.ram_hit_positions
            if len(hits):
                click.echo(f"epoch {epoch.epoch}: RAM hits at positions {hits.min()}..{hits.max()}"
                           f" ({len(hits)} of them), retained at start "
                           f"{epoch.boundary_ram_blocks} blocks "
                           f"({epoch.boundary_ram_on_ssd} also on SSD)")

    command.main(args=argv, prog_name="python -m cachefs.sim")


if __name__ == "__main__":
    main()
