"""The manifest: the relative paths an order's indices point into, and finding a path in it.

An order file names files by index into a manifest: its own ``files`` array, or, without one,
the source's listing (`scan_source`: every regular file under the source, sorted by its path's
bytes). The daemon looks a path up in the manifest when a file is opened, and checks a
trainer's list against the source's with one lookup per path.

Design points:

- Scale: an ImageNet-sized manifest (1.28 M paths) must load and be checked in well under a
  second, and the daemon must hold it without per-path Python objects. Paths live in a numpy
  ``S`` array (bytes, as `os.fsencode` gives them); every check is a vectorised numpy
  operation. Lookups use a sorted table of 64-bit hashes of the paths (hashing is a few passes
  over the bytes viewed as uint64 words, far cheaper than sorting strings), verified by
  comparing the strings, so a hash collision can cost time but never a wrong answer.
- A path list is checked where it enters (`Manifest.from_paths`, `check_relpaths`,
  `check_unique_paths`); a bad one raises OrderError naming the position and the path, since a
  list comes from an order file's ``files`` or from a file the user named.
- `scan_source` walks the source beneath its root through no symbolic link
  (`cachefs.beneath`), so a directory swapped for a link cannot list files outside it. It also
  records each file's device, that of its directory (one fstat per directory, none per file):
  the storage target of the file when the order names none (cachefs/placement.py). A trainer's
  list (`files`) takes its devices from the source's listing (`cachefs.order`).

This module imports neither pyfuse3 nor torch: trainers import it (through `cachefs.order`).
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cachefs.beneath import open_beneath
from cachefs.errors import OrderError
from cachefs.placement import Placement
from cachefs.sorted_arrays import index_left

log = logging.getLogger(__name__)

_SHOWN_PATH_CHARS = 200  # how much of a bad path a message quotes
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB


def _splitmix64(x: np.ndarray) -> None:
    """SplitMix64's finaliser, in place on a uint64 array (wrapping arithmetic)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(_MIX_MUL1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MIX_MUL2)
    x ^= x >> np.uint64(31)


def _word_mix_of_zero(seed: int) -> int:
    """What `_path_hashes` adds for an all-zero word in the column with this seed."""
    value = (seed * _MIX_MUL1) & _MASK64
    value ^= value >> 29
    return (value * _MIX_MUL2) & _MASK64


