"""The order file: format, validation messages, rank slicing, atomic writes, publish.

Pure tests: no FUSE. `publish` is tested against a fake daemon that answers the two xattrs
the real one serves (see `FakeDaemon`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio

from cachefs import manifest as manifest_mod
from cachefs import publish as publish_mod
from cachefs.errors import OrderError
from cachefs.manifest import Manifest, scan_source
from cachefs.mountinfo import CACHEFS_FSTYPE, MountInfo
from cachefs.order import (
    ORDER_VERSION,
    FileIdentity,
    load_order,
    permutation,
    rank_slice,
    validate_arrays,
    write_order_file,
)
from cachefs.order_watch import OrderWatcher
from cachefs.publish import publish, read_files_list, read_index_file, source_file_count
from conftest import release_fifo_readers

FILES = [f"train/c{i % 3}/img_{i:03d}.jpg" for i in range(12)]


@pytest.fixture
def source_manifest() -> Manifest:
    return Manifest.from_paths(sorted(FILES, key=os.fsencode))


def save_npz(path: Path, **arrays) -> Path:
    """Write an order file by hand, as a framework without cachefs would."""
    arrays.setdefault("version", np.int64(ORDER_VERSION))
    np.savez(path, **arrays)
    return path


def rejection(path: Path, manifest) -> str:
    with pytest.raises(OrderError) as info:
        load_order(path, manifest)
    return str(info.value)


def test_importable_without_fuse_torch_or_trio():
    code = ("import sys, cachefs.order; "
            "print(sorted(m for m in ('pyfuse3', 'torch', 'trio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent, check=True)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# Manifest and scanning


def test_manifest_keeps_order_and_finds_paths():
    manifest = Manifest.from_paths(["b.jpg", "a.jpg", "dir/ü.jpg", b"raw\xff.jpg"])
    assert manifest.paths.dtype.kind == "S"
    assert len(manifest) == 4
    assert manifest.path(0) == b"b.jpg"
    assert manifest.index_of(b"a.jpg") == 1
    assert manifest.index_of("dir/ü.jpg") == 2
    assert manifest.index_of(b"raw\xff.jpg") == 3
    assert manifest.index_of(b"missing.jpg") == -1
    assert manifest.index_of(b"a.jpg/longer/than/any/path/in/the/manifest") == -1
    with pytest.raises(IndexError):
        manifest.path(4)


def test_one_path_hashes_as_the_vectorised_hash_does():
    """index_of hashes one path in Python, the table hashes all with numpy: they must agree
    for every length (a word boundary, a zero byte inside a path) or lookups miss."""
    from cachefs.manifest import _path_hash_one, _path_hashes

    rng = np.random.default_rng(5)
    paths = [bytes(rng.integers(1, 256, size=length, dtype=np.uint8))
             for length in range(1, 70) for _ in range(3)]
    paths += [b"a\0b", b"x" * 8, b"x" * 16, "dir/ü.jpg".encode()]
    hashes = _path_hashes(np.array(paths, dtype="S"))
    assert [_path_hash_one(path) for path in paths] == hashes.tolist()


def test_index_left_finds_what_searchsorted_finds():
    from cachefs.sorted_arrays import index_left

    array = np.array([2, 2, 5, 9, 9, 9, 14], np.int64)
    for value in range(-1, 17):
        assert index_left(array, value) == int(array.searchsorted(value)), value
        assert index_left(array, value, 3) == max(3, int(array.searchsorted(value))), value
    assert index_left(np.zeros(0, np.int64), 4) == 0


def test_manifest_from_unicode_and_bytes_arrays_agree():
    paths = ["x/1.png", "x/22.png", "y/333.png"]
    from_u = Manifest.from_paths(np.array(paths))
    from_s = Manifest.from_paths(np.array(paths, dtype="S"))
    assert from_u.paths.tolist() == from_s.paths.tolist() == [p.encode() for p in paths]


def test_lookup_between_manifests_of_different_widths():
    source = Manifest.from_paths([f"d/{i}.jpg" for i in range(1000)])
    query = Manifest.from_paths(np.array(["d/999.jpg", "d/0.jpg", "nope", "d/5.jpg"], dtype="S40"))
    assert source.lookup(query).tolist() == [999, 0, -1, 5]


def test_hash_collisions_cost_time_but_never_a_wrong_answer(monkeypatch, tmp_path):
    """With every path hashing alike, lookups, index_of and duplicate checks stay right."""
    monkeypatch.setattr(manifest_mod, "_path_hashes",
                        lambda paths: np.full(len(paths), 7, dtype=np.uint64))
    monkeypatch.setattr(manifest_mod, "_path_hash_one", lambda path: 7)
    source = Manifest.from_paths(FILES)
    assert [source.index_of(p) for p in FILES] == list(range(12))
    assert source.index_of("train/c0/none.jpg") == -1
    query = Manifest.from_paths([FILES[5], "nope", FILES[0]])
    assert source.lookup(query).tolist() == [5, -1, 0]
    with pytest.raises(OrderError, match=f"duplicate path {FILES[2]!r} at positions 2 and 4"):
        validate_arrays(0, [0], files=[FILES[0], FILES[1], FILES[2], FILES[3], FILES[2]])
    validate_arrays(0, [0], files=FILES)


def test_scan_source_lists_regular_files_by_path_bytes_without_symlinks(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.jpg").write_bytes(b"1")
    (tmp_path / "a.txt").write_bytes(b"2")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"3")
    (tmp_path / "link.jpg").symlink_to(tmp_path / "a.txt")
    (tmp_path / "linkdir").symlink_to(tmp_path / "b")
    (tmp_path / "empty").mkdir()
    manifest = scan_source(tmp_path)
    # b"a.txt" < b"a/x" because '.' (0x2e) sorts before '/' (0x2f)
    assert manifest.paths.tolist() == [b"a.txt", b"a/x", b"b/z.jpg"]


# ---------------------------------------------------------------------------------------------
# Generator and rank slicing


def test_permutation_is_reproducible_and_differs_per_epoch():
    first = permutation(1000, seed=7, epoch=3)
    assert first.dtype == np.int64
    assert np.array_equal(first, permutation(1000, seed=7, epoch=3))
    assert np.array_equal(np.sort(first), np.arange(1000))
    assert not np.array_equal(first, permutation(1000, seed=7, epoch=4))
    assert not np.array_equal(first, permutation(1000, seed=8, epoch=3))
    documented = np.random.Generator(np.random.PCG64([7, 3])).permutation(1000)
    assert np.array_equal(first, documented)


def distributed_sampler_indices(indices: list[int], rank: int, num_replicas: int) -> list[int]:
    """torch.utils.data.DistributedSampler.__iter__ with drop_last=False, copied (no torch)."""
    num_samples = math.ceil(len(indices) / num_replicas)
    total_size = num_samples * num_replicas
    padding_size = total_size - len(indices)
    if padding_size <= len(indices):
        indices += indices[:padding_size]
    else:
        indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:num_replicas]
    assert len(indices) == num_samples
    return indices


@pytest.mark.parametrize("n, world_size", [(10, 1), (10, 3), (12, 4), (7, 8), (2, 5), (1, 3),
                                           (100, 7), (5, 16)])
def test_rank_slice_matches_distributed_sampler(n, world_size):
    order = permutation(n, seed=1, epoch=0)
    for rank in range(world_size):
        expected = distributed_sampler_indices(order.tolist(), rank, world_size)
        assert rank_slice(order, rank, world_size).tolist() == expected


def test_rank_slice_rejects_bad_rank():
    with pytest.raises(OrderError, match="rank"):
        rank_slice(np.arange(4), 2, 2)


def test_rank_slice_of_a_huge_world_size_allocates_only_the_share():
    order = permutation(1000, seed=1, epoch=0)
    tracemalloc.start()
    try:
        share = rank_slice(order, 9_999_999, 10**7)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert share.tolist() == [order[9_999_999 % 1000]]
    assert peak_bytes < 1_000_000  # 80 MB before (the order padded to world_size entries)
    with pytest.raises(OrderError, match="world_size"):
        rank_slice(order, 0, 10**9 + 1)


def test_reject_world_size_beyond_what_rank_files_can_name():
    with pytest.raises(OrderError, match="world_size must be <= 1000000000"):
        validate_arrays(0, np.arange(5), rank=0, world_size=10**12)


# ---------------------------------------------------------------------------------------------
# Writing and loading good files


def test_round_trip_with_files_and_rank(tmp_path, source_manifest):
    files = list(reversed(FILES))
    current, nxt = permutation(12, 0, 5), permutation(12, 0, 6)
    identity = write_order_file(tmp_path / "order.npz", epoch=5, current=current, next=nxt,
                                files=files, rank=1, world_size=5)
    assert identity == FileIdentity.from_stat(os.stat(tmp_path / "order.npz"))
    order = load_order(tmp_path / "order.npz", source_manifest)
    assert order.epoch == 5 and order.rank == 1 and order.world_size == 5
    assert order.total_length == 12
    assert order.current.tolist() == distributed_sampler_indices(current.tolist(), 1, 5)
    assert order.next.tolist() == distributed_sampler_indices(nxt.tolist(), 1, 5)
    assert order.manifest.path(0) == files[0].encode()
    assert order.file == identity
    assert order.ranks == (1,) and order.files == (identity,)
    assert order.status() == {"epoch": 5, "length": 3, "total_length": 12, "rank": 1,
                              "world_size": 5, "ranks": [1], "has_next": True,
                              "file": identity.to_json(), "files": [identity.to_json()],
                              "targets": "device", "items": None}
    with pytest.raises(ValueError):
        order.current[0] = 0  # the daemon's arrays are read-only


def test_without_files_the_manifest_is_the_source_computed_on_demand(tmp_path,
                                                                     source_manifest):
    write_order_file(tmp_path / "order.npz", epoch=0, current=np.arange(12)[::-1])
    calls = []

    def compute():
        calls.append(1)
        return source_manifest

    order = load_order(tmp_path / "order.npz", compute)
    assert calls == [1]
    assert order.manifest is source_manifest and order.next is None
    assert order.current.tolist() == list(range(11, -1, -1))


def test_a_bad_file_does_not_compute_the_source_manifest(tmp_path):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0))  # no `current`

    def compute():
        raise AssertionError("scanned the source for a malformed file")

    with pytest.raises(OrderError, match="missing key 'current'"):
        load_order(tmp_path / "order.npz", compute)


def test_hand_written_file_with_unicode_files_and_int32_indices(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(1),
             current=np.arange(12, dtype=np.int32), files=np.array(FILES))
    order = load_order(tmp_path / "order.npz", source_manifest)
    assert order.current.dtype == np.int64
    assert order.manifest.path(3) == FILES[3].encode()


def test_the_man_page_example_is_accepted(tmp_path, source_manifest):
    """man/cachefs-order.5 EXAMPLES: python ints and savez on a file object, numpy only."""
    def perm(e):
        return np.random.Generator(np.random.PCG64([0, e])).permutation(12)

    with open(tmp_path / "order.npz", "wb") as f:
        np.savez(f, version=1, epoch=3, current=perm(3), next=perm(4), rank=0, world_size=1)
    order = load_order(tmp_path / "order.npz", source_manifest)
    assert order.epoch == 3 and np.array_equal(order.current, permutation(12, 0, 3))
    assert np.array_equal(order.next, permutation(12, 0, 4))


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "order.npz"
    write_order_file(path, epoch=0, current=[0, 1, 2])
    first = os.stat(path).st_ino
    write_order_file(path, epoch=1, current=[2, 1, 0])
    assert os.listdir(tmp_path) == ["order.npz"]
    assert os.stat(path).st_ino != first  # replaced by rename, not rewritten in place
    with np.load(path, allow_pickle=False) as npz:
        assert int(npz["epoch"]) == 1 and npz["current"].tolist() == [2, 1, 0]


def test_a_failing_validation_writes_nothing(tmp_path):
    path = tmp_path / "order.npz"
    write_order_file(path, epoch=0, current=[0, 1, 2])
    before = path.read_bytes()
    with pytest.raises(OrderError, match="duplicate index 1"):
        write_order_file(path, epoch=1, current=[0, 1, 1])
    assert os.listdir(tmp_path) == ["order.npz"] and path.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Bad files: each rejected with a message naming the problem


def test_reject_not_an_npz(tmp_path, source_manifest):
    (tmp_path / "order.npz").write_text("epoch=1\ncurrent=1,2,3\n")
    assert "not an npz archive" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_a_single_npy(tmp_path, source_manifest):
    np.save(tmp_path / "order.npy", np.arange(3))
    assert "single .npy array, not an npz" in rejection(tmp_path / "order.npy",
                                                        source_manifest)


def test_reject_zero_byte_file(tmp_path, source_manifest):
    (tmp_path / "order.npz").write_bytes(b"")
    assert "empty file (0 bytes)" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_truncated_file(tmp_path, source_manifest):
    write_order_file(tmp_path / "good.npz", epoch=0, current=np.arange(12))
    data = (tmp_path / "good.npz").read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 30):
        (tmp_path / "order.npz").write_bytes(data[:cut])
        assert "truncated or corrupt npz" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_pickled_object_array(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0),
             current=np.array([0, 1, 2], dtype=object))
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "'current'" in message and "pickled (object) array" in message


def test_reject_pickled_files_list(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(2),
             files=np.array(["a", "b"], dtype=object))
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "'files'" in message and "pickled" in message


def _npz_members(path: Path, members: dict[str, bytes]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _npy(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_reject_a_member_that_is_no_npy_array_with_a_short_reason(tmp_path, source_manifest):
    """numpy hands a member with no .npy header over as its raw bytes: the reason quoted
    them, about four characters a byte, and a 195 KB file of 200 MB of zeros made the
    daemon take 2.5 GB (up to the archive's 2 GiB, enough to have it killed)."""
    _npz_members(tmp_path / "order.npz", {"version": b"\0" * 20_000_000,
                                          "epoch.npy": _npy(np.int64(0)),
                                          "current.npy": _npy(np.arange(3))})
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "'version' is not a .npy array" in message and len(message) < 200


def test_reject_an_archive_of_many_members_before_opening_it(tmp_path, source_manifest):
    """Opening a zip reads its list of members whole and makes an object of each: one of a
    million empty members (60 MB) took the daemon 600 MB before any check. The list's size
    is read from the archive's end first."""
    members = {f"m{number}": b"" for number in range(2_000)}
    _npz_members(tmp_path / "order.npz", {"epoch.npy": _npy(np.int64(0)),
                                          "current.npy": _npy(np.arange(3)), **members})
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "bytes of members, more than the 65,536 an order's few arrays may" in message
    # the end record as far from the end as a zip's comment can put it
    import zipfile

    with zipfile.ZipFile(tmp_path / "order.npz", "a") as archive:
        archive.comment = b"c" * 0xFFFF
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "bytes of members, more than the 65,536 an order's few arrays may" in message
    # ... and a byte past that, which the zip reader still finds (a search of its own,
    # a byte short, missed it, and the reader listed every member)
    with open(tmp_path / "order.npz", "ab") as archive_file:
        archive_file.write(b"c")
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "bytes of members, more than the 65,536 an order's few arrays may" in message


def test_reject_an_array_of_items_of_no_bytes(tmp_path, source_manifest):
    """A `files` list of a billion items of dtype S0 takes no bytes in the archive, and
    checking its paths filled gigabytes (2.9 GB and 16 s for a file of 942 bytes)."""
    import io

    from numpy.lib import format as npy_format

    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "|S0", "fortran_order": False,
                                               "shape": (1_000_000_000,)})
    _npz_members(tmp_path / "order.npz", {"version.npy": _npy(np.int64(1)),
                                          "epoch.npy": _npy(np.int64(0)),
                                          "current.npy": _npy(np.arange(3)),
                                          "files.npy": header.getvalue()})
    tracemalloc.start()
    try:
        message = rejection(tmp_path / "order.npz", source_manifest)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "'files' is an array of 1,000,000,000 items of no bytes each" in message
    assert peak_bytes < 50_000_000


