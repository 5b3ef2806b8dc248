"""Take replicas' bytes on data connections beside gRPC, for the ranges offered over gRPC (rpc.data_channel).

Who calls what: daemon.serve starts a DataListener before the peer server and stops it
first (event loop); PeerServicer.OpenDataRange calls offer() (event loop), after the
receiver admitted the range; each connection is a task on the event loop, its TLS
handshake, ticket and status on the listener's threads, its bytes on the receiver's
(ReplicaReceiver._fill_and_write, the receive loop PutShard's pieces go through too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckpt.errors import CheckpointError, CorruptCheckpoint, InvalidArgument
from ckpt.format import ShardMeta

from ckptd.byte_range import ByteRange
from ckptd.config import PeerConfig
from ckptd.errors import ReceiverBusy
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.rpc import tls_refusal
from ckptd.rpc.data_channel import STALL_TIMEOUT_S, TICKET_BYTES, recv_exactly, send_status
from ckptd.rpc.log_pace import LogPace

log = logging.getLogger(__name__)

TICKET_TTL_S = 30.0
MAX_TICKETS = 64  # offered and not yet used: bounds what callers can make this node keep
MAX_CONNECTIONS = 32  # open at once; more are closed at once


@dataclass(frozen=True)
class _Offer:
    meta: ShardMeta
    transfer: str
    byte_range: ByteRange
    expires_s: float


def server_context(peer: PeerConfig) -> ssl.SSLContext | None:
    """Return the TLS context of a data listener: this node's certificate, clients' checked against peer.ca."""
    if not peer.cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(peer.cert, peer.key)
    context.load_verify_locations(peer.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class DataListener:
    """Take replica ranges on data connections, for the ranges offered over gRPC."""

    def __init__(
        self,
        receiver: ReplicaReceiver,
        peer: PeerConfig,
        host: str,
        on_bad_chunk: Callable[[], None],
        threads: ThreadPoolExecutor,
    ) -> None:
        """threads: each connection's TLS handshake, ticket and status (Executors.data_connections)."""
        self._receiver = receiver
        self._peer = peer
        self._host = host
        self._on_bad_chunk = on_bad_chunk
        self._tls = server_context(peer)
        self._refusals_logged = LogPace()  # keyed by (caller, why)
        self._offers: dict[bytes, _Offer] = {}
        self._connections: dict[asyncio.Task[None], socket.socket] = {}
        self._threads = threads
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen on the host of [node] listen, port [peer] data_port (0: any free one); self.port says which."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._peer.data_port))
            sock.listen(MAX_CONNECTIONS)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock, self.port = sock, sock.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    def offer(self, meta: ShardMeta, transfer: str, byte_range: ByteRange) -> bytes:
        """Return a one-time ticket for a range the receiver admitted (ReceiverBusy: too many offered)."""
        now = time.monotonic()
        for ticket in [k for k, o in self._offers.items() if o.expires_s < now]:
            del self._offers[ticket]
        if len(self._offers) >= MAX_TICKETS:
            raise ReceiverBusy(f"{len(self._offers)} data ranges are offered already")
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._offers[ticket] = _Offer(meta, transfer, byte_range, now + TICKET_TTL_S)
        return ticket

    async def stop(self) -> None:
        """Stop taking connections and end those open (their ranges are abandoned, their threads waited for)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._sock is not None:
            self._sock.close()
        for task, conn in list(self._connections.items()):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # a thread blocked in recv_into returns
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if len(self._connections) >= MAX_CONNECTIONS:
                conn.close()
                continue
            conn.settimeout(STALL_TIMEOUT_S)
            task = loop.create_task(self._serve(conn))
            self._connections[task] = conn
            task.add_done_callback(self._connections.pop)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock = conn
        caller = _caller(conn)  # before TLS takes the socket over
        try:
            sock, ticket = await loop.run_in_executor(self._threads, self._handshake, conn)
            self._connections[asyncio.current_task()] = sock  # type: ignore[index]
            offer = self._offers.pop(ticket, None)
            if offer is None or offer.expires_s < time.monotonic():
                status = "PERMISSION_DENIED no such data range offered (or its ticket expired)"
            else:
                status = await self._receive(offer, sock)
            await loop.run_in_executor(self._threads, send_status, sock, status)
        except ssl.SSLError as e:
            self._log_refusal(caller, e)
        except (OSError, EOFError) as e:  # the sender went away, or spoke no TLS, or stalled: nothing to answer
            log.debug("data connection dropped: %s", e)
        finally:
            sock.close()
            conn.close()

    def _log_refusal(self, caller: str, error: ssl.SSLError) -> None:
        """Log a refused certificate once a minute per caller and reason; any other TLS failure at debug."""
        why = tls_refusal.reason(str(error))
        if why is None:
            log.debug("data connection from %s dropped: %s", caller, error)
        elif self._refusals_logged.due((caller, why)):
            log.warning(
                "refused a data connection from %s: its certificate: %s (more within %.0f s are not logged)",
                caller, why, self._refusals_logged.every_s,
            )  # fmt: skip

    def _handshake(self, conn: socket.socket) -> tuple[socket.socket, bytes]:
        """On a connection thread: TLS where configured, then the ticket."""
        sock = self._tls.wrap_socket(conn, server_side=True) if self._tls is not None else conn
        return sock, recv_exactly(sock, TICKET_BYTES)

    async def _receive(self, offer: _Offer, sock: socket.socket) -> str:
        """Receive an offered range; return the status to send back."""
        try:
            await self._receiver.receive_range(offer.meta, offer.transfer, offer.byte_range, sock)
        except CorruptCheckpoint as e:
            self._on_bad_chunk()
            return f"DATA_LOSS {e}"
        except InvalidArgument as e:
            return f"INVALID_ARGUMENT {e}"
        except ReceiverBusy as e:
            return f"RESOURCE_EXHAUSTED {e}"
        except (CheckpointError, OSError) as e:
            return f"INTERNAL {e}"
        return "OK"


def _caller(conn: socket.socket) -> str:
    """Name a caller by its address without the port: a sender reconnecting is the same caller."""
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "a caller gone already"
