"""Prometheus metrics on prometheus_client: a collector over the daemon's status, histograms, GET /metrics.

Who calls what, on which thread:
- The flusher and the uploader create their Histograms when they are built and observe
  durations as work ends, on whatever thread it ends (prometheus_client's histograms are
  thread-safe; fixed buckets, so memory stays bounded).
- On a scrape (at most one render a second, however many scrape: serve), StatusReport
  reads its status from memory on the event loop (StatusReport.snapshot: no disk) and
  hands that copy to page() on a worker thread, which renders it with a registry of its
  own holding one StatusCollector (prometheus_client's global REGISTRY stays empty).
  Counters the roles keep for `ckptd status` are read then, never counted twice.

Labels are bounded: a tier, and a job name (`job_name`: Prometheus keeps `job` for the scrape
job) only on the newest-complete-step gauges and the passed-over counter, whose tables hold at most
progress.MAX_JOBS_REPORTED jobs.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from importlib.metadata import version
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ckptd import __version__

log = logging.getLogger(__name__)

UPLOAD_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
SAVE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIERS = ("memory", "nvme", "peer", "object")
MAX_REQUEST_BYTES = 8192
MAX_CLIENTS = 8  # scrapes served at once; more wait their turn, CLIENT_TIMEOUT_S at most
MAX_CONNECTIONS = 32  # open at once, waiting or served: more are closed at accept (each holds a descriptor)
CLIENT_TIMEOUT_S = 5.0
PAGE_TTL_S = 1.0  # a page is rendered at most once a second, however many scrape it
# The text format generate_latest writes for names like ours; prometheus_client 0.20 calls it
# CONTENT_TYPE_LATEST, later releases CONTENT_TYPE_PLAIN_0_0_4 (their LATEST moved on to 1.0.0).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUILD = {  # the labels of ckptd_build_info: versions from package metadata, so this module never imports grpc
    "version": __version__,
    "python": platform.python_version(),
    "grpcio": version("grpcio"),
    "protobuf": version("protobuf"),
}


class Histogram(prometheus_client.Histogram):
    """Count durations into fixed cumulative buckets (a prometheus_client histogram in no registry)."""

    def __init__(self, name: str, help: str, buckets: Sequence[float] = UPLOAD_BUCKETS_S) -> None:
        super().__init__(name, help, buckets=buckets, registry=None)


class StatusCollector(Collector):
    """Yield the metric families of one scrape: a status document's (see StatusReport.snapshot), then histograms'.

    Built by page() for one render; the registry calls collect() on page()'s thread.
    """

    def __init__(self, status: dict[str, Any], histograms: list[Histogram]) -> None:
        self.status = status
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        """Yield every family: what the status document says, then the histograms."""
        yield from families(self.status)
        for h in self.histograms:
            yield from h.collect()


def page(status: dict[str, Any], histograms: list[Histogram]) -> str:
    """Return a whole /metrics page in Prometheus' text format (any thread: status is a copy, histograms lock)."""
    own = CollectorRegistry(auto_describe=False)
    own.register(StatusCollector(status, histograms))
    return prometheus_client.generate_latest(own).decode()


