"""Prometheus metrics of a mount: `cachefs mount --metrics HOST:PORT` serves `/metrics`.

No second bookkeeping: at each scrape the collector takes the snapshot that `cachefs stats
--json` reads (`Mount.snapshot`) and turns it into metric families, so the two always agree.
The counters are touched only by the trio thread (stats.py), and prometheus_client's HTTP
server answers in threads of its own, so a scrape asks the trio thread for the snapshot
(`trio.from_thread.run_sync`) rather than reading the objects under its feet.

Lifetime: `Exporter.start` listens in the daemon process (the one that serves the mount),
before the mount exists, so a port in use is a start-up error (exit code 8,
`errors.EXIT_METRICS`) and not a mount without its metrics; the CLI tries the address in the
user's terminal first (`check_address`). Until `attach` is called from inside the trio run, and
after that run ends, a scrape gets the process's own metrics only (CPU, memory, file
descriptors: prometheus_client's `ProcessCollector`). `close` stops the server when the
mount's process is done.

Names are `cachefs_*` with the unit in the name (`_bytes`, `_seconds`, `_total` for counters),
totals since the mount started; the list, with the JSON key each comes from, is in
man/cachefs-mount.1 ("Metrics").
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily, Metric)
from prometheus_client.registry import Collector

from cachefs import errors
from cachefs.threads import start_thread

log = logging.getLogger(__name__)

# Any local user reaches a loopback port: a client that connects and says nothing is dropped
# after REQUEST_TIMEOUT_S, and at most MAX_CLIENTS are answered at once (the server made a
# thread per connection and kept it while the client stayed: 200 idle connections, 199
# threads, none let go)
REQUEST_TIMEOUT_S = 10.0
MAX_CLIENTS = 8
# ... and one that sends a byte before each timeout ends is dropped this long after it was
# accepted, its whole request and answer included (a scrape takes milliseconds)
REQUEST_DEADLINE_S = 30.0

# epoch-record counters (Stats.totals) -> (metric, help); the read classes are one metric
_TOTALS = (
    ("bytes_served", "cachefs_served_bytes", "Bytes returned to readers."),
    ("backend_bytes", "cachefs_source_read_bytes", "Bytes read from the source."),
    ("backend_reads", "cachefs_source_block_reads", "Blocks read from the source."),
    ("refetched_blocks", "cachefs_refetched_blocks",
     "Blocks read from the source again in the same epoch."),
    ("ssd_bytes_read", "cachefs_ssd_read_bytes", "Bytes read from the SSD tier."),
    ("stall_s", "cachefs_stall_seconds", "Seconds readers waited for the source."),
)
READ_CLASSES = ("hits_ram", "hits_ssd", "prefetched", "misses")  # stats.py; they sum to reads
_RAM = (("bytes", "cachefs_ram_used_bytes", "Bytes held by the RAM tier."),
        ("budget", "cachefs_ram_budget_bytes", "The RAM tier's budget (--ram-cache)."),
        ("reserved", "cachefs_ram_reserved_bytes", "Bytes reserved for fetches in flight."),
        ("kernel_bytes", "cachefs_ram_kernel_bytes",
         "Bytes of the RAM tier held as the kernel's page cache."),
        ("blocks", "cachefs_ram_blocks", "Blocks in the RAM tier."))
_SSD = (("bytes", "cachefs_ssd_used_bytes", "Bytes held by the SSD tier."),
        ("budget", "cachefs_ssd_budget_bytes", "The SSD tier's budget (--ssd-size)."),
        ("entries", "cachefs_ssd_entries", "Blocks in the SSD tier."))
_SSD_COUNTERS = (("errors", "cachefs_ssd_errors", "Reads and writes of the SSD tier that failed."),
                 ("rejected_checksum", "cachefs_ssd_rejected_checksum",
                  "SSD entries dropped as damaged."),
                 ("dropped_stale", "cachefs_ssd_dropped_stale",
                  "SSD entries dropped because their source file changed."),
                 ("admissions_skipped", "cachefs_ssd_admissions_skipped",
                  "Blocks not written to the SSD tier because its queue was full."))


def address_text(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _unusable(address: tuple[str, int], exc: OSError) -> errors.StartupError:
    reason = exc.strerror or str(exc)
    return errors.StartupError(f"--metrics {address_text(address)}: cannot listen there: "
                               f"{reason}", errors.EXIT_METRICS)


def check_address(address: tuple[str, int]) -> None:
    """StartupError (exit code 8) unless this process could listen on `address` now; the
    CLI's check in the user's terminal, before the daemon starts and listens for good."""
    host, port = address
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port,
                                                              type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            # as the HTTP server binds (allow_reuse_address): a port left in TIME_WAIT is free
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen()
    except OSError as exc:
        raise _unusable(address, exc) from None


class SnapshotCollector(Collector):
    """Metric families from `Mount.snapshot`, taken on the trio thread at each scrape."""

    def __init__(self) -> None:
        self._snapshot: Callable[[], dict] | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    def attach(self, snapshot: Callable[[], dict]) -> None:
        """Serve `snapshot` from now on; called from inside the trio run that owns it."""
        self._snapshot, self._token = snapshot, trio.lowlevel.current_trio_token()

    def detach(self) -> None:
        self._snapshot = self._token = None

    def collect(self) -> Iterator[Metric]:
        snapshot, token = self._snapshot, self._token
        if snapshot is None or token is None:
            return
        try:
            taken = trio.from_thread.run_sync(snapshot, trio_token=token)
        except trio.RunFinishedError:
            return  # the mount is going down
        yield from families(taken)


def families(snapshot: dict) -> Iterator[Metric]:
    """The metrics of one `cachefs stats --json` snapshot (man/cachefs-stats.1)."""
    mount = snapshot["mount"]
    kernel = snapshot.get("kernel") or {}
    info = InfoMetricFamily("cachefs_mount", "The mount: source, mount point, version, "
                            "data plane.")
    info.add_metric([], {"source": mount["source"], "mountpoint": mount["mountpoint"],
                         "version": snapshot["cachefs_version"],
                         "data_plane": kernel.get("mode", "daemon")})
    yield info
    yield GaugeMetricFamily("cachefs_block_bytes", "The unit of caching (--block-size).",
                            value=mount["block_bytes"])
    totals = snapshot["totals"]
    reads = CounterMetricFamily("cachefs_reads", "Files read through the mount, by how they "
                                "were served: hits_ram, hits_ssd, prefetched (read ahead) or "
                                "misses (the reader waited for the source).", labels=["class"])
    for name in READ_CLASSES:
        reads.add_metric([name], totals[name])
    yield reads
    for key, name, text in _TOTALS:
        yield CounterMetricFamily(name, text, value=totals[key])
    source = snapshot["source"]
    requests = CounterMetricFamily("cachefs_source_requests", "Requests made to the source, "
                                   "by kind.", labels=["kind"])
    for kind, count in sorted(source["requests"].items()):
        requests.add_metric([kind], count)
    yield requests
    fuse = CounterMetricFamily("cachefs_fuse_requests", "Requests of the kernel the daemon "
                               "answered, by handler.", labels=["op"])
    for op, count in sorted(snapshot["fuse_requests"].items()):
        fuse.add_metric([op], count)
    yield fuse
    yield CounterMetricFamily("cachefs_source_stats_reused", "Lookups answered from a recent "
                              "stat of the source instead of a request.",
                              value=source["stats_reused"])
    yield _histogram("cachefs_source_read_seconds", "Time the source took to read a block, "
                     "open to last byte.", source["read_seconds"])
    prefetch = snapshot["prefetch"]
    yield GaugeMetricFamily("cachefs_readahead_inflight_files", "Files of the order being "
                            "read ahead now.", value=prefetch["inflight"])
    yield CounterMetricFamily("cachefs_readahead_errors", "Read-ahead reads that failed.",
                              value=prefetch["errors"])
    ram = snapshot["ram"]
    for key, name, text in _RAM:
        yield GaugeMetricFamily(name, text, value=ram[key])
    yield CounterMetricFamily("cachefs_ram_evictions", "Blocks evicted from the RAM tier to "
                              "make room for another.", value=ram["evictions"])
    ssd = snapshot.get("ssd")
    if ssd is not None:
        for key, name, text in _SSD:
            yield GaugeMetricFamily(name, text, value=ssd[key])
        for key, name, text in _SSD_COUNTERS:
            yield CounterMetricFamily(name, text, value=ssd[key])
    order = snapshot.get("order")
    if order is not None:
        yield GaugeMetricFamily("cachefs_epoch", "The epoch of the order in force.",
                                value=order["epoch"])
        yield GaugeMetricFamily("cachefs_order_length_files", "Positions in this node's "
                                "current order.", value=order["length"])
        yield GaugeMetricFamily("cachefs_order_consumed_files", "Positions of the current "
                                "order consumed so far.", value=order.get("consumed", 0))
        if "lookahead" in order:
            yield GaugeMetricFamily("cachefs_readahead_window_files", "The read-ahead window "
                                    "in files of the order.", value=order["lookahead"])
    yield CounterMetricFamily("cachefs_order_rejections", "Order files rejected (the previous "
                              "order stayed in force).", value=snapshot["rejections_total"])


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # the socket's: a silent or slow client is dropped

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Not on stderr (the daemon's log): a scrape is no event."""


