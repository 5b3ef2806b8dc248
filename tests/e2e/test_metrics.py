"""Prometheus metrics scraped over HTTP from a real daemon after real saves."""

from __future__ import annotations

import json
import platform
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

import ckpt
import google.protobuf
import grpc
import pytest
import torch
from conftest import CKPTD, free_port
from prometheus_client.parser import text_string_to_metric_families

from ckptd import __version__, metrics

pytestmark = pytest.mark.e2e
CLOCK_SLACK_S = 0.05  # file times come from the kernel's coarse clock, a tick behind time.time()

LINE = re.compile(
    r'^(#.*|[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+|[a-z_]+\{le="\+Inf"\} [0-9.e+]+)$'
)
# Every name 0.1 exported, with its type: kept, same meaning (CHANGELOG.md).
NAMES_OF_0_1 = {
    "ckptd_up": "gauge",
    "ckptd_saves_total": "counter",
    "ckptd_saves_skipped_total": "counter",
    "ckptd_flushes_total": "counter",
    "ckptd_flush_failures_total": "counter",
    "ckptd_bytes_written_total": "counter",
    "ckptd_replica_bytes_sent_total": "counter",
    "ckptd_retries_total": "counter",
    "ckptd_verification_failures_total": "counter",
    "ckptd_snapshots_in_flight": "gauge",
    "ckptd_staging_bytes": "gauge",
    "ckptd_staging_budget_bytes": "gauge",
    "ckptd_newest_complete_step_age_seconds": "gauge",
    "ckptd_malformed_requests_total": "counter",
    "ckptd_removal_failures_total": "counter",
    "ckptd_event_loop_max_stall_seconds": "gauge",
    "ckptd_uploads_pending": "gauge",
    "ckptd_save_duration_seconds": "histogram",
    "ckptd_flush_duration_seconds": "histogram",
    "ckptd_upload_duration_seconds": "histogram",
}
NEW_IN_0_2 = {
    "ckptd_build_info": "gauge",
    "ckptd_newest_complete_step": "gauge",
    "ckptd_newest_complete_step_timestamp_seconds": "gauge",
}


def scrape(address: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return reply.read().decode()


def value(page: str, sample: str) -> float:
    found = [line for line in page.splitlines() if line.startswith(sample + " ")]
    assert len(found) == 1, f"{sample} not in:\n{page}"
    return float(found[0].split()[-1])


def types(page: str) -> dict[str, str]:
    """Return the type of every sample name on the page, as prometheus_client's own parser reads it."""
    return {s.name: family.type for family in text_string_to_metric_families(page) for s in family.samples}


def family_types(page: str) -> dict[str, str]:
    return {f"{f.name}_total" if f.type == "counter" else f.name: f.type for f in text_string_to_metric_families(page)}


@pytest.fixture
def saved(make_daemon, short_tmp):
    """A daemon with metrics and a file:// store, after 3 saves of job "m" waited for on every local tier."""
    address = f"127.0.0.1:{free_port()}"
    store = short_tmp / "store"
    node = make_daemon(f'[metrics]\nlisten = "{address}"\n[object]\nurl = "file://{store}"\n').start()
    state = {"w": torch.randn(1 << 20)}  # 4 MiB
    started = time.time()
    with ckpt.Checkpointer(job="m", address=node.address) as c:
        for step in (1, 2, 3):
            c.save_async(state, step=step).wait("object", timeout=60)
    return node, address, started, time.time()


def test_metrics_are_served_after_real_saves(saved):
    node, address, _, _ = saved
    page = scrape(address)
    assert all(LINE.match(line) for line in page.splitlines()), [x for x in page.splitlines() if not LINE.match(x)]
    assert value(page, "ckptd_up") == 1
    assert value(page, "ckptd_saves_total") == 3
    assert value(page, 'ckptd_bytes_written_total{tier="memory"}') >= 3 * (4 << 20)
    assert value(page, 'ckptd_bytes_written_total{tier="nvme"}') >= 3 * (4 << 20)
    assert value(page, 'ckptd_bytes_written_total{tier="object"}') >= 3 * (4 << 20)
    assert value(page, 'ckptd_bytes_written_total{tier="peer"}') == 0
    assert value(page, "ckptd_replica_bytes_sent_total") == 0
    assert value(page, "ckptd_upload_duration_seconds_count") == 3
    assert 0 <= value(page, 'ckptd_newest_complete_step_age_seconds{tier="nvme"}') < 600
    assert 0 <= value(page, 'ckptd_newest_complete_step_age_seconds{tier="object"}') < 600
    assert value(page, "ckptd_snapshots_in_flight") == 0
    assert value(page, 'ckptd_verification_failures_total{tier="nvme"}') == 0  # there from the start, for increase()
    assert value(page, 'ckptd_retries_total{tier="object"}') == 0
    assert value(page, "ckptd_uploads_pending") == 0
    assert value(page, "ckptd_staging_bytes") > 0
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(address, "/")
    assert e.value.code == 404
    status = json.loads(node.cli("status", "--json").stdout)
    assert value(page, "ckptd_staging_bytes") == status["staging"]["in_use_bytes"]


def test_every_name_of_0_1_is_kept_with_its_type_and_the_new_ones_are_there(saved):
    _, address, _, _ = saved
    found = family_types(scrape(address))
    assert {name: found.get(name) for name in NAMES_OF_0_1} == NAMES_OF_0_1
    assert {name: found.get(name) for name in NEW_IN_0_2} == NEW_IN_0_2


def test_build_info_names_this_release_and_its_runtime(saved):
    _, address, _, _ = saved
    infos = [
        s for f in text_string_to_metric_families(scrape(address)) for s in f.samples if s.name == "ckptd_build_info"
    ]
    assert len(infos) == 1 and infos[0].value == 1
    # The daemon runs on this very interpreter (conftest starts `sys.executable -m ckptd`).
    assert infos[0].labels == {
        "version": __version__,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
    }


def test_save_stall_and_flush_time_histograms_count_each_save_in_fixed_buckets(saved):
    _, address, _, _ = saved
    page = scrape(address)
    assert types(page)["ckptd_save_duration_seconds_bucket"] == "histogram"
    for name in ("ckptd_save_duration_seconds", "ckptd_flush_duration_seconds"):
        buckets = [
            (s.labels["le"], s.value)
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == f"{name}_bucket"
        ]
        assert [float(le) for le, _ in buckets] == [*metrics.SAVE_BUCKETS_S, float("inf")]
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), f"{name}: buckets are cumulative"
        assert counts[-1] == value(page, f"{name}_count") == 3
        assert 0 < value(page, f"{name}_sum") < 3 * 60


