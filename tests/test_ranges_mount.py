"""Samples inside large files on a real mount: a `.npy` read through `numpy.memmap` in the
published order of its rows (byte-range items), what the daemon counts, reads that span cached
and uncached bytes, and the tables of cachefs.ranges for a tar shard and an HDF5 dataset."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from cachefs import ranges
from cachefs.order import permutation
from cachefs.order_items import ItemArrays
from cachefs.publish import publish
from cachefs.range_cache import sentinel_page
from conftest import epoch_record, wait_for

ROWS = 200
ROW_BYTES = 50_000  # 12.2 pages: rows start anywhere in a page
PAGE = os.sysconf("SC_PAGE_SIZE")
FILES = ["rows.npy"]  # the manifest the items index


@pytest.fixture
def npy(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    rows = np.random.default_rng(7).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    np.save(src / "rows.npy", rows)
    (src / "other.bin").write_bytes(b"x" * 5000)  # a file that holds no items
    return src / "rows.npy"


def row_items(path: Path) -> ItemArrays:
    """Row i of the .npy is item i (published with files=["rows.npy"]: its file index is 0)."""
    header = np.load(path, mmap_mode="r").offset
    return ItemArrays(np.zeros(ROWS, np.int64),
                      header + np.arange(ROWS, dtype=np.int64) * ROW_BYTES,
                      np.full(ROWS, ROW_BYTES, np.int64))


def consumed(mount) -> int:
    return mount.stats()["order"]["consumed"]


@pytest.mark.parametrize("data_plane", ["auto", "daemon"])
def test_memmap_reader_in_the_published_order(npy, mounter, data_plane):
    """Three epochs: the bytes are the source's, every row counts as one read, and from the
    second epoch on RAM serves the head of each epoch (a quarter of the rows fit)."""
    ram_bytes = ROWS * ROW_BYTES // 4
    mount = mounter(npy.parent, "--ram-cache", ram_bytes, "--data-plane", data_plane)
    items = row_items(npy)
    direct = np.load(npy)
    for epoch in range(3):
        order = permutation(ROWS, 0, epoch)
        publish(mount.mountpoint, epoch, order, next=permutation(ROWS, 0, epoch + 1),
                items=items, files=FILES)
        if epoch == 0:  # opened once the order is in force (the kernel's read-ahead is off)
            rows = np.load(mount.mountpoint / "rows.npy", mmap_mode="r")
        for index in order.tolist():
            assert np.array_equal(rows[index], direct[index]), (epoch, index)
        record = epoch_record(mount, epoch, reads=ROWS)
        assert record["reads"] == ROWS and record["bytes_served"] == ROWS * ROW_BYTES
        classes = sum(record[key] for key in ("hits_ram", "hits_ssd", "prefetched", "misses"))
        assert classes == ROWS
        if epoch:
            # C/N is 0.25 less the bookkeeping per entry: the head of the epoch, retained
            assert record["hits_ram"] >= 0.2 * ROWS, record
            # and the rest read ahead of the reader, barely a miss
            assert record["prefetched"] + record["hits_ram"] >= 0.9 * ROWS, record
        # the daemon read each row about once per epoch it was not kept for (spans of whole
        # pages: a few KB of its neighbours' bytes each)
        assert record["backend_bytes"] <= (ROWS - record["hits_ram"]) * (ROW_BYTES + 3 * PAGE)
    stats = mount.stats()
    assert stats["ram"]["bytes"] <= ram_bytes
    if stats["kernel"] is not None:
        assert stats["prefetch"]["ranges"]["pushed_items"] >= ROWS
    assert (mount.mountpoint / "other.bin").read_bytes() == b"x" * 5000
    del rows


def test_an_item_is_consumed_when_its_own_last_page_is_read(npy, mounter):
    """Reading the first half of a row, or a neighbouring row whose last page it shares,
    consumes nothing of it; reading its last whole page does."""
    mount = mounter(npy.parent, "--ram-cache", ROWS * ROW_BYTES)
    items = row_items(npy)
    order = np.arange(ROWS)[::-1].copy()  # the last row first: its neighbour is row ROWS - 2
    publish(mount.mountpoint, 0, order, items=items, files=FILES)
    rows = np.load(mount.mountpoint / "rows.npy", mmap_mode="r")
    flat = np.load(mount.mountpoint / "rows.npy", mmap_mode="r").reshape(-1)
    first = order[0]
    offset, length = int(items.offset[first]), ROW_BYTES
    sentinel_at = sentinel_page(offset, length) * PAGE - offset  # within the row
    assert 0 < sentinel_at < length - PAGE
    assert flat[first * ROW_BYTES:first * ROW_BYTES + sentinel_at].sum() >= 0
    time.sleep(0.2)
    assert consumed(mount) == 0
    # the next row in the order starts in the page where this one ends: read it first
    second = order[1]
    assert np.array_equal(rows[second], np.load(npy, mmap_mode="r")[second])
    wait_for(lambda: consumed(mount) == 1)  # the second row, not the first
    assert mount.stats()["order"]["cursor"] == 0
    assert np.array_equal(rows[first], np.load(npy, mmap_mode="r")[first])
    wait_for(lambda: consumed(mount) == 2)
    assert mount.stats()["order"]["cursor"] == 2
    del rows, flat


def test_files_read_under_a_byte_range_order_are_consumed_under_the_next_file_order(npy,
                                                                                     mounter):
    """Both orders index the source's own manifest (no `files`): an item number a file was
    given under the byte-range order (none: -1) was kept for the file order after it, whose
    reads then consumed nothing and whose epoch never ended."""
    mount = mounter(npy.parent, "--ram-cache", ROWS * ROW_BYTES)
    header = np.load(npy, mmap_mode="r").offset
    rows_file = 1  # other.bin, rows.npy: the source's files, sorted
    items = ItemArrays(np.full(ROWS, rows_file, np.int64),
                       header + np.arange(ROWS, dtype=np.int64) * ROW_BYTES,
                       np.full(ROWS, ROW_BYTES, np.int64))
    publish(mount.mountpoint, 0, permutation(ROWS, 0, 0), items=items)
    for name in ("other.bin", "rows.npy"):
        with open(mount.mountpoint / name, "rb") as reader:
            reader.read(100)
    time.sleep(0.2)  # the closes are accounted for
    publish(mount.mountpoint, 1, np.array([1, 0]))
    for name in ("rows.npy", "other.bin"):
        assert (mount.mountpoint / name).read_bytes() == (npy.parent / name).read_bytes()
    wait_for(lambda: consumed(mount) == 2)


def test_the_wait_of_an_open_of_a_file_of_items_counts_as_a_stall(npy, mounter):
    """The items of a file count as they are read, each with its own wait; the wait of the
    file's open (its check of the source: `--metadata-ttl 0` checks at every open) was no
    item's, and `cachefs stats` left it out: a reader waited, and no stall said so."""
    mount = mounter(npy.parent, "--ram-cache", ROWS * ROW_BYTES, "--data-plane", "keep-cache",
                    "--metadata-ttl", 0, "--source-delay-ms", 300)
    publish(mount.mountpoint, 0, permutation(ROWS, 0, 0), items=row_items(npy), files=FILES)
    time.sleep(1.0)  # the read-ahead's first reads of rows (each 0.3 s late) are done
    started_s = time.monotonic()
    fd = os.open(mount.mountpoint / "rows.npy", os.O_RDONLY)
    opened_s = time.monotonic() - started_s
    os.close(fd)  # nothing read: no item counts, nor its wait
    assert opened_s >= 0.3
    wait_for(lambda: epoch_record(mount, 0)["stall_s"] >= 0.3)
    assert epoch_record(mount, 0)["reads"] == 0


