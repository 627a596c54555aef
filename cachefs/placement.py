"""Where each item of a manifest lives: its storage target, as a small dense number.

A data set on a parallel or networked store is spread over storage nodes (Lustre OSTs, object
store shards, several NFS servers or disks mounted under one directory), and each node has a
latency and a capacity of its own. The read-ahead keeps one list per node (cachefs/targets.py),
so it needs every manifest item's node, which comes from one of two places:

1. the order file's ``targets`` array (man/cachefs-order.5), for stores whose placement the
   trainer knows: `Placement.of_targets`, checked by `cachefs.order.check_targets`;
2. otherwise the device the file lives on (st_dev): several servers or disks mounted under the
   source are distinct targets with no configuration. A file's device is that of the directory
   holding it (every file of a directory is on the directory's file system, unless a single
   file is bind-mounted over another), which the scan of the source reads once per directory
   (`cachefs.manifest.scan_source`): no stat per file. `Placement.of_devices`.

`ids[item]` is the item's target number, 0..k-1, and `keys[number]` what the number stands for
(the order file's value, or the device). Numbers are dense so that the per-target state is a
list, and an ImageNet-sized manifest costs an int32 per item and no Python object per item. The
mapping is computed once, in the order loader's worker thread.

At most MAX_TARGETS targets: each has a read-ahead list, a share of `--source-threads` and a
row of `cachefs stats`, and more lists than source threads would leave some without a slot.
An order file with more distinct values is rejected (the trainer can fold them); a source with
more devices than that keeps the devices with the most files and folds the rest into one
target, keyed OTHER_DEVICES.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

MAX_TARGETS = 64
OTHER_DEVICES = -1  # the key of the target that folds the devices beyond MAX_TARGETS - 1


@dataclass(frozen=True, eq=False)
class Placement:
    """The target of every manifest item (module docstring)."""

    ids: np.ndarray  # int32 per manifest item: its target number
    keys: np.ndarray  # int64 per target number: the `targets` value, or the device
    from_devices: bool

    @property
    def count(self) -> int:
        return len(self.keys)

    @classmethod
    def of_targets(cls, targets: np.ndarray) -> Placement:
        """From an order file's checked `targets` array."""
        keys, ids = np.unique(np.asarray(targets), return_inverse=True)
        return cls(ids.astype(np.int32), keys.astype(np.int64), False)

    @classmethod
    def of_devices(cls, devices: np.ndarray) -> Placement:
        """From the device of every item; beyond MAX_TARGETS, the devices with the fewest
        files share one target (module docstring)."""
        keys, inverse, counts = np.unique(np.asarray(devices, np.int64), return_inverse=True,
                                          return_counts=True)
        ids = inverse.astype(np.int32)
        if len(keys) > MAX_TARGETS:
            kept = np.sort(np.argsort(-counts, kind="stable")[:MAX_TARGETS - 1])
            renumber = np.full(len(keys), MAX_TARGETS - 1, np.int32)
            renumber[kept] = np.arange(len(kept), dtype=np.int32)
            ids = renumber[ids]
            keys = np.append(keys[kept], OTHER_DEVICES)
        return cls(ids, keys.astype(np.int64), True)

    @classmethod
    def single(cls, items: int) -> Placement:
        """Every item on one target: a manifest whose devices are unknown."""
        return cls(np.zeros(items, np.int32), np.zeros(1, np.int64), True)

    def name(self, number: int) -> str:
        """How `cachefs stats` names a target: the order file's value, or MAJOR:MINOR."""
        key = int(self.keys[number])
        if not self.from_devices:
            return str(key)
        if key == OTHER_DEVICES:
            return "other"
        return f"{os.major(key)}:{os.minor(key)}"
