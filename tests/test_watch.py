"""`cachefs stats --watch`: rates per interval from a real mount, as plain lines off a terminal
and a table redrawn in place on one; Ctrl-C ends it cleanly (issue 18)."""

from __future__ import annotations

import signal
import subprocess

from cachefs import order
from cachefs.publish import publish
from cachefs.watch import COLUMNS
from conftest import (cachefs_cmd, default_sigint, epoch_record, flat_dataset_fixture,
                      run_cachefs, run_in_terminal)

N_FILES = 60
INTERVAL_S = 0.5
dataset = flat_dataset_fixture(N_FILES, 40_000)


def test_plain_lines_off_a_terminal_carry_the_rates(dataset, mounter):
    src, relpaths = dataset
    # a window of fewer files than the data set: source reads go on while the reader reads
    mount = mounter(src, "--source-delay-ms", 2, "--source-threads", 8)
    current = order.permutation(N_FILES, 0, 0)
    publish(mount.mountpoint, 0, current, next=order.permutation(N_FILES, 0, 1))
    intervals = 8
    watching = subprocess.Popen(
        cachefs_cmd("stats", mount.mountpoint, "--watch", "--interval", INTERVAL_S,
                    "--count", intervals), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    # printed once the watch took its first snapshot: the reads start after it (a sleep was
    # shorter than the watch's start-up on a busy machine, and reads before it fell in no
    # interval)
    header = watching.stdout.readline()
    read_bytes = 0
    for index in current:
        read_bytes += len((mount.mountpoint / relpaths[index]).read_bytes())
    epoch_record(mount, 0, reads=N_FILES)  # every close counted, well inside the watch
    out, err = watching.communicate(timeout=30)
    assert watching.returncode == 0 and err == ""
    lines = out.splitlines()
    assert header.split()[:3] == ["time", "files/s", "read"]
    assert len(lines) == intervals
    rows = [dict(zip([name for name, _, _ in COLUMNS], line.split(), strict=True))
            for line in lines]
    # each rate is the interval's count over its length: they add up to what was read
    files = sum(float(row["files/s"]) for row in rows) * INTERVAL_S
    assert abs(files - N_FILES) <= 0.1 * N_FILES, out
    mb = sum(float(row["read MB/s"]) for row in rows) * INTERVAL_S
    assert abs(mb - read_bytes / 1e6) <= 0.1 * read_bytes / 1e6, out
    busy = [row for row in rows if float(row["files/s"]) > 0]
    for row in busy:  # the four classes of a read share the interval's reads
        shares = sum(float(row[name]) for name in ("ram %", "ssd %", "ahead %", "miss %"))
        assert abs(shares - 100) < 0.5, row
    assert float(busy[0]["source MB/s"]) > 0
    assert rows[-1]["epoch"] == "1" and rows[-1]["consumed"] == f"0/{N_FILES}"  # 0 done


def test_a_terminal_gets_a_table_redrawn_in_place(dataset, mounter):
    src, _ = dataset
    mount = mounter(src)
    code, text = run_in_terminal(
        cachefs_cmd("stats", mount.mountpoint, "--watch", "--interval", 0.2, "--count", 3))
    assert code == 0, text
    assert "files/s" in text and "stall" in text and "consumed" in text
    # a redraw moves the cursor back up over the table before drawing it again
    assert text.count("\x1b[2K") >= 3 and "\x1b[1A" in text, text
    assert "Traceback" not in text


def test_ctrl_c_ends_a_watch_with_status_0(dataset, mounter):
    src, _ = dataset
    mount = mounter(src)
    watching = subprocess.Popen(
        cachefs_cmd("stats", mount.mountpoint, "--watch", "--interval", 0.2),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)  # a suite run as a background job ignores SIGINT
    # the header and two intervals' lines, and then Ctrl-C (a sleep could end before the
    # watch had started, on a busy machine)
    shown = [watching.stdout.readline() for _ in range(3)]
    watching.send_signal(signal.SIGINT)
    out, err = watching.communicate(timeout=10)
    assert watching.returncode == 0 and err == ""
    assert shown[0].split()[:2] == ["time", "files/s"]
    assert all(line.endswith("\n") for line in shown), shown


def test_watch_options_go_together(tmp_path):
    done = run_cachefs("stats", tmp_path, "--interval", 2)
    assert done.returncode == 2 and "go with --watch" in done.stderr
    done = run_cachefs("stats", tmp_path, "--watch", "--json")
    assert done.returncode == 2 and "give one" in done.stderr
    done = run_cachefs("stats", tmp_path, "--watch", "--count", 1)
    assert done.returncode == 1 and "is not a cachefs mount" in done.stderr
