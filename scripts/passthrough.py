"""A bare pyfuse3 + trio read-only passthrough: the ceiling of cachefs's stack, for benchmarks.

It does what any FUSE file system must and nothing else: LOOKUP/GETATTR/READDIR(PLUS) from
lstat, OPEN (an fd of the source file), READ (an inline pread: the source is in the page cache
when benchmarks time it), RELEASE, FLUSH answered ENOSYS once (as cachefs does). No cache, no
accounting, no thread hops. With `--keep-cache` opens are answered with keep_cache, so the
kernel serves the second pass of a file from its page cache: the fastest this stack can serve
files without pushing them (`scripts/bench_fuse.py` runs it beside cachefs).

Usage: python scripts/passthrough.py SOURCE MOUNTPOINT [--keep-cache]
Runs in the foreground until unmounted (fusermount3 -u) or signalled.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

TIMEOUT_S = 300.0  # entries and attributes, as cachefs's --kernel-timeout default
READ_AHEAD_KB = 1024  # as cachefs sets it for its mounts (root only)


class Passthrough(pyfuse3.Operations):
    def __init__(self, root: bytes, keep_cache: bool):
        super().__init__()
        self.root = root
        self.keep_cache = keep_cache
        self.paths = {pyfuse3.ROOT_INODE: root}
        self.inode_of = {root: pyfuse3.ROOT_INODE}
        self.next_inode = pyfuse3.ROOT_INODE + 1

    def _inode(self, path: bytes) -> int:
        inode = self.inode_of.get(path)
        if inode is None:
            inode = self.inode_of[path] = self.next_inode
            self.paths[inode] = path
            self.next_inode += 1
        return inode

    def _attrs(self, inode: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(attrs, name, getattr(st, name))
        attrs.st_ino = inode
        attrs.entry_timeout = attrs.attr_timeout = TIMEOUT_S
        attrs.st_blksize, attrs.st_blocks = st.st_blksize, st.st_blocks
        return attrs

    async def lookup(self, parent_inode, name, ctx=None):
        path = os.path.join(self.paths[parent_inode], name)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attrs(self._inode(path), st)

    async def getattr(self, inode, ctx=None):
        return self._attrs(inode, os.lstat(self.paths[inode]))

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, inode, start_id, token):
        path = self.paths[inode]
        names = sorted(os.listdir(path))
        for index in range(start_id, len(names)):
            child = os.path.join(path, names[index])
            st = os.lstat(child)
            if not pyfuse3.readdir_reply(token, names[index],
                                         self._attrs(self._inode(child), st), index + 1):
                return

    async def open(self, inode, flags, ctx):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        fd = os.open(self.paths[inode], os.O_RDONLY | os.O_CLOEXEC)
        return pyfuse3.FileInfo(fh=fd, keep_cache=self.keep_cache)

    async def read(self, fh, offset, size):
        return os.pread(fh, size, offset)

    async def flush(self, fh):
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh):
        os.close(fh)


async def _serve(mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_raise_read_ahead, mountpoint)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(_terminate_on, signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()


async def _terminate_on(signals) -> None:
    async for _ in signals:
        pyfuse3.terminate()
        return


async def _raise_read_ahead(mountpoint: str) -> None:
    """The mount's kernel read-ahead as cachefs sets its own (once INIT is answered)."""
    from cachefs.mountinfo import mountinfo

    await trio.to_thread.run_sync(os.stat, mountpoint)
    target = os.fsencode(os.path.abspath(mountpoint))
    devices = [m.device for m in mountinfo() if m.point == target]
    if devices:
        try:
            with open(f"/sys/class/bdi/{devices[-1]}/read_ahead_kb", "w") as f:
                f.write(str(READ_AHEAD_KB))
        except OSError:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--keep-cache", action="store_true")
    args = parser.parse_args(argv)
    root = os.fsencode(os.path.realpath(args.source))
    if not stat.S_ISDIR(os.stat(root).st_mode):
        parser.error(f"{args.source} is not a directory")
    ops = Passthrough(root, args.keep_cache)
    options = set(pyfuse3.default_options) | {"fsname=passthrough", "ro"}
    pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(_serve, args.mountpoint)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
