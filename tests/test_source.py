"""The source's remembered stats, the short memories they use, and the worker-thread hop."""

from __future__ import annotations

import os
import threading
import time

import pytest
import trio

from cachefs import source as source_mod
from cachefs import threads
from conftest import write_file


@pytest.fixture
def source_dir(tmp_path):
    for name in ("a", "b", "c", "d"):
        write_file(tmp_path / name, 1000 + ord(name))
    return tmp_path


def test_a_read_blocks_stat_answers_the_lookup_that_follows(source_dir):
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        block = await source.read_block(b"a", 0, 4096, background=True)
        st, seen_s = await source.lstat_recent(b"a", max_age_s=60)
        assert st.st_size == len(block.data) == 1000 + ord("a")
        assert (st.st_mtime_ns, st.st_mode) == (block.stat.st_mtime_ns, block.stat.st_mode)
        assert seen_s <= time.monotonic()
        assert source.requests["lstat"] == 0 and source.stats_reused == 1
        # too old for the caller: asked again, and the answer replaces the remembered one
        os.truncate(source_dir / "a", 10)
        st, _ = await source.lstat_recent(b"a", max_age_s=0)
        assert st.st_size == 10 and source.requests["lstat"] == 1
        st, _ = await source.lstat_recent(b"a", max_age_s=60)
        assert st.st_size == 10 and source.stats_reused == 2

    trio.run(main)


def test_remembered_stats_are_bounded_oldest_first(source_dir, monkeypatch):
    monkeypatch.setattr(source_mod, "RECENT_STATS", 2)
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        for name in (b"a", b"b", b"c"):
            await source.lstat(name)
        await source.lstat_recent(b"b", max_age_s=60)
        await source.lstat_recent(b"c", max_age_s=60)
        assert source.stats_reused == 2 and source.requests["lstat"] == 3
        await source.lstat_recent(b"a", max_age_s=60)  # forgotten: asked again
        assert source.requests["lstat"] == 4

    trio.run(main)


def test_a_missing_file_is_not_remembered(source_dir):
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        with pytest.raises(FileNotFoundError):
            await source.lstat_recent(b"nothing", max_age_s=60)
        with pytest.raises(FileNotFoundError):
            await source.lstat_recent(b"nothing", max_age_s=60)
        assert source.requests["lstat"] == 2 and source.stats_reused == 0

    trio.run(main)


def test_run_sync_returns_raises_and_bounds_calls_in_flight():
    slots = threads.Slots(2)
    running, most = [0], [0]
    lock = threading.Lock()

    def work(value):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return value * 2

    async def main():
        results = []

        async def call(value):
            results.append(await threads.run_sync(slots, work, value))

        async with trio.open_nursery() as nursery:
            for value in range(6):
                nursery.start_soon(call, value)
        assert sorted(results) == [0, 2, 4, 6, 8, 10]
        with pytest.raises(ZeroDivisionError):
            await threads.run_sync(slots, lambda: 1 / 0)

    trio.run(main)
    assert most[0] == 2
    assert slots.free == 2


def test_a_call_cancelled_while_waiting_for_a_slot_gives_it_back():
    slots = threads.Slots(1)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(threads.run_sync, slots, time.sleep, 0.05)
            await trio.sleep(0.01)  # the slot is taken
            with trio.move_on_after(0.01):
                await threads.run_sync(slots, time.sleep, 0)
        # the running call finished, the cancelled one never ran: every slot is free again
        assert slots.free == 1 and slots.in_use == 0
        assert await threads.run_sync(slots, lambda: "ok") == "ok"

    trio.run(main)


def test_recent_map_keeps_the_newest_keys():
    from cachefs.recent import RecentMap

    recent = RecentMap(2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.put("a", 3)  # "a" is the newest now
    recent.put("c", 4)  # drops "b", the oldest
    assert dict(recent) == {"a": 3, "c": 4}
    with pytest.raises(ValueError):
        RecentMap(0)
