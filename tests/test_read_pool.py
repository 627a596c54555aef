"""The read pool (cachefs/read_pool.py, cachefs/_readpool.c): block reads in threads without
the GIL, as the source reads them, and the source's use of it."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cachefs import read_pool
from cachefs import source as source_mod
from cachefs.threads import Slots
from conftest import wait_for, write_file


def test_the_read_pool_is_built_here():
    """The package's install builds it (setup.py), and CI must run the code users get: a
    machine without a C compiler installs without it, and these tests would skip it."""
    assert read_pool.available(), "cachefs._readpool is not built: pip install -e . again"


needs_pool = pytest.mark.skipif(not read_pool.available(), reason="cachefs._readpool not built")


def pool_of(root) -> read_pool.ReadPool:
    return read_pool.ReadPool(os.open(root, os.O_PATH | os.O_DIRECTORY), threads=4)


@needs_pool
def test_a_pool_read_gives_the_bytes_and_the_stats_of_one_open_file(tmp_path):
    data = write_file(tmp_path / "f", 10_000).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(4)

    async def main():
        whole = await pool.read(slots, b"f", 0, 1 << 20)
        assert whole.data == data
        st = os.stat(tmp_path / "f")
        assert whole.before == st  # os.stat_result compares its fields
        assert whole.before.st_mtime_ns == st.st_mtime_ns and whole.before.st_ino == st.st_ino
        assert whole.after == (st.st_size, st.st_mtime_ns, st.st_ino)
        assert whole.elapsed_s > 0
        part = await pool.read(slots, b"f", 4096, 4096)
        assert part.data == data[4096:8192]
        assert (await pool.read(slots, b"f", 8192, 4096)).data == data[8192:]
        assert (await pool.read(slots, b"f", 20_000, 4096)).data == b""
        assert slots.free == 4

    trio.run(main)
    pool.close()


@needs_pool
def test_a_read_given_the_size_it_expects_lands_in_the_object_returned(tmp_path):
    """`size_hint`: the bytes object is made at submit and read into; one too long is
    shortened to what was read; one too short is not used, and the read gets the whole
    block all the same (it stopped at the hint, and the source read the block again)."""
    data = write_file(tmp_path / "f", 10_000).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(2)

    async def main():
        for hint in (10_000, 50_000, 1, 9_999):
            got = await pool.read(slots, b"f", 0, 1 << 20, size_hint=hint)
            assert got.data == data and type(got.data) is bytes
        assert (await pool.read(slots, b"f", 4096, 4096, size_hint=100)).data == data[4096:8192]
        assert (await pool.read(slots, b"f", 8192, 4096, size_hint=4096)).data == data[8192:]
        with pytest.raises(FileNotFoundError):
            await pool.read(slots, b"missing", 0, 4096, size_hint=4096)

    trio.run(main)
    pool.close()


@needs_pool
def test_reads_many_at_once_each_get_their_own_bytes(tmp_path):
    """More reads than threads, finished in batches: every task wakes with its file."""
    files = {f"f{index}".encode(): write_file(tmp_path / f"f{index}", 100 + index * 37,
                                              seed=index).read_bytes()
             for index in range(200)}
    pool, slots = pool_of(tmp_path), Slots(4)
    got = {}

    async def main():
        async def one(name):
            hint = len(files[name]) if int(name[1:]) % 2 else 0  # both ways of landing
            got[name] = (await pool.read(slots, name, 0, 1 << 20, size_hint=hint)).data
        async with trio.open_nursery() as nursery:
            for name in files:
                nursery.start_soon(one, name)

    trio.run(main)
    assert got == files
    pool.close()


@needs_pool
def test_a_pool_read_refuses_what_the_source_never_reads(tmp_path):
    """Links (ELOOP), a way out (EXDEV), a directory (EISDIR), a missing file (ENOENT) and a
    FIFO (EINVAL, at once: opened non-blocking, no writer needed), each an OSError with its
    path; the slot comes back each time."""
    write_file(tmp_path / "f", 10)
    (tmp_path / "link").symlink_to("f")
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "fifo")
    pool, slots = pool_of(tmp_path), Slots(1)

    async def main():
        for relpath, code in [(b"link", errno.ELOOP), (b"../" + tmp_path.name.encode() + b"/f",
                                                      errno.EXDEV),
                              (b"d", errno.EISDIR), (b"missing", errno.ENOENT),
                              (b"fifo", errno.EINVAL)]:
            with pytest.raises(OSError) as caught:
                await pool.read(slots, relpath, 0, 4096)
            assert caught.value.errno == code and caught.value.filename == relpath
        assert slots.free == 1

    trio.run(main)
    pool.close()


@needs_pool
def test_a_cancelled_read_returns_at_once_and_keeps_its_slot_until_its_thread_is_done(tmp_path):
    write_file(tmp_path / "f", 10)
    pool, slots = pool_of(tmp_path), Slots(1)

    async def main():
        started_s = time.monotonic()
        with trio.move_on_after(0.05):
            await pool.read(slots, b"f", 0, 4096, delay_s=0.4)  # sleeps before open and read
        assert time.monotonic() - started_s < 0.3
        assert slots.free == 0  # the thread is still in the read
        await wait_until(lambda: slots.free == 1)  # its 0.8 s of sleeps
        assert (await pool.read(slots, b"f", 0, 4096)).data == (tmp_path / "f").read_bytes()

    trio.run(main)
    pool.close()


@needs_pool
def test_a_pool_serves_several_trio_runs_and_a_close_inside_one(tmp_path):
    """A source outlives one trio run in tests and in `cachefs warm`: each run collects. A
    close inside a run ends its collecting task with no error, and a later read starts a new
    pool."""
    data = write_file(tmp_path / "f", 100).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(2)

    async def read_once():
        assert (await pool.read(slots, b"f", 0, 4096)).data == data

    async def read_close_read():
        await read_once()
        pool.close()
        await trio.sleep(0.05)  # the collecting task ends
        await read_once()

    trio.run(read_once)
    trio.run(read_once)
    trio.run(read_close_read)
    pool.close()


@needs_pool
def test_a_close_ends_the_reads_in_flight_and_the_pool_after_it_reads(tmp_path):
    """A close drops the pool's results: a task waiting for one gets ECANCELED, the slot of
    a cancelled one goes back (it came back only with the result, and the next read waited
    for it forever), and a close before the first read's collecting task has run leaves that
    task nothing to do (it looked for the pool when it ran, not when it was started, and
    failed an assertion, which ends the trio run)."""
    data = write_file(tmp_path / "f", 100).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(2)

    async def main():
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled in its wait, before the collecting task has run
            await pool.read(slots, b"f", 0, 4096, delay_s=0.2)
        pool.close()
        assert slots.free == 2
        assert (await pool.read(slots, b"f", 0, 4096)).data == data

        async def waits():
            with pytest.raises(OSError) as raised:
                await pool.read(slots, b"f", 0, 4096, delay_s=0.3)
            assert raised.value.errno == errno.ECANCELED

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waits)
            await trio.sleep(0.05)  # the read is in its thread
            pool.close()
        assert slots.free == 2
        assert (await pool.read(slots, b"f", 0, 4096)).data == data

    for _ in range(5):
        trio.run(main)
    pool.close()


@needs_pool
def test_a_batch_of_reads_lost_to_memory_fails_its_reads_and_the_pool_reads_on(tmp_path):
    """No memory for the list of a batch of finished reads (`completed()` raising
    MemoryError) lost the batch and ended the collecting task, and the trio run with it: now
    each read waited for fails with ENOMEM, and the pool's next reads are served."""
    from cachefs import _readpool

    data = write_file(tmp_path / "f", 10_000).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(4)

    class OutOfMemoryOnce:
        """The pool, whose first `completed()` finds no memory."""

        def __init__(self, real):
            self.real, self.failed = real, False

        def completed(self):
            if not self.failed:
                self.failed = True
                self.real.completed()  # the batch is taken, and lost
                raise MemoryError
            return self.real.completed()

        def __getattr__(self, name):
            return getattr(self.real, name)

    pool._pool = OutOfMemoryOnce(_readpool.Pool(pool._root_fd, 4))

    async def main():
        with pytest.raises(OSError) as raised:
            await pool.read(slots, b"f", 0, 1 << 20)
        assert raised.value.errno == errno.ENOMEM
        assert (await pool.read(slots, b"f", 0, 1 << 20)).data == data
        assert slots.free == 4

    trio.run(main)
    pool.close()


