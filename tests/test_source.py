"""The source's remembered stats, the short memories they use, and the worker-thread hop."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from cachefs import source as source_mod
from cachefs import threads
from cachefs.freshness import Freshness
from conftest import release_fifo_readers, write_file


@pytest.fixture
def source_dir(tmp_path):
    for name in ("a", "b", "c", "d"):
        write_file(tmp_path / name, 1000 + ord(name))
    return tmp_path


def test_a_read_blocks_stat_answers_the_lookup_that_follows(source_dir):
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        block = await source.read_block(b"a", 0, 4096, background=True)
        st, seen_s = await source.lstat_recent(b"a", Freshness(60))
        assert st.st_size == len(block.data) == 1000 + ord("a")
        assert (st.st_mtime_ns, st.st_mode) == (block.stat.st_mtime_ns, block.stat.st_mode)
        assert seen_s <= trio.current_time()
        assert source.requests["lstat"] == 0 and source.stats_reused == 1
        # too old for the caller: asked again, and the answer replaces the remembered one
        os.truncate(source_dir / "a", 10)
        st, _ = await source.lstat_recent(b"a", Freshness(0))
        assert st.st_size == 10 and source.requests["lstat"] == 1
        st, _ = await source.lstat_recent(b"a", Freshness(60))
        assert st.st_size == 10 and source.stats_reused == 2

    trio.run(main)


def test_remembered_stats_are_bounded_oldest_first(source_dir, monkeypatch):
    monkeypatch.setattr(source_mod, "RECENT_STATS", 2)
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        for name in (b"a", b"b", b"c"):
            await source.lstat(name)
        await source.lstat_recent(b"b", Freshness(60))
        await source.lstat_recent(b"c", Freshness(60))
        assert source.stats_reused == 2 and source.requests["lstat"] == 3
        await source.lstat_recent(b"a", Freshness(60))  # forgotten: asked again
        assert source.requests["lstat"] == 4

    trio.run(main)


def test_a_missing_file_is_not_remembered(source_dir):
    source = source_mod.Source(source_dir, threads=4)

    async def main():
        with pytest.raises(FileNotFoundError):
            await source.lstat_recent(b"nothing", Freshness(60))
        with pytest.raises(FileNotFoundError):
            await source.lstat_recent(b"nothing", Freshness(60))
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


def test_a_cancelled_call_returns_at_once_and_keeps_its_slot_until_its_thread_ends():
    """A source call that hangs (an NFS hard mount) held the unmount for as long as it hung:
    a cancelled call returns at once, and its slot is given back only when its thread ends,
    so no more calls than slots ever run."""
    slots = threads.Slots(1)
    release = threading.Event()
    threading.Timer(5.0, release.set).start()  # the hang ends, whatever this test finds

    async def main():
        with trio.fail_after(10):
            started_s = time.monotonic()
            with trio.move_on_after(0.05) as scope:
                await threads.run_sync(slots, release.wait)
            assert scope.cancelled_caught and time.monotonic() - started_s < 2.0
            assert slots.in_use == 1  # the thread still runs
            with trio.move_on_after(0.05):
                await threads.run_sync(slots, lambda: "not before the first ends")
            release.set()
            assert await threads.run_sync(slots, lambda: "ok") == "ok"
            assert slots.free == 1

    trio.run(main)


def test_a_terminal_where_a_file_was_does_not_become_the_daemons_terminal():
    """The daemon (often root) opens a source path before it knows it is no regular file:
    a terminal there is refused, and does not become the controlling terminal of a daemon
    that has none (it did: the open had no O_NOCTTY)."""
    primary, secondary = os.openpty()
    name = os.ttyname(secondary)
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from cachefs.source import Source
os.setsid()  # no controlling terminal, as a daemon
try:
    Source({os.path.dirname(name)!r}, threads=1)._open({os.path.basename(name).encode()!r})
except OSError:
    pass
print(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4])
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=30)
    finally:
        os.close(primary)
        os.close(secondary)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"  # tty_nr: no controlling terminal


def test_a_held_descriptor_reads_as_a_look_of_when_it_was_opened(tmp_path):
    """A range read through a descriptor held open is of the file as it was when opened: one
    renamed over since is another. It counted as a look of now: its stat replaced a newer
    one in the memo that lookups are answered from (the old version given the kernel anew),
    and the range cache kept the old version's bytes, for up to the hold (half a TTL). Now
    its look is dated by the descriptor's age, and a change found lets the descriptor go."""
    from cachefs.freshness import Freshness

    (tmp_path / "f").write_bytes(b"a" * 100)
    source = source_mod.Source(tmp_path, threads=2)
    freshness = Freshness(60.0)
    clock = trio.testing.MockClock()

    async def main():
        old = await source.read_ranges(b"f", [(0, 10)], hold_s=30.0)
        assert old.data == b"a" * 10 and old.look_age_s < 0.05  # opened for this read
        time.sleep(0.05)  # the descriptor's age is on the system's clock
        (tmp_path / "g").write_bytes(b"b" * 200)
        os.rename(tmp_path / "g", tmp_path / "f")  # renamed over: another file
        clock.jump(1.0)
        new = source.identity_of(await source.lstat(b"f"))  # a look at the new file
        again = await source.read_ranges(b"f", [(0, 10)], hold_s=30.0)  # the held one
        assert again.data == b"a" * 10 and again.look_age_s >= 0.05
        st, _ = await source.lstat_recent(b"f", freshness)
        assert source.identity_of(st) == new  # the newer look stays the memo's
        source.distrust_stat(b"f", new)  # a change found: the descriptor goes
        fresh = await source.read_ranges(b"f", [(0, 10)], hold_s=30.0)
        assert fresh.data == b"b" * 10 and fresh.identity == new

    trio.run(main, clock=clock)


