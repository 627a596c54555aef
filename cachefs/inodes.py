"""Inode numbers for source paths, and the source attributes last seen for each.

The kernel names files by inode number; the source by path. This table hands out our own
inode numbers (1 is the root, as FUSE requires) for relative paths, keeps each one stable while
the kernel holds a reference (lookup counts, `forget`), and remembers the lstat result it last
saw with the time it was taken (`freshness.now_s`, trio's clock). That time is how `fuse_ops`
decides whether a file's attributes must be asked again at getattr (`Freshness.trusted`).
Whether its bytes may be served is decided by `checked_s`: the last time any look at the
source (that lstat, a sweep's, or the fstat of a read of its bytes: `confirm`, which the
source calls for every look) saw the version the inode is. A read-ahead's read of a file
looked up an epoch ago is such a look: keyed on the lstat alone, the file's pushed pages
would count as unchecked the moment they were stored. So a changed source file is never
served from a cache, yet an unchanged one costs no extra round trip to the source. The root's
stat, taken before trio's clock runs, is stamped `NEVER_S` until the mount stamps it when it
starts serving.

It is also the daemon's record of what the kernel holds of each inode, for the kernel data
plane (cachefs/pagecache.py): whether the kernel has the inode at all (a lookup count above
zero), the handles open on it, and `page_identity`, the version of the file whose pages the
kernel may hold (set when a file is opened or pushed, cleared when the source file changed).
`store_target` is the one check before pages are stored: the kernel holds the inode, with
attributes of the version stored (a store past the size the kernel holds would extend it) and
no pages of another one.

The table has an entry for every file the kernel knows, which with many small samples is
every sample: entries are slotted and keep the attributes packed (`PackedStat`, 137 bytes where
an `os.stat_result` takes 640), since this memory is not in the RAM tier's budget otherwise
(its per-block charge, cachefs/cache/ram.py, covers the entry of a cached file).

It also keeps, by inode, what the reader gave to count the file's next close by with no look
at its entry (`remember_close`, `close_tokens`; fuse_ops.Operations.closed, cachefs/reader.py
`AloneFile`): a look at each file's entry and stat at its close was cold memory, a cache miss
per object (the readers' copies evict the daemon's objects between two closes of a file). It
is forgotten whenever the file's attributes change and when the kernel forgets the inode.

An inode is one version of a file, as on NFS, where a file handle names one file: its size
and modification time never change while the kernel holds it. A stat of another version
(a newer one than the entry's: a lookup, a listing) makes a new inode for the path, and the
old one is *retired* (`retire`): kept while the kernel holds it, under no path, answered
ESTALE by fuse_ops, which the kernel's path walk meets with a lookup anew (the VFS retries an
open or stat that got ESTALE once, revalidating the dentry). Why: the kernel has one page
cache and one size per inode. When a file's inode took on the new version, a reader with the
file open read the old version's pages and then the new one's (a size that grew between two
reads, pages of the old version beside a READ answered with the new): a mix of two versions
(scripts/soak.py saw several in every four minutes of rewrites). Now a reader gets the
version it opened or ESTALE, never a mix.

Invariant: `_inode_by_path[p] == i` iff `_entries[i].relpath == p` and `i` is not retired; a
retired inode is in `_retired[p]` until the kernel forgets it.
"""

from __future__ import annotations

import operator
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.freshness import NEVER_S, now_s

ROOT_INODE = 1  # the same value as pyfuse3.ROOT_INODE; this module does not import pyfuse3


class PackedStat(bytes):
    """The attributes of an `os.stat_result` the daemon uses, as one bytes object; read with
    the same names (`st_size`, ...), so it stands in for the stat result."""

    __slots__ = ()
    FIELDS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize",
              "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_ino", "st_dev")
    _FORMAT = struct.Struct(f"{len(FIELDS)}q")
    # one C call for all the fields: a generator of getattrs was 13 steps of Python for each
    # stat a LOOKUP, a listing's entry or a read-ahead remembers
    _VALUES = operator.attrgetter(*FIELDS)
    # the fields' types, for the type checker (the properties are set below, from FIELDS)
    st_mode: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_rdev: int
    st_size: int
    st_blksize: int
    st_blocks: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_ino: int
    st_dev: int

    # st_size, st_mtime_ns and st_ino in one unpack (a source identity, read per file closed)
    _IDENTITY = struct.Struct("40xq24xq8xq")

    def values(self) -> tuple[int, ...]:
        """Every field, in the order of FIELDS, in one unpack."""
        return self._FORMAT.unpack(self)

    def identity_fields(self) -> tuple[int, int, int]:
        """(st_size, st_mtime_ns, st_ino)."""
        return self._IDENTITY.unpack_from(self)

    @classmethod
    def of(cls, st: os.stat_result | PackedStat) -> PackedStat:
        if isinstance(st, cls):
            return st
        return cls(cls._FORMAT.pack(*cls._VALUES(st)))


def _field(index: int) -> property:
    offset = index * 8
    return property(lambda self: struct.unpack_from("q", self, offset)[0])


for _index, _name in enumerate(PackedStat.FIELDS):
    setattr(PackedStat, _name, _field(_index))


