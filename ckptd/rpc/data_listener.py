"""Take replicas' bytes on data connections beside gRPC, for the ranges offered over gRPC (cluster.data_channel).

Who calls what: daemon.serve starts a DataListener before the peer server and stops it
first (event loop); PeerServicer.OpenDataRange reserves the range with the receiver
(every refusal that needs no byte is made there, as a gRPC status) and calls offer()
(event loop); each connection is a task on the event loop, its TLS handshake, ticket,
status and drain on the listener's threads, its bytes on the receiver's
(ReplicaReceiver._fill_and_write, the receive loop PutShard's pieces go through too).

Bounds, against anyone who can reach the port: a connection has HANDSHAKE_DEADLINE_S in
all for its TLS handshake and its ticket; at most MAX_HANDSHAKING connections are there
before their ticket, MAX_PER_ADDRESS of them from one source address. A connection with a
good ticket leaves those slots for the receiver's place its ticket reserved (ranges in
flight are bounded there, and by the tickets), so idle connections hold up no range.

A refusal made after the ticket is written, the connection half-closed and what the sender
still sends read and dropped for up to DRAIN_S, so that the sender reads the status rather
than a reset.
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
from typing import TypeVar

from ckpt_core.errors import CorruptCheckpoint

from ckptd.cluster import tls_refusal
from ckptd.cluster.data_channel import STALL_TIMEOUT_S, TICKET_BYTES, close_when_silent, send_status
from ckptd.config import PeerConfig
from ckptd.errors import NotOffered, PeerBusy
from ckptd.log_pace import LogPace
from ckptd.replication.receiving import MAX_RANGES_IN_FLIGHT, RangeReservation, ReplicaReceiver, wait_finished
from ckptd.rpc.statuses import status_line

log = logging.getLogger(__name__)
T = TypeVar("T")

TICKET_TTL_S = 30.0
MAX_TICKETS = 64  # offered and not yet used: bounds what callers can make this node keep
HANDSHAKE_DEADLINE_S = 5.0  # from accept to a whole ticket (TLS handshake included), however slowly bytes come
MAX_HANDSHAKING = 32  # connections not yet past their ticket; more are closed at once
MAX_PER_ADDRESS = 8  # connections before their ticket from one source address; more are closed at once
DRAIN_S = 5.0  # after a refusal, the sender's bytes are read and dropped this long, so that it reads the status
STOP_GRACE_S = 10.0  # at stop, ranges in flight (and tickets offered) get this long to end
ACCEPT_BACKOFF_MIN_S = 0.1  # after accept fails (EMFILE, ENFILE, ENOBUFS...): wait, doubling to the max
ACCEPT_BACKOFF_MAX_S = 1.0
ACCEPT_LOG_EVERY_S = 10.0  # accept failures are logged at most this often, with a count
CONNECTION_THREADS = MAX_HANDSHAKING + MAX_RANGES_IN_FLIGHT  # Executors.data_connections: handshakes, statuses


@dataclass(frozen=True)
class _Offer:
    reservation: RangeReservation
    expiry: asyncio.TimerHandle


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
    """Take replica ranges on data connections, for the ranges offered over gRPC.

    Calls, all on the event loop: start(); then offer() for each range admitted (any
    number); stop() once: no ticket is offered after it.
    """

    def __init__(
        self,
        receiver: ReplicaReceiver,
        peer: PeerConfig,
        host: str,
        on_bad_chunk: Callable[[], None],
        threads: ThreadPoolExecutor,
    ) -> None:
        """threads: each connection's TLS handshake, ticket, status and drain (Executors.data_connections)."""
        self._receiver = receiver
        self._peer = peer
        self._host = host
        self._on_bad_chunk = on_bad_chunk
        self._tls = server_context(peer)
        self._refusals_logged = LogPace()  # keyed by (caller, why)
        self._offers: dict[bytes, _Offer] = {}
        self._connections: dict[asyncio.Task[None], socket.socket] = {}
        self._receiving: set[asyncio.Task[None]] = set()  # connections past a good ticket
        self._handshaking = 0
        self._by_address: dict[str, int] = {}  # handshaking connections per source address (only while some are)
        self._threads = threads
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._stopping = False
        self.counters = {"accept_failures": 0, "connections_refused": 0}
        self.port = 0

    async def start(self) -> None:
        """Listen on the host of [node] listen, port [peer] data_port (0: any free one); self.port says which.

        The family follows the host as written in [node] listen: an IPv6 literal listens
        on IPv6, anything else on IPv4; senders dial the data port on the host of the
        address they reached gRPC at, so the two agree where listen and [peer] addresses do.
        """
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._peer.data_port))
            sock.listen(MAX_HANDSHAKING)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock, self.port = sock, sock.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    def offer(self, reservation: RangeReservation) -> bytes:
        """Return a one-time ticket for a range the receiver reserved (PeerBusy: too many offered, or stopping).

        The ticket is good for one connection within TICKET_TTL_S; unused, its reservation is released then.
        """
        if self._stopping:
            raise PeerBusy("this node is stopping: it offers no data ranges")
        if len(self._offers) >= MAX_TICKETS:
            raise PeerBusy(f"{len(self._offers)} data ranges are offered already")
        ticket = secrets.token_bytes(TICKET_BYTES)
        expiry = asyncio.get_running_loop().call_later(TICKET_TTL_S, self._expire, ticket)
        self._offers[ticket] = _Offer(reservation, expiry)
        return ticket

    def _expire(self, ticket: bytes) -> None:
        offer = self._offers.pop(ticket, None)
        if offer is not None:
            offer.expiry.cancel()
            self._receiver.release(offer.reservation)

    async def stop(self) -> None:
        """Offer no more tickets, give ranges in flight STOP_GRACE_S, then end every connection; never raises.

        The threads of connections are waited for on the event loop's terms (never joined on it).
        """
        self._stopping = True
        deadline = time.monotonic() + STOP_GRACE_S
        while (self._offers or self._receiving) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # offered tickets may still be used, and ranges end
        for ticket in list(self._offers):
            self._expire(ticket)
        if self._accepting is not None:
            self._accepting.cancel()
            try:
                await self._accepting
            except asyncio.CancelledError:
                pass
            except Exception:  # the accept loop survives its errors; whatever else ended it must not stop a drain
                log.exception("the data channel's accept loop had ended")
        if self._sock is not None:
            self._sock.close()
        for task, conn in list(self._connections.items()):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # a thread blocked in recv or recv_into returns
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        backoff_s, unsaid, said_s = 0.0, 0, -ACCEPT_LOG_EVERY_S
        while True:
            try:
                conn, address = await loop.sock_accept(self._sock)
            except OSError as e:  # out of descriptors or buffers, or a connection aborted: wait, then go on
                self.counters["accept_failures"] += 1
                unsaid += 1
                backoff_s = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_MIN_S, 2 * backoff_s))
                if time.monotonic() - said_s >= ACCEPT_LOG_EVERY_S:
                    log.warning(
                        "data channel: accepting a connection failed (%s; %d time(s) since last said); going on",
                        e, unsaid,
                    )  # fmt: skip
                    said_s, unsaid = time.monotonic(), 0
                await asyncio.sleep(backoff_s)
                continue
            backoff_s = 0.0
            self._admit(conn, str(address[0]))

    def _admit(self, conn: socket.socket, source: str) -> None:
        """Serve a connection if a handshaking slot and its address's share are free; else close it."""
        if self._handshaking >= MAX_HANDSHAKING or self._by_address.get(source, 0) >= MAX_PER_ADDRESS:
            self.counters["connections_refused"] += 1
            conn.close()
            return
        self._handshaking += 1
        self._by_address[source] = self._by_address.get(source, 0) + 1
        task = asyncio.get_running_loop().create_task(self._serve(conn, source))
        self._connections[task] = conn
        task.add_done_callback(self._connections.pop)

    async def _serve(self, conn: socket.socket, source: str) -> None:
        sock, handshaking = conn, True
        task = asyncio.current_task()
        assert task is not None
        try:
            sock, ticket = await self._on_thread(self._handshake, conn)
            self._connections[task] = sock
            offer = self._offers.pop(ticket, None)
            if offer is None:
                refusal: BaseException | None = NotOffered("no such data range offered (or its ticket expired)")
            else:
                offer.expiry.cancel()
                self._handshake_done(source)
                handshaking = False
                self._receiving.add(task)
                refusal = await self._receive(offer.reservation, sock)
            await self._on_thread(self._answer, sock, refusal)
        except ssl.SSLError as e:  # a refused certificate is logged (paced); other TLS failures at debug
            self._log_refusal(source, e)
        except (OSError, EOFError) as e:  # the sender went away, spoke no TLS, or was too slow: nothing to answer
            log.debug("data connection from %s dropped: %s", source, e)
        finally:
            self._receiving.discard(task)
            if handshaking:
                self._handshake_done(source)
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

    def _handshake_done(self, source: str) -> None:
        """Give back a connection's handshaking slot and its share of its address's."""
        self._handshaking -= 1
        if self._by_address[source] <= 1:
            del self._by_address[source]
        else:
            self._by_address[source] -= 1

    async def _on_thread(self, work: Callable[..., T], *args: object) -> T:
        """Run work on a connection thread; cancelled, still wait for it to end (it uses the socket)."""
        return await wait_finished(self._threads.submit(work, *args))

    def _handshake(self, conn: socket.socket) -> tuple[socket.socket, bytes]:
        """On a connection thread: TLS where configured, then the ticket, all within HANDSHAKE_DEADLINE_S."""
        deadline = time.monotonic() + HANDSHAKE_DEADLINE_S
        close_when_silent(conn)  # a sender cut off mid-range frees its slot in seconds, not STALL_TIMEOUT_S
        conn.settimeout(HANDSHAKE_DEADLINE_S)  # the TLS handshake has one deadline for all its reads
        sock = self._tls.wrap_socket(conn, server_side=True) if self._tls is not None else conn
        ticket = bytearray()
        while len(ticket) < TICKET_BYTES:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"no ticket within {HANDSHAKE_DEADLINE_S:.0f} s of connecting")
            sock.settimeout(left_s)
            received = sock.recv(TICKET_BYTES - len(ticket))
            if not received:
                raise EOFError(f"the connection closed after {len(ticket)} bytes of its ticket")
            ticket += received
        sock.settimeout(STALL_TIMEOUT_S)
        return sock, bytes(ticket)

    @staticmethod
    def _answer(sock: socket.socket, refusal: BaseException | None) -> None:
        """On a connection thread: send the status; after a refusal, half-close and drop what still comes.

        The sender may still be sending the range when it is refused: reading on (for up to
        DRAIN_S, or until it closes once it has the status) lets its sendall end and the status
        be read, where closing with its bytes unread would reset the connection under it.
        """
        send_status(sock, "OK" if refusal is None else status_line(refusal))
        if refusal is None:
            return
        sock.shutdown(socket.SHUT_WR)  # on TLS: the rest is read as it comes, undeciphered, and dropped
        deadline = time.monotonic() + DRAIN_S
        scratch = bytearray(1 << 16)
        while (left_s := deadline - time.monotonic()) > 0:
            sock.settimeout(left_s)
            try:
                if not sock.recv_into(scratch):
                    return
            except TimeoutError:
                return

    async def _receive(self, reservation: RangeReservation, sock: socket.socket) -> BaseException | None:
        """Receive an offered range; return why it was refused (None: checked and written)."""
        try:
            await self._receiver.receive_reserved(reservation, sock)
        except CorruptCheckpoint as e:
            self._on_bad_chunk()
            return e
        except Exception as e:  # the status line says which (rpc.statuses); a sender's reset is one too
            if not isinstance(e, OSError) and status_line(e).startswith("INTERNAL"):
                log.exception("receiving a data range failed")
            return e
        return None