def test_a_held_file_not_read_again_is_let_go_after_its_hold(tmp_path, monkeypatch):
    """Range reads keep a file's descriptor for `hold_s`; one not read again is closed at the
    next use of another after that (it was kept until 64 others pushed it out: a file
    deleted at the source stayed alive, on NFS a .nfsXXXX file that failed rm -r)."""
    from cachefs import held_files

    monkeypatch.setattr(held_files, "SWEEP_S", 0.0, raising=False)
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    held = held_files.HeldFiles(lambda relpath: os.open(tmp_path / os.fsdecode(relpath),
                                                        os.O_RDONLY))
    fd_a, _ = held.use(b"a", 0.05, lambda fd: fd)
    assert os.readlink(f"/proc/self/fd/{fd_a}") == str(tmp_path / "a")
    (tmp_path / "a").unlink()
    time.sleep(0.1)
    held.use(b"b", 0.05, lambda fd: fd)
    assert not any(os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "a"))
                   for fd in map(int, os.listdir("/proc/self/fd"))
                   if os.path.exists(f"/proc/self/fd/{fd}"))
    held.close_all()


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


@pytest.fixture(params=["openat2", "walk"])
def resolution(request, monkeypatch):
    """Both ways of resolving beneath the source: openat2, and the walk used without it."""
    from cachefs import beneath

    if request.param == "openat2" and not beneath.HAVE_OPENAT2:
        pytest.skip("openat2 is not available here")
    monkeypatch.setattr(beneath, "HAVE_OPENAT2", request.param == "openat2")
    return request.param


def test_an_open_interrupted_by_a_signal_is_tried_again(tmp_path, monkeypatch):
    """An openat2 that a signal interrupts (EINTR: a network file system's open, in the
    thread that handles the daemon's signal) is made again, as Python's own opens are."""
    from cachefs import beneath

    if not beneath.HAVE_OPENAT2:
        pytest.skip("openat2 is not available here")
    write_file(tmp_path / "f", 10)
    real, calls = beneath._syscall, []

    def interrupted_once(*args):
        calls.append(args)
        if len(calls) == 1:
            ctypes.set_errno(errno.EINTR)
            return -1
        return real(*args)

    monkeypatch.setattr(beneath, "_syscall", interrupted_once)
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = beneath.open_beneath(root, b"f", os.O_RDONLY)
        assert os.read(fd, 100) == (tmp_path / "f").read_bytes()
        os.close(fd)
        assert len(calls) == 2
    finally:
        os.close(root)


