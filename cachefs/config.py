"""Settings of a mount, as frozen dataclasses: validated once at construction, no I/O.

The CLI parses strings (sizes such as ``8GiB``) with `parse_size` and builds a `MountConfig`;
everything below the CLI receives the config and never sees a string it has to parse.
"""

from __future__ import annotations

import hashlib
import os
import re
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path

from cachefs.mountinfo import listed_path
from cachefs.scheduling import parse_cpus

# order files store epochs, ranks and indices as int64 (man/cachefs-order.5): the CLI's bound
# on --epoch, and cachefs/order.py's on every integer it writes
INT64_MAX = 2**63 - 1

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Parse a byte count: ``4096``, ``512K``, ``8GiB``, ``1.5G``, ``100MB``.

    K/M/G/T and KiB/MiB/GiB/TiB are binary (powers of 1024), as in `dd`, rclone and
    mountpoint-s3's cache sizes; a user who writes ``8G`` for a RAM budget means 8 GiB.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 8GiB)")
    number, unit, _suffix = match.groups()
    # exact (a float of a 400-digit number is inf), and within what the tiers count in
    size = int(Fraction(number) * 1024 ** _SIZE_UNITS[unit.lower()])
    if size > INT64_MAX:
        raise ValueError(f"size too large: {text!r}")
    return size


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``localhost:9567``, ``127.0.0.1:9567``, ``[::1]:9567``), the
    address `--metrics` listens on; the host is a name or an address, never empty, so that
    serving every interface is a choice written out (``0.0.0.0:9567``)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or ":" in host and not text.startswith("["):
        raise ValueError(f"not HOST:PORT: {text!r} (examples: localhost:9567, [::1]:9567)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"not a port number (1-65535): {port!r}")
    return host, int(port)


def default_state_dir(mountpoint: Path) -> Path:
    """Per-mount directory for the order file, daemon log and pid file.

    Keyed by the mount point's real path so that `cachefs publish MNT` run by the trainer and
    the daemon agree on it without talking to each other: the path the mount table lists,
    found without a stat of the mount point itself (`listed_path`), which would hang
    `cachefs umount` on the stuck mount it is run to take down.
    """
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("XDG_CACHE_HOME")
                or Path.home() / ".cache") / "cachefs"
    digest = hashlib.sha1(os.fsencode(listed_path(mountpoint))).hexdigest()[:16]
    return base / digest


DATA_PLANES = ("auto", "no-open", "keep-cache", "daemon")
# `--miss-batch`: a demand miss reads the missed file and the next MISS_BATCH_ITEMS - 1 files of
# its storage target's list (cachefs/prefetch.py `demand_miss`); the default is measured with
# the simulator (docs/design.md §2)
MISS_BATCH_ITEMS = 8


@dataclass(frozen=True)
class CacheConfig:
    """Budgets and the unit of caching."""

    ram_bytes: int = 1 * GIB
    block_bytes: int = 4 * MIB
    ssd_dir: Path | None = None
    ssd_bytes: int = 0

    def __post_init__(self):
        if self.block_bytes < 4 * KIB or self.block_bytes & (self.block_bytes - 1):
            raise ValueError(f"block size must be a power of two >= 4 KiB: {self.block_bytes}")
        if self.ram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("cache sizes must not be negative")
        if self.ssd_dir is not None and self.ssd_bytes <= 0:
            raise ValueError("--ssd-cache needs a positive --ssd-size")


# Reads of the source at once. Over network storage (slowfs: sshfs, 1 ms a packet; 8 DataLoader
# readers, RAM 25%; `scripts/bench.py --rounds 5`) 64 keep the read-ahead further ahead of the
# readers than 32: 610-1,020 demand misses an epoch against 920-1,780; epochs 2 and 3 at a median
# 1.12x and 1.10x the readers alone against 1.07x and 1.06x, epoch 1 0.85x against 0.89x (the
# rounds spread 0.83-0.91x); 96 and 128 missed less still but were no faster (README)
SOURCE_THREADS = 64


@dataclass(frozen=True)
class PrefetchConfig:
    """How far and how wide to read ahead."""

    lookahead_items: int = 0  # 0: automatic (as far as the RAM budget reaches)
    source_threads: int = SOURCE_THREADS
    sequential_blocks: int = 4  # read-ahead inside a file read sequentially without an order
    # a demand miss reads this many files of its storage target's list (prefetch.py)
    miss_batch_items: int = MISS_BATCH_ITEMS

    def __post_init__(self):
        if self.lookahead_items < 0:
            raise ValueError("--lookahead must be >= 0")
        if self.source_threads < 1:
            raise ValueError("--source-threads must be >= 1")
        if self.miss_batch_items < 1:
            raise ValueError("--miss-batch must be >= 1")


@dataclass(frozen=True)
class MountConfig:
    """Everything `mount.run` needs."""

    source: Path
    mountpoint: Path
    state_dir: Path
    order_file: Path
    cache: CacheConfig = CacheConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    allow_other: bool = False
    debug: bool = False
    fuse_tasks: int = 16  # pyfuse3 worker tasks: a miss holds one; hits never await
    kernel_timeout_s: float = 300.0  # entry/attribute cache in the kernel (read-only data)
    # how long a checked source identity is trusted (the freshness contract, revalidate.py)
    metadata_ttl_s: float = 60.0
    # who serves cached bytes (man/cachefs-mount.1, "Kernel page cache"): "auto" (the
    # zero-request mode where the kernel and privileges allow, else "keep-cache"),
    # "no-open", "keep-cache", or "daemon" (every READ reaches the daemon)
    data_plane: str = "auto"
    source_delay_s: float = 0.0  # testing aid: added latency per source open and read
    # adopt the order files present at start (left from an earlier run); else set them aside
    resume_order: bool = False
    # (host, port) where /metrics is served in Prometheus's format (metrics.py), or None
    metrics_address: tuple[str, int] | None = None
    # tell systemd (Type=notify) when the mount serves and when it stops (cachefs/sdnotify.py)
    notify_systemd: bool = False
    # the CPUs the daemon's threads run on: "auto", "all" or a list (cachefs/scheduling.py)
    cpus: str = "auto"

    def __post_init__(self):
        if self.fuse_tasks < 1:
            raise ValueError("--fuse-tasks must be >= 1")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane must be one of {', '.join(DATA_PLANES)}")
        if self.metadata_ttl_s < 0 or self.kernel_timeout_s < 0 or self.source_delay_s < 0:
            raise ValueError("timeouts and delays must not be negative")
        parse_cpus(self.cpus)  # ValueError for a list that is none
