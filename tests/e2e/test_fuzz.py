"""Ten thousand malformed messages to both gRPC services of a real daemon: refused, quietly, and it still serves."""

from __future__ import annotations

import json
import random
from collections import Counter

import ckpt
import grpc
import pytest
import torch
from conftest import free_port

pytestmark = pytest.mark.e2e

MESSAGES = 10_000
SEED = 11
LOCAL = ("Reserve", "Commit", "WaitShard", "Locate", "LocateStep", "ReadShard", "List", "Status", "Collect")
PEER = ("PutShard", "SealShard", "GetShard", "Inventory", "CommitStep")
STREAMING_RESPONSE = {"ReadShard", "GetShard"}
# What our handlers answer for requests that parse but make no sense, and gRPC's own for what it cannot take.
EXPECTED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION", "OK", "INTERNAL"}


def payloads(rng: random.Random) -> bytes:
    """Return random bytes, a truncated or bit-flipped plausible message, or an empty one."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:  # a field header promising more bytes than follow
        return bytes([0x0A, 0x7F]) + rng.randbytes(rng.randrange(0, 20))
    if kind == 2:  # a varint that never ends
        return bytes([0x10]) + b"\xff" * rng.randrange(1, 16)
    return rng.randbytes(rng.randrange(0, 4))


def call(channel: grpc.Channel, service: str, method: str, data: bytes) -> str:
    path = f"/ckpt.wire.v1.{service}/{method}"
    try:
        if method == "PutShard":
            channel.stream_unary(path)(iter([data]), timeout=10)
        elif method in STREAMING_RESPONSE:
            list(channel.unary_stream(path)(data, timeout=10))
        else:
            channel.unary_unary(path)(data, timeout=10)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


@pytest.mark.timeout(300)
def test_malformed_messages_are_refused_quietly_and_the_daemon_still_serves(make_daemon, short_tmp):
    node = make_daemon("[peer]\ninsecure = true\n", listen=f"127.0.0.1:{free_port()}").start()
    rng = random.Random(SEED)
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(f"unix:{node.address}") as local, grpc.insecure_channel(node.listen) as peer:
        for i in range(MESSAGES):
            if i % 3 == 2:
                method = rng.choice(PEER)
                codes[call(peer, "CkptdPeer", method, payloads(rng))] += 1
            else:
                method = rng.choice(LOCAL)
                codes[call(local, "Ckptd", method, payloads(rng))] += 1
    print("answers to", MESSAGES, "malformed messages:", dict(codes))
    assert sum(codes.values()) == MESSAGES
    assert set(codes) <= EXPECTED, codes  # never UNKNOWN: no exception escaped our code
    assert codes["INVALID_ARGUMENT"] > MESSAGES // 2

    log = node.log()
    assert "Traceback" not in log
    refusals = [line for line in log.splitlines() if "refused a malformed" in line]
    assert 1 <= len(refusals) <= 4, refusals  # a line per caller a minute: the unix socket and one peer connection
    status = json.loads(node.cli("status", "--json", "--address", node.address).stdout)
    assert status["counters"]["malformed_requests"] >= MESSAGES // 2

    with ckpt.Checkpointer(job="after", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(10)}, step=1).wait("nvme", timeout=60)
        assert torch.equal(c.load(1)["w"], torch.arange(10))
    assert node.stop() == 0
