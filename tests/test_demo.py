"""`cachefs demo` end to end: what a user sees, and that it leaves nothing behind.

Each test runs `python -m cachefs demo` in a subprocess with TMPDIR pointing at a fresh
directory, so that "the temporary directory is removed" and "nothing is left mounted" can be
checked exactly: that directory must be empty afterwards, no mount point under it may be in
/proc/mounts, and no process may still run with it on its command line (the mount daemon).
The settings are tiny (a few hundred small files, 1 ms source latency): seconds, not a
benchmark; the figures are checked for consistency, never for speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import default_sigint

FILES = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def demo_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "cachefs", "demo", *map(str, args)]


def demo_env(tmpdir: Path) -> dict:
    tmpdir.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("CACHEFS_")}
    env["TMPDIR"] = str(tmpdir)
    return env


def mounts_under(directory: Path) -> list[str]:
    with open("/proc/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return [point for point in points if point.startswith(str(directory))]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # exited meanwhile
        if text.encode() in cmdline:
            found.append(int(entry.name))
    return found


def assert_left_nothing(tmpdir: Path) -> None:
    assert mounts_under(tmpdir) == [], "the demo left a mount behind"
    assert list(tmpdir.iterdir()) == [], "the demo left files in its temporary directory"
    assert processes_mentioning(str(tmpdir)) == [], "a process of the demo is still running"


@pytest.mark.timeout(90)
def test_demo_prints_the_table_writes_json_and_png_and_cleans_up(tmp_path):
    tmpdir, output = tmp_path / "tmp", tmp_path / "out"
    done = subprocess.run(
        demo_cmd("--files", FILES, "--file-kb", 8, "--epochs", 2, "--workers", 4,
                 "--delay-ms", 1, "--ram-fraction", 0.5, "--ssd-fraction", 0.25,
                 "--output", output),
        env=demo_env(tmpdir), capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr

    lines = done.stdout.splitlines()
    for epoch in ("0", "1", "all"):
        for way in ("direct", "cachefs"):
            assert any(re.match(rf"\s*{epoch}\s+{way}\s", line) for line in lines), (
                f"no {epoch}/{way} row in:\n{done.stdout}")
    overall = next(line for line in lines if re.match(r"\s*all\s+cachefs\s", line))
    assert re.search(r"\d+\.\d\dx$", overall), overall

    if HAVE_MATPLOTLIB:
        png = output / "cachefs-demo.png"
        assert png.read_bytes().startswith(PNG_MAGIC)
    else:
        assert "matplotlib is not installed" in done.stderr
        assert not (output / "cachefs-demo.png").exists()

    report = json.loads((output / "cachefs-demo.json").read_text())
    assert report["dataset"]["files"] == FILES
    assert report["capacity_fraction"] == pytest.approx(0.75, abs=0.01)
    assert [e["epoch"] for e in report["epochs"]] == [0, 1]
    for epoch in report["epochs"]:
        direct, cached = epoch["direct"], epoch["cachefs"]
        for way in (direct, cached):
            assert way["reads"] == way["files"] == FILES
            assert way["hits_ram"] + way["hits_ssd"] + way["prefetched"] + way["misses"] == FILES
            assert way["bytes"] == report["dataset"]["bytes"]  # every file read whole
        assert direct["misses"] == FILES
        assert epoch["speedup"] == pytest.approx(direct["time_s"] / cached["time_s"], rel=0.01)
    # the first epoch has nothing cached yet; the second finds what the first kept
    first, second = (e["cachefs"] for e in report["epochs"])
    assert first["hits_ram"] + first["hits_ssd"] == 0
    assert second["hits_ram"] + second["hits_ssd"] > 0
    assert_left_nothing(tmpdir)


def test_demo_keep_leaves_the_data_set_and_says_where(tmp_path):
    tmpdir = tmp_path / "tmp"
    done = subprocess.run(
        demo_cmd("--files", 40, "--file-kb", 4, "--epochs", 1, "--delay-ms", 0,
                 "--output", tmp_path / "out", "--keep"),
        env=demo_env(tmpdir), capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr
    kept = Path(re.search(r"data set kept in (\S+)", done.stdout).group(1))
    assert kept.parent.parent == tmpdir
    assert sum(1 for path in kept.rglob("*") if path.is_file()) == 40
    assert [p.name for p in kept.parent.iterdir()] == ["data"]  # mount point and state gone
    assert mounts_under(tmpdir) == []


# Imported by every Python process of the demo (PYTHONPATH): the mount's daemon writes a
# traceback to its log as it starts, as a bug in a handler would (fuse_ops._guarded).
PLANTED_TRACEBACK = """
import sys
if "mount" in sys.argv and "--foreground" in sys.argv:
    print("Traceback (most recent call last):\\n  planted by test_demo\\nRuntimeError: planted",
          file=sys.stderr, flush=True)
