"""The man pages under man/ stay in step with the CLI, and groff accepts them.

The command list comes from `cachefs.cli.cli.commands` at test time, so a command or an option
added to cli.py without its documentation fails here:

- every command `cmd` has a page `man/cachefs-<cmd>.1` that mentions each of its option strings
  (every `--long` and `-s` spelling, help excepted), the upper-case name of each argument, and the
  environment variable of each option (click's automatic name, CACHEFS_<COMMAND>_<PARAMETER>,
  which follows the parameter's name and not always the option's spelling);
- `man/cachefs.1` points to every command's page and mentions the group's own options;
- every page under man/ has the sections a man page needs and passes `groff -man -ww -z` with no
  warning, and writes option-like words with `\\-` (a plain `-` renders as a hyphen that cannot
  be pasted into a shell).

Pages are searched in their troff source after removing font escapes and turning `\\-` into
`-`, so `\\fB\\-\\-ram\\-cache\\fR` counts as a mention of `--ram-cache`. A mention must be a
whole word: `-o` inside `--order-file` does not count.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest

from cachefs.cli import cli

MAN_DIR = Path(__file__).resolve().parent.parent / "man"
ENV_PREFIX = "CACHEFS"  # cachefs.cli.main: cli(auto_envvar_prefix="CACHEFS")

SECTIONS_ALL = ("NAME", "SYNOPSIS", "DESCRIPTION", "ENVIRONMENT", "FILES", "EXAMPLES", "SEE ALSO")
SECTIONS_COMMAND = ("OPTIONS", "EXIT STATUS")  # section 1 pages only

_FONT_ESCAPE = re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)")
# a '-' that starts a word and is followed by a letter or another '-': an option, not a hyphen
_BARE_OPTION = re.compile(r"(?<![\\\w-])-{1,2}[A-Za-z]")


def man_pages() -> list[Path]:
    return sorted(p for p in MAN_DIR.iterdir() if re.fullmatch(r".+\.\d", p.name))


def page_text(path: Path) -> str:
    """The page's troff source as searchable text: no comments, no font escapes, `\\-` as `-`."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith('.\\"')]
    text = _FONT_ESCAPE.sub("", "\n".join(lines))
    return text.replace("\\-", "-").replace("\\&", "")


def mentions(text: str, word: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", text) is not None


def option_strings(command: click.Command) -> list[str]:
    found = []
    for param in command.params:
        if isinstance(param, click.Option):
            found += [opt for opt in param.opts + param.secondary_opts if opt != "--help"]
    return found


def envvar_names(command: click.Command, name: str) -> dict[str, str]:
    """Option -> the environment variable click reads it from, as click itself computes it."""
    root = click.Context(cli, info_name="cachefs", auto_envvar_prefix=ENV_PREFIX)
    ctx = click.Context(command, info_name=name, parent=root)
    return {param.opts[0]: f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
            for param in command.params if isinstance(param, click.Option)}


def missing_from_page(name: str, command: click.Command, text: str) -> list[str]:
    """Everything about `command` that its page's text fails to mention."""
    missing = [opt for opt in option_strings(command) if not mentions(text, opt)]
    missing += [param.name.upper() for param in command.params
                if isinstance(param, click.Argument) and not mentions(text, param.name.upper())]
    missing += [var for var in envvar_names(command, name).values() if not mentions(text, var)]
    return missing


def sections(path: Path) -> list[str]:
    found = []
    for line in path.read_text().splitlines():
        match = re.match(r"\.SH\s+(.*)$", line)
        if match:
            found.append(match.group(1).strip().strip('"'))
    return found


def man_section(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(".TH "):
            return line.split()[2]
    raise AssertionError(f"{path.name} has no .TH line")


# -- the pages agree with the CLI ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_has_a_page_that_documents_it(name):
    page = MAN_DIR / f"cachefs-{name}.1"
    assert page.is_file(), f"command {name!r} has no man page {page}"
    missing = missing_from_page(name, cli.commands[name], page_text(page))
    assert not missing, f"{page.name} does not mention: {', '.join(missing)}"


def test_overview_names_every_command_and_the_group_options():
    text = page_text(MAN_DIR / "cachefs.1")
    missing = [f"cachefs-{name}" for name in sorted(cli.commands)
               if not mentions(text, f"cachefs-{name}")]
    missing += [opt for opt in option_strings(cli) + ["-h"] if not mentions(text, opt)]
    assert not missing, f"cachefs.1 does not mention: {', '.join(missing)}"


def test_documented_envvar_names_are_the_ones_click_reads(monkeypatch):
    """The names the pages list are what click really reads (not guessed from the spelling)."""
    for name, command in cli.commands.items():
        root = click.Context(cli, info_name="cachefs", auto_envvar_prefix=ENV_PREFIX)
        ctx = click.Context(command, info_name=name, parent=root)
        by_opt = {param.opts[0]: param for param in command.params
                  if isinstance(param, click.Option)}
        for opt, var in envvar_names(command, name).items():
            monkeypatch.setenv(var, "probe")
            assert by_opt[opt].resolve_envvar_value(ctx) == "probe", (name, opt, var)
            monkeypatch.delenv(var)


# -- the check itself catches what it is for ------------------------------------------------------

def test_check_reports_an_undocumented_option_and_argument():
    name, command = "mount", cli.commands["mount"]
    text = page_text(MAN_DIR / f"cachefs-{name}.1")
    extended = click.Command(name, params=[
        *command.params,
        click.Option(["--dummy-option", "-Z"], is_flag=True),
        click.Argument(["extra_path"]),
    ])
    assert missing_from_page(name, extended, text) == [
        "--dummy-option", "-Z", "EXTRA_PATH", "CACHEFS_MOUNT_DUMMY_OPTION"]


def test_a_mention_must_be_a_whole_word():
    assert mentions("use --order-file PATH", "--order-file")
    assert not mentions("use --order-file PATH", "-o")
    assert not mentions("--debugging", "--debug")
    assert mentions(page_text(MAN_DIR / "cachefs-mount.1"), "-o")


# -- every page is well formed --------------------------------------------------------------------

@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_page_has_the_required_sections(page):
    required = SECTIONS_ALL + (SECTIONS_COMMAND if man_section(page) == "1" else ())
    have = sections(page)
    missing = [section for section in required if section not in have]
    assert not missing, f"{page.name} lacks sections: {', '.join(missing)}"
    assert have[0] == "NAME", f"{page.name} must start with NAME, not {have[0]}"


@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_groff_accepts_page_without_warnings(page):
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed")
    done = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", f"{page.name}:\n{done.stderr}"


@pytest.mark.parametrize("page", man_pages(), ids=lambda p: p.name)
def test_options_are_written_with_escaped_hyphens(page):
    bad = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith('.\\"'):
            continue
        if _BARE_OPTION.search(_FONT_ESCAPE.sub("", line)):
            bad.append(f"{page.name}:{number}: {line}")
    assert not bad, "write options with \\- (e.g. \\-\\-ram\\-cache):\n" + "\n".join(bad)


def test_man_dir_holds_the_overview():
    assert (MAN_DIR / "cachefs.1").is_file()
    assert MAN_DIR / "cachefs.1" in man_pages()
