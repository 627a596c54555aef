"""`--cpus`: the CPU lists cachefs accepts and which CPUs the daemon takes (no FUSE; the
threads of a real daemon: tests/test_mount.py)."""

from __future__ import annotations

import pytest

from cachefs.scheduling import AUTO_ONE_CPU_MAX, daemon_cpus, parse_cpus


@pytest.mark.parametrize("text, cpus", [
    ("auto", "auto"), ("all", "all"), (" all ", "all"), ("1", {1}), ("0,2", {0, 2}),
    ("2-3", {2, 3}), ("0,2-4,7", {0, 2, 3, 4, 7}), ("3-3", {3}),
])
def test_cpu_lists_read_as_taskset_writes_them(text, cpus):
    assert parse_cpus(text) == (cpus if isinstance(cpus, str) else frozenset(cpus))


@pytest.mark.parametrize("text", ["", "x", "1,,2", "-1", "3-1", "1-", "one", "0x1"])
def test_a_list_that_is_none_says_what_a_list_is(text):
    with pytest.raises(ValueError, match="--cpus"):
        parse_cpus(text)


def test_auto_takes_the_last_cpu_of_a_small_machine_and_floats_on_a_large_one():
    assert daemon_cpus("auto", {0, 1}) == {1}
    assert daemon_cpus("auto", {2, 5}) == {5}  # a cpuset: the last CPU of those allowed
    assert daemon_cpus("auto", set(range(AUTO_ONE_CPU_MAX))) == {AUTO_ONE_CPU_MAX - 1}
    assert daemon_cpus("auto", set(range(AUTO_ONE_CPU_MAX + 1))) is None


def test_all_leaves_the_cpus_and_a_list_must_be_among_those_allowed():
    assert daemon_cpus("all", {0, 1}) is None
    assert daemon_cpus(frozenset({0}), {0, 1}) == {0}
    with pytest.raises(ValueError, match=r"CPUs 2-3 are not among those the daemon may use "
                                         r"\(0-1\)"):
        daemon_cpus(frozenset({1, 2, 3}), {0, 1})
    with pytest.raises(ValueError, match=r"CPU 5 is not among"):
        daemon_cpus(frozenset({5}), {0, 1})