NO_ROOM_FOR_THE_BYTES = """
import errno, os, resource, time, trio, trio.testing
from cachefs import read_pool
from cachefs.threads import Slots
pool, slots = read_pool.ReadPool(os.open(".", os.O_PATH | os.O_DIRECTORY), threads=2), Slots(2)
got = {}
async def read(name):
    try:
        got[name] = (await pool.read(slots, name, 0, 1 << 30)).data.decode()[:5]
    except OSError as exc:
        got[name] = errno.errorcode[exc.errno]
async def main():
    await read(b"small")  # the threads started
    size = [line for line in open("/proc/self/status") if line.startswith("VmSize")][0]
    # room for the thread's buffer of the file, not for the bytes object it is copied into
    resource.setrlimit(resource.RLIMIT_AS, (int(size.split()[1]) * 1024 + 100_000_000,
                                            resource.RLIM_INFINITY))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, b"big")
        nursery.start_soon(read, b"small")
        await trio.testing.wait_all_tasks_blocked()  # both submitted
        time.sleep(1)  # both read while the trio thread waits: one batch of two
    print(got[b"big"], got[b"small"])
    await read(b"small")
    print(got[b"small"])
trio.run(main)
"""


@needs_pool
def test_a_read_with_no_memory_for_its_bytes_fails_alone(tmp_path):
    """A finished read whose bytes find no memory (a read with no size expected, copied
    out of its thread's buffer) fails with ENOMEM, and the read finished in the same batch
    is served (the batch was lost whole), and so are the pool's next reads."""
    (tmp_path / "big").write_bytes(os.urandom(64_000_000))
    (tmp_path / "small").write_bytes(b"hello")
    done = subprocess.run([sys.executable, "-c", NO_ROOM_FOR_THE_BYTES], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ENOMEM", "hello", "hello"]


@needs_pool
def test_the_pools_threads_block_every_signal(tmp_path):
    """A signal for the daemon is handled by a Python thread, never inside a pool read:
    there it interrupted a network file system's open or stat, which failed the read with
    EINTR (the source retries an interrupted read, not an interrupted open)."""
    pool, slots = pool_of(tmp_path), Slots(1)
    write_file(tmp_path / "f", 10)
    trio.run(pool.read, slots, b"f", 0, 10)  # the pool and its threads start with a read
    def blocked(status: str) -> int:
        return int(status.split("SigBlk:")[1].split()[0], 16)

    def pool_threads() -> dict[str, int]:
        """The signal mask of each thread of this pool that has named itself by now (the
        threads of the other tests' closed pools end meanwhile)."""
        masks = {}
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "comm").read_text().strip() == "cachefs-read":
                    masks[task.name] = blocked((task / "status").read_text())
            except FileNotFoundError:
                pass  # a thread that ended
        return masks

    try:
        wait_for(lambda: len(pool_threads()) >= 4)
        masks = pool_threads()
        assert masks
        # all 64 signals but the C library's two for its threads, and SIGKILL and SIGSTOP,
        # which no thread can block
        assert all(bin(mask).count("1") == 60 for mask in masks.values()), masks
        own = blocked(Path("/proc/thread-self/status").read_text())
        assert bin(own).count("1") < 60  # the creating thread's mask is as it was
    finally:
        pool.close()