def test_reject_missing_current(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), next=np.arange(12))
    assert "missing key 'current'" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_missing_version_and_unknown_version(tmp_path, source_manifest):
    np.savez(tmp_path / "a.npz", epoch=np.int64(0), current=np.arange(3))
    assert "missing key 'version'" in rejection(tmp_path / "a.npz", source_manifest)
    save_npz(tmp_path / "b.npz", version=np.int64(2), epoch=np.int64(0), current=np.arange(3))
    assert "unknown version 2" in rejection(tmp_path / "b.npz", source_manifest)


def test_reject_unknown_key(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(3),
             nxt=np.arange(3))
    assert "unknown key(s) 'nxt'" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_many_unknown_keys_names_a_few(tmp_path, source_manifest):
    extra = {f"extra_{number:04d}": np.arange(1) for number in range(300)}
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(3), **extra)
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "unknown key(s) 'extra_0000', 'extra_0001'" in message
    assert "and 295 more" in message and len(message) < 300


def test_reject_non_integer_indices(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([0.0, 1.0]))
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "current must be an integer array" in message and "float64" in message


def test_reject_negative_index(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([0, 1, -3, 2]))
    assert "current[2] = -3 is negative" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_out_of_range_index_against_the_source(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([0, 12, 1]))
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "current[1] = 12 is out of range" in message and "12 files" in message


