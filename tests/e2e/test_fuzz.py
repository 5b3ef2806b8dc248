"""Malformed and hostile messages to both gRPC services of a real daemon: refused, quietly, and it still serves.

Malformed: bytes that are no message at all. Hostile: well-formed requests of every method of both services,
built from the request types' descriptors field by field, each value chosen to hurt: names that climb out of
the root, absolute paths, negative and huge numbers, slots and reservations handed out to other callers,
megabytes of bytes, thousands of repeated entries, sealed records that lie.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import ckpt
import grpc
import pytest
import torch
from ckpt_core.format import JOB_RE, ShardMeta, digest, seal
from ckpt_core.wire.v1 import ckptd_pb2, peer_pb2
from conftest import OUR_SHARED_MEMORY_PREFIXES, SHARED_MEMORY, free_port
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message

pytestmark = pytest.mark.e2e

MALFORMED = 10_000
HOSTILE = 5_000
SEED = 11
SERVICES = (ckptd_pb2.DESCRIPTOR.services_by_name["Ckptd"], peer_pb2.DESCRIPTOR.services_by_name["CkptdPeer"])
LOCAL, PEER = (list(s.methods) for s in SERVICES)
CALL_TIMEOUT_S = 10.0
WAIT_TIMEOUT_S = 1.0  # the deadline of a WaitShard call: one that asks to wait longer may run out of it
# What our handlers answer for requests that parse but make no sense, and gRPC's own for what it cannot take.
EXPECTED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION", "OK", "INTERNAL"}
# For well-formed requests: no INTERNAL (that is gRPC failing to decode, or our code failing), never UNKNOWN
# (an exception escaped our code). DATA_LOSS: bytes that do not match their record (a replica range, a refetch
# with no other copy); ALREADY_EXISTS: a replica held already (as peer.proto says).
EXPECTED_HOSTILE = EXPECTED - {"INTERNAL"} | {"PERMISSION_DENIED", "DATA_LOSS", "ALREADY_EXISTS"}
HOSTILE_LOG_LINES = 20  # what the daemon may say about 5,000 hostile requests, all together
JOBS = ("fuzz-a", "fuzz-b")
STAGING_BUDGET_BYTES = 64 << 20
LEARNED = 16  # values the daemon handed out or took, kept by field name to send back in other requests
MANY = 5_000  # entries of a huge repeated field


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


def call(
    channel: grpc.Channel, method: MethodDescriptor, data: bytes | list[bytes], timeout_s: float = CALL_TIMEOUT_S
) -> tuple[str, str, list[bytes]]:
    """Send one request (a list: the pieces of a client stream); return the status code, its details, the replies."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    replies: list[bytes] = []
    try:
        if method.client_streaming:
            replies.append(
                channel.stream_unary(path)(iter(data if isinstance(data, list) else [data]), timeout=timeout_s)
            )
        elif method.server_streaming:
            replies.extend(channel.unary_stream(path)(data, timeout=timeout_s))
        else:
            replies.append(channel.unary_unary(path)(data, timeout=timeout_s))
    except grpc.RpcError as e:
        return e.code().name, e.details() or "", replies
    return "OK", "", replies


def sealed_body(body: bytes) -> bytes:
    """Seal a record body as it lies, however deep or odd."""
    return b'{"record":' + body + b',"xxh3_128":"' + digest(body).encode() + b'"}\n'


