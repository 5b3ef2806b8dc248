"""The daemon's local socket, as the client, the daemon and its CLI all find and check it.

ckpt.transport.DaemonClient dials it; ckptd.config takes default_socket_path as node.socket's
default; ckptd.daemon sizes its messages by MAX_MESSAGE_BYTES. Everything here runs on the caller's
thread.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from pathlib import Path

from ckpt_core.errors import DaemonUnavailable
from ckpt_core.owned_paths import dir_problem

MAX_MESSAGE_BYTES = 256 << 20


def default_socket_path() -> Path:
    """Return the socket a daemon with no configured socket listens on."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "ckptd" / "ckptd.sock"
    return Path(tempfile.gettempdir()) / f"ckptd-{os.getuid()}" / "ckptd.sock"


def socket_owner(path: Path) -> int | None:
    """Return the uid of the process serving a unix socket (SO_PEERCRED), or None where none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return None
        _pid, uid, _gid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return int(uid)


def check_default_socket(path: Path) -> None:
    """Refuse a default socket another user could have prepared: its directory and its daemon must be ours or root's.

    Only the default path needs it: its name is known in advance. An address given explicitly
    (address=, CKPTD_ADDRESS, a config's node.socket) is the user's own choice.
    """
    trusted = {os.getuid(), 0}
    problem = dir_problem(path.parent, trusted)
    if problem is None and (uid := socket_owner(path)) is not None and uid not in trusted:
        problem = f"the daemon on {path} runs as uid {uid}"
    if problem is not None:
        raise DaemonUnavailable(
            f"refusing the default ckptd socket {path}: {problem}. Another local user may have prepared it to serve "
            "a fake daemon; nothing was sent to it. Remove it and restart your ckptd, or give the address of yours "
            "(CKPTD_ADDRESS, Checkpointer(address=...))"
        )


def resolve_address(address: str | None) -> str:
    """Turn an address (a socket path, unix:PATH or host:port) into a gRPC target."""
    address = address or os.environ.get("CKPTD_ADDRESS") or str(default_socket_path())
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if "/" in address or address.endswith(".sock"):
        return "unix:" + os.path.abspath(address)
    return address
