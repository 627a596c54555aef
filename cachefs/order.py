"""The sidecar order file: its format, validation, loading and writing, and rank slicing.

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
    targets     1-D int array, optional: the storage target each manifest item lives on (a
                Lustre OST index, an object-store shard, `index mod N`), one per manifest
                item, 0..MAX_TARGET_ID, at most MAX_TARGETS distinct values. Without it the
                target of a file is the device it lives on (cachefs/targets.py)
    item_file, item_offset, item_length   1-D int arrays of one length, optional, together:
                byte ranges of files (samples inside large files, cachefs.order_items);
                `current` and `next` then index these items instead of the files

Where a file is published: a publication without a rank goes to the order file itself
(``order.npz``); rank R publishes to its own file next to it, ``order.rank<R>.npz``
(`rank_order_path`), so that several ranks sharing one mount never overwrite each other's
file, and the daemon merges their slices (`cachefs.order_merge`).

The module holds the format and what defines it: validation (`check_arrays`, with messages
that name the key, the position and the value), loading (`load_order`), atomic writing
(`write_order_file`), `permutation` (the documented generator of `cachefs publish --seed`), and
the meaning of the rank keys: `rank_slice` (a rank's share) and `rank_order_path` (a rank's
file). The paths an order indexes are a `cachefs.manifest.Manifest`; publishing to a mount and
waiting for the daemon is `cachefs.publish`.

Design points:

- Scale: an ImageNet-sized order (1.28 M items with a manifest) must load and publish in well
  under a second, and the daemon must hold it without per-item Python objects: indices are
  int64 arrays, paths a manifest (`cachefs.manifest`), and every check is a vectorised numpy
  operation.
- A file is loaded from one open file descriptor and identified by the `FileIdentity` of that
  descriptor, so a file renamed over it while loading cannot be confused with the one loaded;
  reading its arrays, bounded before anything is unpacked, is cachefs.order_archive's.
- Writing validates everything it can first, writes a temporary file in the same directory,
  fsyncs it and renames it into place: the daemon only ever sees whole files.

This module imports neither pyfuse3 nor torch: trainers import it.
"""

from __future__ import annotations

import os
import re
import reprlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachefs.config import INT64_MAX
from cachefs.errors import OrderError
from cachefs.manifest import Manifest, check_relpaths, check_unique_paths, quote_path
from cachefs.placement import MAX_TARGETS, Placement
from cachefs.order_archive import FileIdentity, read_npz
from cachefs.order_items import ITEM_KEYS, Items, as_int_array, check_item_files, \
    check_items, check_within_files

ORDER_VERSION = 1


_REQUIRED_KEYS = ("version", "epoch", "current")
_KNOWN_KEYS = frozenset({*_REQUIRED_KEYS, "next", "files", "rank", "world_size", "targets",
                         *ITEM_KEYS})
# The largest world_size: a rank file's name carries at most nine digits (rank_of_file_name).
MAX_WORLD_SIZE = 10**9
# `targets`: a value is a small label (a Lustre OST index fits), and an order names at most
# MAX_TARGETS of them (cachefs/placement.py)
MAX_TARGET_ID = 65535


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

    `items`: the byte-range items `current` and `next` index (cachefs.order_items), or None
    when they index the manifest's files.
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
    # where each manifest item lives, from the `targets` key; None: by device (targets.py)
    targets: Placement | None = None
    items: Items | None = None

    @property
    def item_count(self) -> int:
        """How many items `current` and `next` index: the ranges, or the manifest's files."""
        return len(self.items) if self.items is not None else len(self.manifest)

    def same_items(self, other: Order) -> bool:
        """Item numbers mean the same here and in `other`: both index files, or both the same
        ranges (the manifests are compared apart)."""
        if self.items is None or other.items is None:
            return self.items is None and other.items is None
        return self.items.same_ranges(other.items)

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
            "targets": "order" if self.targets is not None else "device",
            "items": len(self.items) if self.items is not None else None,
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
    """`value` as an int that the order file can store (int64)."""
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise OrderError(f"{key} must be a scalar integer, got an array of shape "
                             f"{value.shape}")
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise OrderError(f"{key} must be an integer, got {type(value).__name__} "
                         f"{reprlib.repr(value)}")
    if not -INT64_MAX - 1 <= int(value) <= INT64_MAX:
        raise OrderError(f"{key} must fit in 64 bits, got {value}")
    return int(value)


