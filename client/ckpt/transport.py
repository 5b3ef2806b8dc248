"""Talk to the local ckptd over gRPC on its unix socket: the one client module that speaks protobuf.

DaemonClient's typed methods (reserve, commit, shard_reached, locate, locate_step, shard_record,
shard_runs, newest_step, status) take and return plain values and the frozen records below; the
save path, the load path, SaveHandle and the lazy copy's threads call them, each on its own thread
(a gRPC channel is thread-safe). call() and stream() are the untyped form ckptd's CLI uses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from ckpt_core.byte_range import ByteRange
from ckpt_core.daemon_socket import MAX_MESSAGE_BYTES, check_default_socket, default_socket_path, resolve_address
from ckpt_core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    DaemonUnavailable,
    InvalidArgument,
    NotFound,
    ReservationLost,
    SaveFailed,
    SaveSkipped,
)
from ckpt_core.shard_io import ShardSource
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from ckpt_core.wire.v1 import ckptd_pb2_grpc

log = logging.getLogger(__name__)

# A load's Locate waits as long as the daemon works on it (a fetch, a slow store's answer: bounded there),
# saying so at this pace; no deadline here would fail a load the daemon is still bringing in.
STILL_WAITING_EVERY_S = 15.0


@dataclass(frozen=True)
class ShardId:
    """Name one rank's shard of one step of a job saved by world_size ranks."""

    job: str
    step: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class JobRetention:
    """Carry a job's own retention to every Reserve: what the Checkpointer was given (None: the daemon's config)."""

    keep: int | None = None
    keep_every: int | None = None


@dataclass(frozen=True)
class Reservation:
    """Say what Reserve granted: the slot to copy into, the one to map ahead, and what the save waited for."""

    skipped: bool  # no room under policy "skip": nothing to copy
    reason: str  # why it was skipped, or what it waited for
    slot_path: str
    slot_size_bytes: int
    spare_slot_path: str  # the slot the next save will likely get ("" none)
    spare_slot_size_bytes: int
    layout_in_slot: bool  # the daemon takes the layout in the slot, after the data
    reservation: int  # handed back with the commit
    line: str  # the line of the job's history the step belongs to


@dataclass(frozen=True)
class ShardCommit:
    """Say which slot holds a reserved shard's snapshot, and how it is laid out there."""

    shard: ShardId
    slot_path: str
    data_size_bytes: int
    layout_size_bytes: int  # the layout's bytes in the slot (0: they travel in layout_json)
    layout_json: bytes
    reservation: int
    run_id: str
    line: str


@dataclass(frozen=True)
class LocatedShard:
    """Say where this node holds a step's shard of one rank, fastest first."""

    step: int
    world_size: int
    sources: list[ShardSource]
    next_line: str  # the line a save after loading this step continues


@dataclass(frozen=True)
class LocatedStep:
    """Say what a complete step is (its sealed commit record and index) and where this node holds each rank."""

    step: int
    commit_json: bytes
    index_json: bytes
    ranks: list[list[ShardSource]]  # by rank; empty: read it through the daemon
    next_line: str


