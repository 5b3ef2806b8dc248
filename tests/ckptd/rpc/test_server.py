"""The servicers' errors reach the caller as status codes with details that fit a status."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from ckpt_core.errors import InvalidArgument

from ckptd.errors import StepAlreadyComplete
from ckptd.rpc.server import answer
from ckptd.rpc.statuses import MAX_DETAILS_BYTES


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def answered(error: Exception) -> tuple[grpc.StatusCode, str]:
    async def work() -> None:
        raise error

    with pytest.raises(Aborted) as aborted:
        asyncio.run(answer(Context(), work))  # type: ignore[arg-type]
    return aborted.value.args


def test_an_error_quoting_megabytes_a_caller_sent_still_fits_a_status():
    # gRPC refuses a status over 16 KiB: the caller saw RESOURCE_EXHAUSTED instead of why.
    code, details = answered(InvalidArgument("a layout of " + "é" * (3 << 20)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("a layout of é") and len(details.encode()) < MAX_DETAILS_BYTES + 100
    assert answered(InvalidArgument("short"))[1] == "short"


def test_a_shard_for_a_step_complete_with_other_shards_is_refused_not_an_internal_error():
    code, _ = answered(StepAlreadyComplete("j step 1: the step is already complete"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