def check_indices(key: str, indices: np.ndarray, manifest_len: int | None, *,
                  of_items: bool = False) -> np.ndarray:
    """Range and duplicate checks; returns the indices as int64. `of_items`: the indices are
    of byte-range items (`manifest_len` is the item count), not of the manifest's files."""
    if len(indices) == 0:
        return indices.astype(np.int64)
    if indices.dtype.kind == "i" and indices.min() < 0:
        position = int(np.argmax(indices < 0))
        raise OrderError(f"{key}[{position}] = {indices[position]} is negative; indices start "
                         f"at 0")
    largest = int(indices.max())
    if manifest_len is not None and largest >= manifest_len:
        position = int(np.argmax(indices >= manifest_len))
        table = (f"item table has {manifest_len} items" if of_items
                 else f"manifest has {manifest_len} files")
        raise OrderError(f"{key}[{position}] = {indices[position]} is out of range: the "
                         f"{table} (valid indices 0..{manifest_len - 1})")
    indices = indices.astype(np.int64, copy=False)  # (as_int_array refused beyond int64)
    if largest < max(4 * len(indices), 1 << 20):
        repeated = np.flatnonzero(np.bincount(indices) > 1)
    else:  # sparse large values (no manifest bound known yet): sort instead of a huge bincount
        ordered = np.sort(indices)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        value = int(repeated[0])
        first, second = np.flatnonzero(indices == value)[:2]
        raise OrderError(f"{key} has duplicate index {value} at positions {first} and {second}; "
                         f"an epoch reads each {'item' if of_items else 'file'} once")
    return indices


def check_targets(targets, manifest_len: int | None) -> np.ndarray:
    """The `targets` array checked (one small integer per manifest item, few distinct ones);
    returned as int32. Without `manifest_len` its length is not checked (the daemon checks it
    against the source)."""
    targets = as_int_array("targets", targets)
    if manifest_len is not None and len(targets) != manifest_len:
        raise OrderError(f"targets has {len(targets)} entries but the manifest has "
                         f"{manifest_len} files; give one target per manifest item")
    if len(targets) == 0:
        return targets.astype(np.int32)
    if targets.dtype.kind == "i" and targets.min() < 0:
        position = int(np.argmax(targets < 0))
        raise OrderError(f"targets[{position}] = {targets[position]} is negative; targets are "
                         f"0..{MAX_TARGET_ID}")
    if int(targets.max()) > MAX_TARGET_ID:
        position = int(np.argmax(targets > MAX_TARGET_ID))
        raise OrderError(f"targets[{position}] = {targets[position]} is out of range; targets "
                         f"are 0..{MAX_TARGET_ID}")
    targets = targets.astype(np.int32)
    distinct = int(np.count_nonzero(np.bincount(targets)))
    if distinct > MAX_TARGETS:
        raise OrderError(f"targets has {distinct} distinct values; at most {MAX_TARGETS} "
                         f"targets (fold them, for example an OST index modulo "
                         f"{MAX_TARGETS})")
    return targets


@dataclass
class CheckedArrays:
    """Normalised arrays after validation (int64 indices, ``S`` paths)."""

    epoch: int
    current: np.ndarray
    next: np.ndarray | None
    files: Manifest | None
    rank: int | None
    world_size: int | None
    targets: np.ndarray | None = None  # int32, one per manifest item
    items: Items | None = None


