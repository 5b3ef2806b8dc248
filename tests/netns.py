"""Nodes as hosts: each process of a test cluster in a network namespace of its own, behind a router the test cuts.

The tests call Network (through the `network` fixture in conftest.py) from the test's thread:
host() once per node (a daemon, an object store, an etcd server), then cut(), cut_one_way(),
isolate() and heal() while the cluster runs, and close() at the end (the fixture does, also
when the test fails). Every name is the test's own: the namespaces carry this process's id
and a random tag, so runs side by side never meet, and a later run removes what a run that
was killed left (sweep_leftovers).

The layout: a router namespace, and per host a namespace whose eth0 (10.213.<i>.2/24, default
route through 10.213.<i>.1) is one end of a veth pair, the other end in the router. A cut is
a policy rule in the router, `ip rule add from A to B blackhole`: what A sends B is dropped on
the way, silently, as a switch port, a firewall or a one-way route drops it. A blackhole route in
the sender's own namespace would not do: the kernel answers the sender's connect with EINVAL at
once, which is a refusal, not the silence of a peer that hangs. Delay and loss (no `tc netem`
here) are for a TCP proxy of the harness's, as benchmarks/fault_proxy.py does for the store.

run_in() lets the harness's own process act on a host: a socket made on its thread stays in
that host's namespace (benchmarks/chaos_cluster.py puts the store's fault proxy on a host of
its own this way, and opens a flood's connections from node a's). The fault campaign
(benchmarks/chaos.py) imports this module from here: one copy for the tests and the campaign.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

PREFIX = "ckn"  # every namespace of this harness: ckn<pid>x<tag>-router, ckn<pid>x<tag>-h-<role>
SUBNET = "10.213"  # 10.213.<i>.0/24 per host; only inside the test's own namespaces
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
_CLONE_NEWNET = 0x40000000  # setns(2): enter a network namespace (this thread only)
T = TypeVar("T")


class NamespacesRefused(RuntimeError):
    """This machine does not let us make network namespaces (not root, or `ip netns add` refused)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> None:
    """Remove the namespaces of this harness whose run has ended (a run killed before its fixtures' teardown)."""
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass(frozen=True)
class Host:
    """One host of the network: its namespace and its address."""

    name: str
    namespace: str
    address: str

    def command(self) -> list[str]:
        """Return the prefix that runs a command on this host (Daemon.wrapper, subprocess argv)."""
        return ["ip", "netns", "exec", self.namespace]


def run_in(host: Host, work: Callable[[], T]) -> T:
    """Run work on a thread of its own inside host's network namespace; return its result, or raise its error.

    Called from any thread of the harness; only the new thread enters the namespace (setns(2)
    moves the calling thread alone), and the sockets work makes there stay on the host.
    """
    outcome: dict[str, object] = {}

    def entered() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{host.namespace}") as namespace:
                if libc.setns(namespace.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {host.namespace}")
            outcome["value"] = work()
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=entered, name=f"in-{host.name}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


class Network:
    """A router and the hosts behind it, all in namespaces of this test's own; see the module docstring."""

    def __init__(self) -> None:
        """Make the router; raise NamespacesRefused where namespaces cannot be made here."""
        if os.geteuid() != 0:
            raise NamespacesRefused("network namespaces need root")
        if shutil.which("ip") is None:
            raise NamespacesRefused("no `ip` command (iproute2) here")
        sweep_leftovers()
        self.tag = f"{PREFIX}{os.getpid()}x{uuid.uuid4().hex[:8]}"
        self.router = f"{self.tag}-router"
        self.hosts: list[Host] = []
        self._rules: set[tuple[str, str]] = set()  # (from, to) addresses whose packets the router drops
        try:
            _ip("netns", "add", self.router)
        except (OSError, RuntimeError) as e:
            raise NamespacesRefused(f"cannot make a network namespace here: {e}") from None
        try:
            _ip("-n", self.router, "link", "set", "lo", "up")
            subprocess.run(
                ["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                check=True,
                capture_output=True,
            )
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            self.close()
            raise NamespacesRefused(f"cannot set up a router namespace here: {e}") from None

    def host(self, role: str) -> Host:
        """Add a host (role names it in the namespace: "n0", "s3", "etcd") and return it, reachable from every other."""
        i = len(self.hosts) + 1
        host = Host(role, f"{self.tag}-h-{role}", f"{SUBNET}.{i}.2")
        _ip("netns", "add", host.namespace)
        self.hosts.append(host)
        _ip("-n", self.router, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("-n", self.router, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"h{i}")
        _ip("-n", self.router, "link", "set", f"h{i}", "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        _ip("-n", host.namespace, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
        return host

    def cut_one_way(self, sender: Host, receiver: Host) -> None:
        """Drop what sender sends receiver; what receiver sends sender still arrives.

        A node that sends and hears nothing back: cut_one_way(peer, node) loses the peer's answers.
        """
        self._drop(sender.address, receiver.address)

    def cut(self, a: Host, b: Host) -> None:
        """Drop everything between a and b, both ways."""
        self._drop(a.address, b.address)
        self._drop(b.address, a.address)

    def isolate(self, host: Host) -> None:
        """Cut a host off from every other host, both ways."""
        self.partition([host], [h for h in self.hosts if h != host])

    def partition(self, side: list[Host], other_side: list[Host]) -> None:
        """Cut every host of one side off from every host of the other, both ways (each side still whole)."""
        for a in side:
            for b in other_side:
                self.cut(a, b)

    def heal(self) -> None:
        """Take every cut away: packets flow again between every pair of hosts."""
        for source, target in sorted(self._rules):
            _ip("-n", self.router, "rule", "del", "from", f"{source}/32", "to", f"{target}/32", "blackhole")
        self._rules.clear()

    def _drop(self, source: str, target: str) -> None:
        if (source, target) not in self._rules:
            _ip("-n", self.router, "rule", "add", "from", f"{source}/32", "to", f"{target}/32", "blackhole")
            self._rules.add((source, target))

    def close(self) -> None:
        """Remove every namespace of this network (their veths go with them); kill what runs in them first."""
        for namespace in [h.namespace for h in self.hosts] + [self.router]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.hosts.clear()
