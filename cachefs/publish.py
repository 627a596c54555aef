"""Publishing an order to a mount: the trainer's side of the order file.

`publish` validates the arrays (everything it can check before writing), writes the order file
atomically (`cachefs.order.write_checked`: a temporary file, fsync, rename) where the mount's
daemon watches, and waits until the daemon has taken it or rejected it. It talks to the daemon
only through two xattrs on the mount root: ``user.cachefs.order_file`` (where to write; a
rank's file is derived from it, `cachefs.order.rank_order_path`) and ``user.cachefs.stats``
(JSON; the daemon reports there which files the order in force was made of, and which files it
rejected, and why). The first is trusted only from a cachefs mount in the kernel's mount table,
and only for a directory of the user who mounted it (`_owner_of`): any FUSE file system can
answer it, and the publisher may be root. `source_file_count` waits in the same way for the
daemon's scan of the source, so that a trainer can make a permutation of the right length.

`read_index_file`, `read_files_list` and `read_items_file` read what `cachefs publish
--current/--next/--files/--items` name (man/cachefs-publish.1).

`cachefs.torch`, the CLI and trainers call this module (README, man/cachefs.1); the names
`cachefs.order.publish` and `cachefs.order.source_file_count`, which earlier versions
documented, still reach it. It imports neither pyfuse3 nor torch.
"""

from __future__ import annotations

import logging
import os
import time
import zipfile
from pathlib import Path

import numpy as np

from cachefs import ctrl
from cachefs.errors import OrderError, OrderRejected
from cachefs.mountinfo import CACHEFS_FSTYPE, listed_path, mount_at
from cachefs.order import (check_arrays, check_indices, check_targets, rank_order_path,
                           write_checked)
from cachefs.order_archive import NPY_MAGIC
from cachefs.order_items import ITEM_KEYS, ItemArrays, as_int_array, check_item_files

log = logging.getLogger(__name__)

_POLL_S = 0.02


