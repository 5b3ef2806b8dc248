"""Translate gRPC messages to calls of the roles that answer them, and back; no logic of its own lives here.

Each RPC is one call into one role, handed over by the composition root (node.py): a save's to
SavePath, a load's to the Locator and ShardedReads, the operators' to retention, job removal and
the status report.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, InvalidArgument
from ckpt_core.format import utc_timestamp, validate_job, validate_rank, validate_step
from ckpt_core.history import Line, line_from_text, line_text
from ckpt_core.shard_key import ShardKey
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from ckpt_core.wire.v1 import ckptd_pb2_grpc
from google.protobuf.message import DecodeError

from ckptd.cluster.shard_stream import PIECE_BYTES
from ckptd.load.locate import Locator
from ckptd.load.sharded_reads import ShardedReads
from ckptd.operations.job_removal import JobRemoval
from ckptd.operations.retention import Removal, RetentionRunner
from ckptd.operations.status import StatusReport
from ckptd.rpc.guard import NotAPeer, RequestGuard
from ckptd.rpc.statuses import status_of
from ckptd.save.save_path import SavePath
from ckptd.save.staging import Snapshot

T = TypeVar("T")
MAX_LAYOUT_BYTES = 128 << 20
MAX_WAIT_S = 24 * 3600.0
MAX_LINE_CHARS = 64 << 10  # a line is a few numbers per rollback


def _shard_key(shard: pb.ShardId) -> ShardKey:
    rank, world_size = validate_rank(shard.rank, shard.world_size)
    return ShardKey(validate_job(shard.job), validate_step(shard.step), rank, world_size)


async def answer(context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]]) -> T:
    """Run an RPC's work, turning ckpt errors into gRPC status codes (the one table: rpc.statuses)."""
    try:
        return await work()
    except (CheckpointError, OSError, DecodeError, NotAPeer) as e:
        code, details = status_of(e) or ("INTERNAL", str(e))
        await context.abort(grpc.StatusCode[code], details)
    raise AssertionError("unreachable")


def _collect_reply(removals: list[Removal]) -> pb.CollectReply:
    return pb.CollectReply(
        removals=[pb.Removal(tier=r.tier, job=r.job, step=r.step, reason=r.reason) for r in removals]
    )


def _line(text: str, key: ShardKey) -> Line:
    """Parse the line a client names (ckpt_core.history.line_text), raising InvalidArgument if it is not one."""
    if len(text) > MAX_LINE_CHARS:
        raise InvalidArgument(f"{key}: a line of {len(text)} characters is too long")
    try:
        return line_from_text(text, f"{key}: the line")
    except CorruptCheckpoint as e:
        raise InvalidArgument(str(e)) from None


