"""Say why a TLS handshake between peers failed, in words an operator can act on, read from OpenSSL's or gRPC's.

Which side refused which certificate matters: a sender's error says "certificate rejected by
<peer>: <reason>" when the peer refused this node's certificate, and "certificate of <peer>
not trusted: <reason>" when this node refused the peer's. The reason is read from the text of
OpenSSL (Python's ssl), BoringSSL (inside gRPC) or gRPC's status details.

Who calls what: PeerLink (a call's UNAVAILABLE details; probe where gRPC says only "Socket
closed"), data_channel.send_range (a sender's ssl error), DataListener (a receiver's refused
handshake), CoreLog (gRPC's own handshake lines). reason and sender_error are pure; probe and
own_certificate_problem block, on the caller's worker thread.
"""

from __future__ import annotations

import re
import socket
import ssl

from ckptd.config import PeerConfig

PROBE_TIMEOUT_S = 2.0

# (words in OpenSSL's, BoringSSL's or gRPC's text, lower case) -> what they mean; the first that matches
_MEANINGS = (
    (("certificate has expired", "certificate expired", "certificate_expired"), "the certificate has expired"),
    (("not yet valid",), "the certificate is not valid yet"),
    (
        (
            "unable to get local issuer",
            "self-signed certificate",
            "self signed certificate",
            "unknown ca",
            "unknown_ca",
            "unable to verify the first certificate",
        ),
        "the certificate is signed by an unknown CA (not the one in [peer] ca)",
    ),
    (
        ("hostname mismatch", "ip address mismatch", "is not in peer certificate"),
        "the certificate does not name the address dialled (its subjectAltName lacks it)",
    ),
    (
        ("unsupported certificate purpose", "unsupported_certificate", "unsupported certificate"),
        "the certificate's extendedKeyUsage does not allow this use (every node needs serverAuth and clientAuth)",
    ),
    (
        ("certificate required", "certificate_required", "did not return a certificate", "did_not_return_a_cert"),
        "no certificate was presented",
    ),
    (
        ("bad certificate", "bad_certificate", "certificate verify failed", "certificate_verify_failed"),
        "the certificate was refused",
    ),
)
# The words of the library itself, shown after the meaning: what to search for, or quote in a ticket.
_WORDS = re.compile(
    r"(?:certificate verify failed|CERTIFICATE_VERIFY_FAILED): ([^:()\]]+?)(?: \(_ssl|:|$)"
    r"|((?:tlsv1|sslv3|tlsv13) alert [a-z ]+)"
    r"|(Peer name \S+ is not in peer certificate)",
    re.IGNORECASE,
)
_ALERT = re.compile(r"(tlsv1|sslv3|tlsv13)[ _]alert", re.IGNORECASE)


def reason(text: str) -> str | None:
    """Return what a TLS failure's text means for a certificate (and the library's own words), or None."""
    lower = text.lower()
    for words, meaning in _MEANINGS:
        if any(w in lower for w in words):
            found = _WORDS.search(text)
            said = next((g for g in found.groups() if g), "").strip() if found else ""
            return f"{meaning} ({said})" if said else meaning
    return None


def refused_by_the_other_side(text: str) -> bool:
    """Return True if a TLS failure's text is an alert the other side sent (it refused this node's certificate)."""
    return _ALERT.search(text) is not None


def sender_error(address: str, text: str) -> str | None:
    """Return a sender's error for a failed handshake with the peer at address, or None if text names no certificate.

    An alert in the text came from the peer: it refused this node's certificate. Otherwise
    this node's own check refused the peer's.
    """
    why = reason(text)
    if why is None:
        return None
    if refused_by_the_other_side(text):
        return f"certificate rejected by {address}: {why}"
    return f"certificate of {address} not trusted: {why}"


def _client_context(peer: PeerConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=peer.ca)
    context.load_cert_chain(peer.cert, peer.key)
    return context


def probe(address: str, host: str, port: int, peer: PeerConfig, tls_name: str) -> str | None:
    """Handshake with a peer's gRPC port as gRPC would; return the sender's error if a certificate is refused.

    For what gRPC's details leave out: a gRPC server that refuses a client certificate closes
    the connection without an alert, and the channel says only "Socket closed". A peer that
    closes the connection right after the handshake, before a byte of HTTP/2, refused ours;
    own_certificate_problem says why where this node can tell. None: no refusal seen.
    """
    try:
        context = _client_context(peer)
        context.set_alpn_protocols(["h2"])
        with (
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as conn,
            context.wrap_socket(conn, server_hostname=tls_name) as tls,
        ):
            try:
                if tls.recv(1):
                    return None  # it speaks HTTP/2 to us: our certificate was taken
            except TimeoutError:
                return None
    except ssl.SSLError as e:
        return sender_error(address, str(e))
    except OSError:
        return None
    why = own_certificate_problem(peer) or "it closed the connection after the TLS handshake (its log says why)"
    return f"certificate rejected by {address}: {why}"


def own_certificate_problem(peer: PeerConfig) -> str | None:
    """Return what is wrong with this node's certificate as every peer sees it (checked against [peer] ca), or None.

    One handshake in memory, this node's certificate on both sides: the client checks it as a
    server certificate, the server as a client certificate (validity, CA, extendedKeyUsage).
    """
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(peer.cert, peer.key)
        server.load_verify_locations(peer.ca)
        server.verify_mode = ssl.CERT_REQUIRED
        client = _client_context(peer)
        client.check_hostname = False  # the names are the peers' check, against [peer] addresses
    except (OSError, ValueError) as e:
        return f"this node's certificate files cannot be read: {e}"
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    sides = [
        (client.wrap_bio(client_in, client_out, server_side=False), client_out, server_in),
        (server.wrap_bio(server_in, server_out, server_side=True), server_out, client_in),
    ]
    done = [False, False]
    for _ in range(8):  # TLS 1.3 takes three flights, 1.2 four
        for i, (tls, out, other_in) in enumerate(sides):
            try:
                if not done[i]:
                    tls.do_handshake()
                    done[i] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as e:
                why = reason(str(e))
                return f"this node's certificate: {why or e}"
            other_in.write(out.read())
        if all(done):
            return None
    return None