def read_index_file(path: Path) -> np.ndarray:
    """Indices from a ``.npy`` file (no pickles) or a text file with one integer per line.

    Blank lines are ignored. A bad line raises OrderError naming the file and the line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise OrderError(f"{path}: {err.strerror}") from None
    if data.startswith(NPY_MAGIC):
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, EOFError, OSError) as err:
            raise OrderError(f"{path}: not a usable .npy array of indices: {err}") from None
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
            raise OrderError(f"{path}: a .npy array of indices must be 1-D integers, got "
                             f"{getattr(array, 'dtype', type(array).__name__)} of shape "
                             f"{getattr(array, 'shape', '?')}")
        try:
            return as_int_array("indices", array)  # uint64 beyond int64 refused, not wrapped
        except OrderError as err:
            raise OrderError(f"{path}: {err}") from None
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


def read_items_file(path: Path) -> ItemArrays:
    """Byte-range items from a ``.npz`` holding ``item_file``, ``item_offset`` and
    ``item_length`` (as `cachefs.ranges.save_items` writes it, no pickles), or from a text
    file with three integers per line: file index, offset, length. Blank lines are ignored;
    a bad line raises OrderError naming the file and the line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise OrderError(f"{path}: {err.strerror}") from None
    if data[:4] == b"PK\x03\x04":
        try:
            with np.load(path, allow_pickle=False) as npz:
                missing = [key for key in ITEM_KEYS if key not in npz.files]
                if missing:
                    raise OrderError(f"{path}: no {', '.join(missing)} in the archive")
                return ItemArrays(*(npz[key] for key in ITEM_KEYS))
        except (ValueError, EOFError, OSError, zipfile.BadZipFile) as err:
            raise OrderError(f"{path}: not a usable npz of items: {err}") from None
    rows = []
    for line_number, line in enumerate(data.split(b"\n"), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            row = [int(field) for field in fields]
            if len(row) != 3 or not all(-2**63 <= value < 2**63 for value in row):
                raise ValueError
            rows.append(row)
        except ValueError:
            raise OrderError(f"{path}: line {line_number}: not three 64-bit integers (file "
                             f"index, offset, length): {line[:80].decode('utf-8', 'replace')!r}"
                             ) from None
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return ItemArrays(table[:, 0], table[:, 1], table[:, 2])


def read_inputs(files: Path | None, items: Path | None
                ) -> tuple[list[str] | None, ItemArrays | None]:
    """What `cachefs publish --files` and `--items` name, read (None where not given)."""
    return (read_files_list(files) if files else None,
            read_items_file(items) if items else None)


def order_length(mount: Path, files: list[str] | None, items: ItemArrays | None) -> int:
    """How many items an order of the mount indexes: its byte-range items, else the listed
    files, else the source's regular files (waiting while the daemon scans it)."""
    if items is not None:
        return items.item_count
    return len(files) if files is not None else source_file_count(mount)


def publish(mount: Path, epoch: int, current, next=None, files=None, rank=None,
            world_size=None, timeout_s: float = 10.0, targets=None, items=None) -> dict:
    """Publish an order to a mount and wait until the daemon takes it.

    `items`: byte-range items (`cachefs.order_items.ItemArrays`: item_file, item_offset,
    item_length, e.g. from `cachefs.ranges`); `current` and `next` then index them.

    Without a rank the order file itself is written; with one, the rank's own file next to it
    (`rank_order_path`), which the daemon merges with the files of the node's other ranks.
    Returns the daemon's status of the order in force (``stats["order"]``) once this file is
    among the files it was made of; raises OrderError with the daemon's reason if it rejects
    the file, or if it does not answer within timeout_s. A valid file that the daemon keeps
    but leaves out of the merge (its epoch or world size does not fit the newest
    publication's) returns too, with a warning giving the daemon's reason. `targets`: the
    storage target of each manifest item (man/cachefs-order.5), None to let the daemon go by
    the files' devices.
    """
    try:
        checked = check_arrays(epoch, current, next, files, rank, world_size, targets=targets,
                               items=items)
    except OrderError as exc:
        raise OrderRejected(str(exc)) from None
    mount = Path(mount)
    order_path = Path(os.fsdecode(ctrl.read_attr(mount, ctrl.ORDER_FILE, OrderError)))
    if checked.rank is not None:  # (and world_size: check_arrays takes both or neither)
        order_path = rank_order_path(order_path, checked.rank)
    if checked.files is None:
        # The daemon knows the source's size once it has scanned it: check the upper bound
        # now, so that a bad index fails before anything is written.
        known = (ctrl.read_stats(mount, OrderError).get("manifest") or {}).get("files")
        try:
            if known is not None and checked.items is not None:
                check_item_files(checked.items.file, known)
            elif known is not None:
                for key, indices in (("current", checked.current), ("next", checked.next)):
                    if indices is not None:
                        check_indices(key, indices, known)
            if known is not None and checked.targets is not None:
                check_targets(checked.targets, known)
        except OrderError as exc:
            raise OrderRejected(str(exc)) from None
    identity = write_checked(order_path, checked,
                             directory_owner_uid=_owner_of(mount)).to_json()
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
                raise OrderRejected(rejection.get("reason")
                                    or "the daemon rejected the order file")
        for publication in stats.get("publications") or ():
            if publication.get("file") == identity and publication.get("left_out"):
                log.warning("%s was accepted but is not merged into the order in force: %s",
                            order_path, publication["left_out"])
                return in_force
        if time.monotonic() >= deadline:
            raise OrderError(f"the cachefs daemon of {mount} did not answer within "
                             f"{timeout_s:g} s (order file {order_path})")
        time.sleep(_POLL_S)


def _owner_of(mount: Path) -> int:
    """Who mounted `mount`, as the kernel lists it (mountinfo's `user_id`), not as its daemon
    says. The mount names where its order file is, and the publisher, perhaps root, writes
    there: any FUSE file system can answer `user.cachefs.order_file` (one that another user
    mounted with allow_other could name /etc), so an order is written only into a directory
    the mount's owner owns (`write_checked`)."""
    found = mount_at(listed_path(mount))
    if found is None or found.fstype != CACHEFS_FSTYPE or found.owner_uid is None:
        raise OrderError(f"{mount} is not a cachefs mount (not in the mount table as one)")
    return found.owner_uid


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
        time.sleep(_POLL_S * 5)
