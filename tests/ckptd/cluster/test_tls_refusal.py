"""A failed TLS handshake is said as who refused whose certificate and why, from OpenSSL's and gRPC's words."""

from __future__ import annotations

import pytest
from certs import CertificateAuthority

from ckptd.cluster.tls_refusal import own_certificate_problem, reason, sender_error
from ckptd.config import PeerConfig

PEER = "127.0.0.13:7070"
# gRPC 1.85's UNAVAILABLE details where this node refused the peer's certificate
GRPC_NOT_TRUSTED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.13:7070: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
    "unable to get local issuer certificate: OK"
)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (GRPC_NOT_TRUSTED, f"certificate of {PEER} not trusted: the certificate is signed by an unknown CA"),
        (
            "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca (_ssl.c:2580)",
            f"certificate rejected by {PEER}: the certificate is signed by an unknown CA",
        ),
        (
            "[SSL: SSLV3_ALERT_CERTIFICATE_EXPIRED] sslv3 alert certificate expired (_ssl.c:2580)",
            f"certificate rejected by {PEER}: the certificate has expired (sslv3 alert certificate expired)",
        ),
        (
            "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: certificate has expired (_ssl.c:1006)",
            f"certificate of {PEER} not trusted: the certificate has expired (certificate has expired)",
        ),
        (
            "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: IP address mismatch, certificate is not "
            "valid for '127.0.0.13'. (_ssl.c:1006)",
            f"certificate of {PEER} not trusted: the certificate does not name the address dialled",
        ),
        (
            "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unsupported certificate purpose (_ssl.c:1006)",
            f"certificate of {PEER} not trusted: the certificate's extendedKeyUsage does not allow this use",
        ),
    ],
)
def test_a_refused_certificate_is_said_with_the_side_that_refused_it(text, said):
    assert (sender_error(PEER, text) or "").startswith(said)


@pytest.mark.parametrize(
    "text",
    [
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.13:7070: Socket closed",
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.13:7070: Connection refused",
        "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)",
    ],
)
def test_a_failure_that_names_no_certificate_is_no_refusal(text):
    assert sender_error(PEER, text) is None
    assert reason(text) is None


def test_this_nodes_own_certificate_is_checked_against_its_ca(short_tmp):
    ca = CertificateAuthority(short_tmp / "ca")
    other = CertificateAuthority(short_tmp / "other", "other-ca")

    def problem(files: tuple) -> str | None:
        cert, key = files
        return own_certificate_problem(PeerConfig(cert=str(cert), key=str(key), ca=str(ca.ca_path)))

    assert problem(ca.issue("good")) is None
    assert "signed by an unknown CA" in (problem(other.issue("stranger")) or "")
    assert "has expired" in (problem(ca.issue("old", expired=True)) or "")
    assert "cannot be read" in (own_certificate_problem(PeerConfig(cert="/nonexistent", key="/x", ca="/y")) or "")