def test_reject_out_of_range_index_against_files(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([0, 1]),
             next=np.array([1, 2]), files=np.array(FILES[:2]))
    assert "next[1] = 2 is out of range" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_duplicate_index(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([4, 5, 6, 5]))
    assert "current has duplicate index 5 at positions 1 and 3" in rejection(
        tmp_path / "order.npz", source_manifest)


def test_reject_duplicate_index_in_next(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([0, 1, 2]),
             next=np.array([2, 2, 0]))
    assert "next has duplicate index 2" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_current_next_length_mismatch(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(5),
             next=np.arange(4))
    assert "next has 4 entries but current has 5" in rejection(tmp_path / "order.npz",
                                                               source_manifest)


def test_reject_absolute_path(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(2),
             files=np.array([FILES[0], "/etc/passwd"]))
    assert "files[1] = '/etc/passwd' is absolute" in rejection(tmp_path / "order.npz",
                                                                source_manifest)


@pytest.mark.parametrize("bad", ["../secret", "train/../../x", "train/c0/..", ".."])
def test_reject_dotdot_path(tmp_path, source_manifest, bad):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(2),
             files=np.array([FILES[0], bad]))
    assert f"files[1] = {bad!r} contains a '..' component" in rejection(
        tmp_path / "order.npz", source_manifest)