@pytest.mark.parametrize("data_plane", ["auto", "daemon"])
def test_reads_spanning_cached_and_uncached_bytes(npy, mounter, data_plane):
    """preads at random offsets and sizes, over the header, row boundaries, rows in RAM and
    rows not, return the source's bytes."""
    mount = mounter(npy.parent, "--ram-cache", ROWS * ROW_BYTES // 8,
                    "--data-plane", data_plane)
    items = row_items(npy)
    publish(mount.mountpoint, 0, permutation(ROWS, 1, 0), items=items, files=FILES)
    expected = npy.read_bytes()
    rng = np.random.default_rng(3)
    with open(mount.mountpoint / "rows.npy", "rb", buffering=0) as f:
        # the first rows of the order are read ahead; the others are not
        time.sleep(0.3)
        for _ in range(300):
            offset = int(rng.integers(0, len(expected)))
            size = int(rng.choice([1, 100, PAGE, 3 * PAGE + 7, ROW_BYTES, 3 * ROW_BYTES]))
            assert os.pread(f.fileno(), size, offset) == expected[offset:offset + size], \
                (offset, size)
        assert os.pread(f.fileno(), 200, 0) == expected[:200]  # the header: no item
        assert os.pread(f.fileno(), 100, len(expected) - 50) == expected[-50:]