def test_no_path_leads_out_of_the_source(tmp_path, resolution):
    """Links in the source, to a directory or a file outside it, are never followed: nothing
    outside is read, listed or stat'ed, whatever relative path the daemon is given."""
    outside = tmp_path / "outside"
    write_file(outside / "secret", 100, seed=1)
    os.setxattr(outside / "secret", "user.secret", b"x")
    src = tmp_path / "src"
    write_file(src / "sub" / "ok", 100, seed=2)
    os.symlink(outside, src / "etc")  # a directory link, absolute
    os.symlink("../../outside/secret", src / "sub" / "link")  # a file link, relative
    os.symlink("..", src / "sub" / "up")
    source = source_mod.Source(src, threads=2)
    escapes = [b"etc/secret", b"sub/link", b"sub/up/outside/secret", b"../outside/secret",
               b"sub/../../outside/secret", str(outside / "secret").encode()]

    async def main():
        assert (await source.read_block(b"sub/ok", 0, 4096)).data == \
            (src / "sub" / "ok").read_bytes()
        for relpath in escapes:
            with pytest.raises(OSError):
                await source.read_block(relpath, 0, 4096, background=True)
            with pytest.raises(OSError):
                await source.check_readable(relpath)
            with pytest.raises(OSError) as raised:
                await source.getxattr(relpath, b"user.secret")
            # refused, not looked up (a link's own attributes are the link's: it has none)
            assert raised.value.errno != errno.ENODATA or relpath == b"sub/link"
        for relpath in (b"etc/secret", b"sub/up/outside/secret"):
            with pytest.raises(OSError):
                await source.lstat(relpath)
        for relpath in (b"etc", b"sub/up", b"sub/up/outside"):
            with pytest.raises(OSError):
                await source.listdir(relpath)
        # the links themselves are what the mount shows: links, with their targets
        assert stat.S_ISLNK((await source.lstat(b"etc")).st_mode)
        assert stat.S_ISLNK((await source.lstat(b"sub/link")).st_mode)
        assert await source.readlink(b"etc") == os.fsencode(outside)
        assert [name for name, _ in await source.listdir(b"sub")] == [b"link", b"ok", b"up"]
        assert [name for name, _ in await source.listdir(b"")] == [b"etc", b"sub"]

    trio.run(main)


def test_a_fifo_in_the_source_is_refused_not_waited_on(tmp_path, resolution):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    source = source_mod.Source(tmp_path, threads=2)
    done = threading.Event()

    def let_go():
        """Without the fix a reader waits in open() for a writer: be one, so the test ends."""
        while not done.wait(2.0):
            release_fifo_readers(fifo)

    async def main():
        started = time.monotonic()
        with pytest.raises(OSError):
            await source.read_block(b"fifo", 0, 4096)
        with pytest.raises(OSError):
            await source.check_readable(b"fifo")
        assert time.monotonic() - started < 1.5  # refused at once, not after a writer came

    helper = threading.Thread(target=let_go)
    helper.start()
    try:
        trio.run(main)
    finally:
        done.set()
        helper.join()


@pytest.mark.parametrize("new_size", [300, 2000], ids=["shorter", "same-size"])
@pytest.mark.parametrize("ranged", [False, True], ids=["block", "ranges"])
def test_a_file_rewritten_while_it_is_read_is_read_again(tmp_path, monkeypatch, new_size,
                                                         ranged):
    """A rewrite in place (truncate, then write: np.save, torch.save, cp) between a read's
    fstat and its pread gave bytes cut short, or of the new version, with the old identity,
    which the tiers then kept and served: the bytes returned are always of the identity
    returned with them."""
    path = tmp_path / "f"
    path.write_bytes(b"o" * 2000)
    old_ns = path.stat().st_mtime_ns
    real_pread = source_mod.pread_full
    rewrites = []

    def pread_racing_a_writer(fd, size, offset):
        if not rewrites:
            rewrites.append(1)
            path.write_bytes(b"n" * new_size)
            os.utime(path, ns=(old_ns + 10**9, old_ns + 10**9))
        return real_pread(fd, size, offset)

    monkeypatch.setattr(source_mod, "pread_full", pread_racing_a_writer)
    source = source_mod.Source(tmp_path, threads=1)
    block = (source.read_ranges_sync(b"f", [(0, 4096)]) if ranged
             else source.read_block_sync(b"f", 0, 4096))
    assert block.data == b"n" * new_size
    assert block.identity == source.identity_of(os.stat(path))