def _path_hashes(paths: np.ndarray) -> np.ndarray:
    """64-bit hashes of the paths of an ``S`` array, independent of the array's width.

    Each 8-byte word of a path is mixed with a per-column seed and the results are summed; the
    zero words that pad short paths add exactly nothing, so a path hashes the same in arrays of
    any itemsize and two manifests can compare hashes directly.
    """
    count = len(paths)
    width_words = max(1, -(-paths.dtype.itemsize // 8))
    fitted = np.ascontiguousarray(paths.astype(f"S{width_words * 8}", copy=False))
    words = fitted.view("<u8").reshape(count, width_words)
    hashes = np.zeros(count, dtype=np.uint64)
    mixed = np.empty(count, dtype=np.uint64)
    for column in range(width_words):
        seed = ((column + 1) * _GOLDEN64) & _MASK64
        np.bitwise_xor(words[:, column], np.uint64(seed), out=mixed)
        mixed *= np.uint64(_MIX_MUL1)
        mixed ^= mixed >> np.uint64(29)
        mixed *= np.uint64(_MIX_MUL2)
        hashes += mixed
        hashes -= np.uint64(_word_mix_of_zero(seed))
    _splitmix64(hashes)
    return hashes


_COLUMN_CONSTANTS: list[tuple[int, int]] = []


def _column_constants(columns: int) -> list[tuple[int, int]]:
    """(seed, mix of a zero word) of each of the first `columns` columns, computed once."""
    while len(_COLUMN_CONSTANTS) < columns:
        seed = ((len(_COLUMN_CONSTANTS) + 1) * _GOLDEN64) & _MASK64
        _COLUMN_CONSTANTS.append((seed, _word_mix_of_zero(seed)))
    return _COLUMN_CONSTANTS[:columns]


def _path_hash_one(path: bytes) -> int:
    """`_path_hashes` of one path with Python ints: no numpy call overhead on a hot path (it
    runs for every file a reader opens outside the read-ahead, so the per-column constants
    are computed once and the words unpacked in one call)."""
    columns = max(1, -(-len(path) // 8))
    words = struct.unpack(f"<{columns}Q", path.ljust(columns * 8, b"\0"))
    total = 0
    for word, (seed, zero_mix) in zip(words, _column_constants(columns), strict=True):
        mixed = ((word ^ seed) * _MIX_MUL1) & _MASK64
        mixed ^= mixed >> 29
        total += ((mixed * _MIX_MUL2) & _MASK64) - zero_mix
    total &= _MASK64
    total ^= total >> 30
    total = (total * _MIX_MUL1) & _MASK64
    total ^= total >> 27
    total = (total * _MIX_MUL2) & _MASK64
    return total ^ (total >> 31)


def quote_path(path: bytes) -> str:
    """A path for a message: decoded as a file name, cut after _SHOWN_PATH_CHARS."""
    text = repr(os.fsdecode(bytes(path)))
    if len(text) > _SHOWN_PATH_CHARS:
        text = text[:_SHOWN_PATH_CHARS] + "..."
    return text


def _paths_to_bytes_array(paths) -> np.ndarray:
    """A 1-D ``S`` array from str/bytes sequences or U/S arrays, in the order given.

    The common case, a list of ASCII str, is converted by numpy in C; other str lists go
    through one join/encode/split, faster than encoding each item or numpy's U->S cast.
    A str path is encoded as os.fsencode does (a lone surrogate U+DC80..U+DCFF stands for the
    byte of a name that was not valid UTF-8); one that cannot be a file name is an OrderError.
    """
    if isinstance(paths, np.ndarray):
        if paths.ndim != 1:
            raise OrderError(f"files must be a 1-D array of paths, got shape {paths.shape}")
        if paths.dtype.kind == "S":
            return paths
        if paths.dtype.kind == "U":
            return _unicode_array_to_bytes(paths)
        if paths.dtype.kind == "O":
            raise OrderError("files holds Python objects (a pickled array); "
                             "store paths as a numpy string array (dtype U or S)")
        raise OrderError(f"files must be an array of strings (dtype U or S), got {paths.dtype}")
    if isinstance(paths, (str, bytes)):
        raise OrderError("files must be a sequence of paths, not a single string")
    items = paths if isinstance(paths, list) else list(paths)
    if not items:
        return np.array([], dtype="S1")
    try:  # ASCII str or bytes: numpy converts the list in C
        return np.array(items, dtype="S")
    except UnicodeEncodeError:
        pass
    try:  # non-ASCII str: one encode of the joined text instead of one per path
        joined = "\n".join(items).encode(sys.getfilesystemencoding(), "surrogateescape")
        if joined.count(b"\n") == len(items) - 1:  # no path contains a newline
            return np.array(joined.split(b"\n"), dtype="S")
    except (TypeError, UnicodeEncodeError):  # bytes mixed in, or a path that is not text
        pass
    encoded = []
    for position, item in enumerate(items):
        try:
            encoded.append(os.fsencode(item))
        except TypeError as err:
            raise OrderError(f"files must hold str or bytes paths: {err}") from None
        except UnicodeEncodeError as err:
            raise _not_a_name(position, ord(item[err.start])) from None
    return np.array(encoded, dtype="S")


def _not_a_name(position: int, code_point: int) -> OrderError:
    return OrderError(f"files[{position}] holds code point U+{code_point:04X}, which no file "
                      f"name can hold (a surrogate other than U+DC80..U+DCFF, which stand for "
                      f"undecodable bytes, or beyond U+10FFFF)")


def _unicode_array_to_bytes(paths: np.ndarray) -> np.ndarray:
    width = paths.dtype.itemsize // 4
    if width == 0 or len(paths) == 0:
        return np.zeros(len(paths), dtype="S1")
    codes = np.ascontiguousarray(paths).view(np.uint32).reshape(len(paths), width)
    if int(codes.max()) < 128:  # ASCII: one byte per code point, a plain narrowing cast
        return np.ascontiguousarray(codes.astype(np.uint8)).view(f"S{width}").reshape(-1)
    # numpy stores any 32-bit value, and turns one that is no character into a broken str
    not_text = (codes > 0x10FFFF) | ((codes >= 0xD800) & (codes <= 0xDFFF)
                                     & ~((codes >= 0xDC80) & (codes <= 0xDCFF)))
    if not_text.any():
        row = int(np.argmax(not_text.any(axis=1)))
        raise _not_a_name(row, int(codes[row][np.argmax(not_text[row])]))
    return _paths_to_bytes_array(paths.tolist())


class _HashTable(NamedTuple):
    """A manifest's lookup table; its three arrays are built together."""

    hashes: np.ndarray  # by manifest index
    by_hash: np.ndarray  # manifest indices in hash order
    sorted_hashes: np.ndarray


class Manifest:
    """Relative paths (bytes, os.fsencode) in a numpy 'S' array; no per-item Python objects.

    A manifest index is a position in `paths`. Lookups by path go through a table of sorted
    path hashes, built once (in the loader's worker thread, by `prepare`) and kept.
    """

    def __init__(self, paths: np.ndarray, devices: np.ndarray | None = None):
        if not isinstance(paths, np.ndarray) or paths.dtype.kind != "S" or paths.ndim != 1:
            raise TypeError("Manifest needs a 1-D numpy 'S' array; use Manifest.from_paths")
        paths = paths.view()
        paths.flags.writeable = False
        self.paths = paths
        self._table: _HashTable | None = None
        # st_dev of each path's directory (scan_source), None where not known
        self.devices = devices
        self._device_placement: Placement | None = None

    @classmethod
    def from_paths(cls, paths) -> Manifest:
        """Accepts str/bytes sequences or U/S arrays, keeps the order given."""
        return cls(_paths_to_bytes_array(paths))

    def __len__(self) -> int:
        return len(self.paths)

    def same_paths(self, other: Manifest) -> bool:
        """The same paths in the same order (the same object, or an equal copy)."""
        return self is other or (len(self) == len(other)
                                 and bool(np.array_equal(self.paths, other.paths)))

    def __repr__(self) -> str:
        return f"<Manifest of {len(self)} paths>"

    def path(self, index: int) -> bytes:
        if not 0 <= index < len(self.paths):
            raise IndexError(f"manifest index {index} out of range (0..{len(self.paths) - 1})")
        return bytes(self.paths[index])

    def device_placement(self) -> Placement:
        """Every path's target by its device (cachefs/placement.py), computed once; one
        target for all when the devices are not known."""
        if self._device_placement is None:
            self._device_placement = (Placement.of_devices(self.devices)
                                      if self.devices is not None
                                      else Placement.single(len(self)))
        return self._device_placement

    def prepare(self) -> Manifest:
        """Build the lookup table now (it is otherwise built by the first lookup)."""
        self._hash_table()
        return self

    def _hash_table(self) -> _HashTable:
        if self._table is None:
            hashes = _path_hashes(self.paths)
            by_hash = np.argsort(hashes)
            self._table = _HashTable(hashes, by_hash, hashes[by_hash])
        return self._table

    def lookup(self, relpaths: np.ndarray | Manifest) -> np.ndarray:
        """Manifest index of each path of an ``S`` array or Manifest, -1 where absent.

        Vectorised: the queries are hashed and sorted (a Manifest brings its own table), then
        found by one merge-like search of the sorted table and checked string by string.
        """
        table = self._hash_table()
        if not isinstance(relpaths, Manifest):
            relpaths = Manifest(relpaths)
        query = relpaths._hash_table()
        queries = relpaths.paths
        found = np.full(len(queries), -1, dtype=np.int64)
        if len(queries) == 0 or len(self.paths) == 0:
            return found
        # Searching sorted keys walks the table once; random keys miss the CPU cache.
        slots = np.empty(len(queries), dtype=np.intp)
        slots[query.by_hash] = np.searchsorted(table.sorted_hashes, query.sorted_hashes)
        np.minimum(slots, len(self.paths) - 1, out=slots)
        same_hash = table.sorted_hashes[slots] == query.hashes
        candidates = table.by_hash[slots]
        match = same_hash & (self.paths[candidates] == queries)
        found[match] = candidates[match]
        # Equal hash but another string: a collision inside the manifest, about one chance in
        # 10^8 for ImageNet; settle those few by a plain scan.
        for position in np.flatnonzero(same_hash & ~match):
            hits = np.flatnonzero(self.paths == queries[position])
            if len(hits):
                found[position] = hits[0]
        return found

    def index_of(self, relpath: bytes) -> int:
        """Index of one relative path, -1 if absent; O(log n) once the table is built.

        A few microseconds: the daemon calls this when a file is opened.
        """
        table = self._hash_table()
        relpath = os.fsencode(relpath)
        if not relpath or relpath.endswith(b"\0"):
            return -1  # an 'S' array cannot hold such a path
        wanted = np.uint64(_path_hash_one(relpath))
        sorted_hashes = table.sorted_hashes
        slot = index_left(sorted_hashes, wanted)
        while slot < len(sorted_hashes) and sorted_hashes[slot] == wanted:
            index = int(table.by_hash[slot])
            if self.paths[index] == relpath:
                return index
            slot += 1  # a hash collision: try the next path with the same hash
        return -1


def scan_source(root: Path) -> Manifest:
    """Every regular file under root, relative, sorted by path bytes.

    lstat semantics: symbolic links are neither followed nor included (a link could point out of
    the source or make a cycle). An unreadable directory is skipped with a warning so that one
    bad directory does not stop a mount. Each file's device is its directory's (module
    docstring).
    """
    found: list[tuple[bytes, int]] = []
    pending: list[bytes] = [b""]
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        while pending:
            relative_dir = pending.pop()
            try:
                # beneath the root through no link: a directory swapped for a link to / while
                # we walk must not list the whole machine into the manifest
                dir_fd = open_beneath(root_fd, relative_dir, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    device = os.fstat(dir_fd).st_dev
                    with os.scandir(dir_fd) as entries:
                        for entry in entries:
                            name = os.fsencode(entry.name)
                            relative = relative_dir + b"/" + name if relative_dir else name
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(relative)
                            elif entry.is_file(follow_symlinks=False):
                                found.append((relative, device))
                finally:
                    os.close(dir_fd)
            except OSError as err:
                if not relative_dir:
                    raise
                log.warning("skipping unreadable directory %s under %s: %s",
                            os.fsdecode(relative_dir), root, err.strerror)
    finally:
        os.close(root_fd)
    found.sort()
    paths = (np.array([path for path, _ in found], dtype="S") if found
             else np.array([], dtype="S1"))
    devices = np.array([device for _, device in found], dtype=np.int64)
    return Manifest(paths, devices).prepare()



def check_relpaths(files: np.ndarray) -> None:
    """Relative, non-empty, no '..' component, no duplicates; all vectorised."""
    def first(mask: np.ndarray) -> int | None:
        return int(np.argmax(mask)) if mask.any() else None

    position = first(files == b"")
    if position is not None:
        raise OrderError(f"files[{position}] is an empty path")
    position = first(np.char.startswith(files, b"/"))
    if position is not None:
        raise OrderError(f"files[{position}] = {quote_path(files[position])} is absolute; paths "
                         f"must be relative to the source")
    dotdot = ((files == b"..") | np.char.startswith(files, b"../")
              | np.char.endswith(files, b"/..") | (np.char.find(files, b"/../") >= 0))
    position = first(dotdot)
    if position is not None:
        raise OrderError(f"files[{position}] = {quote_path(files[position])} contains a '..' "
                         f"component; paths must stay inside the source")


def check_unique_paths(files: Manifest) -> None:
    """Duplicate paths in a manifest, through hashes (no string sort).

    A plain sort of the hashes is several times cheaper than the argsort of `prepare`; the
    table is built only when equal hashes need a closer look.
    """
    if files._table is None:
        sorted_hashes = np.sort(_path_hashes(files.paths))
        if not (sorted_hashes[1:] == sorted_hashes[:-1]).any():
            return
    table = files._hash_table()
    sorted_hashes = table.sorted_hashes
    for slot in np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1]):
        # Equal hashes are duplicates or (very rarely) collisions: compare the strings.
        run = table.by_hash[np.flatnonzero(sorted_hashes == sorted_hashes[slot])]
        seen: dict[bytes, int] = {}
        for position in np.sort(run):
            path = bytes(files.paths[position])
            if path in seen:
                raise OrderError(f"files has duplicate path {quote_path(path)} at positions "
                                 f"{seen[path]} and {position}")
            seen[path] = int(position)

