"""Peer addresses: resolve "host:port" entries to "ip:port" endpoints, and tell which are this node's own.

Used by the config (checks, commands without a daemon) and by ResolvedPeers (the
daemon's membership, which looks names up again on a thread of its own).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping


def endpoints(address: str) -> list[str]:
    """Return the "ip:port" endpoints host:port names: every address (A and AAAA) of its host, with its port.

    A literal IP names itself; an IPv6 endpoint is written "[ip]:port". Blocks on name
    resolution: call it from a worker thread. Raises OSError when the host cannot be
    resolved now.
    """
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except ValueError as e:
        raise OSError(f"{address!r} is not host:port: {e}") from None
    found = {(str(info[4][0]), int(info[4][1])) for info in infos}
    return sorted(f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}" for ip, p in found)


def peer_endpoints(addresses: Iterable[str], listen: str, resolved: Mapping[str, list[str]]) -> frozenset[str]:
    """Return the peers [peer] addresses stands for, given the endpoints each entry (and listen) resolved to.

    Every endpoint of every entry, less this node's own (listen's). A name whose addresses
    are of both families stands for those of the family this node listens on: one node's A
    and AAAA records are one peer, not two (of which one would never answer).
    """
    me = set(resolved.get(listen, [])) if listen else set()
    families = {_is_v6(e) for e in me}
    found: set[str] = set()
    for entry in addresses:
        named = resolved.get(entry, [])
        if not _is_ip(host_of(entry)):
            named = [e for e in named if _is_v6(e) in families] or named
        found.update(e for e in named if e not in me)
    return frozenset(found)


def dialled_names(addresses: Iterable[str], resolved: Mapping[str, list[str]]) -> dict[str, str]:
    """Return {endpoint: the name it was found by} for the endpoints of entries that name a host rather than an IP.

    A peer dialled by the address a name resolved to is still checked, with TLS, against
    that name (its certificate names the name, as when the name itself was dialled).
    """
    return {e: host_of(entry) for entry in addresses if not _is_ip(host_of(entry)) for e in resolved.get(entry, [])}


def _is_v6(endpoint: str) -> bool:
    return endpoint.startswith("[")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def endpoints_or_none(address: str) -> list[str]:
    """Return endpoints(address), or none where it cannot be resolved (or address is empty)."""
    try:
        return endpoints(address) if address else []
    except OSError:
        return []


def is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) < 65536)


def host_of(address: str) -> str:
    """Return the host of host:port ([v6]:port included), as a certificate names it."""
    return address.rsplit(":", 1)[0].strip("[]")
