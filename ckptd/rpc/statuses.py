"""Map the errors a call can end with to gRPC status names: one table for gRPC answers and data connections alike.

answer() (rpc.server, used by every servicer) aborts a call with the status found here;
the data listener (rpc.data_listener) writes the same name on a data connection's status
line, and the sender (PeerLink) turns either back into the same error. Most specific
first: StepAlreadyComplete is a ShardWriteError, and every ckpt error a CheckpointError.
"""

from __future__ import annotations

from ckpt_core.errors import CheckpointError, CorruptCheckpoint, InvalidArgument, NotFound, ReservationLost
from google.protobuf.message import DecodeError

from ckptd.cluster.peer_link import IsSelf
from ckptd.errors import AlreadyHeld, NotOffered, PeerBusy, RemovalRefused, StepAlreadyComplete
from ckptd.rpc.guard import NotAPeer

# A status travels in a header, which gRPC refuses over 16 KiB (the caller would see RESOURCE_EXHAUSTED, not why).
MAX_DETAILS_BYTES = 2048

STATUSES: tuple[tuple[tuple[type[BaseException], ...], str], ...] = (
    ((InvalidArgument, DecodeError), "INVALID_ARGUMENT"),
    ((NotFound,), "NOT_FOUND"),
    ((ReservationLost, IsSelf, StepAlreadyComplete, RemovalRefused), "FAILED_PRECONDITION"),
    ((NotAPeer, NotOffered), "PERMISSION_DENIED"),
    ((CorruptCheckpoint,), "DATA_LOSS"),
    ((AlreadyHeld,), "ALREADY_EXISTS"),
    ((PeerBusy,), "RESOURCE_EXHAUSTED"),
    ((CheckpointError, OSError), "INTERNAL"),
)


def status_of(error: BaseException) -> tuple[str, str] | None:
    """Return (gRPC status name, details cut to fit a status) for an error a call may end with; None for others."""
    for kinds, code in STATUSES:
        if isinstance(error, kinds):
            text = f"malformed message: {error}" if isinstance(error, DecodeError) else error
            return code, details(text)
    return None


def status_line(error: BaseException) -> str:
    """Return a data connection's status for an error: "CODE detail" ("INTERNAL" for one not in the table)."""
    code, detail = status_of(error) or ("INTERNAL", details(error))
    return f"{code} {detail}"


def details(error: object) -> str:
    """Return an error's message cut to what fits a status (it may quote megabytes a caller sent)."""
    text = str(error)
    encoded = text.encode(errors="replace")
    if len(encoded) <= MAX_DETAILS_BYTES:
        return text
    return encoded[:MAX_DETAILS_BYTES].decode(errors="ignore") + f"... ({len(encoded)} bytes in all)"
