"""An order file's arrays, read from disk: `read_npz` and the `FileIdentity` of what it read.

The daemon reads files that users who may publish write, so what it reads is bounded before it
is trusted, and one file is read from one descriptor:

- One regular file, never through a link, opened without blocking (`_open_regular`): a link
  could name a file only the daemon's user may read, a FIFO would hold the reading thread.
- A zip of .npy arrays without pickles: its list of members (MAX_DIRECTORY_BYTES, from the
  archive's end record before the zip is opened), the sizes its members state unpacked
  (MAX_UNPACKED_BYTES, before any is read), its keys (those of the format, given by
  cachefs.order) and each member (a .npy array of items of some bytes) are checked in that
  order, each before what it would cost.
- The file is identified by the fstat of the descriptor read (`FileIdentity`), so a file
  renamed over it meanwhile is never taken for the one read.

What the arrays mean, and their validation, is cachefs.order's.
"""

from __future__ import annotations

import errno
import os
import stat
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cachefs.errors import OrderError

# the most an order file's arrays may take unpacked: a files list of 10 million paths of
# 200 bytes, with both orders (`read_npz`)
MAX_UNPACKED_BYTES = 2 << 30
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with members / an empty zip
# An order's archive has a member per key, a few dozen at most; its central directory (the
# list of members, which opening the zip reads whole and makes an object of each) is a few KB.
# One of a million empty members is 60 MB and took the daemon 600 MB before any check.
MAX_DIRECTORY_BYTES = 64 << 10
UNKNOWN_KEYS_SHOWN = 5  # unknown keys a rejection names
NPY_MAGIC = b"\x93NUMPY"  # a single .npy array (read_index_file reads those)


class FileIdentity(NamedTuple):
    """Identity of an order file on disk: a rename or rewrite changes at least one field."""

    ino: int
    mtime_ns: int
    size: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)

    def to_json(self) -> dict:
        return {"ino": self.ino, "mtime_ns": self.mtime_ns, "size": self.size}


def _read_npz_key(npz, key: str) -> np.ndarray:
    try:
        value = npz[key]
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise OrderError(f"key {key!r} holds a pickled (object) array; pickles are not "
                             f"accepted, store numbers and strings as plain numpy arrays") from None
        raise OrderError(f"key {key!r} is not a readable .npy array: {err}") from None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError) as err:
        raise OrderError(f"truncated or corrupt npz archive (reading {key!r}: {err})") from None
    if not isinstance(value, np.ndarray):
        # a member with no .npy header, which numpy hands over as its raw bytes (a message
        # quoting them took gigabytes of the daemon's memory)
        raise OrderError(f"key {key!r} is not a .npy array (numpy.savez writes every key as "
                         f"one)")
    if value.dtype.itemsize == 0 and value.size:
        # no bytes to read, and as many items as its header says: comparing them took
        # gigabytes, for a file of a few hundred bytes
        raise OrderError(f"key {key!r} is an array of {value.size:,} items of no bytes each")
    return value


def _open_regular(path: Path):
    """The order file, opened for reading; OrderError unless it is a regular file.

    Opened non-blocking, then checked: an open of a FIFO would wait for a writer (holding the
    watcher's thread, and the unmount, forever) and a device such as /dev/zero never ends.
    O_NONBLOCK changes nothing for the reads of a regular file.
    """
    try:
        # no link is followed: whoever may write the order's directory (a group's) could
        # point one at a file only the daemon's user may read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OrderError("a symbolic link, not the order file: publish by renaming a "
                             "complete file into place") from None
        raise OrderError(f"cannot open the order file: {err.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        error = OrderError("not a regular file: publish by renaming a complete file into place")
        error.file = FileIdentity.from_stat(st)
        raise error
    return os.fdopen(fd, "rb"), FileIdentity.from_stat(st)


def _check_directory_size(handle) -> None:
    """OrderError if the archive's central directory is larger than an order's can be
    (MAX_DIRECTORY_BYTES), as its end record states it, read before the zip is opened. The
    record is found by the zip reader's own search (`zipfile._EndRecData`, its zip64 record
    included): one found another way (a window a byte short, the record's own fields taken for
    another record, the 32-bit size of a zip64 archive) let an archive the reader then listed
    whole through. One with no end record is left to the reader, which says it is corrupt."""
    end_record = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
    if end_record is None:
        return
    directory_bytes = end_record[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    if directory_bytes > MAX_DIRECTORY_BYTES:
        raise OrderError(f"the archive lists {directory_bytes:,} bytes of members, more than "
                         f"the {MAX_DIRECTORY_BYTES:,} an order's few arrays may")


def read_npz(path: Path, known_keys: frozenset[str], required_keys: tuple[str, ...],
             version: int) -> tuple[dict[str, np.ndarray], FileIdentity]:
    """The arrays of the order file at `path`, of the keys of format `version` (`known_keys`,
    `required_keys` among them), and the identity of the file read; OrderError, with `.file`
    set when known, if unusable (module docstring)."""
    handle, identity = _open_regular(path)
    with handle:
        try:
            magic = handle.read(6)
            if identity.size == 0 or not magic:
                raise OrderError("empty file (0 bytes), not an npz archive")
            if magic.startswith(NPY_MAGIC):
                raise OrderError("a single .npy array, not an npz archive: write the keys with "
                                 "numpy.savez")
            if magic[:4] not in _ZIP_MAGIC:
                raise OrderError("not an npz archive (a zip of .npy arrays written by "
                                 "numpy.savez)")
            _check_directory_size(handle)
            handle.seek(0)
            try:
                npz = np.load(handle, allow_pickle=False)
            except (zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
                raise OrderError(f"truncated or corrupt npz archive: {err}") from None
            with npz:
                # the arrays' size as the archive states it, before any is read: a small
                # compressed file (or a forged size) made the daemon take gigabytes, or die
                unpacked_bytes = sum(info.file_size for info in npz.zip.infolist())
                if unpacked_bytes > MAX_UNPACKED_BYTES:
                    raise OrderError(f"the archive's arrays take {unpacked_bytes:,} bytes "
                                     f"unpacked, more than the {MAX_UNPACKED_BYTES:,} an order "
                                     f"may (a few hundred MB for millions of files)")
                unknown = sorted(set(npz.files) - known_keys)
                if unknown:
                    # the first few only: a file of thousands of arrays made a reason too long
                    # for the stats attribute (64 KiB) that reports it
                    shown = ", ".join(map(repr, unknown[:UNKNOWN_KEYS_SHOWN]))
                    more = (f" and {len(unknown) - UNKNOWN_KEYS_SHOWN} more"
                            if len(unknown) > UNKNOWN_KEYS_SHOWN else "")
                    raise OrderError(f"unknown key(s) {shown}{more}; version "
                                     f"{version} has {', '.join(sorted(known_keys))}")
                for required in required_keys:
                    if required not in npz.files:
                        raise OrderError(f"missing key {required!r}")
                arrays = {key: _read_npz_key(npz, key) for key in npz.files}
        except OrderError as err:
            err.file = identity
            raise
    return arrays, identity