@needs_pool
def test_the_source_reads_its_blocks_through_the_pool(tmp_path):
    data = write_file(tmp_path / "f", 300_000).read_bytes()
    source = source_mod.Source(tmp_path, threads=2)
    assert source.status()["block_reads"] == "read pool"
    sync_reads = []
    real_sync = source.read_block_sync
    source.read_block_sync = lambda *args: sync_reads.append(args) or real_sync(*args)

    async def main():
        for index in range(3):
            block = await source.read_block(b"f", index, 131_072, background=index == 1,
                                            expected_bytes=131_072 if index < 2 else 0)
            assert block.data == data[index * 131_072:(index + 1) * 131_072]
            assert block.identity == source.identity_of(os.stat(tmp_path / "f"))
        with pytest.raises(OSError) as caught:
            await source.read_block(b"a/../f", 0, 4096)
        assert caught.value.errno == errno.EXDEV
        # expected shorter than the file is now (it grew, or its size was estimated): the
        # pool reads the block whole all the same, and nothing reads it again
        block = await source.read_block(b"f", 0, 131_072, expected_bytes=1000)
        assert block.data == data[:131_072]
        assert sync_reads == []

    trio.run(main)
    assert source.requests["block_read"] == 5


@needs_pool
@pytest.mark.parametrize("after", ["changed", "short"])
def test_a_pool_read_of_two_versions_is_read_again_with_the_sources_retries(tmp_path,
                                                                            monkeypatch, after):
    """The fstat after the pool's read says another version, or the read got less than its
    size: the source reads the block again in a worker thread (`_one_version`'s rules)."""
    data = write_file(tmp_path / "f", 5000).read_bytes()
    st = os.stat(tmp_path / "f")
    real_read = read_pool.ReadPool.read

    async def racing_read(self, slots, relpath, offset, max_bytes, delay_s=0.0, size_hint=0):
        got = await real_read(self, slots, relpath, offset, max_bytes, delay_s, size_hint)
        if after == "changed":
            return read_pool.PoolRead(b"o" * 5000, got.before,
                                      (st.st_size, st.st_mtime_ns + 1, st.st_ino),
                                      got.elapsed_s)
        return read_pool.PoolRead(got.data[:100], got.before, got.after, got.elapsed_s)

    monkeypatch.setattr(read_pool.ReadPool, "read", racing_read)
    source = source_mod.Source(tmp_path, threads=2)
    sync_reads = []
    real_sync = source.read_block_sync
    source.read_block_sync = lambda *args: sync_reads.append(args) or real_sync(*args)

    async def main():
        return await source.read_block(b"f", 0, 8192)

    assert trio.run(main).data == data
    assert sync_reads == [(b"f", 0, 8192)]