def test_a_file_that_keeps_changing_while_read_fails_with_eio(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"o" * 2000)
    real_pread = source_mod.pread_full

    def pread_racing_a_writer(fd, size, offset):
        stamp = path.stat().st_mtime_ns + 10**9
        os.utime(path, ns=(stamp, stamp))
        return real_pread(fd, size, offset)

    monkeypatch.setattr(source_mod, "pread_full", pread_racing_a_writer)
    source = source_mod.Source(tmp_path, threads=1)
    with pytest.raises(OSError) as caught:
        source.read_block_sync(b"f", 0, 4096)
    assert caught.value.errno == errno.EIO and "changed each of the 3 times" in str(caught.value)


def test_an_entry_the_source_cannot_stat_leaves_the_others_listed(tmp_path, monkeypatch):
    """One entry whose lstat fails (EIO of an object store, a stale NFS handle) made the
    whole directory unlistable; it is left out, as ls leaves it."""
    for name in ("a", "bad", "c"):
        write_file(tmp_path / name, 10)
    real_lstat = os.lstat

    def lstat(path, *, dir_fd=None):
        if path == b"bad":
            raise OSError(errno.EIO, "Input/output error")
        return real_lstat(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "lstat", lstat)
    source = source_mod.Source(tmp_path, threads=1)
    assert [name for name, _ in trio.run(source.listdir, b"")] == [b"a", b"c"]


def test_a_directory_gone_while_it_is_listed_fails_as_one_call_would(tmp_path, monkeypatch):
    """A directory removed between the read of its names and their lstats (which run in
    several calls at once) fails the listing with its OSError, not an exception group that
    the callers' `except OSError` lets through: the kernel got EIO for an ENOENT, and a
    READDIR's rewind failed."""
    directory = tmp_path / "gone"
    for i in range(300):
        write_file(directory / f"f{i:03d}", 1)
    source = source_mod.Source(tmp_path, threads=1)
    names_in = source._names_in

    def names_then_gone(relpath):
        names = names_in(relpath)
        subprocess.run(["rm", "-rf", str(directory)], check=True)
        return names

    monkeypatch.setattr(source, "_names_in", names_then_gone)
    with pytest.raises(FileNotFoundError):
        trio.run(source.listdir, b"gone")