"""


def test_a_traceback_in_the_daemon_log_fails_the_demo(tmp_path):
    # issue 15, item 5: the demo's daemon log goes with its temporary directory, so the demo
    # itself reports a daemon's traceback, and its tests see it in the exit code
    tmpdir, site = tmp_path / "tmp", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PLANTED_TRACEBACK)
    env = demo_env(tmpdir)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")]),
                                         os.getcwd()])
    done = subprocess.run(
        demo_cmd("--files", 40, "--file-kb", 4, "--epochs", 1, "--delay-ms", 0,
                 "--output", tmp_path / "out"),
        env=env, capture_output=True, text=True, timeout=80)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "the cachefs daemon logged an unexpected error (a bug)" in done.stderr
    assert "RuntimeError: planted" in done.stderr
    assert_left_nothing(tmpdir)


def test_demo_rejects_bad_settings_before_doing_anything(tmp_path):
    tmpdir = tmp_path / "tmp"
    done = subprocess.run(demo_cmd("--ram-fraction", 0), env=demo_env(tmpdir),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--ram-fraction" in done.stderr
    assert list(tmpdir.iterdir()) == []


def test_the_generated_data_set_keeps_its_shape(tmp_path):
    """The data set of a seed is the same from one version to the next (sizes and names, so
    the figures of two versions compare); these are the first version's."""
    from cachefs.demo import generate_dataset

    assert generate_dataset(tmp_path / "data", 300, 4.0, 0) == 1_278_142
    files = sorted(p.relative_to(tmp_path / "data").as_posix()
                   for p in (tmp_path / "data").rglob("*") if p.is_file())
    assert len(files) == 300 and files[:2] == ["class_00/sample_000000.bin",
                                                "class_00/sample_000010.bin"]
    assert generate_dataset(tmp_path / "other", 7, 1.5, 5) == 10_378


@pytest.mark.timeout(120)
@pytest.mark.parametrize("interrupt_after", [
    "direct  epoch 0",   # reading the slow source; nothing mounted yet
    "mounting cachefs",  # while the mount comes up
    "cachefs epoch 0",   # reading through the mount
])
def test_ctrl_c_unmounts_and_removes_everything(tmp_path, interrupt_after):
    interrupt_demo(tmp_path, interrupt_after)


@pytest.mark.timeout(120)
def test_ctrl_c_reaches_the_demo_when_the_caller_ignores_it(tmp_path):
    """A suite started as a background job of a shell runs with SIGINT ignored, and the
    demo would inherit that (issue 15, item 14): the test's child restores the default."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt_demo(tmp_path, "direct  epoch 0")
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_demo(tmp_path: Path, interrupt_after: str) -> None:
    """Start the demo, send SIGINT once it prints `interrupt_after`; it must clean up."""
    tmpdir = tmp_path / "tmp"
    process = subprocess.Popen(
        demo_cmd("--files", FILES, "--file-kb", 8, "--epochs", 8, "--delay-ms", 1,
                 "--output", tmp_path / "out"),
        env=demo_env(tmpdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)
    try:
        seen = []
        for line in process.stderr:
            seen.append(line)
            if line.startswith(interrupt_after):
                break
        else:
            pytest.fail("the demo ended before " + repr(interrupt_after) + ":\n" + "".join(seen))
        if interrupt_after == "cachefs epoch 0":
            assert mounts_under(tmpdir), "the mount should be up now"
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    assert "Aborted" in rest
    # the daemon exits on its own after the unmount; give it a moment to go
    deadline = time.monotonic() + 10
    while processes_mentioning(str(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (tmp_path / "out" / "cachefs-demo.json").exists()
    assert_left_nothing(tmpdir)