def test_reject_path_not_under_source(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(3),
             files=np.array([FILES[0], FILES[1], "train/c9/img_999.jpg"]))
    message = rejection(tmp_path / "order.npz", source_manifest)
    assert "files[2] = 'train/c9/img_999.jpg' does not exist under the source" in message


def test_reject_empty_and_duplicate_paths(tmp_path, source_manifest):
    save_npz(tmp_path / "a.npz", epoch=np.int64(0), current=np.arange(2),
             files=np.array([FILES[0], ""]))
    assert "files[1] is an empty path" in rejection(tmp_path / "a.npz", source_manifest)
    save_npz(tmp_path / "b.npz", epoch=np.int64(0), current=np.arange(3),
             files=np.array([FILES[0], FILES[1], FILES[0]]))
    assert f"files has duplicate path {FILES[0]!r} at positions 0 and 2" in rejection(
        tmp_path / "b.npz", source_manifest)


BEYOND_UNICODE = np.array([0x61, 0x110000], dtype=np.uint32).view("U2")  # numpy stores it


@pytest.mark.parametrize("files, position, code", [
    (["train/a.jpg", "train/\ud800.jpg"], 1, "D800"),
    (np.array(["train/a.jpg", "train/\u00e9\udfff.jpg"]), 1, "DFFF"),
    (BEYOND_UNICODE, 0, "110000"),
])
def test_paths_that_no_file_name_can_hold_are_an_order_error(tmp_path, source_manifest, files,
                                                             position, code):
    """Issue 15, item 14: not UnicodeEncodeError or SystemError from publish or the daemon."""
    message = rf"files\[{position}\] holds code point U\+{code}, which no file name can hold"
    with pytest.raises(OrderError, match=message):
        publish(tmp_path, 0, np.arange(len(files)), files=files)
    if isinstance(files, np.ndarray):  # a file written without cachefs, read by the daemon
        save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(len(files)),
                 files=files)
        assert re.search(message, rejection(tmp_path / "order.npz", source_manifest))


