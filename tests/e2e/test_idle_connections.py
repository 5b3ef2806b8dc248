"""Nothing held open before authentication: a connection to the peer port that never starts TLS is closed.

gRPC's default server handshake timeout is 120 s: 200 idle TCP connections that never started TLS were all
still held after 45 s, each a descriptor of the daemon.
"""

from __future__ import annotations

import socket
import time

import pytest
from certs import CertificateAuthority

from ckptd.rpc.peer_link import SERVER_HANDSHAKE_TIMEOUT_MS

pytestmark = pytest.mark.e2e

IDLE = 20


def test_connections_to_the_peer_port_that_never_start_tls_are_closed_after_the_handshake_timeout(
    make_cluster, short_tmp
):
    ca = CertificateAuthority(short_tmp / "ca")
    cert, key = ca.issue("n0")
    (node,) = make_cluster(1, tls=[(cert, key, ca.ca_path)])
    node.start()
    host, port = node.listen.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(IDLE)]
    try:
        deadline = time.monotonic() + SERVER_HANDSHAKE_TIMEOUT_MS / 1e3 + 20
        closed = 0
        for sock in idle:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += sock.recv(1) == b""  # the server closed it: end of stream
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass  # still held
        assert closed == IDLE
        status = node.cli("status")
        assert status.returncode == 0, status.stderr  # and it serves on
    finally:
        for sock in idle:
            sock.close()
