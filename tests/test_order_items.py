"""Byte-range items in the order file: the three keys, their validation, writing and loading,
and a real mount that takes a good table and rejects a bad one, keeping the previous order."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cachefs.errors import OrderError
from cachefs.manifest import Manifest
from cachefs.order import ORDER_VERSION, check_arrays, load_order, write_order_file
from cachefs.order_items import MAX_ITEM_BYTES, ItemArrays, Items, check_items
from cachefs.publish import publish, read_items_file
from conftest import run_cachefs, wait_for

FILES = ["a.bin", "b.bin", "c.bin"]
SIZES = {0: 1000, 1: 50, 2: 4096}


@pytest.fixture
def manifest() -> Manifest:
    return Manifest.from_paths(FILES)


def sizes_of(manifest, indices):
    return np.array([SIZES[int(i)] for i in indices], np.int64)


def table(**changes) -> dict:
    """A good table: 4 items in a.bin, 1 in b.bin, 1 in c.bin; `changes` replace arrays."""
    arrays = {"item_file": np.array([0, 0, 0, 0, 1, 2]),
              "item_offset": np.array([0, 100, 300, 600, 0, 96]),
              "item_length": np.array([100, 200, 300, 400, 50, 4000])}
    arrays.update(changes)
    return arrays


def save(path: Path, **arrays) -> Path:
    arrays.setdefault("version", np.int64(ORDER_VERSION))
    arrays.setdefault("epoch", np.int64(0))
    np.savez(path, **arrays)
    return path


def rejection(path: Path, manifest) -> str:
    with pytest.raises(OrderError) as info:
        load_order(path, manifest, sizes_of)
    return str(info.value)


def test_a_table_round_trips_and_current_indexes_items(tmp_path, manifest):
    path = tmp_path / "order.npz"
    items = ItemArrays(*table().values())
    write_order_file(path, epoch=2, current=[5, 4, 3, 2, 1, 0], next=np.arange(6),
                     files=FILES, items=items)
    with np.load(path) as npz:
        assert sorted(npz.files) == sorted(["version", "epoch", "current", "next", "files",
                                            "item_file", "item_offset", "item_length"])
        assert npz["item_offset"].dtype == np.int64
    order = load_order(path, manifest, sizes_of)
    assert order.item_count == 6 and len(order.manifest) == 3
    assert order.current.tolist() == [5, 4, 3, 2, 1, 0]
    assert order.items.offset.tolist() == [0, 100, 300, 600, 0, 96]
    assert order.status()["items"] == 6


def test_without_the_keys_an_order_means_what_it_meant(tmp_path, manifest):
    order = load_order(save(tmp_path / "o.npz", current=np.array([2, 0, 1])), manifest)
    assert order.items is None and order.item_count == 3
    assert order.status()["items"] is None


def test_the_per_file_index_finds_overlapping_items():
    items = check_items(*table().values())
    assert items.in_file(0).tolist() == [0, 1, 2, 3]
    assert items.in_file(7).tolist() == []
    assert items.overlapping(0, 0, 1).tolist() == [0]
    assert items.overlapping(0, 99, 101).tolist() == [0, 1]
    assert items.overlapping(0, 300, 600).tolist() == [2]  # the gap 600..600 is none
    assert items.overlapping(0, 1000, 2000).tolist() == []
    assert items.overlapping(2, 0, 96).tolist() == []  # before the item: a gap
    assert items.overlapping(2, 0, 4096).tolist() == [5]
    unsorted = check_items([1, 0, 0], [10, 500, 0], [5, 10, 20])
    assert unsorted.in_file(0).tolist() == [2, 1]


@pytest.mark.parametrize("changes, message", [
    ({"item_length": None}, "item_file, item_offset given without item_length"),
    ({"item_offset": np.array([0, 100, 300])}, "must have one length, got 6, 3 and 6"),
    ({"item_file": np.array([0, 0, 0, 0, 3, 2])}, "item_file[4] = 3 is out of range"),
    ({"item_file": np.array([0, 0, -1, 0, 1, 2])}, "item_file[2] = -1 is negative"),
    ({"item_offset": np.array([0, 100, -5, 600, 0, 96])}, "item_offset[2] = -5 is negative"),
    ({"item_length": np.array([100, 0, 300, 400, 50, 4000])}, "item_length[1] = 0"),
    ({"item_length": np.array([100, 200, 300, MAX_ITEM_BYTES + 1, 50, 4000])},
     "over 1073741824 bytes"),
    ({"item_length": np.array([101, 200, 300, 400, 50, 4000])},
     "items 0 and 1 overlap in file 0"),
    ({"item_length": np.array([100.0, 200, 300, 400, 50, 4000])}, "integer array"),
    ({"item_length": np.array([100, 200, 300, 401, 50, 4000])},
     "item 3 (bytes 600+401) ends past the end of 'a.bin', which has 1000 bytes"),
    ({"item_offset": np.array([0, 100, 300, 600, 1, 96])}, "ends past the end of 'b.bin'"),
])
def test_a_bad_table_is_rejected_naming_the_problem(tmp_path, manifest, changes, message):
    arrays = {key: value for key, value in table(**changes).items() if value is not None}
    path = save(tmp_path / "o.npz", current=np.arange(6), files=np.array(FILES), **arrays)
    assert message in rejection(path, manifest)


def test_current_and_next_index_the_items_not_the_files(tmp_path, manifest):
    path = save(tmp_path / "o.npz", current=np.array([0, 1, 6]), **table())
    assert "current[2] = 6 is out of range: the item table has 6 items" in \
        rejection(path, manifest)
    path = save(tmp_path / "o.npz", current=np.array([0, 1, 1]), **table())
    assert "duplicate index 1" in rejection(path, manifest)
    # without `files`, item_file indexes the source's listing
    path = save(tmp_path / "o.npz", current=np.arange(6),
                **table(item_file=np.array([0, 0, 0, 0, 1, 5])))
    assert "item_file[5] = 5 is out of range: the manifest has 3 files" in \
        rejection(path, manifest)


def test_writers_validate_before_writing(tmp_path):
    path = tmp_path / "order.npz"
    with pytest.raises(OrderError, match="overlap"):
        write_order_file(path, epoch=0, current=[0, 1], items=([0, 0], [0, 5], [10, 10]))
    assert not path.exists()
    checked = check_arrays(0, [1, 0], items=([0, 0], [0, 10], [10, 10]))
    assert isinstance(checked.items, Items) and checked.current.tolist() == [1, 0]


def test_items_files_read_as_npz_or_text(tmp_path):
    npz = tmp_path / "items.npz"
    np.savez(npz, **table())
    assert [a.tolist() for a in read_items_file(npz)] == [list(a) for a in table().values()]
    text = tmp_path / "items.txt"
    text.write_text("0 0 100\n\n0 100 200\n")
    assert [a.tolist() for a in read_items_file(text)] == [[0, 0], [0, 100], [100, 200]]
    text.write_text("0 0 100\n0 100\n")
    with pytest.raises(OrderError, match="line 2: not three 64-bit integers"):
        read_items_file(text)
    np.savez(npz, item_file=[0])
    with pytest.raises(OrderError, match="no item_offset, item_length"):
        read_items_file(npz)


# -- a real mount --------------------------------------------------------------------------------

@pytest.fixture
def packed(tmp_path) -> Path:
    """Two packed files of 100 fixed-size records each, and a small file without items."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for name in ("p0.bin", "p1.bin"):
        (src / name).write_bytes(rng.integers(0, 256, 100 * 3000, np.uint8).tobytes())
    (src / "z.txt").write_bytes(b"not packed")
    return src