def test_a_tar_shard_read_member_by_member_in_the_order(tmp_path, mounter):
    """A WebDataset-like shard: its members' data are the items (cachefs.ranges); tarfile on
    the mount reads them in the published order, headers included (bytes of no item)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    contents = [rng.integers(0, 256, int(rng.integers(20_000, 60_000)), np.uint8).tobytes()
                for _ in range(40)]
    with tarfile.open(src / "shard.tar", "w") as archive:
        for index, data in enumerate(contents):
            info = tarfile.TarInfo(f"sample{index:03d}.bin")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    items, names = ranges.tar_members(src / "shard.tar")
    mount = mounter(src, "--ram-cache", sum(map(len, contents)) // 4)
    order = permutation(len(names), 0, 0)
    publish(mount.mountpoint, 0, order, next=permutation(len(names), 0, 1), items=items,
            files=["shard.tar"])
    with tarfile.open(mount.mountpoint / "shard.tar") as archive:
        members = {member.name: member for member in archive.getmembers()}
        for index in order.tolist():
            data = archive.extractfile(members[names[index]]).read()
            assert data == contents[int(names[index][6:9])], names[index]
    record = epoch_record(mount, 0, reads=len(names))
    assert record["reads"] == len(names)
    assert record["bytes_served"] == sum(map(len, contents))


def test_an_hdf5_dataset_read_row_by_row_in_the_order(tmp_path, mounter):
    """h5py on the mount reads the rows of a contiguous dataset in the published order; its
    metadata are bytes of no item."""
    h5py = pytest.importorskip("h5py")
    src = tmp_path / "src"
    src.mkdir()
    # rows larger than HDF5's 64 KiB sieve buffer, which would read the next rows along
    rows = np.random.default_rng(9).integers(0, 2**31, (60, 20_000), dtype=np.int32)
    with h5py.File(src / "data.h5", "w") as hdf:
        hdf.create_dataset("x", data=rows)
    items, per_item = ranges.hdf5_rows(src / "data.h5", "x")
    assert per_item == 1
    mount = mounter(src, "--ram-cache", rows.nbytes // 4)
    for epoch in range(2):
        order = permutation(len(rows), 0, epoch)
        publish(mount.mountpoint, epoch, order, next=permutation(len(rows), 0, epoch + 1),
                items=items, files=["data.h5"])
        if epoch == 0:
            hdf = h5py.File(mount.mountpoint / "data.h5", "r")
        for index in order.tolist():
            assert np.array_equal(hdf["x"][index], rows[index]), (epoch, index)
        record = epoch_record(mount, epoch, reads=len(rows))
        assert record["reads"] == len(rows)
        if epoch:
            assert record["hits_ram"] >= 0.15 * len(rows), record
    hdf.close()


def test_a_dataloader_over_rows_with_the_cachefs_sampler(npy, mounter):
    """A torch dataset whose samples are rows of one .npy: CachefsSampler publishes the rows'
    item table with each epoch's order, and the mount counts rows, with the next epoch's head
    in RAM."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    from cachefs.torch import CachefsSampler

    mount = mounter(npy.parent, "--ram-cache", ROWS * ROW_BYTES // 4)
    direct = np.load(npy)

    class Rows(Dataset):
        def __init__(self):
            self.rows = None  # opened once the order is in force (the kernel's read-ahead off)

        def __len__(self):
            return ROWS

        def __getitem__(self, index):
            if self.rows is None:
                self.rows = np.load(mount.mountpoint / "rows.npy", mmap_mode="r")
            return index, torch.from_numpy(np.array(self.rows[index]))

    sampler = CachefsSampler(Rows(), mount.mountpoint, items=row_items(npy), files=FILES)
    with pytest.raises(ValueError, match="byte-range items"):
        CachefsSampler(ROWS + 1, mount.mountpoint, items=row_items(npy), files=FILES)
    dataset = Rows()
    loader = DataLoader(dataset, batch_size=10, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for indices, rows in loader:
            for index, row in zip(indices.tolist(), rows, strict=True):
                assert np.array_equal(row.numpy(), direct[index]), (epoch, index)
        record = epoch_record(mount, epoch, reads=ROWS)
        assert record["reads"] == ROWS and record["bytes_served"] == ROWS * ROW_BYTES
    assert record["hits_ram"] >= 0.2 * ROWS, record  # epoch 1: the retained head
    assert mount.stats()["order"]["items"] == ROWS