def test_newest_complete_steps_carry_the_time_they_became_complete(saved):
    node, address, started, ended = saved
    page = scrape(address)
    for tier in ("memory", "nvme", "object"):
        labels = f'{{job_name="m",tier="{tier}"}}'
        assert value(page, f"ckptd_newest_complete_step{labels}") == 3
        stamp = value(page, f"ckptd_newest_complete_step_timestamp_seconds{labels}")
        assert started - CLOCK_SLACK_S <= stamp <= ended
    assert 'tier="peer"' not in "".join(line for line in page.splitlines() if "newest_complete_step{" in line)
    newest = json.loads(node.cli("status", "--json").stdout)["newest_complete"]
    assert {tier: n["step"] for tier, n in newest["m"].items()} == {"memory": 3, "nvme": 3, "object": 3}
    assert value(page, 'ckptd_newest_complete_step_timestamp_seconds{job_name="m",tier="nvme"}') == pytest.approx(
        newest["m"]["nvme"]["completed_unix_s"], abs=0.001
    )


def test_newest_complete_step_on_nvme_is_learnt_again_at_start_from_the_disk(saved):
    node, address, started, ended = saved
    node.stop()
    node.start()
    page = scrape(address)
    assert value(page, 'ckptd_newest_complete_step{job_name="m",tier="nvme"}') == 3
    # The commit record's time, not the restart's.
    stamp = value(page, 'ckptd_newest_complete_step_timestamp_seconds{job_name="m",tier="nvme"}')
    assert started - CLOCK_SLACK_S <= stamp <= ended


def test_a_metrics_port_in_use_stops_start_up_naming_the_key(make_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        node = make_daemon(f'[metrics]\nlisten = "127.0.0.1:{taken.getsockname()[1]}"\n')
        out = subprocess.run(
            [*CKPTD, "serve", "--config", str(node.config_path)], capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 2
    assert "metrics.listen" in out.stderr


def test_idle_connections_to_the_metrics_port_hold_no_descriptors_a_save_needs(make_daemon):
    address = f"127.0.0.1:{free_port()}"
    node = make_daemon(f'[metrics]\nlisten = "{address}"\n')
    node.wrapper = ["prlimit", "--nofile=256:256"]  # a daemon of few descriptors, as the review ran it
    node.start()
    host, port = address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(300):  # anyone who reaches the port: connected, never sending a request
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        held = 0
        for sock in idle:
            sock.settimeout(0.05)
            try:
                held += sock.recv(1) != b""
            except TimeoutError:
                held += 1
            except ConnectionResetError:
                pass
        assert held <= metrics.MAX_CONNECTIONS  # the rest closed at accept
        with ckpt.Checkpointer(job="busy-metrics", address=node.address) as c:
            c.save_async({"w": torch.arange(1000.0)}, step=1).wait("nvme", timeout=30)
            assert torch.equal(c.load(1)["w"], torch.arange(1000.0))
    finally:
        for sock in idle:
            sock.close()