class DaemonClient:
    """Call the daemon's RPCs, turning transport failures into ckpt errors.

    One per Checkpointer (and one per ckptd CLI command), closed by its owner after every other use.
    """

    def __init__(self, address: str | None = None) -> None:
        if not (address or os.environ.get("CKPTD_ADDRESS")):
            check_default_socket(default_socket_path())
            self._way_out = "start it with `ckptd serve`, or set CKPTD_ADDRESS to the address of a running one"
        elif address:
            self._way_out = "start it with `ckptd serve`, or check the address given"
        else:
            self._way_out = "start it with `ckptd serve`, or check CKPTD_ADDRESS, which named this address"
        self.target = resolve_address(address)
        self._channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = ckptd_pb2_grpc.CkptdStub(self._channel)

    def reserve(
        self, shard: ShardId, size_bytes: int, retention: JobRetention, after: tuple[str, int] | None
    ) -> Reservation:
        """Reserve a slot for shard's snapshot of size_bytes, waiting as long as the daemon's policy says.

        after: the line this rank continues and the step it loaded or saved last (None: the job's head).
        """
        request = pb.ReserveRequest(shard=_shard_message(shard), size_bytes=size_bytes)
        given = {k: v for k, v in (("keep", retention.keep), ("keep_every", retention.keep_every)) if v is not None}
        request.retention.CopyFrom(pb.JobRetention(**given))  # proto3 optional: an unset field is not a 0
        if after is not None:
            request.has_line, request.line, request.after = True, after[0], after[1]
        return _reservation(self.call("Reserve", request, timeout_s=None))

    def prepare(self, shard: ShardId, size_bytes: int) -> Reservation:
        """Have the daemon allocate this rank's slots for saves of size_bytes, ahead of its first save."""
        request = pb.ReserveRequest(shard=_shard_message(shard), size_bytes=size_bytes, prepare=True)
        return _reservation(self.call("Reserve", request, timeout_s=None))

    def commit(self, commit: ShardCommit) -> None:
        """Hand a copied snapshot to the daemon; raise ReservationLost if the daemon restarted since its Reserve."""
        request = pb.CommitRequest(
            shard=_shard_message(commit.shard),
            slot_path=commit.slot_path,
            data_size_bytes=commit.data_size_bytes,
            layout_size_bytes=commit.layout_size_bytes,
            layout_json=commit.layout_json,
            reservation=commit.reservation,
            run_id=commit.run_id,
            line=commit.line,
        )
        try:
            self.call("Commit", request)
        except ReservationLost as e:
            raise ReservationLost(f"{e}: the daemon restarted during this save; call save_async again") from None

    def shard_reached(self, shard: ShardId, tier: str, wait_s: float, timeout_s: float = 60.0) -> bool:
        """Return whether shard reached tier, waiting up to wait_s for it (0: answer at once).

        Raise SaveSkipped if a newer snapshot replaced it before its flush, SaveFailed if it cannot get there.
        """
        request = pb.WaitShardRequest(shard=_shard_message(shard), tier=tier, timeout_s=wait_s)
        reply = self.call("WaitShard", request, timeout_s=timeout_s)
        if reply.passed_over:  # saves outran the disk: a newer snapshot replaced this one before its flush
            raise SaveSkipped(reply.error)
        if reply.error:
            raise SaveFailed(reply.error)
        return bool(reply.done)

    def locate(self, job: str, step: int | None, rank: int, tier: str, refetch: bool = False) -> LocatedShard:
        """Return where rank's shard of step (None: the latest complete step) is on this node.

        refetch: this node's copies failed their checks; the daemon fetches a good one over them first.
        """
        request = pb.LocateRequest(job=job, step=-1 if step is None else step, rank=rank, tier=tier, refetch=refetch)
        reply = self.call_waiting("Locate", request, f"rank {rank}'s shard of {job} {_step_named(step)}")
        sources = [ShardSource(s.tier, s.kind, s.path, job, reply.step) for s in reply.sources]
        return LocatedShard(int(reply.step), int(reply.world_size), sources, reply.next_line)

    def locate_step(self, job: str, step: int | None, tier: str) -> LocatedStep:
        """Return a complete step (None: the latest): its sealed records, and the ranks this node holds."""
        request = pb.LocateStepRequest(job=job, step=-1 if step is None else step, tier=tier)
        reply = self.call_waiting("LocateStep", request, f"{job} {_step_named(step)}")
        ranks = [[ShardSource(s.tier, s.kind, s.path, job, reply.step) for s in held.sources] for held in reply.ranks]
        return LocatedStep(int(reply.step), bytes(reply.commit_json), bytes(reply.index_json), ranks, reply.next_line)

    def shard_record(self, job: str, step: int, rank: int) -> bytes:
        """Return the sealed record of rank's shard of step, as the daemon reads it from its fastest copy."""
        first = next(iter(self.stream("ReadShard", pb.ReadShardRequest(job=job, step=step, rank=rank))), None)
        if first is None:
            raise CheckpointError(f"ckptd sent no record of rank {rank} shard of {job} step {step}")
        return bytes(first.meta_json)

    def shard_runs(self, job: str, step: int, rank: int, runs: list[ByteRange]) -> Iterator[bytes]:
        """Yield the bytes of rank's data in runs, in order, as the daemon sends them."""
        ranges = [pb.ByteRange(offset=r.offset, length=r.length) for r in runs]
        replies = self.stream("ReadShard", pb.ReadShardRequest(job=job, step=step, rank=rank, ranges=ranges))
        next(replies, None)  # the record, known already
        return (r.data for r in replies)

    def newest_step(self, job: str) -> int | None:
        """Return the newest step of job complete on any tier, or None.

        newest: the daemon answers from the cluster view (an older daemon lists every step).
        """
        reply = self.call("List", pb.ListRequest(job=job, newest=True))
        return max((int(s.step) for s in reply.steps if s.job == job), default=None)

    def status(self) -> dict[str, Any]:
        """Return the daemon's status document, as `ckptd status --json` prints it (ValueError if it is not JSON)."""
        document = json.loads(self.call("Status", pb.StatusRequest()).json)
        if not isinstance(document, dict):
            raise ValueError("ckptd's status is not a JSON object")
        return document

    def call(self, method: str, request: Any, timeout_s: float | None = 60.0) -> Any:
        """Call one RPC by name and return its reply."""
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise self._error(method, e) from None

    def call_waiting(self, method: str, request: Any, what: str) -> Any:
        """Call one RPC that may take long on the daemon's side (a load brought in from the object store) and
        return its reply: no deadline, and a warning every STILL_WAITING_EVERY_S naming what it waits for."""
        future = getattr(self._stub, method).future(request)
        started = time.monotonic()
        try:
            while True:
                try:
                    return future.result(timeout=STILL_WAITING_EVERY_S)
                except grpc.FutureTimeoutError:
                    log.warning(
                        "still waiting for ckptd to find %s (%.0f s): it may be fetching it from a peer or the object "
                        "store; the daemon's log says more",
                        *(what, time.monotonic() - started),
                    )
        except grpc.RpcError as e:
            raise self._error(method, e) from None
        finally:
            future.cancel()  # a no-op once answered; else (interrupted) the daemon stops working for nobody

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
            return DaemonUnavailable(f"ckptd is not reachable at {self.target} ({detail}); {self._way_out}")
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


def _shard_message(shard: ShardId) -> pb.ShardId:
    return pb.ShardId(job=shard.job, step=shard.step, rank=shard.rank, world_size=shard.world_size)


def _reservation(reply: pb.ReserveReply) -> Reservation:
    return Reservation(
        skipped=reply.skipped,
        reason=reply.reason,
        slot_path=reply.slot_path,
        slot_size_bytes=int(reply.slot_size_bytes),
        spare_slot_path=reply.spare_slot_path,
        spare_slot_size_bytes=int(reply.spare_slot_size_bytes),
        layout_in_slot=reply.layout_in_slot,
        reservation=int(reply.reservation),
        line=reply.line,
    )


def _step_named(step: int | None) -> str:
    return "its newest step" if step is None else f"step {step}"
