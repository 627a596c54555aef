"""The test fixtures themselves: a daemon's traceback fails the test that started it.

Issue 15, item 5: the mount turns any exception in a handler into EIO and a log line
(fuse_ops._guarded), so a test that checks only what a reader sees passes over a bug. Each
case runs an inner pytest session with this directory's conftest, against a daemon with a
bug planted (statfs raises), and checks the session's outcome.
"""

from __future__ import annotations

from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

INNER = '''
import errno, os, sys

import pytest

from conftest import write_file

# the daemon, with a bug planted in statfs: the handler maps it to EIO and logs a traceback
BUGGY = ("import runpy, sys; from cachefs.source import Source; "
         "Source.statvfs = lambda self: 1 / 0; "
         "args = sys.argv[sys.argv.index('cachefs') + 1:]; sys.argv = ['cachefs', *args]; "
         "runpy.run_module('cachefs', run_name='__main__')")


def statfs_fails(tmp_path, mounter):
    write_file(tmp_path / "src" / "f", 100)
    mount = mounter(tmp_path / "src", prefix=[sys.executable, "-c", BUGGY, "--"])
    with pytest.raises(OSError) as info:
        os.statvfs(mount.mountpoint)
    assert info.value.errno == errno.EIO
    assert (mount.mountpoint / "f").read_bytes() == (tmp_path / "src" / "f").read_bytes()


def test_unmarked(tmp_path, mounter):
    statfs_fails(tmp_path, mounter)


@pytest.mark.daemon_traceback("the bug planted in statfs")
def test_marked(tmp_path, mounter):
    statfs_fails(tmp_path, mounter)


def test_without_a_bug(tmp_path, mounter):
    write_file(tmp_path / "src" / "f", 100)
    mount = mounter(tmp_path / "src")
    os.statvfs(mount.mountpoint)
'''


def test_a_daemon_traceback_fails_the_test_unless_it_is_marked_as_expected(pytester,
                                                                           monkeypatch):
    # the inner session and its daemons run elsewhere: they import this tree's cachefs
    monkeypatch.setenv("PYTHONPATH", str(CONFTEST.parent.parent))
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_unmarked*",
        "*the daemon logged a traceback*",
        "*ZeroDivisionError*",
    ])
