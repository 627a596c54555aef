"""The pyfuse3 that scripts/setup.sh builds (scripts/patches/), seen through the kernel.

A file system of a few lines in a subprocess, so that what is tested is the library and the
kernel, not cachefs: each lookup waits, up to a few seconds, for a second lookup to be in
flight beside it, and records the most it saw at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyfuse3

from conftest import wait_for

LOOKUP_WAIT_S = 3.0

FILE_SYSTEM = textwrap.dedent(f"""
    import errno, stat, sys
    import pyfuse3, trio

    class LookupsAtOnce(pyfuse3.Operations):
        def __init__(self, record):
            super().__init__()
            self.record, self.in_flight, self.most, self.inodes = record, 0, 0, {{}}
            self.changed = trio.Event()

        async def getattr(self, inode, ctx=None):
            entry = pyfuse3.EntryAttributes()
            entry.st_ino = inode
            entry.st_mode = (stat.S_IFDIR | 0o755) if inode <= 2 else (stat.S_IFREG | 0o644)
            entry.entry_timeout = entry.attr_timeout = 300
            return entry

        async def lookup(self, parent, name, ctx=None):
            if parent == pyfuse3.ROOT_INODE and name == b"d":
                return await self.getattr(2)
            if parent != 2:
                raise pyfuse3.FUSEError(errno.ENOENT)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            with open(self.record, "w") as out:
                out.write(str(self.most))
            self.changed.set()
            self.changed = trio.Event()
            with trio.move_on_after({LOOKUP_WAIT_S}):
                while self.in_flight < 2:
                    await self.changed.wait()
            self.in_flight -= 1
            inode = self.inodes.setdefault(name, 3 + len(self.inodes))
            return await self.getattr(inode)

    options = set(pyfuse3.default_options)
    options.add("fsname=lookups-at-once")
    pyfuse3.init(LookupsAtOnce(sys.argv[2]), sys.argv[1], options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()
""")


def test_the_kernel_sends_lookups_of_one_directory_at_once(tmp_path):
    """Two processes' lookups of two files of one directory reach the file system together
    (scripts/patches/pyfuse3-parallel-dirops.patch): libfuse before 3.17 left
    FUSE_PARALLEL_DIROPS out of its INIT reply, and the kernel sent them one at a time per
    directory, each after the answer to the one before (a cachefs reader's open, and the
    lookups the daemon makes for its page stores, waited for every other in the directory)."""
    assert getattr(pyfuse3, "PARALLEL_DIROPS", False), \
        "pyfuse3 lacks scripts/patches/pyfuse3-parallel-dirops.patch: run scripts/setup.sh"
    mountpoint, record = tmp_path / "mnt", tmp_path / "most-at-once"
    mountpoint.mkdir()
    script = tmp_path / "lookups_at_once.py"
    script.write_text(FILE_SYSTEM)
    daemon = subprocess.Popen([sys.executable, str(script), str(mountpoint), str(record)],
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.ismount(mountpoint))
        stats = [threading.Thread(target=os.stat, args=(mountpoint / "d" / name,))
                 for name in ("a", "b")]
        for thread in stats:
            thread.start()
        for thread in stats:
            thread.join(4 * LOOKUP_WAIT_S)
        assert Path(record).read_text() == "2"
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
        daemon.wait(10)
        assert daemon.returncode == 0, daemon.stderr.read() if daemon.stderr else ""
