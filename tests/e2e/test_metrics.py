"""Prometheus metrics scraped over HTTP from a real daemon after real saves."""

from __future__ import annotations

import re
import socket
import subprocess
import urllib.error
import urllib.request

import ckpt
import pytest
import torch
from conftest import CKPTD, free_port

pytestmark = pytest.mark.e2e

LINE = re.compile(r'^(#.*|[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+|[a-z_]+\{le="\+Inf"\} [0-9]+)$')


def scrape(address: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return reply.read().decode()


def value(page: str, sample: str) -> float:
    found = [line for line in page.splitlines() if line.startswith(sample + " ")]
    assert len(found) == 1, f"{sample} not in:\n{page}"
    return float(found[0].split()[-1])


def test_metrics_are_served_after_real_saves(make_daemon, short_tmp):
    address = f"127.0.0.1:{free_port()}"
    store = short_tmp / "store"
    node = make_daemon(f'[metrics]\nlisten = "{address}"\n[object]\nurl = "file://{store}"\n').start()
    state = {"w": torch.randn(1 << 20)}  # 4 MiB
    with ckpt.Checkpointer(job="m", address=node.address) as c:
        for step in (1, 2):
            c.save_async(state, step=step).wait("object", timeout=60)

    page = scrape(address)
    assert all(LINE.match(line) for line in page.splitlines()), [x for x in page.splitlines() if not LINE.match(x)]
    assert value(page, "ckptd_up") == 1
    assert value(page, "ckptd_saves_total") == 2
    assert value(page, 'ckptd_bytes_written_total{tier="nvme"}') >= 2 * (4 << 20)
    assert value(page, 'ckptd_bytes_written_total{tier="object"}') >= 2 * (4 << 20)
    assert value(page, "ckptd_flush_duration_seconds_count") == 2
    assert value(page, "ckptd_save_duration_seconds_count") == 2
    assert value(page, "ckptd_upload_duration_seconds_count") == 2
    assert value(page, 'ckptd_flush_duration_seconds_bucket{le="+Inf"}') == 2
    assert 0 <= value(page, 'ckptd_newest_complete_step_age_seconds{tier="nvme"}') < 600
    assert 0 <= value(page, 'ckptd_newest_complete_step_age_seconds{tier="object"}') < 600
    assert value(page, "ckptd_snapshots_in_flight") == 0
    assert value(page, 'ckptd_verification_failures_total{tier="nvme"}') == 0  # there from the start, for increase()
    assert value(page, "ckptd_uploads_pending") == 0
    assert "# TYPE ckptd_saves_total counter" in page and "# TYPE ckptd_staging_bytes gauge" in page
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(address, "/")
    assert e.value.code == 404


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
