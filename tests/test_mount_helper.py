"""The mount(8) helper form: `cachefs SRC MNT -o OPTS`, read as the `cachefs mount` command.

No mount here: the translation is checked against click's own parse of the command form (so
every option of `cachefs mount` is reachable as a mount option), and the CLI's messages and
exit codes through a subprocess. The real `mount -t fuse.cachefs`, fstab lines and `umount`
are in tests/test_fstab.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from cachefs import mount_helper
from cachefs.cli import _helper_options, cli
from conftest import run_cachefs

MOUNT = cli.commands["mount"]
# options of `cachefs mount` that decide how the command runs, not what is mounted: mount(8)
# waits for the command, so they have no helper-form spelling
NOT_MOUNT_OPTIONS = {"help", "foreground", "systemd"}


def sample_value(param: click.Option) -> str:
    """A valid value for the option that is not its default."""
    kind = param.type
    if isinstance(kind, click.Choice):
        return str(kind.choices[-1])
    if isinstance(kind, click.IntRange):
        return "3"
    if isinstance(kind, click.FloatRange):
        return "1.5"
    if kind.name == "SIZE":
        return "8GiB"
    if kind.name == "HOST:PORT":
        return "127.0.0.1:9567"
    return "/some/path"


def parsed(args: list[str]) -> dict:
    """The parameters click parses from `cachefs mount ARGS`."""
    assert args[0] == "mount"
    return MOUNT.make_context("mount", list(args[1:])).params


def helper(*argv: str) -> list[str]:
    return mount_helper.command_line(list(argv), _helper_options())


def test_every_mount_option_can_be_given_in_the_helper_form():
    """Each option of `cachefs mount`, given as `-o name=value` (or `-o name` for a flag),
    parses to exactly what the command form gives."""
    names = set()
    for param in MOUNT.params:
        if not isinstance(param, click.Option) or param.name in NOT_MOUNT_OPTIONS:
            continue
        long_name = next(opt for opt in param.opts if opt.startswith("--") or opt == "-o")
        if param.name == "fuse_options":
            direct, name = ["-o", "allow_other"], "allow_other"
        elif param.is_flag:
            direct, name = [long_name], long_name[2:].replace("-", "_")
        else:
            value = sample_value(param)
            direct, name = [long_name, value], f"{long_name[2:].replace('-', '_')}={value}"
        for spelling in (name, name.replace("_", "-")):
            assert parsed(helper("/src", "/mnt", "-o", spelling)) == \
                parsed(["mount", "/src", "/mnt", *direct]), spelling
        names.add(name.partition("=")[0])
    assert names == set(_helper_options())  # and no mount option that the command lacks


def test_the_issue_example_and_a_value_that_starts_with_a_dash():
    assert helper("/nfs/x", "/mnt/x", "-o", "ram_cache=8GiB,ssd_cache=/nvme/c,"
                  "ssd_size=400GiB,allow_other") == [
        "mount", "/nfs/x", "/mnt/x", "--ram-cache=8GiB", "--ssd-cache=/nvme/c",
        "--ssd-size=400GiB", "-o", "allow_other"]
    params = parsed(helper("/src", "/mnt", "-o", "state_dir=-odd"))
    assert params["state_dir"] == Path("-odd")


def test_fstab_only_options_are_dropped_wherever_they_arrive():
    """What mount(8) or mount.fuse3 of one version or another may pass along: dropped."""
    fstab_only = sorted(mount_helper.IGNORED) + [
        "x-systemd.automount", "x-systemd.requires-mounts-for=/nfs", "X-mount.mkdir",
        "comment=systemd.automount", ""]
    options = ",".join(fstab_only + ["ram_cache=64MiB"])
    assert helper("/src", "/mnt", "-o", options) == ["mount", "/src", "/mnt",
                                                     "--ram-cache=64MiB"]
    # mount(8)'s calling convention for /sbin/mount.cachefs: -n, -v, -t, several -o
    assert helper("/src", "/mnt", "-n", "-v", "-o", "rw,nosuid", "-t", "cachefs", "-o",
                  "debug") == ["mount", "/src", "/mnt", "--debug"]
    assert helper("/src", "/mnt") == ["mount", "/src", "/mnt"]


@pytest.mark.parametrize("argv, message", [
    (["-o", "bogus=1"], "unknown mount option 'bogus'; cachefs takes allow_other, "
                        "block_size=VALUE"),
    (["-o", "ram_cache"], "mount option 'ram_cache' needs a value: ram_cache=VALUE"),
    (["-o", "debug=yes"], "mount option 'debug' takes no value"),
    (["-o", "foreground"], "unknown mount option 'foreground'"),
    (["-o", "systemd"], "unknown mount option 'systemd'"),
    (["-t", "fuse.sshfs"], "-t fuse.sshfs: this is cachefs"),
    (["-f"], "unknown argument '-f'"),
    (["-o"], "-o needs a value"),
    (["/third"], "expected SOURCE and MOUNTPOINT, got 3 argument(s)"),
])
def test_what_cannot_be_read_is_refused_with_a_message(argv, message):
    with pytest.raises(mount_helper.HelperArgsError) as info:
        helper("/src", "/mnt", *argv)
    assert message in str(info.value)


def test_the_command_refuses_an_unknown_option_with_exit_status_2(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "mnt").mkdir()
    done = run_cachefs(tmp_path / "src", tmp_path / "mnt", "-o", "rw,ram_cache=1G,bogus")
    assert done.returncode == 2
    assert done.stderr.startswith("cachefs: unknown mount option 'bogus'"), done.stderr
    # then click's own checks, with the option's command-form name
    done = run_cachefs(tmp_path / "src", tmp_path / "mnt", "-o", "ram_cache=lots")
    assert done.returncode == 2
    assert "Invalid value for '--ram-cache': not a size: 'lots'" in done.stderr


def test_a_word_that_is_not_a_path_stays_an_unknown_command():
    done = run_cachefs("stat", "/mnt")
    assert done.returncode == 2 and "No such command 'stat'" in done.stderr
    assert not mount_helper.is_helper_form(["mount", "/a", "/b"], cli.commands)
    assert not mount_helper.is_helper_form(["--version", "x"], cli.commands)
    assert mount_helper.is_helper_form(["/a", "/b"], cli.commands)


def test_the_mount_cachefs_entry_point_reads_the_helper_form(tmp_path):
    """pyproject.toml declares `mount.cachefs`; what it runs takes only the helper form."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mount.cachefs"] == "cachefs.cli:mount_main"
    as_mount_runs_it = ("import sys; from cachefs.cli import mount_main; "
                        "sys.argv[0] = '/sbin/mount.cachefs'; mount_main()")
    done = subprocess.run([sys.executable, "-c", as_mount_runs_it, "/src", "/mnt", "-n", "-o",
                           "rw,bogus"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("cachefs: unknown mount option 'bogus'"), done.stderr
    # a source named like a command is still a source here
    done = subprocess.run([sys.executable, "-c", as_mount_runs_it, "stats", str(tmp_path),
                           "-o", "rw"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert f"source {tmp_path / 'stats'} does not exist" in done.stderr