def families(status: dict[str, Any]) -> Iterator[Metric]:
    """Yield the families read from a status document (see StatusReport.snapshot), names unchanged since 0.1."""
    c = status["counters"]
    peer = status["tiers"]["peer"].get("counters", {})
    obj = status["tiers"]["object"]
    staging = status["staging"]
    written = {"memory": c["bytes_saved"], "nvme": c["bytes_flushed"], "peer": c["replica_bytes_received"]}
    retries = {"peer": peer.get("replica_failures", 0)}
    if obj["enabled"]:
        written["object"] = obj["uploaded_bytes"]
        retries["object"] = obj["upload_failures"]

    yield GaugeMetricFamily("ckptd_up", "1 while the daemon serves", value=1)
    info = GaugeMetricFamily("ckptd_build_info", "Always 1: this daemon's release and its runtime's", labels=[*BUILD])
    info.add_metric(list(BUILD.values()), 1)
    yield info
    yield CounterMetricFamily("ckptd_saves_total", "Snapshots committed by training ranks", value=c["saves"])
    yield CounterMetricFamily(
        "ckptd_saves_skipped_total", "Saves refused for want of staging room, or of a step complete already",
        value=c["skipped"],
    )  # fmt: skip
    yield CounterMetricFamily("ckptd_flushes_total", "Shards made durable on NVMe", value=c["flushed"])
    passed_over = CounterMetricFamily(
        "ckptd_nvme_passed_over_total",
        "Steps of each job passed over on this node's NVMe: a newer save replaced their snapshot before the "
        "disk was free for it (saves outran the flush; [nvme] flush_every keeps chosen steps)",
        labels=["job_name"],
    )
    for job, p in sorted(status.get("passed_over", {}).items()):
        passed_over.add_metric([job], p["steps"])
    yield passed_over
    yield CounterMetricFamily("ckptd_flush_failures_total", "Flushes to NVMe that failed", value=c["flush_failures"])
    yield _by_tier(
        CounterMetricFamily(
            "ckptd_bytes_written_total",
            "Shard bytes that reached each tier on this node: memory (committed by ranks), nvme (flushed), "
            "peer (replicas received from other nodes), object (uploaded)",
            labels=["tier"],
        ),
        written,
    )
    yield CounterMetricFamily(
        "ckptd_replica_bytes_sent_total", "Shard bytes sent to peers", value=peer.get("replica_bytes_sent", 0)
    )
    short = status["tiers"]["peer"].get("under_replicated", {})
    yield GaugeMetricFamily(
        "ckptd_under_replicated_shards",
        "Shards written here that lack a replica on a live peer ([peer] replicas wanted)",
        value=short.get("shards", 0),
    )
    yield GaugeMetricFamily(
        "ckptd_under_replicated_seconds",
        "How long the shard longest short of a replica has been so (0: none is)",
        value=short.get("oldest_s", 0.0),
    )
    yield GaugeMetricFamily(
        "ckptd_replicas_on_stand_in",
        "Shards whose replica a stand-in keeps while the peer placed to keep it fails ([peer] failover_s)",
        value=short.get("on_stand_in", 0),
    )
    yield _by_tier(
        CounterMetricFamily(
            "ckptd_retries_total", "Failed attempts at replicas (peer) and uploads (object), retried", labels=["tier"]
        ),
        retries,
    )
    yield _by_tier(
        CounterMetricFamily(
            "ckptd_verification_failures_total",
            "Chunks caught not matching their checksum, by the tier they came from",
            labels=["tier"],
        ),
        c["verification_failures"],
    )
    yield GaugeMetricFamily(
        "ckptd_snapshots_in_flight", "Snapshots not yet durable on NVMe", value=staging["pending_flushes"]
    )
    yield GaugeMetricFamily("ckptd_staging_bytes", "Shared memory held by staging slots", value=staging["in_use_bytes"])
    yield GaugeMetricFamily(
        "ckptd_staging_budget_bytes",
        "Cap on staging memory ([staging] budget_bytes, by default 3/4 of its filesystem)",
        value=staging["budget_bytes"],
    )
    yield from _newest_steps(status["newest_complete"])
    yield _by_tier(
        GaugeMetricFamily(
            "ckptd_newest_complete_step_age_seconds",
            "Deprecated (use time() - ckptd_newest_complete_step_timestamp_seconds): seconds since the newest "
            "complete step of any job became complete on each tier",
            labels=["tier"],
        ),
        status["newest_complete_age_s"],
    )
    yield CounterMetricFamily(
        "ckptd_malformed_requests_total",
        "Requests refused because their bytes did not parse (logged at most once a minute per caller)",
        value=c.get("malformed_requests", 0),
    )
    yield CounterMetricFamily(
        "ckptd_removal_failures_total",
        "Step removals that failed on this node's disks (logged, retried each retention pass)",
        value=c["removal_failures"],
    )
    yield GaugeMetricFamily(
        "ckptd_event_loop_max_stall_seconds",
        "The longest the daemon's event loop ran late since start (RPCs wait that long)",
        value=status["event_loop"]["max_stall_s"],
    )
    yield GaugeMetricFamily(
        "ckptd_uploads_pending", "Shards not yet in the object store", value=obj.get("pending_uploads", 0)
    )
    cluster = status.get("cluster", {})
    if cluster.get("backend", "none") != "none":
        yield GaugeMetricFamily(
            "ckptd_cluster_connected",
            "1 while the cluster view's backend answers ([cluster] backend: etcd, or the peers themselves)",
            value=1 if cluster.get("connected") else 0,
        )
        yield GaugeMetricFamily(
            "ckptd_cluster_pending_reports",
            "Shard reports and commits this node has not yet delivered to the cluster view (they wait, saves go on)",
            value=cluster.get("pending_reports", 0),
        )


