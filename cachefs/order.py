"""The sidecar order file: format, validation, rank slicing and atomic publishing.

The trainer tells cachefs in which order it will read: this epoch's permutation (`current`) and
usually the next one (`next`), as indices into a manifest of relative paths. The format is a
NumPy ``.npz`` archive without pickles (man/cachefs-order.5 documents it for writers that do not
use this module):

    version     int scalar, 1
    epoch       int scalar >= 0
    current     1-D int array: this epoch's order, indices into the manifest, no duplicates
    next        1-D int array, optional: the next epoch's order, same length as `current`
    files       1-D string array (S or U), optional: the manifest. Without it the manifest is
                every regular file under the source, sorted by its path's bytes
    rank, world_size   int scalars, optional, together: this node reads
                `pad(order)[rank::world_size]`, PyTorch DistributedSampler(drop_last=False)

Where a file is published: a publication without a rank goes to the order file itself
(``order.npz``); rank R publishes to its own file next to it, ``order.rank<R>.npz``
(`rank_order_path`), so that several ranks sharing one mount never overwrite each other's
file, and the daemon merges their slices (`cachefs.order_merge`).

Design points:

- Scale: an ImageNet-sized order (1.28 M items with a manifest) must load and publish in well
  under a second, and the daemon must hold it without per-item Python objects. Paths live in a
  numpy ``S`` array (bytes, as `os.fsencode` gives them); every check is a vectorised numpy
  operation. Path lookups use a sorted table of 64-bit hashes of the paths (hashing is a few
  passes over the bytes viewed as uint64 words, far cheaper than sorting strings), verified by
  comparing the strings, so a hash collision can cost time but never a wrong answer.
- A file is loaded from one open file descriptor and identified by the `FileIdentity` of that
  descriptor, so a file renamed over it while loading cannot be confused with the one loaded.
- Publishing validates everything it can before writing, writes a temporary file in the same
  directory, fsyncs it and renames it into place: the daemon only ever sees whole files.
- `publish` talks to the daemon only through two xattrs on the mount root:
  ``user.cachefs.order_file`` (where to write; a rank's file is derived from it) and
  ``user.cachefs.stats`` (JSON; the daemon reports there which files the order in force was
  made of, and which files it rejected, and why).

This module imports neither pyfuse3 nor torch: trainers import it.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from cachefs import ctrl
from cachefs.beneath import open_beneath
from cachefs.errors import OrderError

log = logging.getLogger(__name__)

ORDER_VERSION = 1


_KNOWN_KEYS = frozenset({"version", "epoch", "current", "next", "files", "rank", "world_size"})
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with members / an empty zip
_NPY_MAGIC = b"\x93NUMPY"
_PUBLISH_POLL_S = 0.02
_SHOWN_PATH_CHARS = 200  # how much of a bad path a message quotes
# The largest world_size: a rank file's name carries at most nine digits (rank_of_file_name).
MAX_WORLD_SIZE = 10**9


class FileIdentity(NamedTuple):
    """Identity of an order file on disk: a rename or rewrite changes at least one field."""

    ino: int
    mtime_ns: int
    size: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)

    def to_json(self) -> dict:
        return {"ino": self.ino, "mtime_ns": self.mtime_ns, "size": self.size}


# --------------------------------------------------------------------------------------------
# Manifest


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


def _path_hash_one(path: bytes) -> int:
    """`_path_hashes` of one path with Python ints: no numpy call overhead on a hot path."""
    total = 0
    for column in range(max(1, -(-len(path) // 8))):
        word = int.from_bytes(path[column * 8:column * 8 + 8].ljust(8, b"\0"), "little")
        seed = ((column + 1) * _GOLDEN64) & _MASK64
        mixed = ((word ^ seed) * _MIX_MUL1) & _MASK64
        mixed ^= mixed >> 29
        mixed = (mixed * _MIX_MUL2) & _MASK64
        total = (total + mixed - _word_mix_of_zero(seed)) & _MASK64
    total ^= total >> 30
    total = (total * _MIX_MUL1) & _MASK64
    total ^= total >> 27
    total = (total * _MIX_MUL2) & _MASK64
    return total ^ (total >> 31)


def _quote(path: bytes) -> str:
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


class Manifest:
    """Relative paths (bytes, os.fsencode) in a numpy 'S' array; no per-item Python objects.

    A manifest index is a position in `paths`. Lookups by path go through a table of sorted
    path hashes, built once (in the loader's worker thread, by `prepare`) and kept.
    """

    def __init__(self, paths: np.ndarray):
        if not isinstance(paths, np.ndarray) or paths.dtype.kind != "S" or paths.ndim != 1:
            raise TypeError("Manifest needs a 1-D numpy 'S' array; use Manifest.from_paths")
        paths = paths.view()
        paths.flags.writeable = False
        self.paths = paths
        self._hashes: np.ndarray | None = None  # by manifest index
        self._by_hash: np.ndarray | None = None  # manifest indices in hash order
        self._sorted_hashes: np.ndarray | None = None

    @classmethod
    def from_paths(cls, paths) -> "Manifest":
        """Accepts str/bytes sequences or U/S arrays, keeps the order given."""
        return cls(_paths_to_bytes_array(paths))

    def __len__(self) -> int:
        return len(self.paths)

    def same_paths(self, other: "Manifest") -> bool:
        """The same paths in the same order (the same object, or an equal copy)."""
        return self is other or (len(self) == len(other)
                                 and bool(np.array_equal(self.paths, other.paths)))

    def __repr__(self) -> str:
        return f"<Manifest of {len(self)} paths>"

    def path(self, index: int) -> bytes:
        if not 0 <= index < len(self.paths):
            raise IndexError(f"manifest index {index} out of range (0..{len(self.paths) - 1})")
        return bytes(self.paths[index])

    def prepare(self) -> "Manifest":
        """Build the lookup table now (it is otherwise built by the first lookup)."""
        if self._sorted_hashes is None:
            hashes = _path_hashes(self.paths)
            by_hash = np.argsort(hashes)
            self._hashes, self._by_hash = hashes, by_hash
            self._sorted_hashes = hashes[by_hash]
        return self

    def lookup(self, relpaths: "np.ndarray | Manifest") -> np.ndarray:
        """Manifest index of each path of an ``S`` array or Manifest, -1 where absent.

        Vectorised: the queries are hashed and sorted (a Manifest brings its own table), then
        found by one merge-like search of the sorted table and checked string by string.
        """
        self.prepare()
        if isinstance(relpaths, Manifest):
            query = relpaths.prepare()
        else:
            query = Manifest(relpaths).prepare()
        queries = query.paths
        found = np.full(len(queries), -1, dtype=np.int64)
        if len(queries) == 0 or len(self.paths) == 0:
            return found
        # Searching sorted keys walks the table once; random keys miss the CPU cache.
        slots = np.empty(len(queries), dtype=np.intp)
        slots[query._by_hash] = np.searchsorted(self._sorted_hashes, query._sorted_hashes)
        np.minimum(slots, len(self.paths) - 1, out=slots)
        same_hash = self._sorted_hashes[slots] == query._hashes
        candidates = self._by_hash[slots]
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
        self.prepare()
        relpath = os.fsencode(relpath)
        if not relpath or relpath.endswith(b"\0"):
            return -1  # an 'S' array cannot hold such a path
        wanted = np.uint64(_path_hash_one(relpath))
        sorted_hashes = self._sorted_hashes
        slot = int(sorted_hashes.searchsorted(wanted))
        while slot < len(sorted_hashes) and sorted_hashes[slot] == wanted:
            index = int(self._by_hash[slot])
            if self.paths[index] == relpath:
                return index
            slot += 1  # a hash collision: try the next path with the same hash
        return -1


def scan_source(root: Path) -> Manifest:
    """Every regular file under root, relative, sorted by path bytes.

    lstat semantics: symbolic links are neither followed nor included (a link could point out of
    the source or make a cycle). An unreadable directory is skipped with a warning so that one
    bad directory does not stop a mount.
    """
    found: list[bytes] = []
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
                    with os.scandir(dir_fd) as entries:
                        for entry in entries:
                            name = os.fsencode(entry.name)
                            relative = relative_dir + b"/" + name if relative_dir else name
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(relative)
                            elif entry.is_file(follow_symlinks=False):
                                found.append(relative)
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
    paths = np.array(found, dtype="S") if found else np.array([], dtype="S1")
    return Manifest(paths).prepare()


# --------------------------------------------------------------------------------------------
# Orders


@dataclass(frozen=True, eq=False)
class Order:
    """A validated order as this node reads it (rank slice applied). Arrays are read-only.

    One order file gives `ranks` = (rank,) (None without a rank) and `files` = (file,). A
    merge of several ranks' files (`cachefs.order_merge`) interleaves their slices by position:
    ``current[i * k + j]`` is item i of the slice of rank ``ranks[j]``, for the k ranks in
    increasing order, and `next` likewise; `files` are the identities of the merged files in
    the same order, and `rank`, `total_length` and `file` are those of the newest of them.
    """

    epoch: int
    current: np.ndarray
    next: np.ndarray | None
    manifest: Manifest
    rank: int | None
    world_size: int | None
    total_length: int
    file: FileIdentity | None
    ranks: tuple[int, ...] | None = None
    files: tuple[FileIdentity, ...] = ()

    def status(self) -> dict:
        return {
            "epoch": self.epoch,
            "length": len(self.current),
            "total_length": self.total_length,
            "rank": self.rank,
            "world_size": self.world_size,
            "ranks": list(self.ranks) if self.ranks is not None else None,
            "has_next": self.next is not None,
            "file": self.file.to_json() if self.file is not None else None,
            "files": [identity.to_json() for identity in self.files],
        }


def rank_order_path(order_path: Path, rank: int) -> Path:
    """Where rank `rank` publishes: ``DIR/order.npz`` -> ``DIR/order.rank<rank>.npz``.

    The name is derived from the order path's stem, so a mount started with another
    ``--order-file`` gets its own rank files; `rank_of_file_name` is its inverse.
    """
    order_path = Path(order_path)
    return order_path.with_name(f"{order_path.stem}.rank{int(rank)}.npz")


def rank_of_file_name(order_path: Path, name: str | bytes) -> int | None:
    """The rank whose file `name` (a name in the order file's directory) is, else None.

    Only the names `rank_order_path` writes match: no leading zeros, so one rank has one name.
    """
    stem = re.escape(Path(order_path).stem)
    match = re.fullmatch(stem + r"\.rank(0|[1-9][0-9]{0,8})\.npz", os.fsdecode(name))
    return int(match.group(1)) if match else None


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The documented generator of `cachefs publish --seed`, for trainers to reproduce.

    ``np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)`` as int64.
    """
    if n < 0 or seed < 0 or epoch < 0:
        raise OrderError(f"permutation needs n, seed and epoch >= 0, got {n}, {seed}, {epoch}")
    generator = np.random.Generator(np.random.PCG64([seed, epoch]))
    return generator.permutation(n).astype(np.int64, copy=False)


def rank_slice(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's share, exactly torch.utils.data.DistributedSampler(drop_last=False).

    The order is padded to a multiple of world_size by repeating it from the start (as many
    times as needed when it is shorter than the padding), then every world_size-th item from
    `rank` is taken. Position i of the padded order is position i mod n of the order, so the
    rank's positions are computed directly: memory for this rank's share only, however large
    world_size is.
    """
    if not 1 <= world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
        raise OrderError(f"rank must be in 0..world_size-1 and world_size in "
                         f"1..{MAX_WORLD_SIZE}, got rank {rank}, world_size {world_size}")
    order = np.asarray(order)
    if len(order) == 0:
        return order[:0].copy()
    samples_per_rank = -(-len(order) // world_size)
    positions = np.arange(samples_per_rank, dtype=np.int64) * world_size + rank
    return order[positions % len(order)]


def _as_int_scalar(key: str, value) -> int:
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise OrderError(f"{key} must be a scalar integer, got an array of shape "
                             f"{value.shape}")
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise OrderError(f"{key} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _as_index_array(key: str, values) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind == "O":
        raise OrderError(f"{key} holds Python objects; it must be an integer array")
    if array.ndim != 1:
        raise OrderError(f"{key} must be a 1-D integer array, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        if len(array) == 0:  # np.asarray([]) is float64; an empty order has no bad index
            return np.zeros(0, dtype=np.int64)
        raise OrderError(f"{key} must be an integer array, got dtype {array.dtype}")
    return array


def _check_indices(key: str, indices: np.ndarray, manifest_len: int | None) -> np.ndarray:
    """Range and duplicate checks; returns the indices as int64."""
    if len(indices) == 0:
        return indices.astype(np.int64)
    if indices.dtype.kind == "i" and indices.min() < 0:
        position = int(np.argmax(indices < 0))
        raise OrderError(f"{key}[{position}] = {indices[position]} is negative; indices start "
                         f"at 0")
    largest = int(indices.max())
    if manifest_len is not None and largest >= manifest_len:
        position = int(np.argmax(indices >= manifest_len))
        raise OrderError(f"{key}[{position}] = {indices[position]} is out of range: the "
                         f"manifest has {manifest_len} files (valid indices 0..{manifest_len - 1})")
    if largest > np.iinfo(np.int64).max:
        raise OrderError(f"{key} holds an index beyond int64: {largest}")
    indices = indices.astype(np.int64, copy=False)
    if largest < max(4 * len(indices), 1 << 20):
        repeated = np.flatnonzero(np.bincount(indices) > 1)
    else:  # sparse large values (no manifest bound known yet): sort instead of a huge bincount
        ordered = np.sort(indices)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        value = int(repeated[0])
        first, second = np.flatnonzero(indices == value)[:2]
        raise OrderError(f"{key} has duplicate index {value} at positions {first} and {second}; "
                         f"an epoch reads each file once")
    return indices


def check_relpaths(files: np.ndarray) -> None:
    """Relative, non-empty, no '..' component, no duplicates; all vectorised."""
    def first(mask: np.ndarray) -> int | None:
        return int(np.argmax(mask)) if mask.any() else None

    position = first(files == b"")
    if position is not None:
        raise OrderError(f"files[{position}] is an empty path")
    position = first(np.char.startswith(files, b"/"))
    if position is not None:
        raise OrderError(f"files[{position}] = {_quote(files[position])} is absolute; paths "
                         f"must be relative to the source")
    dotdot = ((files == b"..") | np.char.startswith(files, b"../")
              | np.char.endswith(files, b"/..") | (np.char.find(files, b"/../") >= 0))
    position = first(dotdot)
    if position is not None:
        raise OrderError(f"files[{position}] = {_quote(files[position])} contains a '..' "
                         f"component; paths must stay inside the source")


def _check_unique_paths(files: Manifest) -> None:
    """Duplicate paths in a manifest, through hashes (no string sort).

    A plain sort of the hashes is several times cheaper than the argsort of `prepare`; the
    table is built only when equal hashes need a closer look.
    """
    sorted_hashes = files._sorted_hashes
    if sorted_hashes is None:
        sorted_hashes = np.sort(_path_hashes(files.paths))
        if not (sorted_hashes[1:] == sorted_hashes[:-1]).any():
            return
        sorted_hashes = files.prepare()._sorted_hashes
    for slot in np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1]):
        # Equal hashes are duplicates or (very rarely) collisions: compare the strings.
        run = files._by_hash[np.flatnonzero(sorted_hashes == sorted_hashes[slot])]
        seen: dict[bytes, int] = {}
        for position in np.sort(run):
            path = bytes(files.paths[position])
            if path in seen:
                raise OrderError(f"files has duplicate path {_quote(path)} at positions "
                                 f"{seen[path]} and {position}")
            seen[path] = int(position)


@dataclass
class _Checked:
    """Normalised arrays after validation (int64 indices, ``S`` paths)."""

    epoch: int
    current: np.ndarray
    next: np.ndarray | None
    files: Manifest | None
    rank: int | None
    world_size: int | None


def _validate(epoch, current, next=None, files=None, rank=None, world_size=None,
              manifest_len=None, unique_paths_checked=False) -> _Checked:
    epoch = _as_int_scalar("epoch", epoch)
    if epoch < 0:
        raise OrderError(f"epoch must be >= 0, got {epoch}")
    if (rank is None) != (world_size is None):
        missing, given = ("world_size", "rank") if world_size is None else ("rank", "world_size")
        raise OrderError(f"{given} given without {missing}; give both or neither")
    if world_size is not None:
        world_size = _as_int_scalar("world_size", world_size)
        rank = _as_int_scalar("rank", rank)
        if world_size < 1:
            raise OrderError(f"world_size must be >= 1, got {world_size}")
        if world_size > MAX_WORLD_SIZE:
            raise OrderError(f"world_size must be <= {MAX_WORLD_SIZE}, got {world_size}")
        if rank < 0:
            raise OrderError(f"rank must be >= 0, got {rank}")
        if rank >= world_size:
            raise OrderError(f"rank {rank} >= world_size {world_size}; ranks are "
                             f"0..{world_size - 1}")
    if files is not None:
        files = Manifest(_paths_to_bytes_array(files))
        check_relpaths(files.paths)
        if not unique_paths_checked:
            _check_unique_paths(files)
        manifest_len = len(files)
    current = _check_indices("current", _as_index_array("current", current), manifest_len)
    if next is not None:
        next = _as_index_array("next", next)
        if len(next) != len(current):
            raise OrderError(f"next has {len(next)} entries but current has {len(current)}; "
                             f"both epochs must have the same length")
        next = _check_indices("next", next, manifest_len)
    return _Checked(epoch, current, next, files, rank, world_size)


def validate_arrays(epoch, current, next=None, files=None, rank=None, world_size=None,
                    manifest_len=None) -> None:
    """Raise OrderError naming the problem (key, position, value) if the arrays are unusable.

    Without `files` and `manifest_len` the upper bound of the indices is not checked (the
    daemon checks it against the source).
    """
    _validate(epoch, current, next, files, rank, world_size, manifest_len)


# --------------------------------------------------------------------------------------------
# Loading


def _read_npz_key(npz, key: str) -> np.ndarray:
    try:
        return npz[key]
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise OrderError(f"key {key!r} holds a pickled (object) array; pickles are not "
                             f"accepted, store numbers and strings as plain numpy arrays") from None
        raise OrderError(f"key {key!r} is not a readable .npy array: {err}") from None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError) as err:
        raise OrderError(f"truncated or corrupt npz archive (reading {key!r}: {err})") from None


def _open_regular(path: Path):
    """The order file, opened for reading; OrderError unless it is a regular file.

    Opened non-blocking, then checked: an open of a FIFO would wait for a writer (holding the
    watcher's thread, and the unmount, forever) and a device such as /dev/zero never ends.
    O_NONBLOCK changes nothing for the reads of a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise OrderError(f"cannot open the order file: {err.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        err = OrderError("not a regular file: publish by renaming a complete file into place")
        err.file = FileIdentity.from_stat(st)
        raise err
    return os.fdopen(fd, "rb"), FileIdentity.from_stat(st)


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], FileIdentity]:
    handle, identity = _open_regular(path)
    with handle:
        try:
            magic = handle.read(6)
            if identity.size == 0 or not magic:
                raise OrderError("empty file (0 bytes), not an npz archive")
            if magic.startswith(_NPY_MAGIC):
                raise OrderError("a single .npy array, not an npz archive: write the keys with "
                                 "numpy.savez")
            if magic[:4] not in _ZIP_MAGIC:
                raise OrderError("not an npz archive (a zip of .npy arrays written by "
                                 "numpy.savez)")
            handle.seek(0)
            try:
                npz = np.load(handle, allow_pickle=False)
            except (zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
                raise OrderError(f"truncated or corrupt npz archive: {err}") from None
            with npz:
                unknown = sorted(set(npz.files) - _KNOWN_KEYS)
                if unknown:
                    raise OrderError(f"unknown key(s) {', '.join(map(repr, unknown))}; version "
                                     f"{ORDER_VERSION} has {', '.join(sorted(_KNOWN_KEYS))}")
                for required in ("version", "epoch", "current"):
                    if required not in npz.files:
                        raise OrderError(f"missing key {required!r}")
                arrays = {key: _read_npz_key(npz, key) for key in npz.files}
        except OrderError as err:
            err.file = identity
            raise
    return arrays, identity


def load_order(path: Path, source_manifest: Manifest | Callable[[], Manifest]) -> Order:
    """Load and validate an order file; OrderError (with `.file` set when known) if unusable.

    `source_manifest` is the source's manifest, or a callable that computes it: it is called
    only once the file itself is well-formed. With `files`, every path must exist in it; the
    check is one vectorised lookup, never a stat per path.
    """
    arrays, identity = _read_npz(Path(path))
    try:
        version = _as_int_scalar("version", arrays["version"])
        if version != ORDER_VERSION:
            raise OrderError(f"unknown version {version}; this cachefs reads version "
                             f"{ORDER_VERSION}")
        # Duplicate paths are found later, more cheaply, by the check against the source.
        checked = _validate(arrays["epoch"], arrays["current"], arrays.get("next"),
                            arrays.get("files"), arrays.get("rank"), arrays.get("world_size"),
                            unique_paths_checked=True)
        source = source_manifest() if callable(source_manifest) else source_manifest
        if checked.files is None:
            manifest = source
            for key, indices in (("current", checked.current), ("next", checked.next)):
                if indices is not None:
                    _check_indices(key, indices, len(source))
        else:
            manifest = _manifest_within_source(checked.files, source)
        manifest.prepare()
    except OrderError as err:
        err.file = identity
        raise
    current, next_order = checked.current, checked.next
    if checked.world_size is not None:
        current = rank_slice(current, checked.rank, checked.world_size)
        if next_order is not None:
            next_order = rank_slice(next_order, checked.rank, checked.world_size)
    for array in (current, next_order):
        if array is not None:
            array.flags.writeable = False
    return Order(epoch=checked.epoch, current=current, next=next_order, manifest=manifest,
                 rank=checked.rank, world_size=checked.world_size,
                 total_length=len(checked.current), file=identity,
                 ranks=(checked.rank,) if checked.world_size is not None else None,
                 files=(identity,))


def _manifest_within_source(files: Manifest, source: Manifest) -> Manifest:
    """`files`, after checking that each of its paths exists in the source, once.

    The source's paths are unique, so two equal paths in `files` find the same source index.
    """
    paths = files.paths
    if paths.dtype == source.paths.dtype and np.array_equal(paths, source.paths):
        return source  # the usual case: the trainer wrote the source's own listing
    found = source.lookup(files)
    if (found < 0).any():
        position = int(np.argmax(found < 0))
        raise OrderError(f"files[{position}] = {_quote(paths[position])} does not exist under "
                         f"the source (not among its {len(source)} regular files)")
    repeated = np.flatnonzero(np.bincount(found, minlength=len(source)) > 1)
    if len(repeated):
        first, second = np.flatnonzero(found == repeated[0])[:2]
        raise OrderError(f"files has duplicate path {_quote(paths[first])} at positions "
                         f"{first} and {second}")
    return files


# --------------------------------------------------------------------------------------------
# Writing and publishing


def _write_checked(path: Path, checked: _Checked) -> FileIdentity:
    path = Path(path)
    arrays = {"version": np.int64(ORDER_VERSION), "epoch": np.int64(checked.epoch),
              "current": checked.current}
    if checked.next is not None:
        arrays["next"] = checked.next
    if checked.files is not None:
        arrays["files"] = checked.files.paths
    if checked.world_size is not None:
        arrays["rank"] = np.int64(checked.rank)
        arrays["world_size"] = np.int64(checked.world_size)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                             suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
            identity = FileIdentity.from_stat(os.fstat(handle.fileno()))
        # The rename is what makes the file visible whole; the directory is not fsynced
        # because an order file does not need to survive a power cut (the trainer republishes).
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    return identity


def write_order_file(path: Path, *, epoch, current, next=None, files=None, rank=None,
                     world_size=None) -> FileIdentity:
    """Validate, then write atomically (temporary name, fsync, rename); nothing on failure."""
    checked = _validate(epoch, current, next, files, rank, world_size)
    return _write_checked(Path(path), checked)


def read_index_file(path: Path) -> np.ndarray:
    """Indices from a ``.npy`` file (no pickles) or a text file with one integer per line.

    Blank lines are ignored. A bad line raises OrderError naming the file and the line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise OrderError(f"{path}: {err.strerror}") from None
    if data.startswith(_NPY_MAGIC):
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as err:
            raise OrderError(f"{path}: not a usable .npy array of indices: {err}") from None
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
            raise OrderError(f"{path}: a .npy array of indices must be 1-D integers, got "
                             f"{getattr(array, 'dtype', type(array).__name__)} of shape "
                             f"{getattr(array, 'shape', '?')}")
        return array.astype(np.int64, copy=False)
    lines = np.char.strip(np.array(data.split(b"\n"), dtype="S"))
    line_numbers = np.flatnonzero(lines != b"") + 1
    try:
        return lines[line_numbers - 1].astype(np.int64)
    except (ValueError, OverflowError):
        pass
    for line_number in line_numbers:  # only on bad input: find the line to name
        text = bytes(lines[line_number - 1])
        try:
            value = int(text)
            if not -2**63 <= value < 2**63:
                raise ValueError
        except ValueError:
            raise OrderError(f"{path}: line {line_number}: not an integer: "
                             f"{text[:80].decode('utf-8', 'replace')!r}") from None
    raise OrderError(f"{path}: could not read integers")  # unreachable in practice


def read_files_list(path: Path) -> list[str]:
    """Relative paths from a text file, one per line; blank lines ignored.

    Lines end with LF; a CR before it is dropped (lists written on Windows). Spaces are kept:
    they are legal in file names.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise OrderError(f"{path}: {err.strerror}") from None
    names = []
    for line in data.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if line:
            names.append(line)
    return [os.fsdecode(name) for name in names]


def publish(mount: Path, epoch: int, current, next=None, files=None, rank=None,
            world_size=None, timeout_s: float = 10.0) -> dict:
    """Publish an order to a mount and wait until the daemon takes it.

    Without a rank the order file itself is written; with one, the rank's own file next to it
    (`rank_order_path`), which the daemon merges with the files of the node's other ranks.
    Returns the daemon's status of the order in force (``stats["order"]``) once this file is
    among the files it was made of; raises OrderError with the daemon's reason if it rejects
    the file, or if it does not answer within timeout_s. A valid file that the daemon keeps
    but leaves out of the merge (its epoch or world size does not fit the newest
    publication's) returns too, with a warning giving the daemon's reason.
    """
    checked = _validate(epoch, current, next, files, rank, world_size)
    mount = Path(mount)
    order_path = Path(os.fsdecode(ctrl.read_attr(mount, ctrl.ORDER_FILE, OrderError)))
    if checked.world_size is not None:
        order_path = rank_order_path(order_path, checked.rank)
    if checked.files is None:
        # The daemon knows the source's size once it has scanned it: check the upper bound
        # now, so that a bad index fails before anything is written.
        known = (ctrl.read_stats(mount, OrderError).get("manifest") or {}).get("files")
        if known is not None:
            for key, indices in (("current", checked.current), ("next", checked.next)):
                if indices is not None:
                    _check_indices(key, indices, known)
    identity = _write_checked(order_path, checked).to_json()
    log.debug("wrote %s, waiting for the daemon of %s", order_path, mount)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ctrl.read_stats(mount, OrderError)
        in_force = stats.get("order") or {}
        if in_force.get("file") == identity or identity in (in_force.get("files") or ()):
            return in_force
        # `rejections` holds the last few, so that ranks publishing at the same moment each
        # find their own; a daemon older than the merge has `last_rejection` only
        for rejection in stats.get("rejections") or [stats.get("last_rejection") or {}]:
            if rejection.get("file") == identity:
                raise OrderError(rejection.get("reason")
                                 or "the daemon rejected the order file")
        for publication in stats.get("publications") or ():
            if publication.get("file") == identity and publication.get("left_out"):
                log.warning("%s was accepted but is not merged into the order in force: %s",
                            order_path, publication["left_out"])
                return in_force
        if time.monotonic() >= deadline:
            raise OrderError(f"the cachefs daemon of {mount} did not answer within "
                             f"{timeout_s:g} s (order file {order_path})")
        time.sleep(_PUBLISH_POLL_S)


def source_file_count(mount: Path, timeout_s: float = 60.0) -> int:
    """Number of regular files in the mount's source, waiting while the daemon scans it."""
    mount = Path(mount)
    deadline = time.monotonic() + timeout_s
    while True:
        count = (ctrl.read_stats(mount, OrderError).get("manifest") or {}).get("files")
        if count is not None:
            return int(count)
        if time.monotonic() >= deadline:
            raise OrderError(f"the cachefs daemon of {mount} has not finished scanning the "
                             f"source within {timeout_s:g} s")
        time.sleep(_PUBLISH_POLL_S * 5)