def sealed_records(escape: Path) -> tuple[dict[str, tuple[bytes, ...]], list[bytes]]:
    """Return (plausible bytes by field name, hostile bytes): sealed shard and commit records that check, and lie."""
    zeros = b"\0" * 4096
    good = ShardMeta("fuzz-a", 1, 0, 1, 4096, 4096, (digest(zeros),), "{}")
    shard = {"format": "ckpt-shard", "version": 2, "job": "fuzz-a", "step": 1, "rank": 0, "world_size": 1,
             "data_size_bytes": 4096, "chunk_size_bytes": 4096, "chunk_xxh3_128": [digest(zeros)],
             "layout_json": "{}", "run_id": ""}  # fmt: skip
    commit = {"format": "ckpt-commit", "version": 2, "job": "fuzz-a", "step": 1, "world_size": 1,
              "shard_meta_xxh3_128": [digest(good.to_bytes())], "size_bytes": 4096}  # fmt: skip
    shard_lies = [
        {"job": "../x"}, {"job": f"../../{escape.name}"}, {"job": str(escape)}, {"job": ""}, {"job": "."},
        {"step": -1}, {"step": 2**63 - 1}, {"step": "1"}, {"rank": 5}, {"rank": -1}, {"rank": True},
        {"world_size": 0}, {"world_size": 2**31}, {"data_size_bytes": -1}, {"data_size_bytes": 2**62},
        {"data_size_bytes": "4096"}, {"data_size_bytes": 4096.5}, {"chunk_size_bytes": 0},
        {"chunk_size_bytes": 4095}, {"chunk_size_bytes": 2**40}, {"chunk_xxh3_128": "x" * 32},
        {"chunk_xxh3_128": [1]}, {"chunk_xxh3_128": []}, {"layout_json": "x" * (3 << 20)}, {"version": 99},
        {"run_id": "r" * 10_000}, {"data_size_bytes": 8192, "chunk_xxh3_128": [digest(zeros)] * 2},
    ]  # fmt: skip
    commit_lies = [
        {"world_size": 0, "shard_meta_xxh3_128": []}, {"world_size": -1}, {"world_size": "1"},
        {"world_size": 1.5}, {"world_size": 3, "shard_meta_xxh3_128": "abc"}, {"shard_meta_xxh3_128": [7]},
        {"size_bytes": -1}, {"size_bytes": 2**64}, {"job": "../x"}, {"step": -1}, {"step": 2**62},
        {"world_size": 2**16, "shard_meta_xxh3_128": ["0" * 32] * 2**16}, {"job": "fuzz-b", "step": 0},
    ]  # fmt: skip
    # Records that check, of layouts that do not: the daemon parses a layout only to index a sharded step.
    deep = "[" * 100_000 + "]" * 100_000
    layouts = [
        '["dtensors"]',
        '{"dtensors": []}',
        '{"dtensors": {"w": 1}}',
        f'{{"dtensors": {deep}}}',
        '{"dtensors": {"w": {"shape": [-1], "dtype": "x"}}, "tensors": [{"kind": "chunk", "key": "v"}]}',
    ]
    hostile = [seal({**shard, **lie}, compact=True) for lie in shard_lies]
    hostile += [seal({**commit, **lie}) for lie in commit_lies]
    for layout in layouts:
        lying = ShardMeta("fuzz-b", 2, 0, 1, 4096, 4096, (digest(zeros),), layout).to_bytes()
        hostile += [lying, seal({**commit, "job": "fuzz-b", "step": 2, "shard_meta_xxh3_128": [digest(lying)]})]
    hostile += [sealed_body(f'{{"a":{deep}}}'.encode()), b"[" * 100_000, b'{"record":' + b"[" * 100_000]
    plausible = {"meta_json": (good.to_bytes(),), "commit_json": (seal(commit),), "layout_json": (b"{}",),
                 "data": (zeros,)}  # fmt: skip
    return plausible, hostile


def _kind(field: FieldDescriptor) -> int | str:
    """Name a field's kind of value: its C++ type, or "bytes" (a string field's values would not do)."""
    return "bytes" if field.type == FieldDescriptor.TYPE_BYTES else field.cpp_type


