"""Prometheus metrics of a live mount (``burstfs mount --metrics-addr HOST:PORT``).

A custom collector reads the journal and the mover's counters at scrape time,
so nothing is updated on the write path and nothing lands in prometheus_client's
global registry (several mounts, or tests, can live in one process).  The one
exception is the drain-latency histogram: a histogram needs every observation,
so the mover reports each durable file through ``Mover.on_durable``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import passthrough
from .config import MountConfig, parse_metrics_addr
from .core import BurstCore
from .drainservice import DrainService
from .errors import ConfigError
from .journal import FILE_STATES, QUEUED, Journal
from .status import READ_KINDS, drain_rate, outage_of

log = logging.getLogger("burstfs.metrics")

# Checkpoint files range from kilobytes (metadata) to tens of GiB (shards), so
# drain latency spans milliseconds to many minutes.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class BurstCollector(Collector):
    """Reads the journal (its own read-only connection) and the mover's stats at each scrape."""

    def __init__(self, core: BurstCore, drain: DrainService | None, journal: Journal) -> None:
        self.core = core
        self.drain = drain
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        files = GaugeMetricFamily("burstfs_files", "Files by drain state.", labels=["state"])
        sizes = GaugeMetricFamily("burstfs_file_bytes", "Logical bytes of files by drain state.", labels=["state"])
        by_state = {state: (0, 0) for state in FILE_STATES}
        by_state.update(self.journal.state_counts())
        for state, (count, nbytes) in by_state.items():
            files.add_metric([state], count)
            sizes.add_metric([state], nbytes)
        yield files
        yield sizes
        queued = [by_state[state] for state in sorted(QUEUED)]
        yield GaugeMetricFamily(
            "burstfs_staged_bytes",
            "Bytes closed and not yet durable (staged + draining).",
            value=sum(b for _, b in queued),
        )
        yield GaugeMetricFamily(
            "burstfs_queue_depth", "Files waiting to drain or draining.", value=sum(f for f, _ in queued)
        )
        # What the mount reports (df on it): within --cache-size, less --min-free, durable copies free.
        fs = self.core.capacity.statfs(self.core.capacity.evictable_bytes_blocking())
        yield GaugeMetricFamily(
            "burstfs_local_tier_capacity_bytes",
            "Bytes the local tier may hold (its file system, or --cache-size).",
            value=fs.blocks * fs.block_size,
        )
        yield GaugeMetricFamily(
            "burstfs_local_tier_free_bytes",
            "Bytes a write can still take on the local tier (durable local copies count as free).",
            value=fs.blocks_free * fs.block_size,
        )
        yield CounterMetricFamily(
            "burstfs_fuse_xattr_answered_in_shim",
            "GETXATTR requests of names outside user.* answered ENODATA without the daemon (the passthrough shim).",
            value=passthrough.foreign_xattrs_answered(),
        )
        if self.drain is None:
            return
        stats = self.drain.mover.stats
        yield CounterMetricFamily(
            "burstfs_fetched_bytes",
            "File bytes fetched from the remote since the mount started (compressed objects: once decompressed).",
            value=self.drain.fetched_bytes,
        )
        yield CounterMetricFamily(
            "burstfs_drained_bytes", "Bytes made durable since the mount started.", value=stats.bytes_drained
        )
        yield CounterMetricFamily(
            "burstfs_drained_files", "Files made durable since the mount started.", value=stats.files_drained
        )
        outage = outage_of(stats)
        yield GaugeMetricFamily(
            "burstfs_drain_throughput_bytes_per_second",
            "Drain rate over the last 30 s (0 during an outage, as status says).",
            value=drain_rate(stats, outage),
        )
        yield GaugeMetricFamily(
            "burstfs_remote_outage_seconds",
            "Seconds since the drain's trouble began (status' headline; 0 while it drains).",
            value=max(0.0, time.time() - outage["since"]) if outage else 0.0,
        )
        errors = CounterMetricFamily("burstfs_drain_errors", "Drain errors by kind.", labels=["kind"])
        reads = CounterMetricFamily(
            "burstfs_read_errors", "Reads and listings the remote failed (not the drain), by kind.", labels=["kind"]
        )
        for kind, count in dict(stats.errors_by_kind).items():
            (reads if kind in READ_KINDS else errors).add_metric([kind], count)
        yield errors
        yield reads
        yield GaugeMetricFamily(
            "burstfs_drain_halted",
            "1 while a permanent remote error stops the drain.",
            value=int(stats.halted is not None),
        )


class MetricsServer:
    """The HTTP endpoint and the registry behind it, for one mount."""

    def __init__(self, config: MountConfig, core: BurstCore, drain: DrainService | None) -> None:
        assert config.metrics_addr is not None
        self.host, self.port = parse_metrics_addr(config.metrics_addr)
        self.registry = CollectorRegistry(auto_describe=False)
        self.journal = Journal(config.cache_dir, readonly=True)
        self.registry.register(BurstCollector(core, drain, self.journal))
        self.drain_latency = Histogram(
            "burstfs_drain_latency_seconds",
            "Seconds from the start of a file's upload until it is durable.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        if drain is not None:
            drain.mover.on_durable(self._durable)
        self._server: Any = None  # set by start()

    def _durable(self, size: int, seconds: float) -> None:
        self.drain_latency.observe(seconds)

    def start(self) -> None:
        try:
            self._server, _ = start_http_server(self.port, self.host, registry=self.registry)
        except OSError as exc:
            self.journal.close()
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror}") from None
        log.info("event=metrics_listening addr=%s:%d", self.host, self.port)

    async def run(self) -> None:
        """Keep serving until cancelled (the mount ends), then stop the HTTP thread."""
        try:
            await trio.sleep_forever()
        finally:
            self._server.shutdown()
            self._server.server_close()
            self.journal.close()


def start_metrics(config: MountConfig, core: BurstCore, drain: DrainService | None) -> MetricsServer | None:
    """Bind the endpoint when ``--metrics-addr`` was given.

    Called before the daemon's nursery opens, so a busy port fails the mount with
    a plain message; the caller then runs :meth:`MetricsServer.run` in the nursery.
    """
    if config.metrics_addr is None:
        return None
    server = MetricsServer(config, core, drain)
    server.start()
    return server
