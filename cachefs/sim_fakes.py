"""The simulator's stand-ins for what a mount talks to: the slow source (latency, bandwidth,
per-target servers, packed files of byte ranges), the kernel's inode table, and the SSD tier
with its worker-thread hop on virtual time. cachefs/sim.py wires the mount's own objects over
them; nothing here decides anything of the policy.
"""


from __future__ import annotations

import logging
import types
from collections.abc import Callable

import numpy as np
import trio
import trio.testing

from cachefs import sim_ranges
from cachefs.cache.ssd_format import disk_bytes
from cachefs.cache.tiered import SSD_THREADS, block_length
from cachefs.order import Manifest
from cachefs.source import BlockData, RequestObserver, SourceIdentity
from cachefs.threads import RunSync

log = logging.getLogger(__name__)


MTIME_NS = 1_700_000_000 * 10**9  # every simulated file has this mtime; inode = item + 1


def payload(relpath: bytes, block_index: int, length: int) -> bytes:
    """The bytes of one simulated block: a header naming it, then zeros."""
    head = b"%s#%d|" % (relpath, block_index)
    return (head + bytes(max(0, length - len(head))))[:length]


class SimSource:
    """The slow directory, as `cachefs.source.Source` is used by the cache and prefetcher."""

    def __init__(self, manifest: Manifest, sizes: np.ndarray, *, latency_s: float,
                 parallelism: int, bandwidth_bytes_s: float = 0.0,
                 target_latencies_s: tuple[float, ...] | None = None,
                 target_parallelism: tuple[int, ...] | None = None,
                 requests: RequestObserver | None = None, packed: bool = False):
        self.limiter = trio.CapacityLimiter(parallelism)
        self.latency_s = latency_s
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self._sizes = sizes
        self._index = {manifest.path(i): i for i in range(len(manifest))}
        self.packed = packed  # the files' bytes are `range_content`
        self.requests = 0
        self._target_latencies_s = target_latencies_s or (latency_s,)
        self._target_limiters = [trio.CapacityLimiter(slots)
                                 for slots in target_parallelism or ()]
        self._observer = requests

    def identity(self, relpath: bytes) -> SourceIdentity:
        item = self._item(relpath)
        return SourceIdentity(int(self._sizes[item]), MTIME_NS, item + 1)

    def _item(self, relpath: bytes) -> int:
        try:
            return self._index[relpath]
        except KeyError:
            raise FileNotFoundError(2, "No such file or directory", relpath) from None

    async def _request(self, relpath: bytes, nbytes: int, item: int | None = None) -> None:
        target = self._item(relpath) % len(self._target_latencies_s)
        started = self._observer.request_started(relpath, item) if self._observer else None
        async with self.limiter:
            self.requests += 1
            began_s = trio.current_time()  # in the thread, as the source times it
            transfer_s = nbytes / self.bandwidth_bytes_s if self.bandwidth_bytes_s else 0.0
            if self._target_limiters:
                async with self._target_limiters[target]:
                    await trio.sleep(self._target_latencies_s[target] + transfer_s)
            else:
                await trio.sleep(self._target_latencies_s[target] + transfer_s)
            if self._observer is not None:
                self._observer.request_finished(started, trio.current_time() - began_s, nbytes)

    def identity_of(self, st) -> SourceIdentity:
        return SourceIdentity(st.st_size, st.st_mtime_ns, st.st_ino)

    def distrust_stat(self, relpath: bytes, identity: SourceIdentity) -> None:
        """`Source.distrust_stat`: this source remembers no stat to answer a lookup from (the
        simulator makes no lookups), so there is none to drop."""

    async def lstat(self, relpath: bytes, *, background: bool = False):
        identity = self.identity(relpath)
        await self._request(relpath, 0)
        return types.SimpleNamespace(st_size=identity.size, st_mtime_ns=identity.mtime_ns,
                                     st_ino=identity.ino)

    async def check_readable(self, relpath: bytes) -> SourceIdentity:
        identity = self.identity(relpath)
        await self._request(relpath, 0)
        return identity

    async def read_block(self, relpath: bytes, block_index: int, block_bytes: int, *,
                         background: bool = False, item: int | None = None,
                         expected_bytes: int = 0) -> BlockData:
        identity = self.identity(relpath)
        length = block_length(identity, block_index, block_bytes)
        await self._request(relpath, length, item)
        if self.packed:
            start = block_index * block_bytes
            return BlockData(sim_ranges.range_content(self._item(relpath), start,
                                                      start + length), identity)
        return BlockData(payload(relpath, block_index, length), identity)

    def can_start_block(self) -> bool:
        """`Source.can_start_block`: a source thread is free now."""
        return self.limiter.available_tokens > 0

    def start_block(self, relpath: bytes, block_index: int, block_bytes: int, *, item: int,
                    expected_bytes: int,
                    on_done: Callable[[BlockData | None, OSError | None], None]) -> bool:
        """`Source.start_block`: `read_block` begun with no task of the caller's waiting, if a
        source thread is free now (else False), its outcome handed to `on_done`."""
        if not self.can_start_block():
            return False

        async def read() -> None:
            try:
                block = await self.read_block(relpath, block_index, block_bytes,
                                              background=True, item=item)
            except OSError as exc:
                on_done(None, exc)
            else:
                on_done(block, None)
        trio.lowlevel.spawn_system_task(read, name="sim-source-read")
        return True

    async def read_ranges(self, relpath: bytes, ranges: list[tuple[int, int]], *,
                          background: bool = False, hold_s: float = 0.0) -> BlockData:
        identity = self.identity(relpath)
        file_index = self._item(relpath)
        parts = [sim_ranges.range_content(file_index, offset,
                                          min(offset + length, identity.size))
                 for offset, length in ranges]
        await self._request(relpath, sum(map(len, parts)))
        return BlockData(b"".join(parts), identity)



