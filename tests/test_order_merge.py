"""Merging the slices that several ranks of one node publish: pure, no files, no trio."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefs.errors import OrderError
from cachefs.manifest import Manifest
from cachefs.order import FileIdentity, Order, permutation, rank_of_file_name, \
    rank_order_path, rank_slice
from cachefs.order_merge import PLAIN_IN_FORCE, Publication, check_rank_file, merge, \
    share_manifest

N = 10
MANIFEST = Manifest.from_paths([f"img_{i}.jpg" for i in range(N)])
ORDER_PATH = Path("/state/order.npz")


def ranked(rank, epoch, *, world_size=2, mtime_ns=0, has_next=True, n=N, manifest=MANIFEST,
           seed=0) -> Publication:
    """Rank `rank`'s accepted file: its slice of permutation(n, seed, epoch), as loaded."""
    whole = permutation(n, seed, epoch)
    following = permutation(n, seed, epoch + 1) if has_next else None
    identity = FileIdentity(100 + rank, mtime_ns, 1000 + epoch)
    order = Order(epoch=epoch, current=rank_slice(whole, rank, world_size),
                  next=rank_slice(following, rank, world_size) if has_next else None,
                  manifest=manifest, rank=rank, world_size=world_size, total_length=n,
                  file=identity, ranks=(rank,), files=(identity,))
    return Publication(order, rank, sequence=mtime_ns)


def plain(epoch, mtime_ns) -> Publication:
    identity = FileIdentity(1, mtime_ns, 1)
    order = Order(epoch=epoch, current=permutation(N, 0, epoch), next=None, manifest=MANIFEST,
                  rank=None, world_size=None, total_length=N, file=identity, files=(identity,))
    return Publication(order, None, sequence=mtime_ns)


def by_rank(*publications) -> dict:
    return {publication.rank: publication for publication in publications}


def test_rank_file_names_are_derived_from_the_order_path_stem():
    assert rank_order_path(ORDER_PATH, 3) == Path("/state/order.rank3.npz")
    assert rank_order_path(Path("/s/custom.orders.npz"), 0).name == "custom.orders.rank0.npz"
    assert rank_of_file_name(ORDER_PATH, "order.rank3.npz") == 3
    assert rank_of_file_name(ORDER_PATH, b"order.rank12.npz") == 12
    for other in ("order.npz", "order.rank.npz", "order.rank03.npz", "order.rank-1.npz",
                  ".order.rank3.npz.x1y2.tmp", "other.rank3.npz", "order.rank3.npz.tmp"):
        assert rank_of_file_name(ORDER_PATH, other) is None, other


def test_ranks_of_one_epoch_are_interleaved_by_position():
    r0, r1 = ranked(0, 5, mtime_ns=1), ranked(1, 5, mtime_ns=2)
    result = merge(None, by_rank(r1, r0))
    order = result.order
    assert order.ranks == (0, 1) and result.left_out == {}
    assert order.current.tolist() == [item for pair in zip(r0.order.current, r1.order.current,
                                                           strict=True)
                                      for item in pair]
    # both ranks together read the whole (padded) permutation, in its own order
    assert order.current.tolist() == permutation(N, 0, 5).tolist()
    assert order.next.tolist() == permutation(N, 0, 6).tolist()
    assert order.epoch == 5 and order.world_size == 2 and order.manifest is MANIFEST
    assert order.file == r1.order.file and order.rank == 1  # the newest
    assert order.files == (r0.order.file, r1.order.file)  # in rank order
    assert order.total_length == N
    assert order.status()["ranks"] == [0, 1] and len(order.status()["files"]) == 2
    assert not order.current.flags.writeable


def test_merged_next_only_when_every_member_has_one():
    result = merge(None, by_rank(ranked(0, 5, mtime_ns=1),
                                 ranked(1, 5, mtime_ns=2, has_next=False)))
    assert result.order.ranks == (0, 1) and result.order.next is None


