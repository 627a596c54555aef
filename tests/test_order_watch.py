"""OrderWatcher: picks up published files quickly, rejects bad ones, never dies. No FUSE."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import trio

from cachefs import order_watch
from cachefs.errors import OrderError
from cachefs.manifest import Manifest
from cachefs.order import FileIdentity, load_order, permutation, rank_order_path, \
    write_order_file
from cachefs.order_watch import OrderWatcher

# How long a test waits for the watcher to act. Not its speed (the bar is 200 ms,
# measured by scripts/bench_pickup.py): a timed bar here failed a polling test on a loaded
# 2-core machine running the whole suite, and a test must not fail by the clock.
PICKUP_S = 10.0
SOURCE = Manifest.from_paths([f"img_{i:02d}.jpg" for i in range(8)])


class Harness:
    """A watcher on tmp_path/order.npz whose accepted orders arrive on a channel."""

    def __init__(self, tmp_path: Path, load=None, resume=False):
        self.path = tmp_path / "order.npz"
        self.accepted = []
        self._send, self.received = trio.open_memory_channel(10)
        self.watcher = OrderWatcher(self.path, load or (lambda p: load_order(p, SOURCE)),
                                    self._on_order, resume=resume)

    def _on_order(self, order):
        self.accepted.append(order)
        self._send.send_nowait(order)

    async def next_order(self, timeout_s: float = PICKUP_S):
        with trio.fail_after(timeout_s):
            return await self.received.receive()

    async def wait_rejection(self, identity: FileIdentity, timeout_s: float = PICKUP_S):
        with trio.fail_after(timeout_s):
            while True:
                rejection = self.watcher.status()["last_rejection"]
                if rejection and rejection["file"] == identity.to_json():
                    return rejection
                await trio.sleep(0.005)


def run_with_watcher(tmp_path, body, load=None, resume=False):
    """trio.run a test body next to a running watcher (no pytest-trio)."""
    harness = Harness(tmp_path, load, resume)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.watcher.run)
            await body(harness)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return harness


def write_bad_file(path: Path) -> FileIdentity:
    """A complete file renamed into place whose content is invalid (duplicate index)."""
    temporary = path.with_name(".bad.tmp")
    with open(temporary, "wb") as handle:  # a file object: savez would append ".npz" to a name
        np.savez(handle, version=np.int64(1), epoch=np.int64(9), current=np.array([1, 1]))
    os.replace(temporary, path)
    return FileIdentity.from_stat(os.stat(path))


@pytest.fixture(params=["inotify", "polling"])
def mode(request, monkeypatch):
    if request.param == "polling":
        monkeypatch.setattr(order_watch._Inotify, "open", classmethod(lambda cls, d: None))
    return request.param


def test_picks_up_a_renamed_in_file(tmp_path, mode):
    async def body(h: Harness):
        for epoch in (1, 2, 3):
            await trio.sleep(0.05)  # the watcher is idle, waiting for an event or a poll
            write_order_file(h.path, epoch=epoch, current=np.arange(8)[::-1])
            order = await h.next_order()
            assert order.epoch == epoch
        status = h.watcher.status()
        assert status["path"] == str(h.path)
        assert status["order"]["epoch"] == 3 and status["order"]["published_at"] > 0
        assert status["order"]["file"] == FileIdentity.from_stat(os.stat(h.path)).to_json()
        assert status["last_rejection"] is None

    harness = run_with_watcher(tmp_path, body)
    assert [order.epoch for order in harness.accepted] == [1, 2, 3]
    assert harness.watcher.watching == mode  # what it says it does (scripts/bench_pickup.py)


def test_notices_a_file_rewritten_in_place(tmp_path, mode):
    async def body(h: Harness):
        write_order_file(h.path, epoch=1, current=np.arange(8))
        await h.next_order()
        other = tmp_path / "other.npz"
        write_order_file(other, epoch=2, current=np.arange(8))
        h.path.write_bytes(other.read_bytes())  # same inode, new content (close-write)
        assert (await h.next_order()).epoch == 2

    run_with_watcher(tmp_path, body)


def test_an_order_goes_in_force_once_the_reads_reported_before_it_are_counted(tmp_path):
    """`before_order` (the mount's: the close events queued so far, counted) is awaited
    before an order goes in force, so a read of the last epoch reported late is not counted
    as one of the new order's files; an order published meanwhile waits for it too."""
    events = []
    hook_entered = trio.Event()
    release = trio.Event()

    async def before_order():
        events.append("before")
        hook_entered.set()
        await release.wait()

    async def main():
        harness = Harness(tmp_path)
        harness.watcher._before_order = before_order
        original = harness.watcher._on_order
        harness.watcher._on_order = lambda order: (events.append(order.epoch), original(order))
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.watcher.run)
            write_order_file(harness.path, epoch=1, current=np.arange(8))
            with trio.fail_after(PICKUP_S):
                await hook_entered.wait()
            await trio.sleep(0.1)  # a slow count holds the order back
            assert events == ["before"] and harness.watcher.order is None
            release.set()
            assert (await harness.next_order()).epoch == 1
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert events == ["before", 1]


