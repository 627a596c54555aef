"""The simulator's samples inside large files: packed files, their bytes, and a memmap reader.

`cachefs.sim` runs the mount's own objects on virtual time; with `SimConfig.ranges_per_file`
its items are byte ranges of packed files (a header of `range_header_bytes`, then the items
back to back: `packed`, the order's item table, cachefs.order_items). This module holds what
only that case needs:

- `range_content`: the bytes of a packed file, a function of their offset, so that every READ
  is checked;
- `SimPages`: the kernel's page cache of the packed files, by inode: the pages the daemon
  stores whole (`pyfuse3.notify_store`) or READs return, until the daemon drops a file's pages;
- `read_range_item`: a `numpy.memmap` reader over the zero-request data plane with the
  kernel's read-ahead off (mount.py): for each page of its item the kernel does not hold, one
  READ of that page; the item's class is the one the daemon counted when it consumed it.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from cachefs import stats as stats_mod
from cachefs.cache.ram import PAGE_BYTES
from cachefs.order_items import Items

log = logging.getLogger(__name__)

# the stats' class of each origin, in the order of the origins (stats.ORIGIN_*)
ORIGIN_FIELDS = ("hits_ram", "prefetched", "hits_ssd", "misses")


def range_content(file_index: int, lo: int, hi: int) -> bytes:
    """Bytes [lo, hi) of packed file `file_index`: a function of the offset, no two
    neighbouring pages alike."""
    offsets = np.arange(lo, hi, dtype=np.int64)
    return ((offsets * 131 + (offsets >> 12) * 17 + file_index * 7) % 251).astype(
        np.uint8).tobytes()


def packed(sizes: np.ndarray, per_file: int, header_bytes: int) -> tuple[Items, np.ndarray]:
    """The item table of items of `sizes` packed `per_file` to a file after a header, and the
    files' sizes."""
    n = len(sizes)
    file = np.arange(n, dtype=np.int64) // per_file
    offset = np.empty(n, np.int64)
    for first in range(0, n, per_file):
        chunk = sizes[first:first + per_file]
        offset[first:first + per_file] = header_bytes + np.concatenate(
            ([0], np.cumsum(chunk)[:-1]))
    file_sizes = np.array([header_bytes + int(sizes[first:first + per_file].sum())
                           for first in range(0, n, per_file)], np.int64)
    return Items(file, offset, sizes.astype(np.int64)).prepare(), file_sizes


class SimPages:
    """The kernel's page cache of packed files, by inode (module docstring)."""

    def __init__(self, sizes_by_inode: dict[int, int]):
        self._sizes = sizes_by_inode
        self.pages: dict[int, set[int]] = {}
        self.stored_bytes = 0

    def store(self, inode: int, offset: int, data) -> None:
        """What `pyfuse3.notify_store` leaves: the pages the data fills whole (or to the
        file's end)."""
        end = offset + len(data)
        first = -(-offset // PAGE_BYTES)
        last = end // PAGE_BYTES if end < self._sizes[inode] else -(-end // PAGE_BYTES)
        self.pages.setdefault(inode, set()).update(range(first, last))
        self.stored_bytes += len(data)

    def invalidate(self, inode: int) -> None:
        self.pages.pop(inode, None)

    def invalidate_range(self, inode: int, offset: int, length: int) -> None:
        """What `invalidate_inode_range` leaves: the pages the range touches go (length 0:
        to the file's end)."""
        first = offset // PAGE_BYTES
        end = -(-(offset + length) // PAGE_BYTES) if length else None
        self.pages[inode] = {page for page in self.pages.get(inode, ())
                             if page < first or (end is not None and page >= end)}

    def holds(self, inode: int, page: int) -> bool:
        return page in self.pages.get(inode, ())

    def read_into(self, inode: int, page: int) -> None:
        self.pages.setdefault(inode, set()).add(page)


async def read_range_item(sim, item: int, position: int, result) -> None:
    """Read item `item` of a packed file of `sim` (a `cachefs.sim.Sim`) as a memmap reader
    would (module docstring), and note its origin and stall in `result` at `position`."""
    items, pages = sim.items, sim.pages
    file_index = int(items.file[item])
    relpath, inode = sim.paths[file_index], file_index + 2
    handle = sim.handles.get(file_index)
    if handle is None:  # opened once, kept open, as a memmap keeps its file
        handle = sim.handles[file_index] = await sim.reader.open(
            inode, relpath, -1, sim.source.identity(relpath))
    offset, length = int(items.offset[item]), int(items.length[item])
    record = sim.stats.current  # the item counts here, even if it ends the epoch
    before = {name: getattr(record, name) for name in ORIGIN_FIELDS}
    started_s = trio.current_time()
    for page in range(offset // PAGE_BYTES, -(-(offset + length) // PAGE_BYTES)):
        if pages.holds(inode, page):
            continue
        lo = page * PAGE_BYTES
        # the kernel puts the page in its cache (locked) before it sends the READ: a drop of
        # the file's pages meanwhile waits for the READ, and takes the page too
        pages.read_into(inode, page)
        with sim.reader.waiting(handle.relpath, lo, PAGE_BYTES):  # as fuse_ops.read
            data = await sim.reader.read(handle, lo, PAGE_BYTES)
        if data != range_content(file_index, lo, min(lo + PAGE_BYTES, handle.identity.size)):
            sim.data_errors += 1
            log.error("item %d page %d: wrong bytes", item, page)
        sim.ram.observe()
    for origin, name in enumerate(ORIGIN_FIELDS):
        if getattr(record, name) > before[name]:
            result.origins[position] = origin
    if result.origins[position] == stats_mod.ORIGIN_MISS:
        result.stall_by_position[position] = trio.current_time() - started_s
    result.completion.append(position)
