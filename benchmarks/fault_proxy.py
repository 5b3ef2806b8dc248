"""A TCP proxy in front of an HTTP endpoint that fails the way an object store does: 5xx, resets, stalls.

benchmarks/chaos.py starts one in front of moto's server, points the daemon's
[object] endpoint at it, and sets its mode from the campaign's thread:

    pass    bytes go both ways untouched
    5xx     every request gets `503 SlowDown` (S3's answer when it sheds load) and its connection is closed
    reset   every connection is reset (TCP RST), open ones at once and new ones on arrival
    stall   nothing is relayed and nothing answered; when the mode changes, the stalled connections are reset
    slow    bytes go both ways, SLOW_BLOCK_S late per block read: a slow link (no `tc netem` here)
    blackhole  a cut link: open connections stay open and carry nothing either way, new ones get nothing;
            when the mode changes they carry on (a healed link), or close as that mode says

Its listener is on loopback, or one the caller made (chaos_cluster.py makes it on a host of
its own in a network namespace, so that a cut between node a and that host cuts the store off).
Entering 5xx, reset, stall or slow closes the connections already open (blackhole keeps them), as a load balancer
that restarts would. One thread accepts; one thread per connection relays.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

POLL_S = 0.05  # how soon a connection notices that the mode changed
BLOCK_BYTES = 1 << 16
SLOW_DOWN_BODY = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code></Error>"
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(SLOW_DOWN_BODY)}\r\n\r\n".encode()
    + SLOW_DOWN_BODY
)
SLOW_BLOCK_S = 0.2  # slow: at most BLOCK_BYTES per this, each way (about 320 KiB/s)
MODES = ("pass", "5xx", "reset", "stall", "slow", "blackhole")


def _reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN: what the peer sees when a connection is torn down."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class FaultProxy:
    """Listen on a loopback port (or on listener) and relay to upstream_port on loopback, failing as mode says."""

    def __init__(self, upstream_port: int, listener: socket.socket | None = None) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = listener or socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._mode = "pass"
        self._epoch = 0  # bumped on every change of mode: connections opened before it close
        self._lock = threading.Lock()
        self._closed = False
        self.answered_5xx = 0
        self.reset_connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set_mode(self, mode: str) -> None:
        """Switch to mode; connections open under another mode are closed or reset by their threads."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
        with self._lock:
            if mode != self._mode:
                self._mode = mode
                self._epoch += 1

    def _now(self) -> tuple[str, int]:
        with self._lock:
            return self._mode, self._epoch

    def _count_reset(self) -> None:
        with self._lock:
            self.reset_connections += 1

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        mode, epoch = self._now()
        if mode == "reset":
            self._count_reset()
            _reset(client)
        elif mode == "5xx":
            self._answer_slow_down(client)
        elif mode in ("stall", "blackhole"):
            self._stall(client, epoch)
        else:
            self._relay(client, epoch, SLOW_BLOCK_S if mode == "slow" else 0.0)

    def _answer_slow_down(self, client: socket.socket) -> None:
        with client:
            client.settimeout(5)
            try:
                client.recv(BLOCK_BYTES)  # the request's head: the answer does not depend on it
                client.sendall(SLOW_DOWN)
                with self._lock:
                    self.answered_5xx += 1
            except OSError:
                pass

    def _stall(self, client: socket.socket, epoch: int) -> None:
        while self._now()[1] == epoch and not self._closed:
            threading.Event().wait(POLL_S)
        self._count_reset()
        _reset(client)

    def _relay(self, client: socket.socket, epoch: int, delay_s: float) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)
            return
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ, upstream)
            selector.register(upstream, selectors.EVENT_READ, client)
            try:
                while not self._closed:
                    mode, now = self._now()
                    if mode == "blackhole":  # nothing read, nothing sent, nothing closed: until the link heals
                        while mode == "blackhole" and not self._closed:
                            threading.Event().wait(POLL_S)
                            mode, now = self._now()
                        if mode in ("pass", "slow"):
                            epoch = now
                            delay_s = SLOW_BLOCK_S if mode == "slow" else 0.0
                            continue
                    if now != epoch:  # the mode changed under this connection
                        if mode in ("reset", "stall"):
                            self._count_reset()
                            _reset(client)
                        break
                    for key, _ in selector.select(POLL_S):
                        data = key.fileobj.recv(BLOCK_BYTES)  # type: ignore[union-attr]
                        if not data:
                            return
                        if delay_s:
                            threading.Event().wait(delay_s)
                        key.data.sendall(data)
            except OSError:
                pass
            finally:
                client.close()
                upstream.close()