def test_files_left_from_an_earlier_run_are_set_aside_until_they_change(tmp_path, mode):
    """A new mount does not adopt the previous run's order (issue 15, item 13)."""
    left = write_order_file(tmp_path / "order.npz", epoch=4, current=np.arange(8))
    # a rank file that the new run's rank 0 would merge with, were it adopted
    left_rank = write_order_file(rank_order_path(tmp_path / "order.npz", 1), epoch=5,
                                 current=permutation(8, 0, 5), rank=1, world_size=2)

    async def body(h: Harness):
        await trio.sleep(0.1)  # the first check, and polls
        await h.watcher.check()
        status = h.watcher.status()
        assert h.accepted == [] and status["order"] is None and status["publications"] == []
        assert status["set_aside"] == [{"path": "order.npz", "file": left.to_json()},
                                       {"path": "order.rank1.npz", "file": left_rank.to_json()}]
        publish_rank(h, 0, 5)  # the new run publishes: its order alone, no leftover merged
        order = await h.next_order()
        assert (order.epoch, order.ranks) == (5, (0,))
        write_order_file(h.path, epoch=6, current=np.arange(8))  # the set-aside name, changed
        assert (await h.next_order()).epoch == 6
        assert [entry["path"] for entry in h.watcher.status()["set_aside"]] == ["order.rank1.npz"]

    run_with_watcher(tmp_path, body)


def test_resume_adopts_the_files_present_at_start(tmp_path):
    write_order_file(tmp_path / "order.npz", epoch=4, current=np.arange(8))

    async def body(h: Harness):
        assert (await h.next_order()).epoch == 4
        assert h.watcher.status()["set_aside"] == []

    run_with_watcher(tmp_path, body, resume=True)


def test_unchanged_file_is_not_reloaded(tmp_path, mode):
    loads = []

    def load(path):
        loads.append(path)
        return load_order(path, SOURCE)

    async def body(h: Harness):
        write_order_file(h.path, epoch=1, current=np.arange(8))
        await h.next_order()
        (tmp_path / "unrelated.txt").write_text("x")  # an event for another file
        await trio.sleep(0.3)  # several polls
        await h.watcher.check()

    run_with_watcher(tmp_path, body, load)
    assert len(loads) == 1


def test_records_a_rejection_and_keeps_the_previous_order(tmp_path, mode, caplog):
    async def body(h: Harness):
        good = write_order_file(h.path, epoch=1, current=np.arange(8))
        await h.next_order()
        bad = write_bad_file(h.path)
        rejection = await h.wait_rejection(bad)
        assert "current has duplicate index 1" in rejection["reason"]
        assert rejection["at"] > 0
        status = h.watcher.status()
        assert status["order"]["epoch"] == 1 and status["order"]["file"] == good.to_json()
        assert h.watcher.order.epoch == 1
        # and a good file after the bad one is taken again
        write_order_file(h.path, epoch=2, current=np.arange(8))
        assert (await h.next_order()).epoch == 2

    with caplog.at_level(logging.WARNING, logger="cachefs.order_watch"):
        harness = run_with_watcher(tmp_path, body)
    assert [order.epoch for order in harness.accepted] == [1, 2]
    assert any("rejected" in record.getMessage() and "duplicate index 1" in record.getMessage()
               for record in caplog.records)


