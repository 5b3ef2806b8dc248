"""gRPC's C core's stderr reaches the daemon's log readable: handshake failures said plainly, paced, INFO dropped."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptd.rpc.grpc_log import translate

REPO = Path(__file__).resolve().parents[3]
VERIFY_FAILED = (
    "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
    "unable to get local issuer certificate"
)


@pytest.mark.parametrize(
    ("line", "level", "said"),
    [
        # gRPC 1.85 (absl) says it at INFO; the 1.6x releases (gpr_log) at ERROR, "fatal error"
        (
            "I1126 18:55:24.123456    1234 ssl_transport_security.cc:2563] Handshake failed with error "
            + VERIFY_FAILED,
            logging.WARNING,
            "refused a peer's certificate in gRPC's TLS handshake: the certificate is signed by an unknown CA",
        ),
        (
            "E1126 18:55:24.123456  1234 ssl_transport_security.cc:1432] Handshake failed with fatal error "
            "SSL_ERROR_SSL: error:1000045:SSL routines:OPENSSL_internal:SSLV3_ALERT_CERTIFICATE_EXPIRED",
            logging.WARNING,
            "a peer refused this node's certificate: the certificate has expired",
        ),
        (
            "I1126 18:55:24.123456 1234 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: "
            "error:10000070:SSL routines:OPENSSL_internal:BAD_PACKET_LENGTH: Invalid certificate verification context",
            logging.WARNING,
            "a TLS handshake with a peer failed (SSL_ERROR_SSL: ",
        ),
        (
            "E1126 18:55:24.123456 1234 chttp2_server.cc:1053] UNKNOWN: No address added out of total 1 resolved",
            logging.ERROR,
            "gRPC: UNKNOWN: No address added out of total 1 resolved (chttp2_server.cc:1053)",
        ),
        ("W1126 18:55:24.123456 1234 a.cc:1] careful", logging.WARNING, "gRPC: careful (a.cc:1)"),
        ("a library's own text", None, "a library's own text"),
    ],
)
def test_a_line_of_the_core_becomes_a_readable_record(line, level, said):
    translated = translate(line)
    assert translated is not None and translated.level == level
    assert translated.message.startswith(said), translated.message
    assert "ssl_transport_security.cc" not in translated.message


def test_the_cores_info_and_debug_lines_are_dropped():
    assert translate("I1126 18:55:24.123456 1234 trace.cc:91] gRPC Tracers: handshaker") is None
    assert translate("D1126 18:55:24.123456 1234 x.cc:2] detail") is None


SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, time
    from pathlib import Path
    from concurrent import futures

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("LOG %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])

    import grpc
    from certs import CertificateAuthority
    from ckpt_core.wire.v1 import peer_pb2_grpc
    from ckptd.config import PeerConfig
    from ckptd.rpc.grpc_log import CoreLog
    from ckptd.errors import PeerError
    from ckptd.cluster.peer_link import PeerLink, server_credentials

    core_log = CoreLog()
    core_log.start()
    assert handler.stream.fileno() != 2, "Python's handler must keep the real stderr"
    os.write(2, b"I1126 18:55:24.123456 1 x.cc:1] chatter\\n")
    os.write(2, b"W1126 18:55:24.123456 1 y.cc:2] careful\\nW1126 18:55:24.123456 1 y.cc:2] careful\\n")
    os.write(2, b"not a line of the core\\n")
    logging.getLogger("test").warning("python's own line")

    d = Path(sys.argv[1])
    ca, other = CertificateAuthority(d / "ca"), CertificateAuthority(d / "other", "other-ca")
    cert, key = ca.issue("server")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    peer_pb2_grpc.add_CkptdPeerServicer_to_server(peer_pb2_grpc.CkptdPeerServicer(), server)
    config = PeerConfig(cert=str(cert), key=str(key), ca=str(ca.ca_path))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(config))
    server.start()
    stranger, stranger_key = other.issue("stranger")
    link = PeerLink(f"127.0.0.1:{port}", PeerConfig(cert=str(stranger), key=str(stranger_key), ca=str(ca.ca_path)))
    log_text = lambda: Path(sys.argv[2]).read_text()
    deadline = time.monotonic() + 20
    while log_text().count("refused a peer's certificate") == 0 and time.monotonic() < deadline:
        try:
            link.inventory(timeout_s=1)  # refused, every time: gRPC's core logs each handshake
        except PeerError:
            pass
    for _ in range(3):  # more refusals within the minute: not logged again
        try:
            link.inventory(timeout_s=1)
        except PeerError:
            pass
    link.close()
    server.stop(None)
    core_log.stop()
    print("stopped", file=sys.stderr)
    """
)


def test_the_cores_stderr_is_read_into_the_log_and_pythons_own_lines_still_reach_stderr(short_tmp):
    stderr_path = short_tmp / "stderr"
    with open(stderr_path, "wb") as stderr:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(short_tmp), str(stderr_path)],
            stderr=stderr,
            env={"PYTHONPATH": f"{REPO}:{REPO / 'client'}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
    text = stderr_path.read_text()
    assert done.returncode == 0, text
    assert "ssl_transport_security.cc" not in text and "chatter" not in text
    assert text.count("LOG WARNING ckptd.grpc: refused a peer's certificate in gRPC's TLS handshake") == 1, text
    assert text.count("LOG WARNING ckptd.grpc: gRPC: careful (y.cc:2)") == 1, text
    assert "\nnot a line of the core\n" in text
    assert text.count("LOG WARNING test: python's own line") == 1
    assert text.rstrip().endswith("stopped")  # the real stderr is back after stop()
