"""The control channel: extended attributes of the mount root, read by the CLI.

s3ql's pattern (a control file with xattrs) with nothing to create: any process that can see
the mount can ask `os.getxattr(MNT, "user.cachefs.stats")`. Read-only by design; publishing an
order goes through the order file, which any framework can write without our code.

| name                      | value                                                      |
|---------------------------|------------------------------------------------------------|
| user.cachefs.stats        | JSON snapshot of the mount's state (man/cachefs-stats.1)   |
| user.cachefs.order_file   | path of the order file this mount watches                 |
| user.cachefs.version      | cachefs version                                            |

Commands are getxattr calls too, with the request in the attribute's name, because the mount
carries the kernel's `ro` flag (which refuses every setxattr before it reaches us, and saves a
GETATTR per file that atime updates would otherwise cost): reading
`user.cachefs.warm.start.<JSON request>` starts filling the SSD tier (warm.py) and returns the
warm's status as JSON. A command must be idempotent, since the kernel may ask twice for one
read (first with a buffer too small for the answer).

Who may ask. With `-o allow_other` every local user reaches the mount. Any of them may read
the stats, order file and version (nothing in them comes from a file's contents), but a
command is answered only for the user who started the daemon and for root (the uid the kernel
gives with each request); anyone else gets EACCES. A command's effects last (the SSD tier is
cache-once), and the daemon may run with more rights than the user asking.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable

from cachefs import __version__
from cachefs.errors import CachefsError

STATS = b"user.cachefs.stats"
ORDER_FILE = b"user.cachefs.order_file"
VERSION = b"user.cachefs.version"
WARM_START = b"user.cachefs.warm.start."

# os.getxattr gives up above the kernel's XATTR_SIZE_MAX; keep the snapshot below it
XATTR_SIZE_MAX = 64 * 1024
ORDER_LISTS_SHOWN = 64  # rank files of the order in force listed where all would not fit


class ControlDenied(CachefsError):
    """A command from a user other than the daemon's owner or root (module docstring)."""

    errno_value = errno.EACCES


class Control:
    def __init__(self, snapshot: Callable[[], dict], order_file: os.PathLike,
                 warm_start: Callable[[bytes], dict], owner_uid: int | None = None):
        self._snapshot = snapshot
        self._order_file = os.fsencode(order_file)
        self._warm_start = warm_start
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid

    def get(self, name: bytes, uid: int) -> bytes | None:
        """The value of a control attribute asked by user `uid`, or None if `name` is not one;
        ControlDenied for a command from anyone but the owner or root."""
        if name == STATS:
            return self.stats_json()
        if name == ORDER_FILE:
            return self._order_file
        if name == VERSION:
            return __version__.encode()
        if name.startswith(WARM_START):
            if uid not in (0, self.owner_uid):
                raise ControlDenied(f"uid {uid} may not send commands to this mount (only "
                                    f"uid {self.owner_uid}, its owner, and root may)")
            return json.dumps(self._warm_start(name[len(WARM_START):])).encode()
        return None

    def stats_json(self) -> bytes:
        snapshot = self._snapshot()
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        while len(data) > XATTR_SIZE_MAX and len(snapshot.get("epochs", ())) > 1:
            # a very long run: keep the newest epochs (the totals stay in each record)
            snapshot["epochs"] = snapshot["epochs"][len(snapshot["epochs"]) // 2:]
            snapshot["epochs_truncated"] = True
            data = json.dumps(snapshot, separators=(",", ":")).encode()
        order = snapshot.get("order")
        if len(data) > XATTR_SIZE_MAX and order:
            # an order merged from hundreds of rank files: their identities and ranks made the
            # attribute too large to read, and `cachefs stats` and `publish` failed for every
            # user; the first few are shown, and how many there are
            for key in ("files", "ranks"):
                values = order.get(key)
                if values and len(values) > ORDER_LISTS_SHOWN:
                    order[key] = values[:ORDER_LISTS_SHOWN]
                    order[f"{key}_total"] = len(values)
            data = json.dumps(snapshot, separators=(",", ":")).encode()
        return data


# -- the client side: what the CLI, `cachefs.publish` and the tools read ----------------------

def read_attr(mount: os.PathLike, name: bytes, error: type[CachefsError] = CachefsError) -> bytes:
    """A control attribute of a mount; `error` (with a message that says why) if there is none."""
    text_name = os.fsdecode(name)
    try:
        return os.getxattr(mount, text_name)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise error(f"{mount} is not a cachefs mount (no {text_name} attribute)") from None
        if exc.errno == errno.EACCES and name.startswith(WARM_START):
            raise error(f"{mount}: permission denied: only the user who mounted it, or root, "
                        f"may send it commands") from None
        if exc.errno == errno.ENOTCONN:
            raise error(f"{mount}: the cachefs daemon is not running (transport endpoint is "
                        f"not connected)") from None
        raise error(f"{mount}: {exc.strerror}") from None


def read_stats(mount: os.PathLike, error: type[CachefsError] = CachefsError) -> dict:
    """The JSON snapshot of `cachefs stats` (man/cachefs-stats.1)."""
    raw = read_attr(mount, STATS, error)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise error(f"{mount}: unreadable {os.fsdecode(STATS)} attribute: {exc}") from None