def _by_tier(family: CounterMetricFamily | GaugeMetricFamily, values: dict[str, float]) -> Metric:
    for tier in sorted(values, key=lambda t: TIERS.index(t) if t in TIERS else len(TIERS)):
        family.add_metric([tier], values[tier])
    return family


def _newest_steps(newest: dict[str, dict[str, dict[str, float]]]) -> Iterator[Metric]:
    labels = ["job_name", "tier"]
    step = GaugeMetricFamily(
        "ckptd_newest_complete_step", "The newest step of each job complete on each tier, as this node saw it",
        labels=labels,
    )  # fmt: skip
    stamp = GaugeMetricFamily(
        "ckptd_newest_complete_step_timestamp_seconds",
        "When that step became complete on that tier (unix seconds): its age is time() minus this",
        labels=labels,
    )
    for job, tiers in sorted(newest.items()):
        for tier, newest_step in tiers.items():
            step.add_metric([job, tier], newest_step["step"])
            stamp.add_metric([job, tier], newest_step["completed_unix_s"])
    yield step
    yield stamp


async def serve(listen: str, page: Callable[[], Awaitable[str]]) -> asyncio.Server:
    """Serve GET /metrics on listen (host:port) with page(); anything else gets 404 or 405."""
    clients = asyncio.Semaphore(MAX_CLIENTS)
    rendered: list[tuple[float, bytes]] = []

    async def cached_page() -> bytes:
        now = time.monotonic()
        if not rendered or now - rendered[0][0] > PAGE_TTL_S:
            rendered[:] = [(now, (await page()).encode())]
        return rendered[0][1]

    open_connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Anyone who reaches the port may connect: no connection is held past its deadline or past the cap.
        if open_connections[0] >= MAX_CONNECTIONS:
            writer.close()
            return
        open_connections[0] += 1
        try:
            await asyncio.wait_for(clients.acquire(), timeout=CLIENT_TIMEOUT_S)
        except TimeoutError:
            open_connections[0] -= 1
            writer.close()
            return
        try:
            await answer(reader, writer)
        finally:
            clients.release()
            open_connections[0] -= 1

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=CLIENT_TIMEOUT_S)
            method, path, *_ = [*head[:MAX_REQUEST_BYTES].decode("latin-1").split(" ", 2), "", ""]
            if method not in ("GET", "HEAD"):
                status, body = "405 Method Not Allowed", b"GET /metrics\n"
            elif path.split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", b"see /metrics\n"
            else:
                status, body = "200 OK", await cached_page()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (body if method != "HEAD" else b"")
            )
            await asyncio.wait_for(writer.drain(), timeout=CLIENT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that goes away or sends garbage gets nothing
        except Exception:  # a scrape must never take the daemon down
            log.exception("serving /metrics failed")
        finally:
            writer.close()

    host, _, port = listen.rpartition(":")
    return await asyncio.start_server(handle, host.strip("[]"), int(port), limit=MAX_REQUEST_BYTES)
