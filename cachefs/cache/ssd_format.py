"""The SSD tier's on-disk format: entry files, their headers, and the index log.

`cachefs.cache.ssd.SsdTier` decides what to keep and when (budget, recovery, threads); this
module only says how the bytes lie on disk and checks them, with no state of its own. Nothing
here is ever trusted without its checksum: a reader of an entry or of the index verifies it.

Layout of DIR::

    lock                 flock'ed for the lifetime of an SsdTier: one mount per directory
    meta                 JSON {"format", "block_bytes", "clean"}
    index                append-only log of fixed 72-byte records (see below)
    entries/00 .. ff/    256 fan-out directories, so no directory holds a million files
    entries/ab/<name>    one block: a 96-byte header, then the payload
    entries/ab/<name>.<random>.tmp   an entry being written; renamed to <name> when complete

An entry's name is the 128-bit xxh3 of (xxh3_128(relpath), block_index), in hex. Its header
holds magic, format version, block_bytes, the 128-bit hash of the relpath, the block index, the
source identity (size, mtime_ns, ino), the payload length, xxh3_64 of the payload and xxh3_64
of the header itself. A read checks all of them against the request, so a truncated,
half-written, bit-flipped or misplaced entry is dropped and counted, never served.

The index. The file is a 64-byte header (magic, version, record size, block_bytes, the count
and xxh3_64 of a *base* section), then the base: live records sorted by key, written at
compaction, then a *tail* of records appended one per admission or drop (a drop is a
tombstone). Each tail record carries its own mixing checksum so a torn last record is
recognised. Loading a cleanly closed index is one read, one xxh3 over the base and a
vectorised sortedness check; lookups go to the sorted base with `np.searchsorted`, and to a
dict for rows added since open. No Python object is created per loaded entry, which is what
keeps a 1M-entry open well under a second (scripts/bench_ssd_index.py).
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from cachefs.source import SourceIdentity

FORMAT_VERSION = 1
FANOUT = 256

MASK64 = (1 << 64) - 1

# Entry header: magic, version, header size, block_bytes, path hash (16 bytes, little endian),
# block index, identity size, mtime_ns, ino, payload length, payload xxh3_64, header xxh3_64.
_ENTRY_MAGIC = b"CFSBLK\x00\x01"
_ENTRY_HEADER = struct.Struct("<8sIIQ16sQqqQQQQ")
ENTRY_HEADER_BYTES = _ENTRY_HEADER.size  # 96

# Index file header: magic, version, record size, block_bytes, base count, base xxh3_64,
# reserved, header xxh3_64.
_INDEX_MAGIC = b"CFSIDX\x00\x01"
_INDEX_HEADER = struct.Struct("<8sIIQQQ16sQ")
INDEX_HEADER_BYTES = _INDEX_HEADER.size  # 64

_RECORD_MAGIC = 0x4346
OP_ADD = 1
OP_DROP = 2
# One index record; the numpy dtype and the struct describe the same 72 bytes.
RECORD_DTYPE = np.dtype([
    ("magic", "<u2"), ("op", "u1"), ("pad", "u1"), ("length", "<u4"),
    ("key_lo", "<u8"), ("key_hi", "<u8"), ("path_lo", "<u8"), ("block", "<u8"),
    ("size", "<i8"), ("mtime_ns", "<i8"), ("ino", "<u8"), ("check", "<u8"),
])
_RECORD = struct.Struct("<HBBIQQQQqqQQ")
RECORD_BYTES = _RECORD.size  # 72
assert RECORD_DTYPE.itemsize == RECORD_BYTES

# The block of the file systems an SSD tier lives on (ext4, xfs): an entry file takes whole
# ones on disk (`disk_bytes`).
DISK_BLOCK_BYTES = 4096


def disk_bytes(payload_bytes):
    """What an entry of `payload_bytes` takes on disk, as `--ssd-size` counts it: its file
    (header and payload, in whole disk blocks) and its index record. Counting payload bytes
    alone, a data set of 300-byte samples took 14 times its budget, and empty files nothing.
    An int, or a numpy array of them."""
    return (-(-(ENTRY_HEADER_BYTES + payload_bytes) // DISK_BLOCK_BYTES) * DISK_BLOCK_BYTES
            + RECORD_BYTES)

# Odd multipliers of the per-record check: XOR over the first eight 64-bit words, each
# multiplied by its constant (a bijection mod 2**64, so any single changed word changes it).
_CHECK_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x27D4EB2F165667C5, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9,
                      0x85EBCA77C2B2AE63, 0xFF51AFD7ED558CCD)
_WORDS = struct.Struct("<8Q")


class Corrupt(Exception):
    """An entry file that does not verify; the message says which check failed."""


class BlockKey:
    """A block key hashed once: the path hash for the header, the entry hash for the name."""

    __slots__ = ("block", "path_hash", "lo", "hi", "name")

    def __init__(self, relpath: bytes, block_index: int):
        self.block = block_index
        self.path_hash = xxhash.xxh3_128_intdigest(relpath)
        entry_hash = xxhash.xxh3_128_intdigest(
            self.path_hash.to_bytes(16, "little") + block_index.to_bytes(8, "little"))
        self.lo = entry_hash & MASK64
        self.hi = entry_hash >> 64
        self.name = f"{entry_hash:032x}"


def entry_name(key_hi: int, key_lo: int) -> str:
    return f"{(key_hi << 64) | key_lo:032x}"


def record_check(words8: tuple[int, ...]) -> int:
    """The per-record check over the first 64 bytes of a record, as eight 64-bit words."""
    check = 0
    for word, mult in zip(words8, _CHECK_MULTIPLIERS, strict=True):
        check ^= (word * mult) & MASK64
    return check


def records_check(records: np.ndarray) -> np.ndarray:
    """`record_check` of every record, vectorised (uint64 arithmetic wraps mod 2**64)."""
    words = records.view("<u8").reshape(len(records), RECORD_BYTES // 8)
    check = np.zeros(len(records), dtype=np.uint64)
    for column, mult in enumerate(_CHECK_MULTIPLIERS):
        check ^= words[:, column] * np.uint64(mult)
    return check


def pack_record(op: int, length: int, key_lo: int, key_hi: int, path_lo: int, block: int,
                identity: SourceIdentity) -> bytes:
    fields = (_RECORD_MAGIC, op, 0, length, key_lo, key_hi, path_lo, block,
              identity.size, identity.mtime_ns, identity.ino)
    body = _RECORD.pack(*fields, 0)
    return body[:64] + record_check(_WORDS.unpack_from(body)).to_bytes(8, "little")


def write_index(path: Path, live: np.ndarray, block_bytes: int) -> None:
    """Write a compacted index (live records only, sorted by key) atomically, fsynced."""
    records = live[np.argsort(live["key_lo"], kind="stable")]  # a copy: the caller's is kept
    records["op"] = OP_ADD
    records["check"] = records_check(records)
    # the ignore: ndarray has the buffer protocol; numpy's stubs declare it for Python 3.12+
    base_hash = (xxhash.xxh3_64_intdigest(records.view(np.uint8))  # type: ignore[arg-type]
                 if len(records) else 0)
    fields = (_INDEX_MAGIC, FORMAT_VERSION, RECORD_BYTES, block_bytes, len(records), base_hash,
              b"\0" * 16)
    head = _INDEX_HEADER.pack(*fields, 0)[:-8]
    head += xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open_private(tmp, "wb") as out:
            out.write(head)
            records.tofile(out)
            out.flush()
            os.fsync(out.fileno())
        os.rename(tmp, path)
    except BaseException:
        # a half-written copy on a full device took its last free bytes from everyone
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_index(path: Path, block_bytes: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """Read an index file: (sorted base, valid tail records, tail intact).

    None if the file is missing or its header or base section is damaged; a damaged tail
    record ends the tail there (`tail intact` False) since a log is only good up to its first
    bad record.
    """
    try:
        with open_for_reading(path) as f:
            head = f.read(INDEX_HEADER_BYTES)
            if len(head) != INDEX_HEADER_BYTES:
                return None
            (magic, version, record_bytes, index_block_bytes, base_count, base_hash, _reserved,
             head_hash) = _INDEX_HEADER.unpack(head)
            if (magic != _INDEX_MAGIC or version != FORMAT_VERSION or record_bytes != RECORD_BYTES
                    or index_block_bytes != block_bytes
                    or xxhash.xxh3_64_intdigest(head[:-8]) != head_hash):
                return None
            base = np.fromfile(f, dtype=RECORD_DTYPE, count=base_count)
            if len(base) != base_count:
                return None
            tail_bytes = np.fromfile(f, dtype=np.uint8)
    except FileNotFoundError:
        return None
    # the ignore: as in write_index
    if base_count and (xxhash.xxh3_64_intdigest(base.view(np.uint8))  # type: ignore[arg-type]
                       != base_hash):
        return None
    if base_count > 1 and not np.all(base["key_lo"][1:] > base["key_lo"][:-1]):
        return None
    whole = len(tail_bytes) // RECORD_BYTES
    tail = tail_bytes[:whole * RECORD_BYTES].view(RECORD_DTYPE)
    good = ((tail["magic"] == _RECORD_MAGIC) & ((tail["op"] == OP_ADD) | (tail["op"] == OP_DROP))
            & (tail["length"] <= block_bytes) & (tail["check"] == records_check(tail)))
    intact = bool(good.all()) and whole * RECORD_BYTES == len(tail_bytes)
    if not good.all():
        tail = tail[:int(np.argmin(good))]
    return base, tail.copy(), intact


def open_for_reading(path: Path):
    """A file of the tier opened to be read, never through a symbolic link (ELOOP: none of
    the tier's files is one, unless someone planted it)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW), "rb")


def open_private(path: Path, mode: str):
    """A file opened for writing, created or truncated, that only its owner may read (mode
    0600 even if it existed: a leftover from a crash keeps the mode it was made with)."""
    # no link followed: the daemon, often root, would truncate and chmod what it points to
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def merge_log(records: np.ndarray) -> np.ndarray:
    """Replay a log: the last record of each key wins; keep the keys whose last op is ADD."""
    if not len(records):
        return records.copy()
    order = np.argsort(records["key_lo"], kind="stable")
    ordered = records[order]
    last = np.ones(len(ordered), dtype=bool)
    last[:-1] = ordered["key_lo"][1:] != ordered["key_lo"][:-1]
    ordered = ordered[last]
    return ordered[ordered["op"] == OP_ADD]


def pack_header(key: BlockKey, block_bytes: int, identity: SourceIdentity, payload_len: int,
                 payload_hash: int) -> bytes:
    fields = (_ENTRY_MAGIC, FORMAT_VERSION, ENTRY_HEADER_BYTES, block_bytes,
              key.path_hash.to_bytes(16, "little"), key.block, identity.size,
              identity.mtime_ns, identity.ino, payload_len, payload_hash)
    head = _ENTRY_HEADER.pack(*fields, 0)[:-8]
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


def unpack_header(head: bytes, block_bytes: int) -> tuple:
    """The header's fields after checking magic, version, block size and its own checksum."""
    if len(head) != ENTRY_HEADER_BYTES:
        raise Corrupt(f"short header ({len(head)} bytes)")
    fields = _ENTRY_HEADER.unpack(head)
    magic, version, header_bytes, entry_block_bytes = fields[:4]
    if magic != _ENTRY_MAGIC or version != FORMAT_VERSION or header_bytes != ENTRY_HEADER_BYTES:
        raise Corrupt("bad magic or version")
    if xxhash.xxh3_64_intdigest(head[:-8]) != fields[-1]:
        raise Corrupt("header checksum mismatch")
    if entry_block_bytes != block_bytes:
        raise Corrupt(f"block size {entry_block_bytes} != {block_bytes}")
    return fields