def check_arrays(epoch, current, next=None, files=None, rank=None, world_size=None,
                 manifest_len=None, unique_paths_checked=False, targets=None,
                 items=None) -> CheckedArrays:
    """The arrays of an order, checked and normalised; OrderError naming the first problem.

    `items`: the byte-range items (`cachefs.order_items.ItemArrays`, or the three arrays in
    that order), or None; with them the indices of `current` and `next` are item numbers."""
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
        files = Manifest.from_paths(files)
        check_relpaths(files.paths)
        if not unique_paths_checked:
            check_unique_paths(files)
        manifest_len = len(files)
    index_bound = manifest_len
    if items is not None and not isinstance(items, Items):
        item_file, item_offset, item_length = items
        items = check_items(item_file, item_offset, item_length, manifest_len)
    if items is not None:
        index_bound = len(items)
    of_items = items is not None
    current = check_indices("current", as_int_array("current", current), index_bound,
                            of_items=of_items)
    if next is not None:
        next = as_int_array("next", next)
        if len(next) != len(current):
            raise OrderError(f"next has {len(next)} entries but current has {len(current)}; "
                             f"both epochs must have the same length")
        next = check_indices("next", next, index_bound, of_items=of_items)
    if targets is not None:
        targets = check_targets(targets, manifest_len)
    return CheckedArrays(epoch, current, next, files, rank, world_size, targets, items)


def validate_arrays(epoch, current, next=None, files=None, rank=None, world_size=None,
                    manifest_len=None, targets=None) -> None:
    """Raise OrderError naming the problem (key, position, value) if the arrays are unusable.

    Without `files` and `manifest_len` the upper bound of the indices is not checked (the
    daemon checks it against the source).
    """
    check_arrays(epoch, current, next, files, rank, world_size, manifest_len, targets=targets)


# --------------------------------------------------------------------------------------------
# Loading


def load_order(path: Path, source_manifest: Manifest | Callable[[], Manifest],
               file_sizes: Callable[[Manifest, np.ndarray], np.ndarray] | None = None
               ) -> Order:
    """Load and validate an order file; OrderError (with `.file` set when known) if unusable.

    `source_manifest` is the source's manifest, or a callable that computes it: it is called
    only once the file itself is well-formed. With `files`, every path must exist in it; the
    check is one vectorised lookup, never a stat per path. `file_sizes(manifest, indices)`:
    the sizes of those files of the manifest now; with it, every byte-range item must lie
    inside its file (one stat per file that holds items, never one per item).
    """
    arrays, identity = read_npz(Path(path), _KNOWN_KEYS, _REQUIRED_KEYS, ORDER_VERSION)
    try:
        version = _as_int_scalar("version", arrays["version"])
        if version != ORDER_VERSION:
            raise OrderError(f"unknown version {version}; this cachefs reads version "
                             f"{ORDER_VERSION}")
        # Duplicate paths are found later, more cheaply, by the check against the source.
        item_arrays = [arrays.get(key) for key in ITEM_KEYS]
        checked = check_arrays(arrays["epoch"], arrays["current"], arrays.get("next"),
                            arrays.get("files"), arrays.get("rank"), arrays.get("world_size"),
                            unique_paths_checked=True, targets=arrays.get("targets"),
                            items=item_arrays if any(a is not None for a in item_arrays)
                            else None)
        source = source_manifest() if callable(source_manifest) else source_manifest
        if checked.files is None:
            manifest = source
            if checked.items is not None:
                check_item_files(checked.items.file, len(source))
            else:
                for key, indices in (("current", checked.current), ("next", checked.next)):
                    if indices is not None:
                        check_indices(key, indices, len(source))
            if checked.targets is not None:
                check_targets(checked.targets, len(source))
        else:
            manifest = _manifest_within_source(checked.files, source)
        manifest.prepare()
        if checked.items is not None:
            if file_sizes is not None:
                check_within_files(checked.items,
                                   lambda indices: file_sizes(manifest, indices),
                                   lambda index: quote_path(manifest.path(index)))
            checked.items.prepare()
        # where the items live, worked out here in the loader's thread, not the daemon's
        targets = (Placement.of_targets(checked.targets) if checked.targets is not None
                   else None)
        manifest.device_placement()
    except OrderError as err:
        err.file = identity
        raise
    current, next_order = checked.current, checked.next
    if checked.rank is not None and checked.world_size is not None:
        current = rank_slice(current, checked.rank, checked.world_size)
        if next_order is not None:
            next_order = rank_slice(next_order, checked.rank, checked.world_size)
    for array in (current, next_order):
        if array is not None:
            array.flags.writeable = False
    return Order(epoch=checked.epoch, current=current, next=next_order, manifest=manifest,
                 rank=checked.rank, world_size=checked.world_size,
                 total_length=len(checked.current), file=identity,
                 ranks=(checked.rank,) if checked.rank is not None else None,
                 files=(identity,), targets=targets, items=checked.items)


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
        raise OrderError(f"files[{position}] = {quote_path(paths[position])} does not exist under "
                         f"the source (not among its {len(source)} regular files)")
    repeated = np.flatnonzero(np.bincount(found, minlength=len(source)) > 1)
    if len(repeated):
        first, second = np.flatnonzero(found == repeated[0])[:2]
        raise OrderError(f"files has duplicate path {quote_path(paths[first])} at positions "
                         f"{first} and {second}")
    if source.devices is not None:
        files.devices = source.devices[found]  # each file's device, as the scan saw it
    return files