def test_survives_a_loader_that_raises(tmp_path, mode, caplog):
    calls = []

    def load(path):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("loader bug")
        return load_order(path, SOURCE)

    async def body(h: Harness):
        write_order_file(h.path, epoch=1, current=np.arange(8))
        await h.next_order()
        crashing = write_order_file(h.path, epoch=2, current=np.arange(8))
        rejection = await h.wait_rejection(crashing)
        assert "RuntimeError('loader bug')" in rejection["reason"]
        assert h.watcher.status()["order"]["epoch"] == 1
        write_order_file(h.path, epoch=3, current=np.arange(8))
        assert (await h.next_order()).epoch == 3

    with caplog.at_level(logging.WARNING, logger="cachefs.order_watch"):
        run_with_watcher(tmp_path, body, load)
    assert any(record.exc_info for record in caplog.records)  # logged with its traceback


def test_a_failing_on_order_is_a_rejection(tmp_path):
    def on_order(order):
        raise ValueError("cannot plan")

    watcher = OrderWatcher(tmp_path / "order.npz", lambda p: load_order(p, SOURCE), on_order)
    identity = write_order_file(tmp_path / "order.npz", epoch=1, current=np.arange(8))
    trio.run(watcher.check)
    status = watcher.status()
    assert status["order"] is None
    assert "cannot plan" in status["last_rejection"]["reason"]
    assert status["last_rejection"]["file"] == identity.to_json()


def test_a_switch_that_fails_puts_the_previous_order_back_in_force(tmp_path):
    """A switch can fail part of the way (the read-ahead on the new order, the planner on
    the old): the previous order is handed over again, so that the daemon works by the order
    `status` shows; the new file is rejected with the reason."""
    handed: list[int] = []

    def on_order(order):
        handed.append(order.epoch)
        if order.epoch == 2:
            raise ValueError("cannot plan")

    watcher = OrderWatcher(tmp_path / "order.npz", lambda p: load_order(p, SOURCE), on_order)
    write_order_file(tmp_path / "order.npz", epoch=1, current=np.arange(8))
    trio.run(watcher.check)
    write_order_file(tmp_path / "order.npz", epoch=2, current=np.arange(8)[::-1].copy())
    trio.run(watcher.check)
    assert handed == [1, 2, 1]
    status = watcher.status()
    assert status["order"]["epoch"] == 1 and "cannot plan" in status["last_rejection"]["reason"]


def test_an_order_over_an_empty_manifest_takes_force_in_the_read_ahead(tmp_path):
    """An order whose file list is empty (or over an empty source) places no item on any
    storage target: building the targets' lists failed (no target to zip with), after the
    planner had switched, and the mount worked by half of each order."""
    from cachefs.sim import SimConfig, run_script

    write_order_file(tmp_path / "o.npz", epoch=5, current=np.zeros(0, np.int64),
                     files=np.zeros(0, "S1"))

    async def script(sim):
        sim.prefetcher.set_order(load_order(tmp_path / "o.npz", sim.manifest))
        return sim.prefetcher.planner.epoch, len(sim.prefetcher.planner.current)

    config = SimConfig(items=8, item_bytes=1000, ram_bytes=1 << 20, epochs=1, latency_s=0.001)
    assert run_script(config, script) == (5, 0)


@pytest.mark.parametrize("text", ["x", "\U0001f600"])
def test_a_rejection_reason_is_cut_to_fit_the_stats_attribute(tmp_path, text):
    # eight rejections of a file with thousands of arrays once made `cachefs stats` unreadable,
    # and so did a reason of as many characters JSON writes as 12 bytes each (emoji)
    def on_order(order):
        raise ValueError(text * 50_000)

    watcher = OrderWatcher(tmp_path / "order.npz", lambda p: load_order(p, SOURCE), on_order)
    write_order_file(tmp_path / "order.npz", epoch=1, current=np.arange(8))
    trio.run(watcher.check)
    reason = watcher.status()["last_rejection"]["reason"]
    assert len(json.dumps(reason)) < 2 * order_watch.REASON_MAX_CHARS + 40
    assert reason.endswith("characters)")