class _BoundedServer(ThreadingWSGIServer):
    """A thread per client, as prometheus_client's server, but at most MAX_CLIENTS at once:
    a connection beyond them is closed unanswered, and one still open REQUEST_DEADLINE_S after
    it was accepted is cut (the socket's timeout is per read: clients each sending a byte
    every few seconds held every slot, and silenced the endpoint)."""

    request_queue_size = 64  # listen(2)'s backlog: connections come faster than accepted
    deadline_s = REQUEST_DEADLINE_S

    def __init__(self, *args, **kwargs):
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        # request -> when it is cut (`_cut_late`: one thread for them all)
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(*args, **kwargs)
        start_thread(self._cut_late, "cachefs-cutoff")

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def _cut_late(self) -> None:
        while not self._closed.wait(min(1.0, self.deadline_s / 4)):
            now_s = time.monotonic()
            with self._deadlines_lock:
                late = [request for request, deadline_s in self._deadlines.items()
                        if deadline_s <= now_s]
            for request in late:
                try:
                    request.shutdown(socket.SHUT_RDWR)  # its handler's next read or write ends
                except OSError:
                    pass  # closed meanwhile

    def handle_error(self, request, client_address) -> None:
        """A client that went away (it closed, or was cut at its deadline, before its answer
        was written) is no error of the daemon's: a line at debug level, where socketserver
        printed a traceback on stderr, the daemon's log. Anything else is logged with its
        traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("metrics client %s went away: %s", client_address, exc)
        else:
            log.warning("metrics request from %s failed", client_address, exc_info=True)

    def process_request(self, request, client_address) -> None:
        if not self._clients.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._clients.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        with self._deadlines_lock:
            self._deadlines[request] = time.monotonic() + self.deadline_s
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadlines_lock:
                self._deadlines.pop(request, None)
            self._clients.release()


def _serve(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """prometheus_client's /metrics app on host:port (IPv4 or IPv6), in a daemon thread."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(_BoundedServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, make_wsgi_app(registry), Server,
                         handler_class=_Handler)
    start_thread(server.serve_forever, "cachefs-metrics")
    return server


def _histogram(name: str, text: str, histogram: dict) -> HistogramMetricFamily:
    """A stats.Histogram snapshot (per-bucket counts) as Prometheus's cumulative buckets."""
    buckets = []
    seen = 0
    for bound_s, count in zip(histogram["bounds_s"], histogram["counts"], strict=False):
        seen += count
        buckets.append((repr(float(bound_s)), seen))
    buckets.append(("+Inf", histogram["count"]))
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=histogram["sum_s"])


class Exporter:
    """The /metrics server of one mount (module docstring)."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)
        self._server: WSGIServer | None = None

    @classmethod
    def start(cls, address: tuple[str, int]) -> Exporter:
        """Listen and serve on `address`; StartupError (exit code 8) if it cannot."""
        exporter = cls(address)
        host, port = address
        try:
            exporter._server = _serve(host, port, exporter.registry)
        except OSError as exc:
            raise _unusable(address, exc) from None
        log.info("serving Prometheus metrics at http://%s/metrics", address_text(address))
        return exporter

    def close(self) -> None:
        self.collector.detach()
        if self._server is not None:
            self._server.shutdown()  # waits for its loop: up to half a second
            self._server.server_close()
            self._server = None