# --------------------------------------------------------------------------------------------
# Writing


def write_checked(path: Path, checked: CheckedArrays, *,
                  directory_owner_uid: int | None = None) -> FileIdentity:
    """Write arrays that `check_arrays` passed atomically (temporary name, fsync, rename), in
    the directory of `path` as one open of it finds it (a link swapped in later is not
    followed). `directory_owner_uid`: that directory must belong to this user, else
    OrderError (`cachefs.publish`: where a mount says its order file is)."""
    path = Path(path)
    arrays = {"version": np.int64(ORDER_VERSION), "epoch": np.int64(checked.epoch),
              "current": checked.current}
    if checked.next is not None:
        arrays["next"] = checked.next
    if checked.files is not None:
        arrays["files"] = checked.files.paths
    if checked.targets is not None:
        arrays["targets"] = checked.targets
    if checked.rank is not None and checked.world_size is not None:
        arrays["rank"] = np.int64(checked.rank)
        arrays["world_size"] = np.int64(checked.world_size)
    if checked.items is not None:
        arrays.update(checked.items.arrays())
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owner_uid = os.fstat(directory).st_uid
        if directory_owner_uid is not None and owner_uid != directory_owner_uid:
            raise OrderError(f"{path.parent} belongs to user {owner_uid}, not to the mount's "
                             f"owner ({directory_owner_uid}): not writing an order there")
        temporary = f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                                 | os.O_NOFOLLOW, 0o600, dir_fd=directory)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(path.parent / temporary)) from None
        try:
            # readable by the daemon's user, whoever publishes (a member of a group that may
            # write the order's directory). An order is no secret (`cachefs stats` shows it
            # to anyone who can see the mount).
            os.fchmod(descriptor, 0o644)
            with os.fdopen(descriptor, "wb") as handle:
                np.savez(handle, **arrays)
                handle.flush()
                os.fsync(handle.fileno())
                identity = FileIdentity.from_stat(os.fstat(handle.fileno()))
            # The rename is what makes the file visible whole; the directory is not fsynced
            # because an order file does not need to survive a power cut (the trainer
            # republishes).
            os.replace(temporary, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=directory)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(directory)
    return identity


def write_order_file(path: Path, *, epoch, current, next=None, files=None, rank=None,
                     world_size=None, targets=None, items=None) -> FileIdentity:
    """Validate, then write atomically (temporary name, fsync, rename); nothing on failure.
    `items`: byte-range items (`check_arrays`)."""
    checked = check_arrays(epoch, current, next, files, rank, world_size, targets=targets,
                           items=items)
    return write_checked(Path(path), checked)


def __getattr__(name: str):
    """`cachefs.order.publish` and `.source_file_count`, documented by earlier versions, live in
    `cachefs.publish` (imported on first use: it imports this module)."""
    if name in ("publish", "source_file_count"):
        from cachefs import publish as publishing

        return getattr(publishing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