def test_missing_file_and_missing_directory_are_quiet(tmp_path):
    async def body(h: Harness):
        await trio.sleep(0.1)
        assert h.watcher.status() == {"path": str(h.path), "order": None,
                                      "last_rejection": None, "rejections": [],
                                      "rejections_total": 0, "publications": [],
                                      "set_aside": []}

    run_with_watcher(tmp_path, body)

    watcher = OrderWatcher(tmp_path / "absent" / "order.npz",
                           lambda p: pytest.fail("nothing to load"), lambda o: None)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run)  # no directory: falls back to polling
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert watcher.status()["order"] is None


def test_rejection_from_a_loader_uses_the_identity_of_the_file_it_read(tmp_path):
    """A file renamed in between stat and open: the rejection names the file actually read."""
    read_identity = FileIdentity(1, 2, 3)

    def load(path):
        err = OrderError("bad")
        err.file = read_identity
        raise err

    watcher = OrderWatcher(tmp_path / "order.npz", load, lambda o: None)
    write_order_file(tmp_path / "order.npz", epoch=1, current=np.arange(8))
    trio.run(watcher.check)
    assert watcher.status()["last_rejection"]["file"] == read_identity.to_json()
    # the file on disk is not the one read, so the next check loads it again
    calls = []
    watcher._load = lambda p: calls.append(p) or load_order(p, SOURCE)
    watcher._on_order = lambda o: None
    trio.run(watcher.check)
    assert calls and watcher.status()["order"]["epoch"] == 1


# -- several ranks sharing the mount: one file each, merged -----------------------------------


def publish_rank(h: Harness, rank: int, epoch: int, world_size: int = 2, seed: int = 0,
                 with_next: bool = True) -> FileIdentity:
    """What cachefs.publish.publish writes for a rank: the whole order, to the rank's own file."""
    return write_order_file(rank_order_path(h.path, rank), epoch=epoch,
                            current=permutation(8, seed, epoch),
                            next=permutation(8, seed, epoch + 1) if with_next else None,
                            rank=rank, world_size=world_size)


async def wait_order(h: Harness, predicate, timeout_s: float = 2.0):
    """The first accepted order that satisfies `predicate` (earlier ones are skipped)."""
    with trio.fail_after(timeout_s):
        while True:
            order = await h.received.receive()
            if predicate(order):
                return order


def test_two_ranks_publishing_at_once_are_both_merged(tmp_path, mode):
    async def body(h: Harness):
        for epoch in (0, 1):
            first = publish_rank(h, 0, epoch)
            second = publish_rank(h, 1, epoch)  # a few ms later, as two processes would
            order = await wait_order(
                h, lambda o, epoch=epoch: o.epoch == epoch and o.ranks == (0, 1))
            assert order.files == (first, second) and order.file == second
            # the node reads the whole permutation: the two slices, interleaved
            assert order.current.tolist() == permutation(8, 0, epoch).tolist()
            assert order.next.tolist() == permutation(8, 0, epoch + 1).tolist()
            status = h.watcher.status()["order"]
            assert status["ranks"] == [0, 1] and status["length"] == 8
            assert status["files"] == [first.to_json(), second.to_json()]
        publications = h.watcher.status()["publications"]
        assert [(p["path"], p["epoch"], p["in_force"], p["left_out"]) for p in publications] \
            == [("order.rank0.npz", 1, True, None), ("order.rank1.npz", 1, True, None)]

    run_with_watcher(tmp_path, body)