def test_undecodable_bytes_as_surrogates_are_paths():
    """os.fsdecode of a name that is not UTF-8 gives U+DC80..U+DCFF: they are its bytes."""
    validate_arrays(0, [0], files=np.array(["train/\u00e9\udc80.jpg"]))
    assert manifest_mod._paths_to_bytes_array(["train/\udcff.jpg"]).tolist() == [b"train/\xff.jpg"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_order_file_that_is_not_a_regular_file_is_rejected_at_once(tmp_path, source_manifest,
                                                                   kind):
    """Issue 15, item 14: a FIFO must not hang the watcher's thread (nor the unmount)."""
    path = tmp_path / "order.npz"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # another /dev/zero
    messages = []
    loader = threading.Thread(target=lambda: messages.append(rejection(path, source_manifest)),
                              daemon=True)
    loader.start()
    loader.join(5)
    try:
        assert not loader.is_alive(), "load_order is stuck opening the order file"
        assert "not a regular file" in messages[0]
    finally:
        if loader.is_alive():  # unblock the reader's open, as a writer would
            release_fifo_readers(path)


def test_an_order_file_that_is_a_symbolic_link_is_rejected(tmp_path, source_manifest):
    """Whoever may write the order's directory (a group's) must not have the daemon open, and
    report on, a file it points to: a link is never followed."""
    save_npz(tmp_path / "elsewhere.npz", epoch=np.int64(3), current=np.arange(12))
    (tmp_path / "order.npz").symlink_to(tmp_path / "elsewhere.npz")
    assert "a symbolic link" in rejection(tmp_path / "order.npz", source_manifest)


def test_an_order_whose_arrays_would_take_too_much_memory_is_rejected_unread(
        tmp_path, source_manifest, monkeypatch):
    """The size the archive states is checked before any array is read: a small compressed
    file (or a forged size) made the daemon take gigabytes, or die."""
    from cachefs import order_archive

    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(12))
    assert load_order(tmp_path / "order.npz", source_manifest).epoch == 0
    monkeypatch.setattr(order_archive, "MAX_UNPACKED_BYTES", 100)
    assert "more than the 100 an order may" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_rank_at_or_above_world_size(tmp_path, source_manifest):
    save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.arange(12),
             rank=np.int64(4), world_size=np.int64(4))
    assert "rank 4 >= world_size 4" in rejection(tmp_path / "order.npz", source_manifest)


