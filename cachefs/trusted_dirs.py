"""Directories no other local user can swap: the check the SSD tier and the state directory share.

Why. The daemon, often root, writes where it is told: its SSD tier (whose entries it serves
to every user of the mount), its state directory (the pid file `cachefs umount` trusts, the
daemon's log, the order file). A directory another user owns, or whose parent another user may
write to, can be renamed away by that user and replaced with one of theirs: forged entries,
an order, or links where the daemon writes (the daemon would append its log to, or truncate,
a file of the link's choosing). ssh refuses a ~/.ssh in such a place (StrictModes) for the same
reason. So each such directory must belong to the daemon's user or root, and so must each of
its parents, none of which another user may write to unless it is sticky (as /tmp is: a
sticky directory lets no user rename another's entries). The same goes for each symbolic
link the path goes through (`/scratch/cache` a link into a directory of the mount's user):
the daemon keeps using the path as given, so a link that another user owns, or may replace,
can be pointed elsewhere once the check has passed.

What the directory itself may allow others is the caller's to decide: the SSD tier wants no
other writer at all (`cachefs.cache.ssd`), the order file's directory may be shared with the
mount's users, who publish by writing there (`cachefs.state_dir`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cachefs.errors import EXIT_ERROR, StartupError


def check_no_other_user_can_swap(directory: Path, what: str,
                                 exit_code: int = EXIT_ERROR) -> None:
    """StartupError (with `exit_code`) unless `directory` (a link given as it is followed)
    belongs to this user or root, and so does each of its parents, writable by no other user
    unless sticky (module docstring). `what` names the directory in the message."""
    real = Path(os.path.realpath(directory))
    uid = os.geteuid()
    for link, link_st in _links_followed(Path(directory)):
        if link_st.st_uid not in (0, uid):
            raise StartupError(f"{what} {directory} goes through the link {link}, which belongs "
                               f"to user {link_st.st_uid}: that user could point it elsewhere",
                               exit_code)
        parent_st = os.stat(link.parent)
        if parent_st.st_uid not in (0, uid) or _others_may_rename_in(parent_st):
            raise StartupError(f"{what} {directory} goes through the link {link}, which another "
                               f"user could replace (its directory {link.parent} is theirs, "
                               f"or theirs to write to)", exit_code)
    st = os.stat(real)
    if st.st_uid not in (0, uid):
        raise StartupError(f"{what} {directory} belongs to user {st.st_uid}, not to this one "
                           f"({uid}): that user could change what the mount does", exit_code)
    for parent in real.parents:
        st = os.stat(parent)
        if st.st_uid not in (0, uid):
            raise StartupError(f"{what} {directory} is inside {parent}, which belongs to user "
                               f"{st.st_uid}: that user could put another directory in its "
                               f"place", exit_code)
        if _others_may_rename_in(st):
            raise StartupError(f"{what} {directory} is inside {parent}, which other users may "
                               f"write to (mode {st.st_mode & 0o7777:o}): they could put "
                               f"another directory in its place", exit_code)


def _others_may_rename_in(st: os.stat_result) -> bool:
    """Users other than the directory's owner may rename its entries: it is writable by its
    group or by all, and not sticky."""
    return bool(st.st_mode & 0o022) and not st.st_mode & stat.S_ISVTX


MAX_LINKS = 40  # as the kernel's path walk allows (ELOOP past it)


def _links_followed(path: Path) -> list[tuple[Path, os.stat_result]]:
    """Each symbolic link resolving `path` goes through, with its lstat, in the order met:
    the path's own, then those of their targets. Components that do not exist end the walk
    (nothing past them is a link yet)."""
    pending = list(Path(os.path.abspath(path)).parts[1:])
    current = Path("/")
    links: list[tuple[Path, os.stat_result]] = []
    while pending and len(links) <= MAX_LINKS:
        part = pending.pop(0)
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            st = os.lstat(candidate)
        except OSError:
            break
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        links.append((candidate, st))
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current = Path("/")
            pending = list(target.parts[1:]) + pending
        else:
            pending = [part for part in target.parts if part != "."] + pending
    return links