def _packed_identity(st: os.stat_result | PackedStat) -> tuple[int, int, int]:
    """The identity of a stat when the table is given no source's (tests)."""
    return PackedStat.of(st).identity_fields()


@dataclass(slots=True)
class InodeEntry:
    relpath: bytes
    stat: PackedStat  # the last lstat of the source file
    stat_time_s: float  # freshness.now_s() when `stat` was asked
    lookups: int = 0
    # The file's item number under `numbering` (Reader.item_numbering, when it was asked),
    # cached so that an open does not search the manifest again; another numbering (a new
    # manifest, or its items switched between files and byte ranges) means ask again.
    numbering: int = -1
    manifest_index: int = -1
    page_identity: object = None  # SourceIdentity of the pages the kernel may hold, or None
    # freshness.now_s() when a look at the source last saw the version the inode is
    # (module docstring): what its bytes are trusted from; NEVER_S: not to be trusted
    checked_s: float = NEVER_S
    # now_s() when a look that could not be ordered against the inode's stat distrusted it
    # (`distrust`): a look asked before then may have seen the file before that one did,
    # and does not make it trusted again (`confirm`)
    distrusted_s: float = NEVER_S
    open_handles: int = 0  # opens answered or in progress, not yet released
    retired: bool = False  # another version of the file has the path now (module docstring)


