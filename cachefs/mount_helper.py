"""The mount(8) helper form of the command line: `cachefs SRC MNT -o OPTS`, read as the
`cachefs mount` command it stands for.

How it is called (util-linux 2.38 and libfuse 3.14, read in their sources and traced):

- `mount -t fuse.cachefs SRC MNT -o OPTS`, and an /etc/fstab line of type `fuse.cachefs`, run
  /sbin/mount.fuse3 (libfuse's util/mount.fuse.c). mount(8) first drops the options it handles
  itself (`defaults`, `noauto`, `x-*`, `comment=`...) and removes PATH, HOME and LD_* from the
  environment (util-linux's sanitize_env). mount.fuse3 drops `user`, `users`, `nouser`,
  `auto`, `noauto`, `_netdev`, `nofail`, appends `dev,suid` unless `nodev` or `nosuid` was
  given, and runs `'cachefs' 'SRC' 'MNT' '-o' 'OPTS'` through /bin/sh: no subcommand, the
  program found by the type's name on the shell's default search path (PATH is gone: for dash,
  /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin).
- `mount -t cachefs SRC MNT -o OPTS` runs /sbin/mount.cachefs (the `mount.cachefs` entry point,
  where a user links it) as `mount.cachefs SRC MNT [-n] [-v] -o OPTS [-t cachefs]`.

Which options arrive thus depends on the versions on each side (older mount(8)s pass `x-*`
through), so every option that only means something to mount(8), fstab or the kernel's flags
(`IGNORED`) is accepted and dropped wherever it arrives: a cachefs mount is always read-only,
nosuid and nodev, and the system's tools handle the rest. Every option of `cachefs mount` is a
mount option of the same name without its dashes, written with `_` or `-` (`ram_cache=8GiB`,
`ssd-cache=/nvme/c`); a flag is given by its name alone (`allow_other`, `debug`). The caller
(cachefs.cli) passes the table of those options, made from the `mount` command itself, so an
option added there is a mount option at once. Anything else is refused with a message naming
it: mount(8) would otherwise report success for a mount that ignored what was asked of it.

The result is the `cachefs mount` command line, which then runs as if typed: the same checks,
messages and exit codes, and the same daemonizing (the command returns once the kernel lists
the mount, and a daemon that fails before prints why), so an error reaches mount(8)'s terminal.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import click

# Options for mount(8), fstab and the kernel's mount flags, accepted and dropped.
IGNORED = frozenset({
    "defaults", "rw", "ro", "auto", "noauto", "user", "users", "nouser", "_netdev", "nofail",
    "dev", "suid", "nodev", "nosuid", "noexec", "exec",
    # access times and write modes: nothing to do on a read-only mount, and what fstab lines
    # copied from other file systems carry
    "noatime", "atime", "relatime", "norelatime", "strictatime", "nostrictatime", "lazytime",
    "nolazytime", "nodiratime", "diratime", "sync", "async", "dirsync",
    # cachefs mounts with it always
    "default_permissions",
})
IGNORED_PREFIXES = ("x-", "X-", "comment=")
# The file system types that name cachefs (`-t`, passed by mount(8) to /sbin/mount.cachefs).
TYPES = ("cachefs", "fuse.cachefs")
# Flags of mount(8)'s helper calling convention with nothing to do here: -n (do not write
# /etc/mtab), -v (verbose).
QUIET_FLAGS = ("-n", "-v")


class HelperArgsError(ValueError):
    """The helper form's arguments cannot be read; the message says why, for the user."""


@dataclass(frozen=True)
class MountOption:
    """How one mount option is given to `cachefs mount`: `args`, then `=VALUE` on the last
    of them when it takes a value (`--ram-cache=8GiB`: a value that starts with a dash is
    not taken for an option), or `args` alone for a flag (`--debug`, `-o allow_other`)."""

    args: tuple[str, ...]
    takes_value: bool


def is_helper_form(argv: list[str], commands: Collection[str]) -> bool:
    """Whether `cachefs ARGV` is the helper form: it starts with a source path rather than a
    command or an option (a word that is neither a path nor a command stays click's to
    report as an unknown command)."""
    if len(argv) < 2 or argv[0] in commands or argv[0].startswith("-"):
        return False
    return "/" in argv[0] or os.path.exists(argv[0])


def command_line(argv: list[str], options: Mapping[str, MountOption]) -> list[str]:
    """`SRC MNT [-o OPTS]... [-t TYPE] [-n] [-v]` as the `cachefs mount` argv (without the
    program name). `options` maps each option's name with `_` for `-` to its `MountOption`.
    Raises HelperArgsError."""
    positional: list[str] = []
    given: list[str] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("-o", "-t"):
            if not rest:
                raise HelperArgsError(f"{arg} needs a value")
            value = rest.pop(0)
            if arg == "-o":
                given += value.split(",")
            elif value not in TYPES:
                raise HelperArgsError(f"-t {value}: this is cachefs (types {', '.join(TYPES)})")
        elif arg in QUIET_FLAGS:
            continue
        elif arg.startswith("-"):
            raise HelperArgsError(f"unknown argument {arg!r} (usage: cachefs SOURCE "
                                  f"MOUNTPOINT -o OPTION[,OPTION...])")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise HelperArgsError(f"expected SOURCE and MOUNTPOINT, got {len(positional)} "
                              f"argument(s): {' '.join(positional) or '(none)'}")
    args = ["mount", *positional]
    for text in given:
        args += _option_args(text, options)
    return args


def _option_args(text: str, options: Mapping[str, MountOption]) -> list[str]:
    """One `name[=value]` of -o as `cachefs mount` arguments ([] for an ignored one)."""
    name, has_value, value = text.partition("=")
    if not text or name in IGNORED or text.startswith(IGNORED_PREFIXES):
        return []
    option = options.get(name.replace("-", "_"))
    if option is None:
        raise HelperArgsError(f"unknown mount option {name!r}; cachefs takes "
                              f"{', '.join(describe(options))} (see cachefs-mount(1))")
    if option.takes_value and not has_value:
        raise HelperArgsError(f"mount option {name!r} needs a value: {name}=VALUE")
    if not option.takes_value and has_value:
        raise HelperArgsError(f"mount option {name!r} takes no value: give {name} alone")
    if not option.takes_value:
        return list(option.args)
    return [*option.args[:-1], f"{option.args[-1]}={value}"]


def describe(options: Mapping[str, MountOption]) -> list[str]:
    """The mount options by name, sorted, a value-taking one as `name=VALUE`."""
    return [name + ("=VALUE" if option.takes_value else "")
            for name, option in sorted(options.items())]


def options_of(mount_command: click.Command, fuse_options: Collection[str]
               ) -> dict[str, MountOption]:
    """The mount options of the helper form: every option of `cachefs mount`
    (`mount_command`) by its name without dashes, `_` for `-`, and the FUSE options of its -o.
    Not the ones that decide how the command runs rather than what is mounted: mount(8) waits
    for the command, so it cannot stay in the foreground."""
    options = {}
    for param in mount_command.params:
        if not isinstance(param, click.Option) or param.name in (
                "help", "foreground", "systemd", "fuse_options"):
            continue
        long_name = next(opt for opt in param.opts if opt.startswith("--"))
        options[long_name[2:].replace("-", "_")] = MountOption(
            (long_name,), takes_value=not param.is_flag)
    for name in fuse_options:
        options[name] = MountOption(("-o", name), takes_value=False)
    return options
