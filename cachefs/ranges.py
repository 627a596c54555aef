"""Item tables for packed data sets: the byte-range items of cachefs-order(5), built from files.

A trainer whose samples are ranges of large files publishes an order of items (item_file,
item_offset, item_length; cachefs.order_items): these helpers find the ranges, each for one
file, given the file's index in the manifest the order uses (`file_index`). They read only
what locates the samples (a `.npy` header, tar headers, HDF5 metadata, TFRecord length
fields), never the samples, and return `cachefs.order_items.ItemArrays`, ready for
`cachefs.publish.publish(..., items=...)`, `concat` for several files, or `save_items` for
`cachefs publish --items`.

- `npy_rows`: the rows of a `.npy` (C order): item i is row i, at the header's end plus i times
  the row's bytes.
- `tar_members`: the data of each regular member of a tar archive (as `tarfile` lists it), with
  the members' names; a member of 0 bytes has no range and is left out.
- `hdf5_rows`: a dataset of an HDF5 file (`h5py`, an optional dependency, imported here only):
  contiguous, item i is row i; chunked with chunks of whole rows, item k is chunk k as stored
  (compressed or not), and holds rows k*c..(k+1)*c-1 for c rows per chunk.
- `tfrecord_records` and `tfrecord_index`: the records of a TFRecord file, each its whole frame
  (length, its CRC, the data, the data's CRC), found by walking the length fields or read from
  an index file of `offset size` lines (as DALI's `tfrecord2idx` writes).

Pure Python and numpy; nothing here touches a mount, and `import cachefs.ranges` imports
neither h5py nor pyfuse3.
"""

from __future__ import annotations

import os
import struct
import tarfile
from pathlib import Path

import numpy as np

from cachefs.order_items import ItemArrays

_TFRECORD_HEADER = struct.Struct("<QI")  # length, masked CRC32C of the length
_TFRECORD_FOOTER_BYTES = 4  # masked CRC32C of the data


def _table(file_index: int, offsets, lengths) -> ItemArrays:
    offsets = np.asarray(offsets, np.int64)
    return ItemArrays(np.full(len(offsets), file_index, np.int64), offsets,
                      np.asarray(lengths, np.int64))


def npy_rows(path, file_index: int = 0) -> ItemArrays:
    """Row i of the `.npy` at `path` is item i (a row: everything under one index of its
    first axis). ValueError for a Fortran-ordered array, whose rows are not contiguous."""
    try:
        array = np.load(path, mmap_mode="r")  # maps the rows: reads the header only
    except ValueError as exc:  # an array of Python objects is a pickle, not rows
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(array, np.memmap):
        raise ValueError(f"{path}: not a .npy file")
    shape, dtype, header_bytes = array.shape, array.dtype, int(array.offset)
    if len(shape) > 1 and not array.flags.c_contiguous:
        raise ValueError(f"{path}: a Fortran-ordered array's rows are not contiguous")
    if not shape:
        raise ValueError(f"{path}: a 0-dimensional array has no rows")
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    if not row_bytes:
        raise ValueError(f"{path}: its rows have no bytes")
    rows = shape[0]
    return _table(file_index, header_bytes + np.arange(rows, dtype=np.int64) * row_bytes,
                  np.full(rows, row_bytes))


def tar_members(path, file_index: int = 0) -> tuple[ItemArrays, list[str]]:
    """The data of each regular member of the tar archive (uncompressed) at `path`, and the
    members' names in the same order."""
    offsets, lengths, names = [], [], []
    with tarfile.open(path, "r:") as archive:
        for member in archive:
            if member.isfile() and member.size > 0 and not member.issparse():
                offsets.append(member.offset_data)
                lengths.append(member.size)
                names.append(member.name)
    return _table(file_index, offsets, lengths), names


def hdf5_rows(path, dataset: str, file_index: int = 0) -> tuple[ItemArrays, int]:
    """The items of an HDF5 dataset, and the rows each holds (module docstring). Needs h5py.
    ValueError for a dataset whose bytes are not in the file as ranges (compact, external,
    not yet written) or whose chunks split rows."""
    import h5py  # optional: only this helper needs it

    with h5py.File(path, "r") as hdf:
        data = hdf[dataset]
        if not data.shape:
            raise ValueError(f"{path}:{dataset} is a scalar, it has no rows")
        rows = data.shape[0]
        row_bytes = int(np.prod(data.shape[1:], dtype=np.int64)) * data.dtype.itemsize
        if data.chunks is None:
            offset = data.id.get_offset()
            if offset is None or data.external:
                raise ValueError(f"{path}:{dataset} is not stored in the file as one range "
                                 f"(compact, external, or not written yet)")
            return _table(file_index, offset + np.arange(rows, dtype=np.int64) * row_bytes,
                          np.full(rows, row_bytes)), 1
        per_chunk = data.chunks[0]
        if tuple(data.chunks[1:]) != tuple(data.shape[1:]):
            raise ValueError(f"{path}:{dataset}: chunks {data.chunks} split its rows "
                             f"{data.shape[1:]}; rechunk with whole rows")
        offsets, lengths = [], []
        origin = (0,) * (len(data.shape) - 1)
        for first_row in range(0, rows, per_chunk):
            info = data.id.get_chunk_info_by_coord((first_row, *origin))
            if info.byte_offset is None:
                raise ValueError(f"{path}:{dataset}: chunk of row {first_row} not written")
            offsets.append(info.byte_offset)
            lengths.append(info.size)
    return _table(file_index, offsets, lengths), per_chunk


def tfrecord_records(path, file_index: int = 0) -> ItemArrays:
    """Each record of the TFRecord file at `path`, whole (its frame), found by reading the
    length fields only. ValueError if the file ends inside a record."""
    offsets, lengths = [], []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        position = 0
        while position < size:
            header = f.read(_TFRECORD_HEADER.size)
            if len(header) < _TFRECORD_HEADER.size:
                raise ValueError(f"{path}: truncated record header at byte {position}")
            length, _ = _TFRECORD_HEADER.unpack(header)
            frame = _TFRECORD_HEADER.size + length + _TFRECORD_FOOTER_BYTES
            if position + frame > size:
                raise ValueError(f"{path}: the record at byte {position} ends past the file")
            offsets.append(position)
            lengths.append(frame)
            position += frame
            f.seek(position)
    return _table(file_index, offsets, lengths)


def tfrecord_index(index_path, file_index: int = 0) -> ItemArrays:
    """The records listed by a TFRecord index file: one `offset size` line per record (DALI's
    `tfrecord2idx` format). ValueError naming a bad line."""
    offsets, lengths = [], []
    for number, line in enumerate(Path(index_path).read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            offset, length = (int(field) for field in fields)
        except ValueError:
            raise ValueError(f"{index_path}: line {number}: not 'offset size': {line!r}") \
                from None
        offsets.append(offset)
        lengths.append(length)
    return _table(file_index, offsets, lengths)


def concat(tables: list[ItemArrays]) -> ItemArrays:
    """Several files' tables as one (items numbered in the order given)."""
    if not tables:
        return _table(0, [], [])
    return ItemArrays(*(np.concatenate([np.asarray(getattr(table, field), np.int64)
                                        for table in tables])
                        for field in ("file", "offset", "length")))


def save_items(path, items: ItemArrays) -> None:
    """Write a table as `cachefs publish --items` reads it: an .npz of the three keys."""
    np.savez(path, item_file=np.asarray(items.file, np.int64),
             item_offset=np.asarray(items.offset, np.int64),
             item_length=np.asarray(items.length, np.int64))