def test_reject_rank_without_world_size_and_bad_world_size(tmp_path, source_manifest):
    save_npz(tmp_path / "a.npz", epoch=np.int64(0), current=np.arange(12), rank=np.int64(0))
    assert "rank given without world_size" in rejection(tmp_path / "a.npz", source_manifest)
    save_npz(tmp_path / "b.npz", epoch=np.int64(0), current=np.arange(12),
             rank=np.int64(0), world_size=np.int64(0))
    assert "world_size must be >= 1" in rejection(tmp_path / "b.npz", source_manifest)


def test_rejection_carries_the_file_identity(tmp_path, source_manifest):
    path = save_npz(tmp_path / "order.npz", epoch=np.int64(0), current=np.array([1, 1]))
    with pytest.raises(OrderError) as info:
        load_order(path, source_manifest)
    assert info.value.file == FileIdentity.from_stat(os.stat(path))


def test_validate_arrays_names_the_problem_before_anything_is_written():
    with pytest.raises(OrderError, match=r"current\[1\] = 7 is out of range"):
        validate_arrays(0, [0, 7], manifest_len=5)
    with pytest.raises(OrderError, match="epoch must be an integer"):
        validate_arrays("3", [0])
    with pytest.raises(OrderError, match="world_size given without rank"):
        validate_arrays(0, [0], world_size=2)
    validate_arrays(0, np.arange(5), next=np.arange(5)[::-1], rank=1, world_size=2,
                    manifest_len=5)


# ---------------------------------------------------------------------------------------------
# CLI input files


def test_read_index_file_text_and_npy(tmp_path):
    (tmp_path / "cur.txt").write_text("3\n1\n\n  2 \n0\n")
    assert read_index_file(tmp_path / "cur.txt").tolist() == [3, 1, 2, 0]
    np.save(tmp_path / "cur.npy", np.array([2, 0, 1], dtype=np.int32))
    assert read_index_file(tmp_path / "cur.npy").tolist() == [2, 0, 1]


def test_read_index_file_names_the_bad_line(tmp_path):
    (tmp_path / "cur.txt").write_text("3\n1\n\nfour\n0\n")
    with pytest.raises(OrderError, match=r"cur.txt: line 4: not an integer: 'four'"):
        read_index_file(tmp_path / "cur.txt")
    np.save(tmp_path / "obj.npy", np.array([1, 2], dtype=object), allow_pickle=True)
    with pytest.raises(OrderError, match="obj.npy: not a usable .npy array"):
        read_index_file(tmp_path / "obj.npy")
    with pytest.raises(OrderError, match="missing.txt"):
        read_index_file(tmp_path / "missing.txt")


