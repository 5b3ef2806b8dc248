"""Prometheus metrics: durations observed as work ends, the rest read from the daemon at each scrape.

The pipeline observes durations into histograms here; counters it already keeps for
`ckptd status` are read when /metrics is scraped, so nothing is counted twice. Labels
are bounded: a tier name at most, never a job, a step or a peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
MAX_REQUEST_BYTES = 8192
MAX_CLIENTS = 8  # scrapes served at once; more wait their turn
CLIENT_TIMEOUT_S = 5.0
PAGE_TTL_S = 1.0  # a page is rendered at most once a second, however many scrape it


@dataclass
class Histogram:
    """Count observations into cumulative buckets, as Prometheus histograms do; thread-safe."""

    name: str
    help: str
    buckets: tuple[float, ...] = DURATION_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Count one observation."""
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1
            self.total += value
            self.observed += 1

    def render(self) -> list[str]:
        """Return the histogram's lines in the text exposition format."""
        with self._lock:
            lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
            for bound, count in zip(self.buckets, self.counts, strict=True):
                lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {count}')
            lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.observed}')
            lines.append(f"{self.name}_sum {_number(self.total)}")
            lines.append(f"{self.name}_count {self.observed}")
        return lines


@dataclass(frozen=True)
class Sample:
    """One metric family read at scrape time: a counter or gauge, by label set."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    values: dict[str, float]  # label text ('tier="nvme"', or "" for none) -> value

    def render(self) -> list[str]:
        """Return the family's lines in the text exposition format."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in sorted(self.values.items()):
            lines.append(f"{self.name}{{{labels}}} {_number(value)}" if labels else f"{self.name} {_number(value)}")
        return lines


def page(status: dict[str, Any], histograms: list[Histogram]) -> str:
    """Return the /metrics page for a daemon's status document (see StatusReport) and its histograms."""
    c = status["counters"]
    peer = status["tiers"]["peer"].get("counters", {})
    obj = status["tiers"]["object"]
    staging = status["staging"]
    written = {'tier="nvme"': c["bytes_flushed"], 'tier="peer"': c["replica_bytes_received"]}
    retries = {'tier="peer"': peer.get("replica_failures", 0)}
    if obj["enabled"]:
        written['tier="object"'] = obj["uploaded_bytes"]
        retries['tier="object"'] = obj["upload_failures"]

    def by_tier(values: dict[str, float]) -> dict[str, float]:
        return {f'tier="{tier}"': v for tier, v in values.items()}

    samples = [
        Sample("ckptd_up", "gauge", "1 while the daemon serves", {"": 1}),
        Sample("ckptd_saves_total", "counter", "Snapshots committed by training ranks", {"": c["saves"]}),
        Sample("ckptd_saves_skipped_total", "counter", "Saves refused for want of staging room", {"": c["skipped"]}),
        Sample("ckptd_flushes_total", "counter", "Shards made durable on NVMe", {"": c["flushed"]}),
        Sample("ckptd_flush_failures_total", "counter", "Flushes to NVMe that failed", {"": c["flush_failures"]}),
        Sample("ckptd_bytes_written_total", "counter", "Shard bytes this node wrote to each tier", written),
        Sample(
            "ckptd_replica_bytes_sent_total",
            "counter",
            "Shard bytes sent to peers",
            {"": peer.get("replica_bytes_sent", 0)},
        ),
        Sample("ckptd_retries_total", "counter", "Failed attempts at replicas and uploads, retried", retries),
        Sample(
            "ckptd_verification_failures_total",
            "counter",
            "Chunks caught not matching their checksum, by the tier they came from",
            by_tier(c["verification_failures"]),
        ),
        Sample(
            "ckptd_snapshots_in_flight", "gauge", "Snapshots not yet durable on NVMe", {"": staging["pending_flushes"]}
        ),
        Sample("ckptd_staging_bytes", "gauge", "Shared memory held by staging slots", {"": staging["in_use_bytes"]}),
        Sample(
            "ckptd_staging_budget_bytes", "gauge", "Cap on staging memory (0: on demand)", {"": staging["budget_bytes"]}
        ),
        Sample(
            "ckptd_newest_complete_step_age_seconds",
            "gauge",
            "Seconds since the newest complete step of any job became complete on each tier",
            by_tier(status["newest_complete_age_s"]),
        ),
        Sample(
            "ckptd_malformed_requests_total",
            "counter",
            "Requests refused because their bytes did not parse (logged at most once a minute per caller)",
            {"": c.get("malformed_requests", 0)},
        ),
        Sample(
            "ckptd_removal_failures_total",
            "counter",
            "Step removals that failed on this node's disks (logged, retried each retention pass)",
            {"": c["removal_failures"]},
        ),
        Sample(
            "ckptd_event_loop_max_stall_seconds",
            "gauge",
            "The longest the daemon's event loop ran late since start (RPCs wait that long)",
            {"": status["event_loop"]["max_stall_s"]},
        ),
        Sample(
            "ckptd_uploads_pending", "gauge", "Shards not yet in the object store", {"": obj.get("pending_uploads", 0)}
        ),
    ]
    return render(samples, histograms)


def render(samples: list[Sample], histograms: list[Histogram]) -> str:
    """Return a whole /metrics page."""
    lines = [line for s in samples for line in s.render()]
    lines += [line for h in histograms for line in h.render()]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


async def serve(listen: str, page: Callable[[], Awaitable[str]]) -> asyncio.Server:
    """Serve GET /metrics on listen (host:port) with page(); anything else gets 404 or 405."""
    clients = asyncio.Semaphore(MAX_CLIENTS)
    rendered: list[tuple[float, bytes]] = []

    async def cached_page() -> bytes:
        now = time.monotonic()
        if not rendered or now - rendered[0][0] > PAGE_TTL_S:
            rendered[:] = [(now, (await page()).encode())]
        return rendered[0][1]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with clients:
            await answer(reader, writer)

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
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
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