class CkptdServicer(ckptd_pb2_grpc.CkptdServicer):
    """Serve the local-client protocol of ckpt_core/wire/v1/ckptd.proto."""

    def __init__(
        self,
        save_path: SavePath,
        locator: Locator,
        sharded_reads: ShardedReads,
        retention: RetentionRunner,
        job_removal: JobRemoval,
        report: StatusReport,
        guard: RequestGuard,
    ) -> None:
        self.save_path = save_path
        self.locator = locator
        self.sharded_reads = sharded_reads
        self.retention = retention
        self.job_removal = job_removal
        self.report = report
        self.guard = guard

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveReply:
        async def work() -> pb.ReserveReply:
            key = _shard_key(request.shard)
            wanted = request.retention  # the job's own retention (Checkpointer keep=, keep_every=)
            reserved = await self.save_path.reserve_for(
                key,
                request.size_bytes,
                _line(request.line, key) if request.has_line else None,
                request.after,
                (
                    wanted.keep if wanted.HasField("keep") else None,
                    wanted.keep_every if wanted.HasField("keep_every") else None,
                )
                if request.HasField("retention")
                else None,
                request.prepare,
            )
            if reserved.skipped:
                self.guard.note(context, "skipped", f"skipped {key}: {reserved.reason}")
            slot, spare = reserved.slot, reserved.spare
            return pb.ReserveReply(
                skipped=reserved.skipped,
                slot_path=str(slot.path) if slot else "",
                slot_size_bytes=slot.size_bytes if slot else 0,
                blocked_s=reserved.blocked_s,
                reason=reserved.reason,
                reservation=reserved.reservation,
                spare_slot_path=str(spare.path) if spare else "",
                spare_slot_size_bytes=spare.size_bytes if spare else 0,
                layout_in_slot=not reserved.skipped,
                line=line_text(reserved.line) if reserved.line is not None else "",
            )

        return await answer(context, work)

    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitReply:
        async def work() -> pb.CommitReply:
            key = _shard_key(request.shard)
            in_slot = request.layout_size_bytes
            if max(len(request.layout_json), in_slot) > MAX_LAYOUT_BYTES or in_slot < 0:
                raise InvalidArgument(f"{key}: layout of {max(len(request.layout_json), in_slot)} bytes is too large")
            if in_slot and request.layout_json:
                raise InvalidArgument(f"{key}: a layout both in the slot and in the message")
            layout_json = request.layout_json  # opaque here (only the client reads it), checked off the event loop
            snapshot = Snapshot(
                key,
                request.slot_path,
                request.reservation,
                request.data_size_bytes,
                layout_json,
                request.run_id,
                in_slot,
                _line(request.line, key),
                utc_timestamp(time.time()),
            )
            await self.save_path.commit(snapshot)
            return pb.CommitReply()

        return await answer(context, work)

    async def WaitShard(self, request: pb.WaitShardRequest, context: Any) -> pb.WaitShardReply:
        async def work() -> pb.WaitShardReply:
            key = _shard_key(request.shard)
            if not math.isfinite(request.timeout_s):
                raise InvalidArgument(f"invalid timeout_s {request.timeout_s}")
            timeout_s = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
            answer = await self.save_path.wait_shard(key, request.tier, timeout_s)
            return pb.WaitShardReply(done=answer.done, error=answer.error, passed_over=answer.passed_over)

        return await answer(context, work)

    async def Locate(self, request: pb.LocateRequest, context: Any) -> pb.LocateReply:
        async def work() -> pb.LocateReply:
            job = validate_job(request.job)
            step = None if request.step == -1 else validate_step(request.step)
            if request.rank < 0:
                raise InvalidArgument(f"invalid rank {request.rank}")
            located = await self.locator.locate(job, step, request.rank, request.tier, refetch=request.refetch)
            return pb.LocateReply(
                found=True,
                step=located.step,
                world_size=located.world_size,
                sources=[pb.Source(tier=s.tier, kind=s.kind, path=s.path) for s in located.sources],
                next_line=line_text(located.next_line),
            )

        return await answer(context, work)

    async def LocateStep(self, request: pb.LocateStepRequest, context: Any) -> pb.LocateStepReply:
        async def work() -> pb.LocateStepReply:
            job = validate_job(request.job)
            step = None if request.step == -1 else validate_step(request.step)
            record, index, sources, next_line = await self.sharded_reads.locate_step(job, step, request.tier)
            return pb.LocateStepReply(
                step=record.step,
                world_size=record.world_size,
                commit_json=record.to_bytes(),
                index_json=index,
                ranks=[
                    pb.RankSources(sources=[pb.Source(tier=s.tier, kind=s.kind, path=s.path) for s in by_rank])
                    for by_rank in sources
                ],
                next_line=line_text(next_line),
            )

        return await answer(context, work)

    async def ReadShard(self, request: pb.ReadShardRequest, context: Any) -> AsyncIterator[pb.ReadShardPiece]:
        async def start() -> AsyncIterator[bytes]:
            job, step = validate_job(request.job), validate_step(request.step)
            ranges = [ByteRange(r.offset, r.length) for r in request.ranges]
            return self.sharded_reads.read_shard(job, step, request.rank, ranges)

        blocks = await answer(context, start)
        record = await answer(context, lambda: anext(blocks, None))
        yield pb.ReadShardPiece(meta_json=record)
        while (block := await answer(context, lambda: anext(blocks, None))) is not None:
            view = memoryview(block)
            for at in range(0, len(view), PIECE_BYTES):
                yield pb.ReadShardPiece(data=view[at : at + PIECE_BYTES].tobytes())

    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListReply:
        async def work() -> pb.ListReply:
            job = validate_job(request.job) if request.job else ""
            if request.newest and not job:
                raise InvalidArgument("listing only the newest step (newest) needs a job")
            steps = await self.locator.list_steps(job, request.newest)
            return pb.ListReply(
                steps=[
                    pb.StepInfo(
                        job=s.job,
                        step=s.step,
                        world_size=s.world_size,
                        size_bytes=s.size_bytes,
                        tiers=s.tiers,
                        committed_at=s.committed_at,
                        superseded=s.superseded,
                        pinned=s.pinned,
                    )
                    for s in steps
                ]
            )

        return await answer(context, work)

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        async def work() -> pb.StatusReply:
            return pb.StatusReply(json=json.dumps(await self.report.document()))

        return await answer(context, work)

    async def Collect(self, request: pb.CollectRequest, context: Any) -> pb.CollectReply:
        async def work() -> pb.CollectReply:
            job = validate_job(request.job) if request.job else ""
            if request.all and not job:
                raise InvalidArgument("removing a whole job (all) needs its name")
            if request.all:
                removals = await self.job_removal.remove(job, request.dry_run, request.object)
            else:
                removals = await self.retention.retain("gc", job, request.dry_run)
            return _collect_reply(removals)

        return await answer(context, work)

    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinReply:
        async def work() -> pb.PinReply:
            job, step = validate_job(request.job), validate_step(request.step)
            return pb.PinReply(pinned=await self.retention.pin(job, step, request.pin))

        return await answer(context, work)

    async def RemoveStep(self, request: pb.RemoveStepRequest, context: Any) -> pb.CollectReply:
        async def work() -> pb.CollectReply:
            job, step = validate_job(request.job), validate_step(request.step)
            removals = await self.retention.remove_one(job, step, request.force, request.dry_run, request.object)
            return _collect_reply(removals)

        return await answer(context, work)
