"""The mount's state directory and the order file's: made, checked, locked, written.

The state directory holds what `cachefs umount` and the CLI read of a running mount (its pid
file, the daemon's log) and, by default, the order file the trainer publishes. The daemon, often
root, writes there, and the mount's users may share the order file's directory to publish: so
no other user may be able to put another directory in their place (`trusted_dirs`), every user
may not write the order file's (which would let any of them steer the mount), and the files the
daemon writes there are never opened through a link planted in their place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

from cachefs import errors
from cachefs.config import MountConfig
from cachefs.trusted_dirs import check_no_other_user_can_swap

# directories a mount creates (its state directory, the order file's): the owner writes them
STATE_DIR_MODE = 0o755


def make_dirs(directory: Path) -> None:
    """`directory` and its missing parents, each STATE_DIR_MODE at most whatever the umask: under
    one of 000 (some containers and batch jobs) they were writable by every user, who could
    rename one and put an order directory of their own in its place, and the mount refused
    the state directory it had just made (`_check_order_directory`)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(mode=STATE_DIR_MODE, exist_ok=True)  # a stricter umask narrows it further


def prepare(config: MountConfig) -> None:
    """Make the state directory and the order file's (`make_dirs`) and check them
    (`check_state_dirs`): by the CLI before it opens the daemon's log there, and by the
    daemon itself (which may have been started in the foreground)."""
    make_dirs(config.state_dir)
    make_dirs(config.order_file.parent)
    check_state_dirs(config)


def check_state_dirs(config: MountConfig) -> None:
    """The state directory and the order file's: no other user can put another in their
    place (`trusted_dirs`), and every user may not write the order file's
    (`_check_order_directory`). The files the daemon writes there are never opened through a
    link (`write_no_link`, `open_log`)."""
    check_no_other_user_can_swap(config.state_dir, "state directory")
    check_no_other_user_can_swap(config.order_file.parent, "the order file's directory")
    _check_order_directory(config.order_file.parent)


def write_no_link(path: Path, data: bytes) -> None:
    """Write `path` whole as a new file renamed over whatever has its name, so never through
    a link, a FIFO or another user's file planted in its place (the daemon may be root, and
    the state directory shared with the mount's users: a link there failed the mount, and a
    FIFO named `pid` held its start until someone read it)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def read_own_file(path: Path, max_bytes: int) -> bytes:
    """Up to `max_bytes` of `path`, a file the daemon wrote (`write_no_link`): OSError if it is
    not a regular file, or, unless this user is root, not one of this user's or root's (a FIFO
    planted there held `cachefs umount` forever; a file of another user's names a process of
    their choosing; root unmounting a user's mount reads that user's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        euid = os.geteuid()
        if not stat.S_ISREG(st.st_mode) or (euid != 0 and st.st_uid not in (0, euid)):
            raise OSError(errno.EPERM, "not a file of this user's or root's", str(path))
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def open_log(path: Path) -> int:
    """The daemon's log, opened for appending: never through a link, its user's file alone
    (0600, a log of an earlier version readable by all too: it names source files, which
    users of the mount may not be allowed to list). StartupError for one that is not a
    regular file of this user's (a FIFO blocked the mount; a file of another user's got the
    log); OSError as the open failed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                 | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise errors.StartupError(f"the daemon's log {path} is not a file of this user's: "
                                  f"another user could read or block it; remove it")
    os.fchmod(fd, 0o600)
    return fd


def _check_order_directory(directory: Path) -> None:
    """Publishing is writing a file in the order file's directory (man/cachefs-mount.1,
    "Other users"): one that every user may write (/tmp) lets any of them publish orders to
    this mount, sticky bit or not (a rank's file is a new name)."""
    if os.stat(directory).st_mode & stat.S_IWOTH:
        raise errors.StartupError(
            f"the order file's directory {directory} is writable by every user, who could all "
            f"publish orders to this mount; use one only the mount's users may write "
            f"(chmod o-w, --state-dir or --order-file)")


def lock(state_dir: Path) -> int:
    """One mount per state directory: two would watch one order file (a publication to one
    steered the other) and overwrite each other's pid file (which `cachefs umount` waits on)."""
    # not "lock": the SSD tier's lock file, in a directory given as both (`SsdTier`), whose
    # flock of another open of the same file would fail in this very process
    fd = os.open(state_dir / "mount.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise errors.StartupError(f"state directory {state_dir} is in use by another cachefs "
                                  f"mount; give this one its own (--state-dir)") from None
    return fd
