"""The control channel: extended attributes of the mount root, read by the CLI.

s3ql's pattern (a control file with xattrs) with nothing to create: any process that can see
the mount can ask `os.getxattr(MNT, "user.cachefs.stats")`. Read-only by design; publishing an
order goes through the order file, which any framework can write without our code.

| name                      | value                                                      |
|---------------------------|------------------------------------------------------------|
| user.cachefs.stats        | JSON snapshot of the mount's state (man/cachefs-stats.1)   |
| user.cachefs.order_file   | path of the order file this mount watches                 |
| user.cachefs.version      | cachefs version                                            |

One attribute can be set, on the root only: `user.cachefs.warm`, whose value is a JSON request
(see warm.py) that starts filling the SSD tier; its progress is `warm` in the stats snapshot.
Setting any other attribute gets EROFS like every write. This is why the mount is not made
with the kernel's `ro` flag, which would refuse the setxattr before it reaches us; every
write-like request is answered EROFS by `fuse_ops` instead.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from cachefs import __version__

STATS = b"user.cachefs.stats"
ORDER_FILE = b"user.cachefs.order_file"
VERSION = b"user.cachefs.version"
WARM = b"user.cachefs.warm"

# os.getxattr gives up above the kernel's XATTR_SIZE_MAX; keep the snapshot below it
XATTR_SIZE_MAX = 64 * 1024


class Control:
    def __init__(self, snapshot: Callable[[], dict], order_file: os.PathLike,
                 commands: dict[bytes, Callable[[bytes], None]]):
        self._snapshot = snapshot
        self._order_file = os.fsencode(order_file)
        self._commands = commands  # settable names -> handler(value); raise CachefsError

    def set(self, name: bytes, value: bytes) -> bool:
        """Run a control command; False if `name` is not one (the caller answers EROFS)."""
        command = self._commands.get(name)
        if command is None:
            return False
        command(value)
        return True

    def get(self, name: bytes) -> bytes | None:
        """The value of a control attribute, or None if `name` is not one."""
        if name == STATS:
            return self.stats_json()
        if name == ORDER_FILE:
            return self._order_file
        if name == VERSION:
            return __version__.encode()
        return None

    def stats_json(self) -> bytes:
        snapshot = self._snapshot()
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        while len(data) > XATTR_SIZE_MAX and len(snapshot.get("epochs", ())) > 1:
            # a very long run: keep the newest epochs (the totals stay in each record)
            snapshot["epochs"] = snapshot["epochs"][len(snapshot["epochs"]) // 2:]
            snapshot["epochs_truncated"] = True
            data = json.dumps(snapshot, separators=(",", ":")).encode()
        return data
