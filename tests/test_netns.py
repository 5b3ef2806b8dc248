"""The harness of nodes as hosts (tests/netns.py): a cut silences a link both ways, or one way; heal ends it;
a socket the harness makes on a host (run_in) lives there and is cut with it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from netns import PREFIX, Host, _namespaces, run_in

pytestmark = pytest.mark.e2e

PORT = 7171
SILENCE_S = 1.0  # how long a probe listens or connects before it calls the link silent

_RECEIVE = f"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", {PORT}))
s.settimeout({SILENCE_S})
print("ready", flush=True)
try:
    print(s.recv(64).decode(), flush=True)
except TimeoutError:
    print("silence", flush=True)
"""

_CONNECT = f"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], {PORT}), timeout={SILENCE_S}).close()
    print("connected")
except TimeoutError:
    print("silence")
except OSError as e:
    print(f"refused {{e}}")
"""

_LISTEN = f"""
import socket
s = socket.create_server(("0.0.0.0", {PORT}))
print("ready", flush=True)
while True:
    s.accept()[0].close()
"""


def _datagram_arrives(sender: Host, receiver: Host) -> bool:
    """Say whether a UDP datagram sender sends receiver arrives (one direction alone, no answer needed)."""
    listener = subprocess.Popen(
        [*receiver.command(), sys.executable, "-c", _RECEIVE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "ready"
        to = (receiver.address, PORT)
        send = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hello', {to!r})"
        subprocess.run([*sender.command(), sys.executable, "-c", send], check=True, timeout=30)
        return listener.stdout.readline().strip() == "hello"
    finally:
        listener.kill()
        listener.wait()


def _connect(client: Host, server: Host) -> str:
    done = subprocess.run(
        [*client.command(), sys.executable, "-c", _CONNECT, server.address], capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip()


def test_a_cut_silences_both_ways_a_one_way_cut_one_way_and_heal_restores_both(network):
    a, b, c = network.host("a"), network.host("b"), network.host("c")
    server = subprocess.Popen([*b.command(), sys.executable, "-c", _LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        assert _connect(a, b) == "connected"
        assert _datagram_arrives(a, b) and _datagram_arrives(b, a)

        network.cut(a, b)
        assert _connect(a, b) == "silence", "a cut drops packets silently: no refusal, no answer"
        assert not _datagram_arrives(a, b) and not _datagram_arrives(b, a)
        assert _connect(c, b) == "connected", "a cut between a and b leaves c's links alone"

        network.heal()
        assert _connect(a, b) == "connected"
        assert _datagram_arrives(a, b) and _datagram_arrives(b, a)

        network.cut_one_way(a, b)
        assert not _datagram_arrives(a, b), "what a sends b is dropped"
        assert _datagram_arrives(b, a), "what b sends a arrives"
        assert _connect(a, b) == "silence" and _connect(b, a) == "silence"  # TCP needs both ways

        network.heal()
        network.isolate(c)  # a partition c | a b
        assert not _datagram_arrives(c, a) and not _datagram_arrives(b, c)
        assert _connect(a, b) == "connected", "each side of a partition still whole"
    finally:
        server.kill()
        server.wait()
        network.heal()


def test_a_network_leaves_no_namespace_behind(network):
    network.host("x")
    mine = [n for n in _namespaces() if n.startswith(network.tag)]
    assert len(mine) == 2 and all(n.startswith(PREFIX) for n in mine)  # the router and the host
    network.close()
    assert not [n for n in _namespaces() if n.startswith(network.tag)]


def test_a_listener_made_on_a_host_is_on_that_host_and_is_cut_with_it(network):
    a, store = network.host("a"), network.host("store")
    listener = run_in(store, lambda: socket.create_server((store.address, PORT)))
    with listener:
        listener.settimeout(SILENCE_S)
        assert _connect(a, store) == "connected", "another host reaches it at the host's address"
        network.cut(a, store)
        assert _connect(a, store) == "silence"
        with pytest.raises(ZeroDivisionError):  # what work raises, the caller gets
            run_in(a, lambda: 1 // 0)