def test_a_rank_one_epoch_behind_counts_with_its_next_order():
    behind, ahead = ranked(1, 4, mtime_ns=1), ranked(0, 5, mtime_ns=2)
    order = merge(None, by_rank(behind, ahead)).order
    assert order.epoch == 5 and order.ranks == (0, 1)
    assert order.current.tolist() == permutation(N, 0, 5).tolist()
    assert order.next is None  # rank 1's epoch 6 is not known yet


def test_a_rank_behind_without_next_or_two_epochs_away_is_left_out():
    newest = ranked(0, 5, mtime_ns=3)
    result = merge(None, by_rank(newest, ranked(1, 4, mtime_ns=1, has_next=False)))
    assert result.order.ranks == (0,)
    assert result.order.current is newest.order.current  # one member: its slice as it is
    assert "epoch 4 without a next order" in result.left_out[1]
    for epoch in (3, 6):  # two behind, or ahead of the newest (a file of an earlier run)
        result = merge(None, by_rank(ranked(1, epoch, mtime_ns=1), newest))
        assert result.order.ranks == (0,)
        assert f"epoch {epoch}, but the newest publication (rank 0, epoch 5)" in result.left_out[1]


def test_world_size_manifest_and_length_mismatches_are_left_out():
    newest = ranked(1, 5, mtime_ns=9)
    other_paths = Manifest.from_paths([f"x{i}" for i in range(N)])
    result = merge(None, {0: ranked(0, 5, mtime_ns=1, world_size=4), 1: newest})
    assert "world_size 4, but the newest publication (rank 1, epoch 5) has world_size 2" \
        in result.left_out[0]
    result = merge(None, {0: ranked(0, 5, mtime_ns=1, manifest=other_paths), 1: newest})
    assert "manifest differs" in result.left_out[0]
    result = merge(None, {0: ranked(0, 5, mtime_ns=1, n=14, manifest=MANIFEST), 1: newest})
    assert "has 7 items, but that of the newest publication" in result.left_out[0]
    assert result.order.ranks == (1,)


def test_an_equal_manifest_object_merges_and_share_manifest_makes_it_one_object():
    equal = Manifest.from_paths([f"img_{i}.jpg" for i in range(N)])
    r0 = ranked(0, 5, mtime_ns=1, manifest=equal)
    assert merge(None, by_rank(r0, ranked(1, 5, mtime_ns=2))).order.ranks == (0, 1)
    shared = share_manifest(r0.order, [Manifest.from_paths(["a"]), MANIFEST])
    assert shared.manifest is MANIFEST and shared.current is r0.order.current
    assert share_manifest(r0.order, [Manifest.from_paths(["a"])]) is r0.order


def test_the_newest_publication_decides_between_plain_and_rank_files():
    r0, r1 = ranked(0, 5, mtime_ns=2), ranked(1, 5, mtime_ns=3)
    newest_plain = plain(7, mtime_ns=4)
    result = merge(newest_plain, by_rank(r0, r1))
    assert result.order is newest_plain.order
    assert result.left_out == {0: PLAIN_IN_FORCE, 1: PLAIN_IN_FORCE}
    result = merge(plain(7, mtime_ns=1), by_rank(r0, r1))
    assert result.order.ranks == (0, 1) and result.order.epoch == 5
    assert merge(None, {}) is None


def test_equal_mtimes_are_ordered_by_acceptance():
    early = ranked(0, 5, mtime_ns=7)
    late = Publication(ranked(1, 9, mtime_ns=7).order, 1, sequence=8)
    assert merge(None, by_rank(early, late)).order.epoch == 9


def test_a_rank_file_must_hold_the_rank_of_its_name():
    check_rank_file(ranked(1, 0).order, ORDER_PATH, 1)
    with pytest.raises(OrderError, match=r"order\.rank1\.npz is the file of rank 1 but holds "
                                         r"rank 0 \(world_size 2\): rank 0 publishes to "
                                         r"order\.rank0\.npz"):
        check_rank_file(ranked(0, 0).order, ORDER_PATH, 1)
    with pytest.raises(OrderError, match=r"order\.rank1\.npz is the file of rank 1 but holds no "
                                         r"rank and world_size"):
        check_rank_file(plain(0, 0).order, ORDER_PATH, 1)