class SlowLstat:
    """os.lstat taking `delay_s` (a network source's round trip: calls overlap only if they
    run at once), counting the calls in flight at once (`most`). A lookup's stat is an
    fstat (`Source.lstat_sync`), so only listings' lstats are slowed and counted."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.real = os.lstat
        self.in_flight = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, path, *, dir_fd=None):
        with self._lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.delay_s)
            return self.real(path, dir_fd=dir_fd)
        finally:
            with self._lock:
                self.in_flight -= 1


def test_a_large_directory_is_stat_ed_in_several_calls_at_once(tmp_path, monkeypatch):
    """A listing's lstats ran one after the other in one thread: on network storage busy
    with the read-ahead, each waited its turn there, and a directory of 1,000 files took
    seconds. They run in a few calls at once now, and the listing is the same: every entry
    with its own lstat, sorted by name."""
    names = [f"f{i:03d}".encode() for i in range(300)]
    for name in reversed(names):
        (tmp_path / os.fsdecode(name)).write_bytes(name)
    slow_lstat = SlowLstat(0.002)
    monkeypatch.setattr(os, "lstat", slow_lstat)
    source = source_mod.Source(tmp_path, threads=1)
    entries = trio.run(source.listdir, b"")
    monkeypatch.undo()
    assert [name for name, _ in entries] == names
    for name, st in entries:
        assert (st.st_ino, st.st_size) == (os.lstat(tmp_path / os.fsdecode(name)).st_ino,
                                           len(name))
    assert 2 <= slow_lstat.most <= source_mod.LISTING_STAT_CALLS


def test_directories_listed_together_leave_demand_slots_to_a_reader(tmp_path, monkeypatch):
    """The read-ahead's stores reach a data set's directories at once, and each listing took
    up to LISTING_STAT_CALLS of the eight demand slots: five directories took them all, and a
    reader's lookup of a file the read-ahead had not read waited for the listings to end.
    Listings have slots of their own now: a lookup made while they run is answered before
    any of them ends, the listings run together (within LISTING_THREADS calls in all), and
    each is whole."""
    dirs = [f"d{i}" for i in range(5)]
    for directory in dirs:
        (tmp_path / directory).mkdir()
        for i in range(256):  # four calls of LISTING_STAT_MIN_NAMES each
            (tmp_path / directory / f"f{i:03d}").write_bytes(b"x")
    (tmp_path / "wanted").write_bytes(b"w")
    slow_lstat = SlowLstat(0.004)  # a busy network source's round trip
    monkeypatch.setattr(os, "lstat", slow_lstat)
    source = source_mod.Source(tmp_path, threads=1)
    listed: dict[str, tuple[list, float]] = {}

    async def main():
        async def list_one(directory: str) -> None:
            entries = await source.listdir(directory.encode())
            listed[directory] = (entries, trio.current_time())

        async with trio.open_nursery() as nursery:
            for directory in dirs:
                nursery.start_soon(list_one, directory)
            await trio.sleep(0.05)  # every listing has started its calls
            assert (await source.lstat(b"wanted")).st_size == 1
            answered_s = trio.current_time()
        return answered_s

    answered_s = trio.run(main)
    monkeypatch.undo()
    assert source_mod.LISTING_STAT_CALLS < slow_lstat.most <= source_mod.LISTING_THREADS
    assert answered_s < min(ended_s for _, ended_s in listed.values())
    for entries, _ in listed.values():
        assert [name for name, _ in entries] == [f"f{i:03d}".encode() for i in range(256)]


def test_a_file_always_shorter_than_its_size_is_served_as_it_reads(tmp_path, monkeypatch):
    """A source whose sizes are estimates (the read ends before the size, the file never
    changing) is read as before, not failed with EIO after the re-reads."""
    (tmp_path / "f").write_bytes(b"x" * 2000)
    real_pread = source_mod.pread_full
    reads = []

    def short(fd, size, offset):
        reads.append(offset)
        return real_pread(fd, size, offset)[:-10]

    monkeypatch.setattr(source_mod, "pread_full", short)
    source = source_mod.Source(tmp_path, threads=1)
    assert source.read_block_sync(b"f", 0, 4096).data == b"x" * 1990
    assert len(reads) == 2  # read once more (a rewrite may have raced it), not three times


def test_a_short_read_after_a_change_is_read_again(tmp_path, monkeypatch):
    """A short read counts towards "short twice with no change between" only after another
    short read of the same version: one that follows a change (a rewrite in flight, which may
    not be done yet) was served as it read."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 2000)
    real_pread = source_mod.pread_full
    reads = []

    def short(fd, size, offset):
        reads.append(offset)
        if len(reads) == 1:
            path.write_bytes(b"y" * 3000)  # rewritten in place while the first read ran
        return real_pread(fd, size, offset)[:-10]

    monkeypatch.setattr(source_mod, "pread_full", short)
    source = source_mod.Source(tmp_path, threads=1)
    block = source.read_block_sync(b"f", 0, 4096)
    assert block.data == b"y" * 2990 and block.identity.size == 3000
    assert len(reads) == 3
