"""`cachefs mount --metrics HOST:PORT`: Prometheus metrics that agree with `cachefs stats
--json` (issue 18), served by the daemonized mount and gone with it; a port in use is a mount
error with its own exit code."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefs import errors
from cachefs.client import MountError, MountProcess
from cachefs.metrics import READ_CLASSES, Exporter
from cachefs.mountinfo import mounted_paths
from cachefs.stats import Histogram
from conftest import flat_dataset_fixture, read_epoch, run_cachefs

N_FILES = 40
dataset = flat_dataset_fixture(N_FILES, 30_000)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def started_with_metrics(src, tmp_path, args) -> tuple[MountProcess, int]:
    """A daemonized mount serving its metrics on a free port, and the port: one probed free,
    then bound by the daemon, and another if a process took it in between (the mount's exit
    code 8; outgoing connections of other tests take ports from the same range)."""
    for _ in range(5):
        port = free_port()
        mount = MountProcess(src, tmp_path / "mnt", tmp_path / "state",
                             ["--metrics", f"127.0.0.1:{port}", *args])
        try:
            mount.start()
        except MountError as exc:
            if f"(exit {errors.EXIT_METRICS})" not in str(exc):
                raise
            continue
        return mount, port
    raise AssertionError("no port probed free stayed free until the daemon bound it")


def scrape(port: int) -> dict[str, float]:
    """The samples of /metrics, keyed `name` or `name{label="value",...}` (labels sorted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def documented_names(port: int) -> list[str]:
    """The cachefs_* metric names /metrics has that man/cachefs-mount.1 does not mention."""
    from test_man import MAN_DIR, mentions, page_text

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        families = list(text_string_to_metric_families(answer.read().decode()))
    suffix = {"counter": "_total", "info": "_info"}
    names = [family.name + suffix.get(family.type, "") for family in families
             if family.name.startswith("cachefs_")]
    assert len(names) > 20
    text = page_text(MAN_DIR / "cachefs-mount.1")
    return [name for name in names if not mentions(text, name)]


def stats_json(mountpoint) -> dict:
    done = run_cachefs("stats", mountpoint, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def settled_scrape(mountpoint, port) -> tuple[dict, dict]:
    """A scrape between two `cachefs stats --json` that agree on every counter it shows (the
    read-ahead of the next epoch may still be reading when the last file was counted)."""
    for _ in range(100):
        before = stats_json(mountpoint)
        samples = scrape(port)
        after = stats_json(mountpoint)
        moving = ("totals", "source", "order", "ssd", "rejections_total")
        if all(before[key] == after[key] for key in moving):
            return after, samples
        time.sleep(0.1)
    raise AssertionError("the counters never stood still")


def test_metrics_agree_with_stats_json_and_stop_with_the_daemon(dataset, tmp_path):
    src, relpaths = dataset
    # daemonized: `cachefs mount` returned, the daemon serves the metrics
    mount, port = started_with_metrics(src, tmp_path, ["--ssd-cache", tmp_path / "ssd",
                                                       "--ssd-size", "600KiB",
                                                       "--ram-cache", "1MiB"])
    try:
        read_epoch(mount, relpaths, 0)
        read_epoch(mount, relpaths, 1)
        snapshot, samples = settled_scrape(mount.mountpoint, port)
        totals = snapshot["totals"]
        assert totals["reads"] == sum(r["reads"] for r in snapshot["epochs"]) == 2 * N_FILES
        by_class = {name: samples[f'cachefs_reads_total{{class="{name}"}}']
                    for name in READ_CLASSES}
        assert by_class == {name: totals[name] for name in READ_CLASSES}
        assert sum(by_class.values()) == totals["reads"]
        assert by_class["hits_ram"] + by_class["hits_ssd"] > 0  # epoch 1 hit something
        assert samples["cachefs_served_bytes_total"] == totals["bytes_served"] > 0
        assert samples["cachefs_source_read_bytes_total"] == totals["backend_bytes"] > 0
        assert samples["cachefs_source_block_reads_total"] == totals["backend_reads"]
        assert samples["cachefs_ssd_read_bytes_total"] == totals["ssd_bytes_read"] > 0
        assert samples["cachefs_stall_seconds_total"] == totals["stall_s"]
        read_seconds = snapshot["source"]["read_seconds"]
        assert (samples["cachefs_source_read_seconds_count"] == read_seconds["count"]
                == snapshot["source"]["requests"]["block_read"] > 0)
        assert samples["cachefs_source_read_seconds_sum"] == read_seconds["sum_s"]
        assert samples['cachefs_source_read_seconds_bucket{le="+Inf"}'] == read_seconds["count"]
        assert (samples['cachefs_source_read_seconds_bucket{le="0.01"}']
                == sum(count for bound, count in zip(read_seconds["bounds_s"],
                                                     read_seconds["counts"], strict=False)
                       if bound <= 0.01))
        assert samples["cachefs_ram_budget_bytes"] == snapshot["ram"]["budget"] == 2**20
        assert samples["cachefs_ssd_budget_bytes"] == snapshot["ssd"]["budget"] == 600 * 1024
        assert samples["cachefs_ssd_used_bytes"] == snapshot["ssd"]["bytes"] > 0
        assert samples["cachefs_epoch"] == snapshot["order"]["epoch"] >= 1
        assert samples["cachefs_readahead_inflight_files"] == snapshot["prefetch"]["inflight"]
        assert samples["cachefs_order_rejections_total"] == 0
        # (the scrape came before the last `stats --json`, whose own requests it missed); no
        # READ at all is right too: the read-ahead may have handed every file's pages to the
        # kernel before the reader came (the zero-request mode), and an op never asked for has
        # a sample in neither
        requests = snapshot["fuse_requests"]
        assert requests["lookup"] > 0
        for op in ("lookup", "read"):
            assert (samples.get(f'cachefs_fuse_requests_total{{op="{op}"}}')
                    == requests.get(op))
        assert documented_names(port) == []  # man/cachefs-mount.1 lists every metric

        (mount.state_dir / "order.npz").write_bytes(b"not an order file")
        deadline = time.monotonic() + 10
        while stats_json(mount.mountpoint)["rejections_total"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert scrape(port)["cachefs_order_rejections_total"] == 1
    finally:
        mount.stop()
    assert str(mount.mountpoint) not in mounted_paths()
    with pytest.raises(urllib.error.URLError):  # the server went with the daemon
        scrape(port)


def test_a_port_in_use_is_a_mount_error(dataset, tmp_path):
    src, _ = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        for mode in ((), ("--foreground",)):
            done = run_cachefs("mount", src, mnt, "--state-dir", tmp_path / "state",
                               "--metrics", address, *mode)
            assert done.returncode == errors.EXIT_METRICS == 8, done.stderr
            assert f"--metrics {address}: cannot listen there: Address already in use" \
                in done.stderr
            assert str(mnt) not in mounted_paths()
        # the daemon's own listening (after the CLI's check) reports the same error
        with pytest.raises(errors.StartupError, match="Address already in use") as raised:
            Exporter.start(("127.0.0.1", busy.getsockname()[1]))
        assert raised.value.exit_code == errors.EXIT_METRICS
    done = run_cachefs("mount", src, mnt, "--metrics", "9567")
    assert done.returncode == 2 and "not HOST:PORT" in done.stderr


def test_histogram_buckets_hold_values_up_to_their_bound():
    histogram = Histogram((0.001, 0.01))
    for value_s in (0.0005, 0.001, 0.002, 0.01, 5.0):
        histogram.observe(value_s)
    snapshot = histogram.snapshot()
    assert snapshot["counts"] == [2, 2, 1]
    assert snapshot["count"] == 5 and snapshot["sum_s"] == pytest.approx(5.0135)


def test_idle_connections_hold_neither_threads_nor_the_server(monkeypatch):
    """Any local user reaches a loopback port: 100 connections that say nothing get at most
    MAX_CLIENTS threads, are dropped after the request timeout, and a scrape is answered
    after that (a thread was made per connection and kept: 200 idle connections, 199)."""
    import socket
    import threading
    import urllib.request

    from cachefs import metrics

    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exporter = metrics.Exporter.start(("127.0.0.1", port))
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= metrics.MAX_CLIENTS
        time.sleep(1.0)  # past the timeout: the idle clients were dropped
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"process_" in body
    finally:
        for connection in idle:
            connection.close()
        exporter.close()


def test_a_client_that_went_away_is_no_traceback_in_the_log(capsys, caplog):
    """socketserver printed a traceback on stderr (the daemon's log) for every client that
    closed, or was cut at its deadline, before its answer was written (a BrokenPipeError in
    the fresh-clone CI, from the trickling client below). Such a client is a debug line; any
    other failure of a request is still logged with its traceback."""
    import logging

    from cachefs import metrics

    server = metrics._serve("127.0.0.1", 0, metrics.CollectorRegistry())
    try:
        with caplog.at_level(logging.DEBUG, logger="cachefs.metrics"):
            try:
                raise BrokenPipeError(32, "Broken pipe")
            except BrokenPipeError:
                server.handle_error(None, ("127.0.0.1", 1))
            try:
                raise ValueError("a bug")
            except ValueError:
                server.handle_error(None, ("127.0.0.1", 2))
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().err == ""
    went_away, failed = caplog.records
    assert went_away.levelno == logging.DEBUG and "went away" in went_away.getMessage()
    assert failed.levelno == logging.WARNING and failed.exc_info is not None


def test_a_client_that_trickles_its_request_is_dropped_at_the_deadline(monkeypatch):
    """The socket's timeout is per read: a client that sends a byte before each timeout ends
    kept its slot for good, and MAX_CLIENTS of them silenced the endpoint. The whole request
    has a deadline."""
    import socket

    from cachefs import metrics

    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    monkeypatch.setattr(metrics._BoundedServer, "deadline_s", 1.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exporter = metrics.Exporter.start(("127.0.0.1", port))
    try:
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.settimeout(5)
            started_s = time.monotonic()
            dropped = False
            while time.monotonic() - started_s < 4:
                try:
                    slow.sendall(b"G")  # never a whole request line
                except OSError:
                    dropped = True
                    break
                time.sleep(0.2)
                slow.setblocking(False)
                try:
                    if slow.recv(1) == b"":
                        dropped = True
                        break
                except BlockingIOError:
                    pass
                finally:
                    slow.setblocking(True)
                    slow.settimeout(5)
            assert dropped and time.monotonic() - started_s < 3
    finally:
        exporter.close()
