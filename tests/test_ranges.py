"""Item tables built from packed files (cachefs.ranges): each range holds exactly its sample."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from cachefs import ranges
from cachefs.order import check_arrays
from cachefs.publish import read_items_file


def bytes_at(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_importing_it_imports_no_h5py():
    code = "import sys, cachefs.ranges; print('h5py' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, check=True)
    assert done.stdout.strip() == "False"


def test_npy_rows_are_the_rows(tmp_path):
    array = np.arange(7 * 3 * 5, dtype=np.float32).reshape(7, 3, 5)
    np.save(tmp_path / "a.npy", array)
    items = ranges.npy_rows(tmp_path / "a.npy", file_index=4)
    assert items.file.tolist() == [4] * 7
    assert items.length.tolist() == [60] * 7
    for row in range(7):
        assert bytes_at(tmp_path / "a.npy", items.offset[row], 60) == array[row].tobytes()
    check_arrays(0, np.arange(7), items=items)  # a valid table
    np.save(tmp_path / "f.npy", np.asfortranarray(array))
    with pytest.raises(ValueError, match="Fortran"):
        ranges.npy_rows(tmp_path / "f.npy")
    np.save(tmp_path / "o.npy", np.array([{}, []], dtype=object))
    with pytest.raises(ValueError, match="o.npy"):
        ranges.npy_rows(tmp_path / "o.npy")


def test_tar_members_are_their_data(tmp_path):
    contents = {"a/1.jpg": b"x" * 700, "a/empty": b"", "b/2.cls": b"label 3\n",
                "c/3.jpg": bytes(range(256)) * 40}
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as archive:
        archive.addfile(tarfile.TarInfo("a"), None)  # a member that is no file
        for name, data in contents.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    items, names = ranges.tar_members(path, file_index=2)
    assert names == ["a/1.jpg", "b/2.cls", "c/3.jpg"]  # the empty member has no range
    for offset, length, name in zip(items.offset, items.length, names, strict=True):
        assert bytes_at(path, offset, length) == contents[name]
    assert set(items.file.tolist()) == {2}
    check_arrays(0, [2, 0, 1], items=items)


def test_hdf5_rows_contiguous_and_chunked(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "d.h5"
    rows = np.random.default_rng(0).integers(0, 1000, (50, 4, 6)).astype(np.int32)
    with h5py.File(path, "w") as hdf:
        hdf.create_dataset("flat", data=rows)
        hdf.create_dataset("chunked", data=rows, chunks=(5, 4, 6), compression="gzip")
        hdf.create_dataset("split", data=rows, chunks=(5, 2, 6))
    items, per_item = ranges.hdf5_rows(path, "flat", file_index=1)
    assert per_item == 1 and len(items.offset) == 50 and set(items.file.tolist()) == {1}
    for row in range(50):
        assert bytes_at(path, items.offset[row], items.length[row]) == rows[row].tobytes()
    items, per_item = ranges.hdf5_rows(path, "chunked")
    assert per_item == 5 and len(items.offset) == 10
    with h5py.File(path, "r") as hdf:
        for chunk in range(10):
            _, stored = hdf["chunked"].id.read_direct_chunk((chunk * 5, 0, 0))
            assert bytes_at(path, items.offset[chunk], items.length[chunk]) == stored
    check_arrays(0, np.arange(10), items=items)
    with pytest.raises(ValueError, match="split its rows"):
        ranges.hdf5_rows(path, "split")


def write_tfrecord(path: Path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for record in records:
            f.write(struct.pack("<QI", len(record), 0) + record + b"\0" * 4)


def test_tfrecord_records_and_index(tmp_path):
    records = [b"a" * 10, b"", b"c" * 3000]
    path = tmp_path / "t.tfrecord"
    write_tfrecord(path, records)
    items = ranges.tfrecord_records(path, file_index=3)
    assert items.offset.tolist() == [0, 26, 42]
    assert items.length.tolist() == [26, 16, 3016]
    for offset, length, record in zip(items.offset, items.length, records, strict=True):
        assert bytes_at(path, offset + 12, length - 16) == record
    index = tmp_path / "t.idx"
    index.write_text("0 26\n26 16\n\n42 3016\n")
    indexed = ranges.tfrecord_index(index, file_index=3)
    assert [a.tolist() for a in indexed] == [a.tolist() for a in items]
    index.write_text("0 26\n26\n")
    with pytest.raises(ValueError, match="line 2"):
        ranges.tfrecord_index(index)
    with open(path, "ab") as f:
        f.write(struct.pack("<QI", 100, 0) + b"short")
    with pytest.raises(ValueError, match="ends past the file"):
        ranges.tfrecord_records(path)


def test_tables_of_several_files_concatenate_and_save_for_the_cli(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 8), np.uint8))
    np.save(tmp_path / "b.npy", np.zeros((2, 16), np.uint8))
    table = ranges.concat([ranges.npy_rows(tmp_path / "a.npy", 0),
                           ranges.npy_rows(tmp_path / "b.npy", 1)])
    assert table.file.tolist() == [0, 0, 0, 1, 1]
    assert table.length.tolist() == [8, 8, 8, 16, 16]
    ranges.save_items(tmp_path / "items.npz", table)
    again = read_items_file(tmp_path / "items.npz")
    assert [a.tolist() for a in again] == [a.tolist() for a in table]
    assert ranges.concat([]).item_count == 0