# Plausible values by field name, so that a request gets past its first check to the code behind it.
PLAUSIBLE_BY_NAME: dict[str, tuple] = {
    "job": JOBS, "tier": ("nvme", "memory", "peer", "object", "auto", ""), "transfer": ("0123456789abcdef",),
    "run_id": ("run-1",), "step": (0, 1, 2, -1), "rank": (0, 1), "world_size": (1, 2), "offset": (0,),
    "length": (4096,), "size_bytes": (4096,), "data_size_bytes": (4096,), "timeout_s": (0.0, 0.05),
}  # fmt: skip
PLAUSIBLE_BY_KIND: dict[int | str, tuple] = {
    FieldDescriptor.CPPTYPE_STRING: JOBS, "bytes": (b"",), FieldDescriptor.CPPTYPE_BOOL: (False, True),
    FieldDescriptor.CPPTYPE_INT64: (0, 1), FieldDescriptor.CPPTYPE_INT32: (0, 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 1), FieldDescriptor.CPPTYPE_UINT32: (0, 1),
    FieldDescriptor.CPPTYPE_DOUBLE: (0.0,), FieldDescriptor.CPPTYPE_FLOAT: (0.0,),
}  # fmt: skip
HOSTILE_NUMBERS: dict[int | str, tuple] = {
    FieldDescriptor.CPPTYPE_INT64: (-1, -(2**63), 2**63 - 1, 2**31, 2**62, 2**62 - 1, 1 << 50, 4095),
    FieldDescriptor.CPPTYPE_INT32: (-1, -(2**31), 2**31 - 1, 1 << 20, (1 << 20) + 1),
    FieldDescriptor.CPPTYPE_UINT64: (2**63, 2**64 - 1), FieldDescriptor.CPPTYPE_UINT32: (2**31, 2**32 - 1),
    FieldDescriptor.CPPTYPE_DOUBLE: (math.nan, math.inf, -math.inf, -1.0, -0.0, 1e308, 5e-324),
    FieldDescriptor.CPPTYPE_FLOAT: (math.nan, math.inf, -1.0, 3e38), FieldDescriptor.CPPTYPE_BOOL: (False, True),
}  # fmt: skip