def test_read_files_list(tmp_path):
    (tmp_path / "files.txt").write_bytes(b"a/b.jpg\n\nc d.jpg\r\nx\xff.jpg\n")
    names = read_files_list(tmp_path / "files.txt")
    assert names == ["a/b.jpg", "c d.jpg", os.fsdecode(b"x\xff.jpg")]
    assert Manifest.from_paths(names).path(2) == b"x\xff.jpg"


# ---------------------------------------------------------------------------------------------
# publish() against a fake daemon


class FakeDaemon:
    """Answers the mount's xattrs like the daemon: loads the order file on each stats read."""

    def __init__(self, mount: Path, order_path: Path, source: Manifest | None):
        self.mount, self.order_path, self.source = mount, order_path, source
        self.order_status = None
        self.last_rejection = None
        self.handled = None
        self.answer = True

    def getxattr(self, path, name, *args, **kwargs):
        if Path(path) != self.mount:
            raise OSError(errno.ENODATA, "No data available")
        if name == "user.cachefs.order_file":
            return os.fsencode(self.order_path)
        if name == "user.cachefs.stats":
            if self.answer:
                self._check()
            return json.dumps({
                "order": self.order_status, "last_rejection": self.last_rejection,
                "manifest": {"files": len(self.source) if self.source is not None else None},
            }).encode()
        raise OSError(errno.ENODATA, "No data available")

    def _check(self):
        if not self.order_path.exists():
            return
        identity = FileIdentity.from_stat(os.stat(self.order_path))
        if identity == self.handled:
            return
        self.handled = identity
        try:
            order = load_order(self.order_path, self.source)
        except OrderError as err:
            self.last_rejection = {"reason": str(err), "at": 0.0, "file": identity.to_json()}
        else:
            self.order_status = dict(order.status(), published_at=0.0)


@pytest.fixture
def fake_mount(tmp_path, monkeypatch, source_manifest):
    mount = tmp_path / "mnt"
    mount.mkdir()
    daemon = FakeDaemon(mount, tmp_path / "state" / "order.npz", source_manifest)
    daemon.order_path.parent.mkdir()
    monkeypatch.setattr(os, "getxattr", daemon.getxattr)
    listed_as_own_cachefs_mount(monkeypatch, mount)
    return daemon


def listed_as_own_cachefs_mount(monkeypatch, mount: Path) -> None:
    """The mount table lists `mount` as a cachefs mount of this user (publish._owner_of)."""
    monkeypatch.setattr(publish_mod, "mount_at", lambda path: MountInfo(
        os.fsencode(path), "0:0", CACHEFS_FSTYPE, os.geteuid()) if path == str(mount) else None)


def test_publish_returns_the_accepted_order(fake_mount):
    status = publish(fake_mount.mount, 2, permutation(12, 0, 2), next=permutation(12, 0, 3))
    assert status["epoch"] == 2 and status["length"] == 12 and status["has_next"]
    assert status["file"] == FileIdentity.from_stat(os.stat(fake_mount.order_path)).to_json()


def test_publish_fails_with_the_daemons_reason(fake_mount):
    # Not caught before writing (the path's syntax is fine): only the daemon knows the source.
    with pytest.raises(OrderError, match="'train/c9/new.jpg' does not exist under the source"):
        publish(fake_mount.mount, 0, [0, 1], files=[FILES[0], "train/c9/new.jpg"])
    assert fake_mount.order_status is None


def test_publish_validates_before_writing(fake_mount):
    with pytest.raises(OrderError, match="current has duplicate index 3"):
        publish(fake_mount.mount, 0, [3, 3])
    with pytest.raises(OrderError, match=r"current\[0\] = 12 is out of range"):
        publish(fake_mount.mount, 0, [12, 0])  # the daemon's manifest count is known
    assert not fake_mount.order_path.exists()


def test_publish_on_a_directory_that_is_not_a_mount(fake_mount, tmp_path):
    with pytest.raises(OrderError, match="is not a cachefs mount"):
        publish(tmp_path, 0, [0, 1])


def test_publish_times_out_when_the_daemon_does_not_answer(fake_mount):
    fake_mount.answer = False
    with pytest.raises(OrderError, match="did not answer within 0.2 s"):
        publish(fake_mount.mount, 0, [0, 1], timeout_s=0.2)


