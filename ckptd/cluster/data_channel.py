"""Send a replica's bytes on a TCP connection beside gRPC, one connection per byte range: the wire and the sender.

gRPC stays the control plane: the sender asks for a range with OpenDataRange, which is
checked and admitted like PutShard's first piece, and gets this node's data port and a
one-time ticket. It connects, presents the ticket, sends the range's raw bytes, and
reads one status back. The receiver reads them with recv_into straight into its aligned
block buffers (ReplicaReceiver._fill_and_write): no message framing, no copy out of gRPC's
buffers, no copy on the event loop. With [peer] cert/key/ca the connection is TLS with
client certificates, from the same files as gRPC; the ticket binds it to a caller that
gRPC admitted.

The wire: ticket (TICKET_BYTES), then the range's bytes; back, a 4-byte big-endian
length and "CODE detail" in UTF-8, CODE a gRPC status name ("OK" when the range is
checked and written; the names and the errors they stand for are rpc.statuses', as on
gRPC). A refusal may come before the range's last byte: the receiver then half-closes
and reads on for a while, and the sender reads the status even if its sending failed.
Whatever can be refused without the bytes is refused by OpenDataRange instead.

PeerLink._put_range calls send_range from a sender's worker thread; the receiving side
is rpc.data_listener's.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

from ckpt_core.byte_range import ByteRange
from ckpt_core.format import ShardMeta

from ckptd.cluster import tls_refusal
from ckptd.cluster.shard_stream import read_pieces
from ckptd.config import PeerConfig

TICKET_BYTES = 16
STALL_TIMEOUT_S = 30.0  # no byte moved for this long: the connection is given up, on either side
CONNECT_TIMEOUT_S = 3.0
SILENT_CONNECTION_S = 5.0  # an idle data connection whose keepalive probes go unanswered this long is failed
MAX_STATUS_BYTES = 16 << 10
_LENGTH = struct.Struct(">I")


class DataChannelError(OSError):
    """The data connection itself failed (refused, reset, stalled, TLS): the sender may use PutShard instead."""


def client_context(peer: PeerConfig) -> ssl.SSLContext | None:
    """Return the TLS context of a sender: its certificate presented, the receiver's checked against peer.ca."""
    if not peer.cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=peer.ca)
    context.load_cert_chain(peer.cert, peer.key)
    return context


def send_range(
    host: str,
    port: int,
    ticket: bytes,
    context: ssl.SSLContext | None,
    path: Path,
    meta: ShardMeta,
    byte_range: ByteRange,
    what: str,
    tls_name: str = "",
) -> str:
    """Send a range of a shard read from path on a data connection; return the receiver's status ("OK", or CODE detail).

    tls_name is the name the receiver's certificate must carry (default: host). A receiver
    that refuses the range part-way stops taking it: the status is read even when sending
    failed, and only a connection that gives none is a DataChannelError (refused, reset, stalled,
    TLS). What read_pieces raises when the local copy changed or went is raised as it is (then
    the connection is closed short, which the receiver refuses).
    """
    pieces = read_pieces(path, meta, byte_range, what)
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise DataChannelError(f"data connection to {host}:{port}: {e}") from e
    with conn:
        try:
            close_when_silent(conn)
            conn.settimeout(STALL_TIMEOUT_S)
            sock = context.wrap_socket(conn, server_hostname=tls_name or host) if context is not None else conn
        except OSError as e:
            raise _channel_error(host, port, e) from e
        with sock:
            failed = _send(sock, ticket, pieces)
            try:
                (size,) = _LENGTH.unpack(recv_exactly(sock, _LENGTH.size))
                if size > MAX_STATUS_BYTES:
                    raise DataChannelError(f"the receiver answered with {size} bytes of status")
                return recv_exactly(sock, size).decode(errors="replace")
            except (OSError, EOFError) as e:
                if isinstance(e, DataChannelError):
                    raise
                cause = failed or e
                raise _channel_error(host, port, cause) from cause


def close_when_silent(conn: socket.socket) -> None:
    """Have the kernel fail a data connection whose other end stops answering as it waits, in SILENT_CONNECTION_S.

    Called on both ends (send_range, and the receiver as it accepts). TCP keepalive probes a
    connection with nothing in flight: a sender waiting for the receiver's status, a receiver
    waiting for bytes. A cut link otherwise leaves them waiting until STALL_TIMEOUT_S. Bytes in
    flight are not covered: TCP_USER_TIMEOUT would cover them, but it also gives up on a receiver
    that is only slow (a closed window, its probes answered), so those wait for STALL_TIMEOUT_S.
    """
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(SILENT_CONNECTION_S) - 1)


def _channel_error(host: str, port: int, error: BaseException) -> DataChannelError:
    """Return the failure of a data connection; a refused certificate says so (cluster.tls_refusal), not "reset"."""
    refusal = tls_refusal.sender_error(f"{host}:{port}", str(error)) if isinstance(error, ssl.SSLError) else None
    return DataChannelError(refusal or f"data connection to {host}:{port}: {error}")


def _send(sock: socket.socket, ticket: bytes, pieces: Iterator[memoryview]) -> OSError | None:
    """Send the ticket and the range's pieces; return the error that stopped the sending, if one did.

    Only the socket's errors are caught: those of the local copy (pieces) go to the caller.
    """
    try:
        sock.sendall(ticket)
    except OSError as e:
        return e
    for data in pieces:
        try:
            sock.sendall(data)
        except OSError as e:  # the receiver refused the range and stopped reading, or the connection broke
            return e
    return None


def send_status(sock: socket.socket, status: str) -> None:
    """Send the receiver's answer to a range: "OK", or a gRPC status name and a detail."""
    encoded = status.encode(errors="replace")[:MAX_STATUS_BYTES]
    sock.sendall(_LENGTH.pack(len(encoded)) + encoded)


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """Receive size bytes (EOFError if the connection closes first); for the short parts of the wire."""
    data = bytearray()
    while len(data) < size:
        received = sock.recv(size - len(data))
        if not received:
            raise EOFError(f"the connection closed after {len(data)} of {size} bytes")
        data += received
    return bytes(data)