class HostileRequests:
    """Build well-formed requests of any message type from its descriptor, every field plausible or hostile.

    A field gets, by chance: a value the daemon handed out or took before under that field name (a slot
    path, a reservation, a shard id: often another caller's), a plausible value for its name, or a hostile
    value of its type. Repeated fields get 0 to MANY entries.
    """

    def __init__(self, rng: random.Random, escape: Path, staging: Path) -> None:
        self.rng = rng
        plausible_bytes, hostile_bytes = sealed_records(escape)
        self.plausible = {**PLAUSIBLE_BY_NAME, **plausible_bytes}
        self.hostile: dict[int | str, tuple] = {
            **HOSTILE_NUMBERS,
            FieldDescriptor.CPPTYPE_STRING: (
                "", ".", "..", "../x", "../../etc", f"../../{escape.name}", f"../{escape.name}", "/etc/passwd",
                str(escape), str(escape / "x"), str(SHARED_MEMORY / escape.name), str(staging / ".." / escape.name),
                "a" * 10_000, "a" * 129, "fuzz-a\x00b", "fuzz-a\n2026 INFO forged log line", "fuzz-a/../../x",
                "ünïcødé-日本語", "\u202e", "-rf", "*", "~", "%s%n", " fuzz-a", "CON", "0" * 65,
            ),
            "bytes": (b"", b"\xff\xfe", b"\0" * 4095, b"\0" * 8192, *hostile_bytes),
        }  # fmt: skip
        self.learned: dict[tuple[str, int | str], list] = {}  # by field name and kind, the last LEARNED

    def request(self, descriptor: Descriptor) -> Message:
        """Return a message of the type, every field unset, learned, plausible or hostile."""
        message = message_factory.GetMessageClass(descriptor)()
        self._fill(message, small=False)
        return message

    def _fill(self, message: Message, small: bool) -> None:
        for field in message.DESCRIPTOR.fields:
            if self.rng.random() < 0.1:
                continue  # left unset: its default
            learned = self._learned(field)
            if field.is_repeated:
                count = self.rng.choice((0, 1, 2, 3, MANY))
                entries = getattr(message, field.name)
                if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                    for _ in range(count):
                        self._fill(entries.add(), small=True)
                else:
                    entries.extend(self._value(field, small or count > 3) for _ in range(count))
            elif field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                if learned and self.rng.random() < 0.5:
                    getattr(message, field.name).CopyFrom(self.rng.choice(learned))
                else:
                    self._fill(getattr(message, field.name), small)
            else:
                setattr(message, field.name, self._value(field, small))

    def _value(self, field: FieldDescriptor, small: bool) -> object:
        rng, kind = self.rng, _kind(field)
        if kind == FieldDescriptor.CPPTYPE_ENUM:
            return rng.choice([v.number for v in field.enum_type.values] + [-1, 2**31 - 1])
        learned = self._learned(field)
        roll = rng.random()
        if learned and roll < 0.25:
            return rng.choice(learned)
        if roll < 0.55:
            return rng.choice(self.plausible.get(field.name) or PLAUSIBLE_BY_KIND[kind])
        if kind in ("bytes", FieldDescriptor.CPPTYPE_STRING) and not small and rng.random() < 0.03:
            return b"\x01" * (5 << 20) if kind == "bytes" else "x" * (3 << 20)  # megabytes of it
        value = rng.choice(self.hostile[kind])
        return value[:64] if small and isinstance(value, (str, bytes)) else value

    def _learned(self, field: FieldDescriptor) -> list:
        """Return what was learned under the field's name or one ending in it (spare_slot_path for slot_path)."""
        kind, suffix = _kind(field), "_" + field.name
        return [
            v
            for (name, k), kept in self.learned.items()
            if k == kind and (name == field.name or name.endswith(suffix))
            for v in kept
        ]

    def learn(self, message: Message) -> None:
        """Keep the values of a reply, or of a request that was answered OK, to send back (by field name)."""
        for field, value in message.ListFields():
            for v in value if field.is_repeated else [value]:
                if isinstance(v, Message):
                    self.learn(v)
                    v = copy.deepcopy(v)
                kept = self.learned.setdefault((field.name, _kind(field)), [])
                kept[:] = [*kept[-LEARNED + 1 :], v]

    def send(self, channels: dict[str, grpc.Channel]) -> tuple[str, str, str]:
        """Send one hostile request to a method of either service; return (method, status code, its details)."""
        service = self.rng.choice(SERVICES)
        method = self.rng.choice(service.methods)
        request = self.request(method.input_type)
        data: bytes | list[bytes] = request.SerializeToString()
        if method.client_streaming:
            more = [self.request(method.input_type).SerializeToString() for _ in range(self.rng.randrange(3))]
            data = [data, *more][: self.rng.choice((0, 1, 3))]
        waits = method.name == "WaitShard" and not request.timeout_s < WAIT_TIMEOUT_S
        timeout_s = WAIT_TIMEOUT_S if waits else CALL_TIMEOUT_S
        code, details, replies = call(channels[service.name], method, data, timeout_s)
        reply_type = message_factory.GetMessageClass(method.output_type)
        for raw in replies:
            self.learn(reply_type.FromString(raw))
        if code == "OK":
            self.learn(request)
        if waits and code == "DEADLINE_EXCEEDED":
            code = "OK"  # it asked to wait longer than its own deadline, and the daemon waited
        if code not in EXPECTED_HOSTILE:
            details = f"{details[:300]} <- {str(request)[:300]}"
        return method.name, code, details


def files_under(directory: Path) -> Iterator[Path]:
    """Yield every file and directory under directory, without following links."""
    for parent, dirs, files in os.walk(directory):
        yield from (Path(parent) / name for name in dirs + files)


@pytest.mark.timeout(300)
def test_malformed_messages_are_refused_quietly_and_the_daemon_still_serves(make_daemon, short_tmp):
    node = make_daemon("[peer]\ninsecure = true\n", listen=f"127.0.0.1:{free_port()}").start()
    rng = random.Random(SEED)
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(f"unix:{node.address}") as local, grpc.insecure_channel(node.listen) as peer:
        for i in range(MALFORMED):
            if i % 3 == 2:
                codes[call(peer, rng.choice(PEER), payloads(rng))[0]] += 1
            else:
                codes[call(local, rng.choice(LOCAL), payloads(rng))[0]] += 1
    print("answers to", MALFORMED, "malformed messages:", dict(codes))
    assert sum(codes.values()) == MALFORMED
    assert set(codes) <= EXPECTED, codes  # never UNKNOWN: no exception escaped our code
    assert codes["INVALID_ARGUMENT"] > MALFORMED // 2

    log = node.log()
    assert "Traceback" not in log
    refusals = [line for line in log.splitlines() if "refused a malformed" in line]
    assert 1 <= len(refusals) <= 4, refusals  # a line per caller a minute: the unix socket and one peer connection
    status = json.loads(node.cli("status", "--json", "--address", node.address).stdout)
    assert status["counters"]["malformed_requests"] >= MALFORMED // 2
    save_and_load(node.address)
    assert node.stop() == 0


