"""Talk to the local ckptd over gRPC on its unix socket."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    DaemonUnavailable,
    InvalidArgument,
    NotFound,
    ReservationLost,
)
from ckpt.owned_paths import dir_problem
from ckpt.wire.v1 import ckptd_pb2_grpc

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


class DaemonClient:
    """Call the daemon's RPCs, turning transport failures into ckpt errors."""

    def __init__(self, address: str | None = None) -> None:
        if not (address or os.environ.get("CKPTD_ADDRESS")):
            check_default_socket(default_socket_path())
        self.target = resolve_address(address)
        self._channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = ckptd_pb2_grpc.CkptdStub(self._channel)

    def call(self, method: str, request: Any, timeout_s: float | None = 60.0) -> Any:
        """Call one RPC by name and return its reply."""
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise self._error(method, e) from None

    def stream(self, method: str, request: Any, timeout_s: float | None = None) -> Iterator[Any]:
        """Call one server-streaming RPC by name and yield its replies."""
        try:
            yield from getattr(self._stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise self._error(method, e) from None

    def _error(self, method: str, e: grpc.RpcError) -> Exception:
        code = e.code()
        detail = e.details() or str(code)
        if code == grpc.StatusCode.UNAVAILABLE:
            return DaemonUnavailable(
                f"ckptd is not reachable at {self.target} ({detail}); start it with `ckptd serve` or set CKPTD_ADDRESS"
            )
        errors: dict[Any, type[Exception]] = {
            grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
            grpc.StatusCode.NOT_FOUND: NotFound,
            grpc.StatusCode.DATA_LOSS: CorruptCheckpoint,
            grpc.StatusCode.FAILED_PRECONDITION: ReservationLost,
        }
        if code in errors:
            return errors[code](detail)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(f"ckptd at {self.target} did not answer {method} in time")
        return CheckpointError(f"ckptd {method} failed: {detail}")

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
