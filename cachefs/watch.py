"""`cachefs stats --watch`: what a mount did in each interval, as rates from two snapshots.

A rate is the difference between two `cachefs stats` snapshots (their `totals`, summed by the
daemon since the mount started: stats.py) divided by the seconds between them, which the caller
measures; the gauges (read-ahead in flight and window, the epoch and how much of it is
consumed) are the newer snapshot's. Hit rates are fractions of the files counted in the
interval, "-" when none was. One list of columns (`COLUMNS`) lays out both views, so they
show the same figures: a rich table redrawn in place when stdout is a terminal (the CLI's
`rich.live.Live`; the epoch's progress and the read-ahead window under it, as of the newest
interval, so that it fits in 80 columns), one plain line per interval otherwise (a log, a
pipe).

The CLI takes the snapshots, sleeps and prints; this module computes and lays out only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich import box
from rich.table import Table

MB = 1e6  # rates in millions of bytes per second, as the stats table's "backend MB"


@dataclass(frozen=True)
class Interval:
    """The figures of one interval between two snapshots."""

    at: float  # Unix time of the newer snapshot
    seconds: float
    reads: int  # files counted in the interval
    files_s: float
    served_mb_s: float  # bytes returned to readers
    ssd_mb_s: float  # bytes read from the SSD tier
    source_mb_s: float  # bytes read from the source (by readers and the read-ahead)
    hits_ram: float | None  # fractions of `reads`; None when it is 0
    hits_ssd: float | None
    prefetched: float | None
    misses: float | None
    stall_s_per_s: float  # seconds readers waited for the source, per second
    inflight: int  # files being read ahead now
    window: int | None  # the read-ahead window in files of the order; None without one
    epoch: int | None
    consumed: int | None
    length: int | None


def interval(before: dict, after: dict, seconds: float, at: float) -> Interval:
    """The interval between snapshots `before` and `after`, taken `seconds` apart."""
    old, new = before["totals"], after["totals"]
    seconds = max(seconds, 1e-9)

    def rate(key: str, unit: float = 1.0) -> float:
        return (new[key] - old[key]) / unit / seconds

    reads = new["reads"] - old["reads"]

    def share(key: str) -> float | None:
        return (new[key] - old[key]) / reads if reads > 0 else None

    order = after.get("order") or {}
    return Interval(
        at=at, seconds=seconds, reads=reads, files_s=reads / seconds,
        served_mb_s=rate("bytes_served", MB), ssd_mb_s=rate("ssd_bytes_read", MB),
        source_mb_s=rate("backend_bytes", MB), hits_ram=share("hits_ram"),
        hits_ssd=share("hits_ssd"), prefetched=share("prefetched"), misses=share("misses"),
        stall_s_per_s=rate("stall_s"), inflight=after["prefetch"]["inflight"],
        window=order.get("lookahead"), epoch=order.get("epoch"),
        consumed=order.get("consumed"), length=order.get("length"))


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _maybe(value: int | None) -> str:
    return "-" if value is None else str(value)


def _consumed(row: Interval) -> str:
    if row.consumed is None or row.length is None:
        return "-"
    return f"{row.consumed}/{row.length}"


# (header, width in the plain view, cell): the columns of both views, left to right
COLUMNS: tuple[tuple[str, int, Callable[[Interval], str]], ...] = (
    ("time", 8, lambda row: time.strftime("%H:%M:%S", time.localtime(row.at))),
    ("files/s", 8, lambda row: _number(row.files_s)),
    ("read MB/s", 9, lambda row: _number(row.served_mb_s)),
    ("ssd MB/s", 8, lambda row: _number(row.ssd_mb_s)),
    ("source MB/s", 11, lambda row: _number(row.source_mb_s)),
    ("ram %", 5, lambda row: _percent(row.hits_ram)),
    ("ssd %", 5, lambda row: _percent(row.hits_ssd)),
    ("ahead %", 7, lambda row: _percent(row.prefetched)),
    ("miss %", 6, lambda row: _percent(row.misses)),
    ("stall s/s", 9, lambda row: f"{row.stall_s_per_s:.2f}"),
    ("in flight", 9, lambda row: str(row.inflight)),
    ("window", 6, lambda row: _maybe(row.window)),
    ("epoch", 5, lambda row: _maybe(row.epoch)),
    ("consumed", 15, _consumed),
)
# the live table shows these of the newest interval below it, not in a column of every line,
# so that it fits in 80 columns
STATE_COLUMNS = ("window", "epoch", "consumed")


def plain_header() -> str:
    return "  ".join(header.rjust(width) for header, width, _ in COLUMNS)


def plain_line(row: Interval) -> str:
    return "  ".join(cell(row).rjust(width) for _, width, cell in COLUMNS)


def table(rows: Sequence[Interval], title: str) -> Table:
    """The live view: one line per interval, the newest last, and the read-ahead and the
    epoch's progress as of the newest."""
    shown = [(header, cell) for header, _, cell in COLUMNS if header not in STATE_COLUMNS]
    view = Table(title=title, title_justify="left", caption_justify="left",
                 header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                 collapse_padding=True)
    for header, _ in shown:
        view.add_column(header.replace(" ", "\n", 1), justify="right", no_wrap=True)
    for row in rows:
        view.add_row(*(cell(row) for _, cell in shown))
    if rows:
        newest = rows[-1]
        view.caption = (f"epoch {_maybe(newest.epoch)}: {_consumed(newest)} consumed; "
                        f"read-ahead window {_maybe(newest.window)} files")
    return view