@pytest.mark.timeout(300)
def test_hostile_requests_get_clear_errors_write_nothing_outside_the_root_and_the_daemon_still_serves(
    make_daemon, short_tmp
):
    escape = short_tmp / f"escape-{uuid.uuid4().hex}"  # hostile paths name it; nobody may create it
    shared_memory_before = set(os.listdir(SHARED_MEMORY))
    node = make_daemon("[peer]\ninsecure = true\n", listen=f"127.0.0.1:{free_port()}")
    node.env["CKPTD_STAGING__BUDGET_BYTES"] = str(STAGING_BUDGET_BYTES)  # a hostile Reserve of 2 GiB is refused
    node.start()
    log_before = len(node.log().splitlines())
    hostile = HostileRequests(random.Random(SEED), escape, node.staging_dir)
    codes: Counter[tuple[str, str]] = Counter()
    odd: dict[str, str] = {}  # an example request for each unexpected code
    with grpc.insecure_channel(f"unix:{node.address}") as local, grpc.insecure_channel(node.listen) as peer:
        channels = {"Ckptd": local, "CkptdPeer": peer}
        for _ in range(HOSTILE):
            method, code, what = hostile.send(channels)
            codes[(method, code)] += 1
            if code not in EXPECTED_HOSTILE:
                odd.setdefault(f"{method} {code}", what)
    by_method: dict[str, dict[str, int]] = {}
    for (method, code), n in sorted(codes.items()):
        by_method.setdefault(method, {})[code] = n
    print("answers to", HOSTILE, "hostile well-formed messages, by method:")
    for method, counts in by_method.items():
        print(f"  {method}: {counts}")
    assert sum(codes.values()) == HOSTILE
    assert set(by_method) == {m.name for m in LOCAL + PEER}  # every RPC of both services
    assert not odd, odd  # no UNKNOWN (an exception escaped), no INTERNAL, no hang
    assert sum(n for (_, code), n in codes.items() if code == "OK") > 0  # some got through to real work

    log = node.log()
    assert "Traceback" not in log
    said = log.splitlines()[log_before:]
    print(f"the daemon logged {len(said)} lines meanwhile")
    assert len(said) < HOSTILE_LOG_LINES, "\n".join(said[:50])

    assert not escape.exists() and not (SHARED_MEMORY / escape.name).exists()
    assert {p.name for p in node.base.iterdir()} <= {"nvme", "d.sock", "ckptd.toml", "ckptd.log", "notify.sock"}
    assert {p.name for p in short_tmp.iterdir()} == {node.base.name}
    for directory in (node.root, node.staging_dir):
        for path in files_under(directory):
            assert not path.is_symlink() and path.resolve().is_relative_to(directory), path
        assert all(JOB_RE.fullmatch(p.name) or p.name.startswith(".") for p in directory.iterdir()), directory
    new_in_shared_memory = set(os.listdir(SHARED_MEMORY)) - shared_memory_before - {node.staging_dir.name}
    # Other sessions' daemons and tests come and go there under our prefixes; nothing else may appear.
    assert all(name.startswith(OUR_SHARED_MEMORY_PREFIXES) for name in new_in_shared_memory), new_in_shared_memory

    save_and_load(node.address)
    assert node.stop() == 0


def save_and_load(address: str) -> None:
    with ckpt.Checkpointer(job="after", rank=0, world_size=1, address=address) as c:
        c.save_async({"w": torch.arange(10)}, step=1).wait("nvme", timeout=60)
        assert torch.equal(c.load(1)["w"], torch.arange(10))