class SimKernelInodes:
    """A kernel that has looked up every file of the data set (`KernelInodes`)."""

    def __init__(self, manifest: Manifest):
        self._inodes = {manifest.path(i): i + 2 for i in range(len(manifest))}

    def inode_of(self, relpath: bytes) -> int | None:
        return self._inodes.get(relpath)

    def store_target(self, relpath: bytes, identity: SourceIdentity) -> int | None:
        return self._inodes.get(relpath)


class SimSsd:
    """Cache-once block store in memory, with `cachefs.cache.ssd.SsdTier`'s methods and its
    charge of an entry against the budget (`disk_bytes`)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: dict[tuple[bytes, int], tuple[SourceIdentity, bytes]] = {}
        self.bytes = 0
        self.reads = 0

    def contains(self, key, identity: SourceIdentity) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry[0] == identity

    def has_entry(self, key) -> bool:
        return key in self.entries

    def holds_other_version(self, key, identity: SourceIdentity) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry[0] != identity

    def read(self, key, identity: SourceIdentity) -> bytes | None:
        entry = self.entries.get(key)
        if entry is not None and entry[0] != identity:
            self.bytes -= disk_bytes(len(self.entries.pop(key)[1]))  # stale: as SsdTier does
            return None
        if entry is None:
            return None
        self.reads += 1
        return entry[1]

    def admit(self, key, identity: SourceIdentity, data: bytes) -> bool:
        if key in self.entries or not self.has_room(len(data)):
            return False  # cache-once: nothing is ever replaced
        self.entries[key] = (identity, data)
        self.bytes += disk_bytes(len(data))
        return True

    def has_room(self, size_bytes: int) -> bool:
        return self.bytes + disk_bytes(size_bytes) <= self.budget_bytes

    def drop_file(self, relpath: bytes, keep: SourceIdentity | None = None) -> int:
        return len(self.forget_file(relpath, keep))

    def forget_file(self, relpath: bytes, keep: SourceIdentity | None = None) -> list:
        """`SsdTier.forget_file`: here the entries go whole at once (no files to unlink)."""
        keys = [key for key, (identity, _) in self.entries.items()
                if key[0] == relpath and identity != keep]
        for key in keys:
            self.bytes -= disk_bytes(len(self.entries.pop(key)[1]))
        return keys

    def unlink_forgotten(self, keys: list) -> None:
        """`SsdTier.unlink_forgotten`: `forget_file` left no file behind."""

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget_bytes, "entries": len(self.entries)}

    def close(self) -> None:
        pass


def inline_ssd_calls(latency_s: float, threads: int = SSD_THREADS) -> RunSync:
    """The tiered cache's worker-thread hop for a `SimSsd`: each call runs inline, holding
    one of `threads` slots, after a virtual delay of `latency_s`.

    The SimSsd does no blocking I/O, and under the MockClock a real thread lets virtual time
    jump ahead while it runs, which would make SSD reads cost an arbitrary time.
    """
    limiter = trio.CapacityLimiter(threads)

    async def run_sync(fn, *args):
        async with limiter:
            await trio.sleep(latency_s)
            return fn(*args)

    return run_sync
