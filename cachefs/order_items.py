"""Byte-range items of an order: samples that are ranges of bytes inside large files.

Many data sets are not one file per sample: a `.npy` read through `numpy.memmap`, an HDF5
dataset, tar shards, TFRecord files. An order file then describes its samples with three
optional int64 arrays of one length (man/cachefs-order.5):

    item_file     index into the manifest (`files`, or the source's listing): the file
    item_offset   the sample's first byte in that file
    item_length   its length in bytes, > 0

With them, `current` and `next` index the items instead of the files, and every count that
counts files (the plan's positions, consumption, the stats' reads) counts items. The format's
version stays 1: without the keys an order means what it always meant.

Validation is as strict as for files (`check_items`): integer arrays of one length, every file
index in the manifest, offsets >= 0, lengths in 1..`MAX_ITEM_BYTES`, no two items of a file
overlapping (a byte belongs to one sample, so that consumption and caching are per item and
never hold a byte twice), and, once the daemon knows the files' sizes (`check_within_files`),
every range inside its file. Messages name the key, the position and the value.

`Items` is the validated table, read-only, and the per-file index the daemon looks ranges up
in: the items of one file sorted by offset (`in_file`), and the items a byte range overlaps
(`overlapping`), both by binary search, without per-item Python objects.

This module imports neither pyfuse3 nor trio: trainers import it (through cachefs.order).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cachefs.errors import OrderError

ITEM_KEYS = ("item_file", "item_offset", "item_length")
# The largest item: a sample is read ahead and cached whole, so one far larger than any RAM
# budget is a mistake in the table (an offset written as a length), not a sample.
MAX_ITEM_BYTES = 1 << 30
# Offsets and ends stay well inside int64 (no overflow in offset + length).
MAX_OFFSET = 1 << 62


class ItemArrays(NamedTuple):
    """The three arrays as a writer gives them (`cachefs.publish.publish(items=...)`)."""

    file: object
    offset: object
    length: object

    @property
    def item_count(self) -> int:
        """How many items: the length of `file`."""
        return len(np.asarray(self.file))


class Items:
    """A validated item table (`check_items`); arrays are int64 and read-only."""

    def __init__(self, file: np.ndarray, offset: np.ndarray, length: np.ndarray):
        self.file = file
        self.offset = offset
        self.length = length
        for array in (file, offset, length):
            array.flags.writeable = False
        self._sorted: np.ndarray | None = None  # item numbers by (file, offset)
        self._file_starts: np.ndarray | None = None  # first slot of each file in _sorted
        self._next: np.ndarray | None = None  # the item after each in its file, -1 for none
        # offsets and ends (offset + length) in `_sorted` order, as memoryviews: `bisect`
        # searches them without numpy, which releases the GIL for a search and then waits
        # for it behind the daemon's worker threads (20 us a search, where this takes 1)
        self._offsets_sorted: memoryview | None = None
        self._ends_sorted: memoryview | None = None

    def __len__(self) -> int:
        return len(self.file)

    def __repr__(self) -> str:
        return f"<Items: {len(self)} ranges in {len(np.unique(self.file))} files>"

    def same_ranges(self, other: Items | None) -> bool:
        """The same ranges with the same numbers (the same object, or an equal copy)."""
        return other is not None and (self is other or (
            len(self) == len(other) and bool(np.array_equal(self.file, other.file))
            and bool(np.array_equal(self.offset, other.offset))
            and bool(np.array_equal(self.length, other.length))))

    def arrays(self) -> dict[str, np.ndarray]:
        """The three arrays by their order-file keys."""
        return dict(zip(ITEM_KEYS, (self.file, self.offset, self.length), strict=True))

    def files(self) -> np.ndarray:
        """The manifest indices of the files that hold items, ascending."""
        return np.unique(self.file)

    # -- the per-file index ------------------------------------------------------------------

    def prepare(self) -> Items:
        """Build the per-file index now (else the first lookup builds it)."""
        self._index()
        return self

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None or self._file_starts is None:
            ordered = np.lexsort((self.offset, self.file))
            files = self.file[ordered]
            # slot where each file's items start, for files 0..max: searchsorted of the sorted
            # file column (a file without items gets an empty slice)
            top = int(files[-1]) + 2 if len(files) else 1
            self._file_starts = np.searchsorted(files, np.arange(top), side="left")
            self._next = np.full(len(self.file), -1, np.int64)
            same_file = files[1:] == files[:-1]
            self._next[ordered[:-1][same_file]] = ordered[1:][same_file]
            offsets = np.ascontiguousarray(self.offset[ordered], np.int64)
            self._offsets_sorted = offsets.data
            self._ends_sorted = np.ascontiguousarray(offsets + self.length[ordered]).data
            self._sorted = ordered
        return self._sorted, self._file_starts

    def in_file(self, file_index: int) -> np.ndarray:
        """Item numbers of one file, by increasing offset (empty if it has none)."""
        ordered, starts = self._index()
        if not 0 <= file_index < len(starts) - 1:
            return ordered[:0]
        return ordered[starts[file_index]:starts[file_index + 1]]

    def overlapping(self, file_index: int, lo: int, hi: int) -> np.ndarray:
        """Item numbers of `file_index` whose range overlaps bytes [lo, hi), by offset. Two
        binary searches in the file's slice of the sorted arrays: no copy per call (the
        daemon asks this for every READ and every push)."""
        ordered, starts = self._index()
        assert self._offsets_sorted is not None and self._ends_sorted is not None
        if not 0 <= file_index < len(starts) - 1 or hi <= lo:
            return ordered[:0]
        start, stop = int(starts[file_index]), int(starts[file_index + 1])
        # items do not overlap, so their ends ascend with their offsets
        first = bisect.bisect_right(self._ends_sorted, lo, start, stop)
        last = bisect.bisect_left(self._offsets_sorted, hi, first, stop)
        return ordered[first:last]

    def next_in_file(self, item: int) -> int:
        """The item that follows `item` in its file (by offset), or -1."""
        self._index()
        assert self._next is not None
        return int(self._next[item])

    def find(self, file_index: int, offset: int, length: int) -> int:
        """The number of the item that is exactly these bytes of this file, else -1."""
        for item in self.overlapping(file_index, offset, offset + 1).tolist():
            if self.offset[item] == offset and self.length[item] == length:
                return item
        return -1


def as_int_array(key: str, values) -> np.ndarray:
    """`values` as a 1-D int64 array (the order file's index arrays and item table), or
    OrderError naming `key` and what is wrong."""
    array = np.asarray(values)
    if array.dtype.kind == "O":
        raise OrderError(f"{key} holds Python objects; it must be an integer array")
    if array.ndim != 1:
        raise OrderError(f"{key} must be a 1-D integer array, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        if len(array) == 0:
            return np.zeros(0, np.int64)
        raise OrderError(f"{key} must be an integer array, got dtype {array.dtype}")
    if array.dtype.kind == "u" and len(array) and int(array.max()) > np.iinfo(np.int64).max:
        position = int(np.argmax(array > np.iinfo(np.int64).max))
        raise OrderError(f"{key}[{position}] = {array[position]} is beyond int64")
    return array.astype(np.int64)


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def check_items(item_file, item_offset, item_length, manifest_len: int | None = None
                ) -> Items:
    """The three arrays, checked (module docstring) and normalised; OrderError naming the
    first problem. Without `manifest_len` the upper bound of `item_file` is not checked (the
    daemon checks it against the source)."""
    given = [key for key, value in zip(ITEM_KEYS, (item_file, item_offset, item_length),
                                       strict=True) if value is not None]
    if len(given) != len(ITEM_KEYS):
        missing = [key for key in ITEM_KEYS if key not in given]
        raise OrderError(f"{', '.join(given)} given without {', '.join(missing)}: an item "
                         f"table needs all of {', '.join(ITEM_KEYS)}")
    file = as_int_array("item_file", item_file)
    offset = as_int_array("item_offset", item_offset)
    length = as_int_array("item_length", item_length)
    if not len(file) == len(offset) == len(length):
        raise OrderError(f"item_file, item_offset and item_length must have one length, got "
                         f"{len(file)}, {len(offset)} and {len(length)}")
    if (position := _first(file < 0)) is not None:
        raise OrderError(f"item_file[{position}] = {file[position]} is negative; file "
                         f"indices start at 0")
    if manifest_len is not None:
        check_item_files(file, manifest_len)
    if (position := _first(offset < 0)) is not None:
        raise OrderError(f"item_offset[{position}] = {offset[position]} is negative")
    if (position := _first(offset >= MAX_OFFSET)) is not None:
        raise OrderError(f"item_offset[{position}] = {offset[position]} is beyond any file "
                         f"(at most 2**62)")
    if (position := _first(length <= 0)) is not None:
        raise OrderError(f"item_length[{position}] = {length[position]}: an item has at least "
                         f"one byte")
    if (position := _first(length > MAX_ITEM_BYTES)) is not None:
        raise OrderError(f"item_length[{position}] = {length[position]} is over "
                         f"{MAX_ITEM_BYTES} bytes (1 GiB): not a sample")
    items = Items(file, offset, length)
    _check_no_overlap(items)
    return items


def check_item_files(file: np.ndarray, manifest_len: int) -> None:
    """Every file index in the manifest of `manifest_len` files."""
    if len(file) and (position := _first(file >= manifest_len)) is not None:
        raise OrderError(f"item_file[{position}] = {file[position]} is out of range: the "
                         f"manifest has {manifest_len} files (valid indices "
                         f"0..{manifest_len - 1})")


def _check_no_overlap(items: Items) -> None:
    if len(items) < 2:
        return
    ordered = np.lexsort((items.offset, items.file))
    file, offset = items.file[ordered], items.offset[ordered]
    end = offset + items.length[ordered]
    clash = (file[1:] == file[:-1]) & (offset[1:] < end[:-1])
    if (slot := _first(clash)) is not None:
        first, second = sorted((int(ordered[slot]), int(ordered[slot + 1])))
        raise OrderError(
            f"items {first} and {second} overlap in file {file[slot]} (bytes "
            f"{items.offset[first]}+{items.length[first]} and "
            f"{items.offset[second]}+{items.length[second]}); a byte belongs to one item")


def check_within_files(items: Items, sizes: Callable[[np.ndarray], np.ndarray],
                       describe: Callable[[int], str] = str) -> None:
    """Every range inside its file. `sizes(file_indices)`: the sizes of those files now,
    one stat each (`file_indices` ascending, unique); `describe(file_index)` names a file."""
    files = items.files()
    by_file = np.zeros(int(files[-1]) + 1 if len(files) else 0, np.int64)
    by_file[files] = sizes(files)
    end = items.offset + items.length
    if (position := _first(end > by_file[items.file])) is not None:
        file_index = int(items.file[position])
        raise OrderError(
            f"item {position} (bytes {items.offset[position]}+{items.length[position]}) ends "
            f"past the end of {describe(file_index)}, which has {by_file[file_index]} bytes")
