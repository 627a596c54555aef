"""Opening a relative path beneath a directory, following no symbolic link on the way.

The daemon often runs as root and reads the source for other people (read-ahead, `cachefs
warm`), so a path it is given must never lead it out of the source: a source holding
`etc -> /etc` must not let `etc/passwd` be read and cached. A check of the path's text cannot
promise that (any directory on the way may be a link, or become one between a check and the
open), so the kernel resolves the path under a directory descriptor and refuses every
symbolic link it meets, the last component's included (ELOOP), and any way out of the
directory (EXDEV for an absolute path or any `..` component).

`open_beneath(dir_fd, relpath, flags)` is that open. It uses openat2(2) with
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS (Linux 5.6 and later): one system call, as cheap as the
plain open it replaces. Where openat2 is missing (an older kernel, or a seccomp filter that
refuses it) it walks the path one component at a time, each `openat` made with O_NOFOLLOW
from the directory opened before: a few system calls more per open.

A caller that wants what lstat(2) would say of the last component, or its link or
extended attributes, opens it with O_PATH: a symbolic link is then opened as itself (not
followed) and can be fstat'ed, read with readlinkat(fd, "") and reached by the
`proc_path` of the descriptor. A relpath is bytes as FUSE gives names (`b""` is the
directory itself).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import stat

log = logging.getLogger(__name__)

# linux/openat2.h
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
# openat2 has number 437 on every architecture of the common syscall table (alpha excepted);
# elsewhere the walk is used, never a guessed number
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "riscv64": 437, "ppc64le": 437,
                "s390x": 437, "i686": 437, "armv7l": 437, "loongarch64": 437}.get(
                    platform.machine())


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall  # CDLL releases the GIL during the call
_syscall.restype = ctypes.c_long
# declared, not converted at each call: this is on the path of every source read
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                     ctypes.c_size_t]
_HOW_BYTES = ctypes.sizeof(_OpenHow)
# flags -> (open_how, its address); only read by the kernel, so threads may share one
_hows: dict[int, tuple[_OpenHow, int]] = {}


def _openat2(dir_fd: int, relpath: bytes, flags: int) -> int:
    how = _hows.get(flags)
    if how is None:
        open_how = _OpenHow(flags, 0, _RESOLVE)
        how = _hows[flags] = (open_how, ctypes.addressof(open_how))
    while True:
        fd = _syscall(_SYS_OPENAT2, dir_fd, relpath, how[1], _HOW_BYTES)
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code), relpath)
        # a signal for the daemon, handled by this thread, interrupted an open on a network
        # file system: tried again, as Python's own os.open does (PEP 475)


def _walk(dir_fd: int, relpath: bytes, flags: int) -> int:
    """The fallback: one openat per component, each with O_NOFOLLOW."""
    parts = [part for part in relpath.split(b"/") if part and part != b"."] or [b"."]
    fd = dir_fd
    try:
        for part in parts[:-1]:
            child = _open_directory(fd, part, relpath)
            if fd != dir_fd:
                os.close(fd)
            fd = child
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def _open_directory(dir_fd: int, name: bytes, relpath: bytes) -> int:
    try:
        return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=dir_fd)
    except NotADirectoryError:
        # a link opened as itself is not a directory: say ELOOP, as openat2 does
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), relpath) from None
        raise


def _probe() -> bool:
    """Whether openat2 works here (kernel, seccomp), asked once."""
    if _SYS_OPENAT2 is None:
        return False
    try:
        os.close(_openat2(-100, b".", os.O_PATH | os.O_CLOEXEC))  # AT_FDCWD
        return True
    except OSError as exc:
        log.debug("openat2 unavailable (%s): resolving source paths one component at a "
                  "time", exc.strerror)
        return False


HAVE_OPENAT2 = _probe()


def open_beneath(dir_fd: int, relpath: bytes, flags: int) -> int:
    """A descriptor of `relpath` under `dir_fd`, reached through no symbolic link (module
    docstring); OSError ELOOP at a link, EXDEV for a way out, as open(2) errors otherwise."""
    check_relpath(relpath)
    # O_NOFOLLOW: a last component that is a link is refused, or with O_PATH opened as itself
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if HAVE_OPENAT2:
        return _openat2(dir_fd, relpath or b".", flags)
    return _walk(dir_fd, relpath, flags)


def check_relpath(relpath: bytes) -> None:
    """OSError for a path that no open beneath a directory follows (EXDEV: absolute, or with
    a '..' component) or that no system call takes (EINVAL: a NUL byte); openat2 refuses only
    the '..' that leave the directory, and the fallback walk refuses every one, so both are
    refused before either (cachefs/read_pool.py opens with openat2 too)."""
    if relpath.startswith(b"/"):
        raise OSError(errno.EXDEV, "an absolute path is not beneath the source", relpath)
    if b"\0" in relpath:
        raise OSError(errno.EINVAL, "a path with a NUL byte", relpath)
    if b".." in relpath and b".." in relpath.split(b"/"):
        raise OSError(errno.EXDEV, "a '..' component is not followed", relpath)


def proc_path(fd: int) -> str:
    """A path naming what `fd` refers to (a symbolic link opened O_PATH stays itself), for
    calls that take no descriptor of that kind (getxattr, listxattr)."""
    return f"/proc/self/fd/{fd}"
