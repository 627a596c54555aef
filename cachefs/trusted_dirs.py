"""Directories no other local user can swap: the check the SSD tier and the state directory share.

Why. The daemon, often root, writes where it is told: its SSD tier (whose entries it serves
to every user of the mount), its state directory (the pid file `cachefs umount` trusts, the
daemon's log, the order file). A directory another user owns, or whose parent another user may
write to, can be renamed away by that user and replaced with one of theirs: forged entries,
an order, or links where the daemon writes (the daemon would append its log to, or truncate,
a file of the link's choosing). ssh refuses a ~/.ssh in such a place (StrictModes) for the same
reason. So each such directory must belong to the daemon's user or root, and so must each of
its parents, none of which another user may write to unless it is sticky (as /tmp is: a
sticky directory lets no user rename another's entries).

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
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise StartupError(f"{what} {directory} is inside {parent}, which other users may "
                               f"write to (mode {st.st_mode & 0o7777:o}): they could put "
                               f"another directory in its place", exit_code)