def packed_items(records: int = 100, record_bytes: int = 3000) -> ItemArrays:
    file = np.repeat([0, 1], records)
    offset = np.tile(np.arange(records) * record_bytes, 2)
    return ItemArrays(file, offset, np.full(2 * records, record_bytes))


def test_a_mount_takes_items_and_rejects_a_bad_table_keeping_the_previous_order(
        packed, mounter, tmp_path):
    mount = mounter(packed)
    items = packed_items()
    status = publish(mount.mountpoint, 1, np.arange(200)[::-1], next=np.arange(200),
                     items=items)
    assert (status["epoch"], status["length"], status["items"]) == (1, 200, 200)
    # a trainer writing the keys directly: item 199 reaches one byte past the end of p1.bin
    bad = tmp_path / "bad.npz"
    np.savez(bad, version=1, epoch=2, current=np.arange(200), item_file=items.file,
             item_offset=items.offset, item_length=np.r_[items.length[:-1], 3001])
    os.replace(bad, mount.order_file)
    reason = wait_for(lambda: mount.stats()["last_rejection"])["reason"]
    assert "item 199 (bytes 297000+3001) ends past the end of 'p1.bin', which has 300000 " \
           "bytes" in reason
    stats = mount.stats()
    assert (stats["order"]["epoch"], stats["order"]["items"]) == (1, 200)
    for name in ("p0.bin", "p1.bin", "z.txt"):
        assert (mount.mountpoint / name).read_bytes() == (packed / name).read_bytes()


def test_the_cli_publishes_items_from_a_file(packed, mounter, tmp_path):
    mount = mounter(packed)
    items_file = tmp_path / "items.txt"
    items = packed_items(records=10, record_bytes=30000)
    items_file.write_text("".join(f"{f} {o} {n}\n" for f, o, n in zip(*items, strict=True)))
    done = run_cachefs("publish", mount.mountpoint, "--epoch", 0, "--seed", 3,
                       "--items", items_file)
    assert done.returncode == 0, done.stderr
    assert "epoch 0: 20 of 20 items accepted" in done.stdout
    assert mount.stats()["order"]["items"] == 20
    items_file.write_text("0 0 300001\n")
    done = run_cachefs("publish", mount.mountpoint, "--epoch", 1, "--current",
                       _write(tmp_path / "cur.txt", "0\n"), "--items", items_file)
    assert done.returncode == 1 and "ends past the end of 'p0.bin'" in done.stderr
    assert mount.stats()["order"]["epoch"] == 0


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
