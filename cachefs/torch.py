"""PyTorch integration: a sampler that publishes the order it is about to yield.

`CachefsSampler` replaces `RandomSampler` / `DistributedSampler` in a DataLoader. Each epoch it
publishes to the mount (`cachefs.publish.publish`) the whole order of that epoch as `current` and
the order of the following epoch as `next`, with `rank` and `world_size` when there are
several replicas, and then yields exactly this rank's share of it. The daemon slices the
published order itself (`pad(order)[rank::world_size]`, `cachefs.order.rank_slice`), so a mount
prefetches only the files of the ranks that publish to it, and keeps in RAM the head of their
next epoch.

Orders. With `shuffle=True` the order of epoch E is `cachefs.order.permutation(n, seed, E)`,
the documented generator of `cachefs publish --seed`, so a trainer and the CLI agree on it;
with `shuffle=False` it is `0..n-1`. The rank split is DistributedSampler's: without
`drop_last` the order is padded by repeating it from the start to a multiple of the world
size; with `drop_last` its tail is cut to a multiple of the world size *before* publishing, so
that the daemon's padding-free slice is the same split. The permutation is not torch's
(`torch.randperm`), so the indices differ from DistributedSampler's for the same seed; with
`shuffle=False` they are identical.

When it publishes. `set_epoch(e)` publishes epoch e at once (the daemon then reads ahead while
the DataLoader starts its workers); `iter()` publishes only if that epoch has not been
published yet, so an epoch is published once. Iterating again without `set_epoch` moves on to
the next epoch, as RandomSampler draws a new permutation each time: repeating an epoch's order
would contradict the `next` order the daemon was told. Publishing waits until the daemon has
accepted the file and raises `cachefs.errors.OrderError` with the daemon's reason otherwise.
The DataLoader uses the sampler in the main process only, never in its workers, so publishing
happens there. `mount=None` yields the same indices and publishes nothing: a reference pass
over another copy of the data, or a rank that must not publish.

Indices. A DataLoader passes the sampler's indices to `dataset[i]`, while an order file holds
indices into a manifest of paths. The mount's default manifest is every file under the source
sorted by path bytes, which is rarely the dataset's own order, so the sampler publishes the
dataset's sample paths as the manifest (`files`), made relative to the mount: then a dataset
index *is* a manifest index. The paths come from `files=` if given (absolute paths are made
relative to the mount, relative ones are taken as relative to it), else from `dataset.samples`
or `dataset.imgs` (lists of `(path, class)`, as torchvision's ImageFolder / DatasetFolder keep
them, relative ones resolved from the working directory as the dataset opens them; a
`torch.utils.data.Subset` of such a dataset works too). A sample path that is not under
the mount is a ValueError naming it: build the dataset on the mount, not on the source. With a
plain length, or a dataset without sample paths, nothing is published as `files` and the
indices are into the mount's default manifest (sorted relative paths of the source).

Several ranks per node. The ranks of one node can share one mount: with more than one replica
each rank publishes to its own file next to the mount's order file (`order.rank<R>.npz`), and
the daemon merges the slices of the node's ranks into one order (`cachefs.order_merge`): it
reads ahead, for every rank, the files that rank reads next, and the RAM budget serves them
all. Ranks publishing at the same moment never overwrite each other, and when one rank publishes
epoch e+1 before another, that other rank's epoch e+1 is taken from the `next` order it
published with epoch e. This works with DistributedSampler's split by global rank, which gives
a node's ranks positions that no single (rank, world_size) pair describes. Giving each rank a
mount of its own still works too (each has its own state directory, order files and RAM
budget). With one replica the sampler publishes the plain order file, without a rank.

torch stays optional: `import cachefs`, `cachefs.order` and `cachefs.publish` never import
torch; this module does.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler, Subset

from cachefs import order as order_mod
from cachefs import publish as publishing
from cachefs.order_items import ItemArrays

log = logging.getLogger(__name__)

# Publishing waits for the daemon; the first publish may wait for its scan of a large source.
DEFAULT_PUBLISH_TIMEOUT_S = 60.0


class CachefsSampler(Sampler[int]):
    """A RandomSampler / DistributedSampler that tells a cachefs mount its order.

    `dataset_or_len`: a dataset (`len()`, and sample paths in `.samples` / `.imgs` if it has
    them) or a number of samples. `mount`: the cachefs mount point the dataset reads from, or
    None to publish nothing. `num_replicas` / `rank` default to torch.distributed's world size
    and rank when it is initialised, else 1 and 0. `files`: the dataset's sample paths, when
    the dataset does not expose them. `timeout_s`: how long a publication waits for the daemon.
    `targets`: the storage target of each file, published as the order file's `targets`
    (None: the mount goes by the files' devices): one per dataset index, or with `items`, one
    per file of `files` (cachefs-order(5)). `items`: for a dataset whose
    samples are byte ranges inside large files (rows of a `.npy`, tar members, HDF5 rows), the
    range of each dataset index (`cachefs.ranges`' tables, `ItemArrays`), published as the
    order file's item table; `files` then names the files the ranges index (each item's
    `file` is an index into it), not one path per sample.
    """

    def __init__(self, dataset_or_len, mount, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False, files: Sequence | None = None,
                 timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S, targets: Sequence | None = None,
                 items: ItemArrays | None = None):
        super().__init__()
        self.dataset_length = _length_of(dataset_or_len)
        if items is not None and items.item_count != self.dataset_length:
            raise ValueError(f"{items.item_count} byte-range items but the data set has "
                             f"{self.dataset_length} samples: each index must name one item")
        if items is not None and files is None and mount is not None:
            raise ValueError("items index files: give files=, the files they lie in")
        self.items = items
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        seed = operator.index(seed)
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds cachefs.order.permutation), got {seed}")
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.timeout_s = timeout_s
        if self.drop_last:
            # DistributedSampler: the nearest length divisible by the world size, rounding down
            self.num_samples = self.dataset_length // self.num_replicas
        else:
            self.num_samples = -(-self.dataset_length // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.mount = Path(mount) if mount is not None else None
        # The published manifest (numpy 'S' array of paths relative to the mount), or None.
        self.files = (_manifest_for(dataset_or_len, files, self.mount,
                                    None if items is not None else self.dataset_length)
                      if self.mount is not None else None)
        # the storage target of each dataset index (man/cachefs-order.5), or None
        self.targets = np.asarray(targets) if targets is not None else None
        self.epoch = 0
        self._epoch_iterated = False  # set by iter(), cleared by set_epoch()
        self._published_epoch: int | None = None

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Make `epoch` the one the next iteration yields, and publish it now."""
        epoch = operator.index(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch
        self._epoch_iterated = False
        self._publish_if_needed()

    def __iter__(self) -> Iterator[int]:
        if self._epoch_iterated:
            self.epoch += 1  # iterated again without set_epoch: a new epoch, as RandomSampler
            log.debug("iterated again without set_epoch: moving on to epoch %d", self.epoch)
        self._epoch_iterated = True
        self._publish_if_needed()
        return iter(self.rank_indices(self.epoch).tolist())

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of all ranks for `epoch`, as published (tail cut when drop_last)."""
        if self.shuffle:
            order = order_mod.permutation(self.dataset_length, self.seed, epoch)
        else:
            order = np.arange(self.dataset_length, dtype=np.int64)
        return order[:self.total_size] if self.drop_last else order

    def rank_indices(self, epoch: int) -> np.ndarray:
        """The indices this rank yields in `epoch`: what the daemon reads for this node."""
        return order_mod.rank_slice(self.epoch_order(epoch), self.rank, self.num_replicas)

    def _publish_if_needed(self) -> None:
        if self.mount is None or self._published_epoch == self.epoch:
            return
        # One replica publishes the plain order file; several each their own rank file, which
        # the daemon merges with those of the other ranks sharing the mount.
        distributed = self.num_replicas > 1
        status = publishing.publish(self.mount, self.epoch, self.epoch_order(self.epoch),
                                    next=self.epoch_order(self.epoch + 1), files=self.files,
                                    rank=self.rank if distributed else None,
                                    world_size=self.num_replicas if distributed else None,
                                    timeout_s=self.timeout_s, targets=self.targets,
                                    items=self.items)
        self._published_epoch = self.epoch
        log.info("published epoch %d to %s: rank %d of %d reads %d items; the mount's order "
                 "has %d, for ranks %s", self.epoch, self.mount, self.rank, self.num_replicas,
                 self.num_samples, status["length"], status.get("ranks"))


def _length_of(dataset_or_len) -> int:
    if isinstance(dataset_or_len, bool):
        raise TypeError("dataset_or_len must be a dataset or a number of samples, not a bool")
    try:
        length = operator.index(dataset_or_len)
    except TypeError:
        length = len(dataset_or_len)
    if length < 0:
        raise ValueError(f"a data set cannot have {length} samples")
    return length


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank: as given, else from torch.distributed if initialised, else 1, 0."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    num_replicas, rank = operator.index(num_replicas), operator.index(rank)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                         f"[0, {num_replicas - 1}]")
    return num_replicas, rank


def _sample_paths(dataset) -> list | None:
    """The dataset's sample paths in index order, or None if it does not expose them."""
    if isinstance(dataset, Subset):
        inner = _sample_paths(dataset.dataset)
        return None if inner is None else [inner[int(i)] for i in dataset.indices]
    for attribute in ("samples", "imgs"):
        entries = getattr(dataset, attribute, None)
        if entries is not None:
            return [entry[0] if isinstance(entry, (tuple, list)) else entry
                    for entry in entries]
    return None


def _manifest_for(dataset_or_len, files, mount: Path, length: int | None) -> np.ndarray | None:
    """The manifest to publish: the dataset's sample paths relative to the mount, or None.
    `length`: the samples each path must name one of (None: `files` are the files of
    byte-range items, any number of them)."""
    origin = "files"
    if files is None:
        if isinstance(dataset_or_len, int):
            return None
        files = _sample_paths(dataset_or_len)
        if files is None:
            log.debug("the dataset has no sample paths: indices are into %s's default "
                      "manifest", mount)
            return None
        origin = "the dataset's samples"
    if length is not None and len(files) != length:
        raise ValueError(f"{len(files)} paths in {origin} but the data set has {length} "
                         f"samples: each index must name one path")
    # A dataset opens its relative paths from the working directory; `files=` names paths of
    # the mount, as an order file does.
    relative = _relative_to(mount, files, origin, keep_relative=origin == "files")
    return np.array(relative, dtype="S") if relative else np.array([], dtype="S1")


def _relative_to(mount: Path, paths, origin: str, keep_relative: bool) -> list[bytes]:
    """Each path relative to the mount, as bytes.

    A relative path is kept as it is if `keep_relative`, else taken from the working directory.

    Paths are normalised lexically (no stat: a million lookups through FUSE would take
    minutes); the mount is tried both as given and with its symbolic links resolved.
    """
    roots = []
    for root in (os.path.abspath(os.fsencode(mount)), os.path.realpath(os.fsencode(mount))):
        prefix = root.rstrip(b"/") + b"/"
        if prefix not in roots:
            roots.append(prefix)
    relative = []
    for position, path in enumerate(paths):
        try:
            raw = os.fsencode(path)
        except TypeError:
            raise ValueError(f"{origin}[{position}] is not a path: {path!r}; pass files= with "
                             f"the sample paths") from None
        if not raw.startswith(b"/") and keep_relative:
            relative.append(raw)
            continue
        if not raw.startswith(b"/"):
            normal = os.path.abspath(raw)
        elif b"//" in raw or b"/." in raw:  # maybe a '.' or '..' component
            normal = os.path.normpath(raw)
        else:  # already normal: the common case, and 10x cheaper than normpath
            normal = raw
        for prefix in roots:
            if normal.startswith(prefix):
                relative.append(normal[len(prefix):])
                break
        else:
            raise ValueError(f"{origin}[{position}] = {os.fsdecode(raw)!r} is not under the "
                             f"cachefs mount {os.path.abspath(mount)}: build the dataset "
                             f"on the mount, not on the source directory")
    return relative
