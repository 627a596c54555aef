"""The kernel's mount table, as /proc/self/mountinfo gives it: one reader for the whole package.

The daemon asks it whether its mount point is already mounted (`mounted_paths`), which device
backs its mount (`MountInfo.device`, for the read-ahead) and what file system holds the source
(`filesystem_type`); the CLI and `cachefs.client` ask whether a mount is up or gone. Reading
mountinfo never touches a mount, so none of these can hang on a stuck FUSE daemon, and dead
FUSE mounts are listed too.

This module imports nothing of cachefs: the daemon (`cachefs.mount`) and the client side
(`cachefs.cli`, `cachefs.client`) both import it, and neither imports the other.
"""

from __future__ import annotations

import os
from typing import NamedTuple

# the type of a cachefs mount in mountinfo: FUSE's, with the subtype the daemon mounts with
# (cachefs/mount.py, "subtype=cachefs")
CACHEFS_FSTYPE = b"fuse.cachefs"


def unescape_mountinfo(field: bytes) -> bytes:
    """Undo mountinfo's octal escapes (space, tab, newline, backslash)."""
    return (field.replace(b"\\040", b" ").replace(b"\\011", b"\t")
            .replace(b"\\012", b"\n").replace(b"\\134", b"\\"))


class MountInfo(NamedTuple):
    """One line of /proc/self/mountinfo, the fields cachefs uses."""

    point: bytes  # the mount point, unescaped
    device: str  # "major:minor"
    fstype: bytes  # the file system type, e.g. b"ext4", b"fuse.sshfs"
    # a FUSE mount's owner (its "user_id" option: who mounted it, as the kernel says, not as
    # its daemon says), None for other file systems
    owner_uid: int | None = None


def mountinfo() -> list[MountInfo]:
    """Every mount of this mount namespace, in the kernel's order (dead FUSE mounts too)."""
    mounts = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            # the optional fields end with "-", followed by the type, the source, the options
            dash = fields.index(b"-")
            owner_uid = None
            for option in fields[dash + 3].split(b",") if len(fields) > dash + 3 else ():
                if option.startswith(b"user_id="):
                    owner_uid = int(option[len(b"user_id="):])
            mounts.append(MountInfo(unescape_mountinfo(fields[4]), fields[2].decode(),
                                    fields[dash + 1], owner_uid))
    return mounts


def listed_path(path: str | os.PathLike, links_left: int = 40) -> str:
    """`path` as mountinfo lists a mount on it: absolute, the links of its parent directories
    resolved. Its last component is never stat'ed (a stuck mount there would hang the
    caller, which is why this is not `realpath`): if it is itself a link (readlink asks no
    file system mounted on it), its target is resolved the same way."""
    absolute = os.path.abspath(path)
    parent, name = os.path.split(absolute)
    if not name:
        return absolute  # the root
    resolved = os.path.join(os.path.realpath(parent), name)
    try:
        target = os.readlink(resolved)
    except OSError:
        return resolved  # not a link (or missing): mountinfo's spelling already
    if links_left == 0:
        return resolved  # a loop: the mount calls will say what is wrong
    return listed_path(os.path.join(os.path.dirname(resolved), target), links_left - 1)


def mounted_paths() -> set[str]:
    """Mount points of this mount namespace (see `mountinfo`)."""
    return {os.fsdecode(mount.point) for mount in mountinfo()}


def mount_at(path: str) -> MountInfo | None:
    """The mount a path lookup of `path` (as `listed_path` spells it) finds: the last one
    mounted on it, over any others; None if nothing is mounted there."""
    point = os.fsencode(path)
    found = None
    for mount in mountinfo():
        if mount.point == point:
            found = mount  # mountinfo lists mounts in the order they were stacked
    return found


def filesystem_type(path: bytes) -> bytes:
    """The type (mountinfo's field after " - ") of the mount holding `path`, e.g. b"ext4"."""
    best, fstype = b"", b""
    for mount in mountinfo():
        point = mount.point
        if (path == point or path.startswith(point.rstrip(b"/") + b"/")) and \
                len(point) >= len(best):
            best, fstype = point, mount.fstype
    return fstype