class InodeTable:
    def __init__(self, root_stat: os.stat_result, identity_of=None,
                 trusted: Callable[[float], bool] = lambda checked_s: True):
        # identity_of(stat) -> SourceIdentity: the source's (Source.identity_of)
        self._identity_of = identity_of or _packed_identity
        # trusted(checked_s): the freshness rule (Freshness.trusted), for `store_target`
        self._trusted = trusted
        self._entries: dict[int, InodeEntry] = {
            ROOT_INODE: InodeEntry(b"", PackedStat.of(root_stat), NEVER_S, lookups=1)}
        self._inode_by_path: dict[bytes, int] = {b"": ROOT_INODE}
        self._retired: dict[bytes, list[int]] = {}  # by path, retired inodes the kernel holds
        self._next_inode = ROOT_INODE + 1
        # by inode: what the reader counts its next close by (module docstring)
        self._close_tokens: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, inode: int) -> InodeEntry:
        """The entry of a known inode; KeyError for one the kernel should not know."""
        return self._entries[inode]

    def inode_of(self, relpath: bytes) -> int | None:
        return self._inode_by_path.get(relpath)

    def entry_of(self, relpath: bytes) -> InodeEntry | None:
        """The entry of the path's inode, if the kernel holds one."""
        inode = self._inode_by_path.get(relpath)
        return None if inode is None else self._entries[inode]

    def child_path(self, parent_inode: int, name: bytes) -> bytes:
        parent = self._entries[parent_inode].relpath
        return parent + b"/" + name if parent else name

    def remember(self, relpath: bytes, st: os.stat_result, *, lookup: bool,
                 stat_time_s: float | None = None) -> int:
        """Record `st` (taken at `stat_time_s`, default now) for `relpath`, unless a stat
        taken later is recorded, and return its inode; `lookup` counts a kernel reference.
        A newer stat of another version of a regular file, of an inode the kernel holds,
        retires that inode and gives the version a new one (module docstring; a directory's
        identity changes with its entries, and it stays one inode)."""
        inode = self._inode_by_path.get(relpath)
        now = now_s() if stat_time_s is None else stat_time_s
        packed = PackedStat.of(st)
        if inode is not None:
            entry = self._entries[inode]
            if now >= entry.stat_time_s and now > entry.distrusted_s:
                # not over a newer one: a directory listing of some age (cachefs/dirs.py) would
                # take the file back to the version it had then; nor one asked before the
                # inode was distrusted (`distrust`), which may have seen the file before the
                # look that distrusted it: a listing's stat of another version retired the
                # inode and gave that version a trusted one
                if (entry.lookups > 0 and stat.S_ISREG(entry.stat.st_mode)
                        and packed.identity_fields() != entry.stat.identity_fields()
                        and self.identity(inode) != self._identity_of(packed)):
                    self.retire(inode)
                    inode = None
                else:
                    self._set_stat(inode, entry, packed, now)
        if inode is None:
            inode = self._next_inode
            self._next_inode += 1
            self._entries[inode] = InodeEntry(relpath, packed, now, checked_s=now)
            self._inode_by_path[relpath] = inode
        if lookup:
            self._entries[inode].lookups += 1
        return inode

    def identity(self, inode: int):
        """The source identity of the version the inode is."""
        return self._identity_of(self._entries[inode].stat)

    def retire(self, inode: int) -> bool:
        """Another version of the file has its path now (module docstring): the inode stays
        while the kernel holds it, under no path. False if it was retired already, or is no
        regular file."""
        entry = self._entries.get(inode)
        if entry is None or entry.retired or not stat.S_ISREG(entry.stat.st_mode):
            return False  # a directory or a link stays one inode (`remember`)
        entry.retired = True
        entry.page_identity = None
        self._forget_close(inode)
        del self._inode_by_path[entry.relpath]
        if entry.lookups > 0:
            self._retired.setdefault(entry.relpath, []).append(inode)
        else:
            del self._entries[inode]  # the kernel holds it no more: nothing to keep it for
        return True

    def distrust(self, inode: int) -> None:
        """The inode's version may not be the source's (a look at another version could not
        be ordered before or after its stat, freshness.compare_look): its stat is asked
        again at its next use, and the kernel's pages of it are not counted on."""
        entry = self._entries[inode]
        entry.stat_time_s = entry.checked_s = NEVER_S
        entry.distrusted_s = now_s()
        entry.page_identity = None

    def retired_of(self, relpath: bytes) -> list[int]:
        """The retired inodes of the path that the kernel still holds."""
        return self._retired.get(relpath, [])

    def add_lookup(self, inode: int) -> None:
        """The kernel took a reference without a lookup call (readdirplus)."""
        self._entries[inode].lookups += 1

    def update_stat(self, inode: int, st: os.stat_result | PackedStat,
                    stat_time_s: float | None = None) -> None:
        self._set_stat(inode, self._entries[inode], PackedStat.of(st),
                       now_s() if stat_time_s is None else stat_time_s)

    def _set_stat(self, inode: int, entry: InodeEntry, packed: PackedStat,
                  stat_time_s: float) -> None:
        checked_s = entry.checked_s
        if packed.identity_fields() != entry.stat.identity_fields():
            self._forget_close(inode)  # another version: its close is looked at again
            entry.checked_s = stat_time_s
        else:
            entry.checked_s = max(entry.checked_s, stat_time_s)
        entry.stat = packed
        entry.stat_time_s = stat_time_s
        if stat_time_s <= entry.distrusted_s:
            # asked before the inode was distrusted: it may have seen the file before the
            # look that distrusted it (`confirm`), so it trusts nothing (a sweep's lstat
            # landing late made the inode trusted again); a look asked after the distrust
            # that saw its version (`confirm`) still counts
            entry.stat_time_s = NEVER_S
            entry.checked_s = checked_s if checked_s > entry.distrusted_s else NEVER_S

    def confirm(self, relpath: bytes, st: os.stat_result, asked_s: float) -> None:
        """A look at the source asked at `asked_s` saw `st` (Source's `on_look`): if that is
        the version the path's inode is, its bytes are trusted from then (module docstring)."""
        inode = self._inode_by_path.get(relpath)
        if inode is None:
            return
        entry = self._entries[inode]
        if asked_s <= entry.checked_s or asked_s <= entry.distrusted_s:
            return
        # the same three fields, the usual case, with no identity built for each (a look
        # per file read); else as the source tells versions apart (Source.identity_of)
        if (entry.stat.identity_fields() == (st.st_size, st.st_mtime_ns, st.st_ino)
                or self._identity_of(st) == self._identity_of(entry.stat)):
            entry.checked_s = asked_s

    def forget(self, inode: int, count: int) -> bytes | None:
        """The kernel dropped `count` references; the relpath if it holds the inode no more
        (and so none of its pages), unless the inode was retired (its version's copies went
        when it was)."""
        entry = self._entries.get(inode)
        if entry is None or inode == ROOT_INODE:
            return None
        entry.lookups -= count
        if entry.lookups > 0:
            return None
        del self._entries[inode]
        self._forget_close(inode)
        if entry.retired:
            retired = self._retired[entry.relpath]
            retired.remove(inode)
            if not retired:
                del self._retired[entry.relpath]
            return None
        del self._inode_by_path[entry.relpath]
        return entry.relpath

    # -- closes counted with no look at the entry (module docstring) --------------------------

    def remember_close(self, inode: int, token: object) -> None:
        """The reader counts the next close of `inode` by `token` (module docstring)."""
        if inode in self._entries:  # else forgotten meanwhile: nothing to remember it by
            self._close_tokens[inode] = token

    def close_tokens(self, inodes: list[int]) -> list:
        """`remember_close`'s token of each of `inodes`, or None."""
        tokens = self._close_tokens
        return [tokens.get(inode) for inode in inodes]

    def _forget_close(self, inode: int) -> None:
        self._close_tokens.pop(inode, None)

    # -- what the kernel holds (KernelInodes, cachefs.cache.tiered) ---------------------------

    def store_target(self, relpath: bytes, identity) -> int | None:
        inode = self._inode_by_path.get(relpath)
        if inode is None:
            return None
        entry = self._entries[inode]
        if entry.lookups <= 0 or self._identity_of(entry.stat) != identity:
            return None
        if not self._trusted(entry.checked_s):
            # not seen at the source within the TTL (the sweeps fell behind): pages stored now
            # would be read with no READ, and so with no check (revalidate.py, "Overdue")
            return None
        if entry.open_handles:
            # An open answered without keep_cache makes the kernel drop the pages when it
            # gets the answer, which a store queued now may precede or follow: the reader
            # would read pages with no READ that the daemon can count. Push when no one reads.
            return None
        if entry.page_identity is None:
            entry.page_identity = identity
        elif entry.page_identity != identity:
            return None
        return inode
