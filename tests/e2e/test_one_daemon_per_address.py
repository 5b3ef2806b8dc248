"""One daemon per peer address: a second one started on a used address exits 2 naming it (OPERATIONS §2).

gRPC binds with SO_REUSEPORT by default; with it a second daemon with node 1's config shared node 1's
port, each taking a random half of the connections meant for node 1.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

CKPTD = [sys.executable, "-m", "ckptd"]


def test_a_second_daemon_on_a_peer_address_in_use_exits_2_naming_it(make_cluster, make_daemon):
    (first,) = make_cluster(1)
    first.start()
    peers = first.config_path.read_text().split(f'dir = "{first.staging_dir}"\n', 1)[1]  # its [peer] section
    second = make_daemon(peers, name="second", listen=first.listen)  # node 1's config, another root and socket
    run = subprocess.run([*CKPTD, "serve", "--config", str(second.config_path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"cannot listen for peers on {first.listen}" in run.stderr
    assert first.proc is not None and first.proc.poll() is None  # the first serves on