def test_source_file_count_waits_for_the_scan(fake_mount):
    assert source_file_count(fake_mount.mount) == 12
    fake_mount.source = None
    with pytest.raises(OrderError, match="has not finished scanning"):
        source_file_count(fake_mount.mount, timeout_s=0.1)


class WatcherThread:
    """A real OrderWatcher in its own trio thread, behind faked mount xattrs."""

    def __init__(self, tmp_path: Path, monkeypatch, source_manifest: Manifest):
        self.mount = tmp_path / "mnt"
        self.mount.mkdir()
        self.order_path = tmp_path / "order.npz"
        self.switched = []
        self.watcher = OrderWatcher(self.order_path,
                                    lambda p: load_order(p, source_manifest),
                                    self.switched.append)
        self._files = len(source_manifest)
        monkeypatch.setattr(os, "getxattr", self._getxattr)
        listed_as_own_cachefs_mount(monkeypatch, self.mount)
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._serve,))

    def _getxattr(self, path, name, *args, **kwargs):
        if name == "user.cachefs.order_file":
            return os.fsencode(self.order_path)
        # in the trio thread, as the daemon's FUSE handler reads it
        status = trio.from_thread.run_sync(self.watcher.status, trio_token=self._token)
        return json.dumps(dict(status, manifest={"files": self._files})).encode()

    async def _serve(self):
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.watcher.run)
            self._ready.set()
            while not self._stop.is_set():
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_publish_end_to_end_with_the_real_watcher(tmp_path, monkeypatch, source_manifest):
    """publish() -> rename -> OrderWatcher (in its own trio thread) -> stats -> accepted."""
    with WatcherThread(tmp_path, monkeypatch, source_manifest) as daemon:
        status = publish(daemon.mount, 1, permutation(12, 3, 1), rank=0, world_size=2)
        assert status["epoch"] == 1 and status["length"] == 6 and status["world_size"] == 2
        assert (tmp_path / "order.rank0.npz").exists() and not daemon.order_path.exists()
        with pytest.raises(OrderError, match="'nope.jpg' does not exist under the source"):
            publish(daemon.mount, 2, [1, 0], files=[FILES[0], "nope.jpg"])
        assert [order.epoch for order in daemon.switched] == [1]
        assert daemon.watcher.status()["order"]["epoch"] == 1  # the previous order stays


def test_ranks_publishing_at_the_same_moment_each_get_their_answer(tmp_path, monkeypatch,
                                                                   source_manifest):
    """Two ranks publish at once: both are merged; a bad one gets its own reason."""
    results: dict = {}
    start = threading.Barrier(2)

    def rank_main(rank, **kwargs):
        start.wait()
        try:
            results[rank] = publish(daemon.mount, 4, permutation(12, 0, 4),
                                    next=permutation(12, 0, 5), rank=rank, world_size=2,
                                    **kwargs)
        except OrderError as err:
            results[rank] = err

    with WatcherThread(tmp_path, monkeypatch, source_manifest) as daemon:
        ranks = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(20)
        for rank in (0, 1):
            mine = FileIdentity.from_stat(os.stat(tmp_path / f"order.rank{rank}.npz"))
            assert mine.to_json() in results[rank]["files"]
        in_force = daemon.watcher.status()["order"]
        assert in_force["ranks"] == [0, 1] and in_force["length"] == 12
        # again, rank 1 with a path the source lacks: rank 0 is taken, rank 1 is told why
        ranks = [threading.Thread(target=rank_main, args=(0,)),
                 threading.Thread(target=rank_main, args=(1,),
                                  kwargs={"files": FILES[:11] + ["gone.jpg"]})]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(20)
        assert isinstance(results[1], OrderError) and "gone.jpg" in str(results[1])
        assert results[0]["ranks"] == [0, 1]  # rank 1's previous file is still merged


def test_a_published_order_file_is_readable_by_the_daemons_user(tmp_path):
    """A member of a group that may write the order's directory publishes for a daemon of
    another user: the file mkstemp made (0600) was rejected with "Permission denied"."""
    write_order_file(tmp_path / "order.npz", epoch=0, current=np.arange(12))
    assert stat.S_IMODE(os.stat(tmp_path / "order.npz").st_mode) == 0o644