def test_without_the_pool_the_source_reads_in_worker_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(read_pool, "_readpool", None)
    data = write_file(tmp_path / "f", 5000).read_bytes()
    source = source_mod.Source(tmp_path, threads=2)
    assert source.status()["block_reads"] == "worker threads"

    async def main():
        return await source.read_block(b"f", 0, 8192)

    assert trio.run(main).data == data


@needs_pool
def test_a_read_begun_with_no_task_hands_its_outcome_to_on_done(tmp_path, caplog):
    """`start`: begun only with a slot free at once (else False, nothing taken), its outcome
    handed to `on_done` on the trio thread after `start` returned, its slot back before; an
    error is its errno; an `on_done` that raises is logged and the pool reads on; a close
    tells the reads begun, and gives their slots back."""
    data = write_file(tmp_path / "f", 10_000).read_bytes()
    pool, slots = pool_of(tmp_path), Slots(1)
    told = []

    def on_done(errno_, read):
        told.append((errno_, None if read is None else read.data, slots.free))

    async def main():
        assert pool.start(slots, b"f", 0, 1 << 20, 0.0, 10_000, on_done)
        assert told == [] and slots.free == 0
        assert not pool.start(slots, b"f", 0, 1 << 20, 0.0, 0, on_done)  # no slot free
        await wait_until(lambda: told)
        assert told == [(0, data, 1)]
        assert pool.start(slots, b"missing", 0, 4096, 0.0, 0, on_done)
        await wait_until(lambda: len(told) == 2)
        assert told[1] == (errno.ENOENT, None, 1)

        def raises(errno_, read):
            raise RuntimeError("a bug in on_done")
        assert pool.start(slots, b"f", 0, 4096, 0.0, 0, raises)
        await wait_until(lambda: "a bug in on_done" in caplog.text and slots.free == 1)
        assert (await pool.read(slots, b"f", 0, 4096)).data == data[:4096]
        assert pool.start(slots, b"f", 0, 4096, 0.3, 0, on_done)  # sleeps in its thread
        await trio.sleep(0.05)
        pool.close()
        assert told[2] == (errno.ECANCELED, None, 1)

    trio.run(main)
    pool.close()


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.005)


@needs_pool
@pytest.mark.parametrize("after", ["same", "changed", "missing"])
def test_the_source_begins_a_block_read_with_no_task(tmp_path, monkeypatch, after):
    """`Source.start_block`: the block and its identity, counted and its fstat remembered as
    `read_block`'s; None for a read of two versions (which the caller makes again with
    `read_block`); the OSError of a read that failed; False with no free thread."""
    data = write_file(tmp_path / "f", 5000).read_bytes()
    st = os.stat(tmp_path / "f")
    if after == "changed":
        real_start = read_pool.ReadPool.start

        def racing_start(self, slots, relpath, offset, max_bytes, delay_s, size_hint, on_done):
            def changed(errno_, read):
                on_done(errno_, read_pool.PoolRead(
                    read.data, read.before, (st.st_size, st.st_mtime_ns + 1, st.st_ino),
                    read.elapsed_s))
            return real_start(self, slots, relpath, offset, max_bytes, delay_s, size_hint,
                              changed)
        monkeypatch.setattr(read_pool.ReadPool, "start", racing_start)
    source = source_mod.Source(tmp_path, threads=1)
    told = []
    relpath = b"missing" if after == "missing" else b"f"

    async def main():
        assert source.start_block(relpath, 0, 8192, item=0, expected_bytes=5000,
                                  on_done=lambda *outcome: told.append(outcome))
        assert not source.start_block(b"f", 0, 8192, item=0, expected_bytes=5000,
                                      on_done=lambda *outcome: told.append(outcome))
        await wait_until(lambda: told)

    trio.run(main)
    block, error = told[0]
    # a read of two versions is counted by the `read_block` that makes it again
    assert source.requests["block_read"] == (0 if after == "changed" else 1)
    if after == "same":
        assert error is None and block.data == data
        assert block.identity == source.identity_of(st)
        assert sum(source.read_seconds.counts) == 1
        assert source._recent_stats.get(b"f")[0].st_mtime_ns == st.st_mtime_ns
    elif after == "changed":
        assert (block, error) == (None, None)
    else:
        assert block is None and error.errno == errno.ENOENT
