"""Several ranks of one node share one mount: merge the slices they publish into one order.

Each rank R of a distributed job publishes its own file, ``order.rank<R>.npz`` next to the
order file (`cachefs.order.rank_order_path`), holding the whole order of the epoch with its
``rank`` and ``world_size``; loading it gives the rank's slice, ``pad(order)[R::world_size]``.
A publication without a rank goes to the order file itself (the "plain" file). The daemon keeps
the last accepted `Order` of every file (`Publication`) and asks `merge` which order is in
force. The rules, and why:

- The newest accepted publication decides (by the file's mtime, then by the order in which the
  daemon accepted them, which breaks ties of coarse timestamps). The publisher that wrote last
  is the one that knows best what is being read now; a leftover file of an earlier run is old.
- If the newest is the plain file, its order alone is in force: a single publisher (or a
  cleanup, see man/cachefs-order.5) overrides every rank file.
- If the newest is a rank file, the order in force merges the rank files that agree with it:
  the same world size and manifest (the same object, or the same paths), the same byte-range
  items if any (cachefs.order_items), a slice of the same length, and its epoch e. A rank
  whose file is of epoch e-1 and has a `next` order counts with that next order as its epoch-e
  slice (its following one unknown): the daemon itself moves to
  the next epoch when the current one is consumed, and ranks publish a new epoch one after
  another, so the first rank to publish epoch e must not throw away the others' slices. Any
  other rank is left out (`Merge.left_out` says why) and read without read-ahead, until it
  publishes something that fits.
- Ranks of one node read at the same pace (data-parallel training keeps them in step), so the
  node reads position i of every rank's slice at about the same time: the merged order
  interleaves the slices by position, ``current[i * k + j] = slice_j[i]`` over the k member
  ranks sorted by rank. The merged `next` interleaves the members' next orders if every
  member has one; otherwise the next epoch is unknown for part of the node, and a partial next
  order would rank the known part's items wrongly, so it is None.
- Where the items live (`targets`, per manifest item) is the newest publication's: the members
  share its manifest.

Pure: no I/O, no trio, no FUSE; the order watcher (`cachefs.order_watch`) calls it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachefs.errors import OrderError
from cachefs.manifest import Manifest
from cachefs.order import Order, rank_order_path

log = logging.getLogger(__name__)

PLAIN_IN_FORCE = "the plain order file is newer: its order alone is in force"


@dataclass(frozen=True)
class Publication:
    """The last accepted order of one file: the plain order file (rank None) or a rank's."""

    order: Order
    rank: int | None  # the rank of the file's name, None for the plain file
    sequence: int  # the daemon's count of accepted files when it accepted this one

    @property
    def newness(self) -> tuple[int, int]:
        """Sort key: the newest publication is the greatest."""
        mtime_ns = self.order.file.mtime_ns if self.order.file is not None else -1
        return (mtime_ns, self.sequence)


@dataclass(frozen=True)
class Merge:
    """The order in force, and why the ranks not merged into it are left out."""

    order: Order
    left_out: dict[int, str]  # rank -> reason


def check_rank_file(order: Order, order_path: Path, name_rank: int) -> None:
    """A rank file must hold the rank its name says; OrderError (naming both) otherwise.

    `order_path` is the plain order file, whose stem the rank files' names are derived from.
    """
    name = rank_order_path(order_path, name_rank).name
    if order.rank is None:  # (and world_size: both or neither)
        raise OrderError(f"{name} is the file of rank {name_rank} but holds no rank and "
                         f"world_size: publish with rank and world_size, or publish the "
                         f"order without a rank to the plain order file")
    if order.rank != name_rank:
        raise OrderError(f"{name} is the file of rank {name_rank} but holds rank "
                         f"{order.rank} (world_size {order.world_size}): rank {order.rank} "
                         f"publishes to {rank_order_path(order_path, order.rank).name}")


def share_manifest(order: Order, manifests: Iterable[Manifest]) -> Order:
    """`order` with its manifest replaced by an equal one of `manifests`, if there is one.

    Ranks that publish their paths (`files`) each bring a manifest object of their own; sharing
    one object makes the merge's manifest check an identity test, and the prefetcher keeps what
    it knows of the items (it starts afresh for a new manifest object). Comparing two manifests
    costs tens of milliseconds for a million paths: call this where the file was loaded, in a
    worker thread.
    """
    for manifest in manifests:
        if manifest is order.manifest:
            return order
    for manifest in manifests:
        if manifest.same_paths(order.manifest):
            return dataclasses.replace(order, manifest=manifest)
    return order


def merge(plain: Publication | None, by_rank: Mapping[int, Publication]) -> Merge | None:
    """The order in force given the last accepted publication of every file; None if none."""
    newest = max([p for p in (plain, *by_rank.values()) if p is not None],
                 key=lambda publication: publication.newness, default=None)
    if newest is None:
        return None
    if newest is plain:
        return Merge(plain.order, {rank: PLAIN_IN_FORCE for rank in by_rank})
    decider = newest.order
    members: list[tuple[int, np.ndarray, np.ndarray | None, Order]] = []
    left_out: dict[int, str] = {}
    for rank in sorted(by_rank):
        order = by_rank[rank].order
        slices = _epoch_slices(order, decider)
        if isinstance(slices, str):
            left_out[rank] = slices
        else:
            members.append((rank, *slices, order))
    current = _interleave([member[1] for member in members])
    nexts = [member[2] for member in members if member[2] is not None]
    next_order = _interleave(nexts) if len(nexts) == len(members) else None
    merged = Order(epoch=decider.epoch, current=current, next=next_order,
                   manifest=decider.manifest, rank=decider.rank,
                   world_size=decider.world_size, total_length=decider.total_length,
                   file=decider.file, ranks=tuple(member[0] for member in members),
                   files=tuple(member[3].file for member in members
                               if member[3].file is not None),
                   targets=decider.targets, items=decider.items)
    return Merge(merged, left_out)


def _epoch_slices(order: Order, decider: Order
                  ) -> tuple[np.ndarray, np.ndarray | None] | str:
    """(slice, next slice) of `order` for the decider's epoch, or why it does not fit."""
    epoch = decider.epoch
    newest = f"the newest publication (rank {decider.rank}, epoch {epoch})"
    if order.world_size != decider.world_size:
        return (f"world_size {order.world_size}, but {newest} has world_size "
                f"{decider.world_size} (a file of another job?)")
    if not order.manifest.same_paths(decider.manifest):
        return f"its manifest differs from that of {newest}"
    if not order.same_items(decider):
        return f"its byte-range items differ from those of {newest}"
    if order.epoch == epoch:
        current, next_order = order.current, order.next
    elif order.epoch == epoch - 1 and order.next is not None:
        current, next_order = order.next, None
    elif order.epoch == epoch - 1:
        return (f"epoch {order.epoch} without a next order, behind {newest}: it is merged "
                f"once this rank publishes epoch {epoch}")
    else:
        return f"epoch {order.epoch}, but {newest} is of epoch {epoch}"
    if len(current) != len(decider.current):
        return (f"its slice of epoch {epoch} has {len(current)} items, but that of {newest} "
                f"has {len(decider.current)}")
    return current, next_order


def _interleave(slices: list[np.ndarray]) -> np.ndarray:
    """Position i of every slice in turn: result[i * k + j] = slices[j][i]. Read-only."""
    if len(slices) == 1:
        return slices[0]  # an order's arrays are read-only already
    merged = np.stack(slices, axis=1).reshape(-1)
    merged.flags.writeable = False
    return merged