def test_a_bad_rank_file_keeps_that_ranks_previous_order(tmp_path, mode):
    async def body(h: Harness):
        publish_rank(h, 0, 1)
        previous = publish_rank(h, 1, 1)
        await wait_order(h, lambda o: o.ranks == (0, 1))
        # rank 0's order written to rank 1's file
        wrong = write_order_file(rank_order_path(h.path, 1), epoch=2,
                                 current=permutation(8, 0, 2), rank=0, world_size=2)
        rejection = await h.wait_rejection(wrong)
        assert "order.rank1.npz is the file of rank 1 but holds rank 0" in rejection["reason"]
        assert rejection["path"] == "order.rank1.npz"
        # a rank file without a rank is no better
        unranked = write_order_file(rank_order_path(h.path, 1), epoch=2,
                                    current=permutation(8, 0, 2))
        rejection = await h.wait_rejection(unranked)
        assert "holds no rank and world_size" in rejection["reason"]
        assert [r["file"] for r in h.watcher.status()["rejections"]] == \
            [wrong.to_json(), unranked.to_json()]
        assert h.watcher.status()["rejections_total"] == 2
        assert h.watcher.order.epoch == 1 and h.watcher.order.ranks == (0, 1)
        # rank 0 moves on to epoch 2: rank 1 still counts, with the next order of its last
        # good file (epoch 1)
        first = publish_rank(h, 0, 2)
        order = await wait_order(h, lambda o: o.epoch == 2)
        assert order.ranks == (0, 1) and order.files == (first, previous)
        assert order.current.tolist() == permutation(8, 0, 2).tolist()
        assert order.next is None  # rank 1's epoch 3 is not known yet

    run_with_watcher(tmp_path, body)


def test_ranks_that_do_not_fit_are_left_out_and_a_plain_order_overrides_them(tmp_path, caplog):
    async def body(h: Harness):
        stale = publish_rank(h, 1, 0, world_size=4)  # a file of an earlier job
        await wait_order(h, lambda o: o.ranks == (1,))
        mine = publish_rank(h, 0, 3)
        order = await wait_order(h, lambda o: o.epoch == 3)
        assert order.ranks == (0,) and order.files == (mine,)
        publication = h.watcher.status()["publications"][1]
        assert publication["file"] == stale.to_json() and not publication["in_force"]
        assert "world_size 4, but the newest publication" in publication["left_out"]
        single = write_order_file(h.path, epoch=9, current=np.arange(8))
        order = await wait_order(h, lambda o: o.epoch == 9)
        assert order.ranks is None and order.files == (single,)
        assert all(p["in_force"] == (p["path"] == "order.npz")
                   for p in h.watcher.status()["publications"])

    with caplog.at_level(logging.INFO, logger="cachefs.order_watch"):
        run_with_watcher(tmp_path, body)
    assert any("order.rank1.npz is not merged: world_size 4" in record.getMessage()
               and record.levelno == logging.WARNING for record in caplog.records)


def test_a_removed_rank_file_leaves_the_next_merge_but_not_the_order_in_force(tmp_path):
    async def body(h: Harness):
        publish_rank(h, 0, 1)
        publish_rank(h, 1, 1)
        await wait_order(h, lambda o: o.ranks == (0, 1))
        rank_order_path(h.path, 1).unlink()
        await h.watcher.check()
        assert h.watcher.order.ranks == (0, 1)  # deleting changes nothing by itself
        assert [p["path"] for p in h.watcher.status()["publications"]] == ["order.rank0.npz"]
        publish_rank(h, 0, 1, seed=1)
        assert (await wait_order(h, lambda o: o.file is not None)).ranks == (0,)

    run_with_watcher(tmp_path, body)


def test_ranks_publishing_with_their_own_manifest_objects_share_one(tmp_path):
    paths = [f"img_{i:02d}.jpg" for i in range(8)][::-1]

    async def body(h: Harness):
        for rank in (0, 1):
            write_order_file(rank_order_path(h.path, rank), epoch=0, current=np.arange(8),
                             files=paths, rank=rank, world_size=2)
        order = await wait_order(h, lambda o: o.ranks == (0, 1))
        assert order.manifest.path(0) == b"img_07.jpg"
        held = [p.order.manifest for p in h.watcher._by_rank.values()]
        assert held[0] is held[1] is order.manifest

    run_with_watcher(tmp_path, body)
