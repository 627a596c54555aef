"""The cachefs exception tree and its errno / exit-code mapping, in one place.

Library code raises these domain errors; `fuse_ops` turns them into `FUSEError(errno)` and the
CLI turns them into a message and an exit code. Nothing else maps errors, so the mapping can be
read here in full:

- `OrderError`: a bad order file (EINVAL); the previous order stays in force.
- `StartupError`: the mount cannot start; carries the documented exit code (man/cachefs-mount.1).
- `WarmError` (warm.py): a warm request that cannot be carried out.
- `ControlDenied` (ctrl.py): a command from a user other than the mount's owner or root
  (EACCES).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachefs.order_archive import FileIdentity


class CachefsError(Exception):
    """Base class; `errno_value` is what a FUSE handler answers for it."""

    errno_value = errno.EIO


class OrderError(CachefsError):
    """An order file or order arguments that cannot be used; the message names the problem."""

    errno_value = errno.EINVAL
    file: FileIdentity | None = None  # identity of the order file read, when there was one


class OrderRejected(OrderError):
    """The order itself is wrong: the checks before it is written, or the daemon, refused it
    (an OrderError of another kind is a failure to publish: the mount, a timeout, a file)."""


class StaleFileError(CachefsError):
    """The source file changed since the kernel was given its attributes: the version a reader
    holds is gone, and serving the new bytes under the old size would hand it a mix of the two
    (the kernel cuts or zero-fills a READ at the size it holds). The reader gets ESTALE, as from
    gcsfuse or NFS; the kernel's attributes are dropped, and its next lookup or stat of the file
    learns the new version."""

    errno_value = errno.ESTALE


# Exit codes of `cachefs mount` (documented in man/cachefs-mount.1, EXIT STATUS).
EXIT_OK = 0
EXIT_ERROR = 1  # anything not listed below
EXIT_USAGE = 2  # click's own code for bad arguments
EXIT_SOURCE = 3  # SRC missing or not a directory
EXIT_MOUNTPOINT = 4  # MNT missing or not a directory
EXIT_ALREADY_MOUNTED = 5  # MNT is already a mount point
EXIT_NO_FUSE = 6  # /dev/fuse or fusermount3 missing
EXIT_CACHE_DIR = 7  # --ssd-cache unusable or locked by another mount
EXIT_METRICS = 8  # the --metrics address cannot be listened on (in use, not this machine's)


class StartupError(CachefsError):
    """The mount cannot start. `exit_code` is one of the EXIT_* constants above."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code
