"""Where code lives: module sizes, what the daemon imports, one copy of the demo's workload.

These hold the layout rules of issue 16 in place: a newcomer finds one home per concept, and a
module that grows past what a reader can hold says why.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cachefs"
SCRIPTS = PACKAGE.parent / "scripts"
MAX_CODE_LINES = 600
LONG_MODULE_REASON = "Why this module is over 600 lines:"
# Modules of the client side (CLI, trainers, demo), which the daemon never needs.
CLIENT_MODULES = ("cachefs.cli", "cachefs.client", "cachefs.demo", "cachefs.mount_helper",
                  "cachefs.publish", "cachefs.stats_table", "cachefs.torch", "cachefs.watch",
                  "cachefs.workload")


def code_lines(path: Path) -> tuple[int, str]:
    """Lines after the module docstring (the design text is not what makes a module long),
    and the docstring."""
    text = path.read_text()
    tree = ast.parse(text)
    docstring = ast.get_docstring(tree) or ""
    first = tree.body[0] if tree.body else None
    doc_end = first.end_lineno if docstring and isinstance(first, ast.Expr) else 0
    return len(text.splitlines()) - doc_end, docstring


def test_no_module_is_long_without_saying_why():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines, docstring = code_lines(path)
        if lines > MAX_CODE_LINES and LONG_MODULE_REASON not in " ".join(docstring.split()):
            too_long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert too_long == [], (f"split these, or give the reason in the module docstring "
                            f"({LONG_MODULE_REASON!r}): {too_long}")


def test_the_daemon_imports_no_client_code():
    """The daemon's import graph holds no CLI-side module (mountinfo parsing is shared)."""
    code = ("import sys, cachefs.mount; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('cachefs'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, check=True)
    loaded = done.stdout.split()
    assert [name for name in CLIENT_MODULES if name in loaded] == []
    assert "cachefs.mountinfo" in loaded


def test_publishing_has_one_home_and_the_old_names_still_reach_it():
    from cachefs import order, publish

    assert order.publish is publish.publish
    assert order.source_file_count is publish.source_file_count
    with pytest.raises(AttributeError):
        order.no_such_name  # noqa: B018


def test_the_demo_and_the_benchmarks_write_and_read_with_one_copy(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import benchlib

    from cachefs import demo, workload

    for name in ("write_dataset", "read_whole_file"):
        assert getattr(demo, name) is getattr(workload, name), name
        assert getattr(benchlib, name) is getattr(workload, name), name
