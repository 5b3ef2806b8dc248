"""Describe the on-disk format: names, validation, sealed records and checksums.

No torch here: the daemon imports this module to write and check shards.
See docs/FORMAT.md for the byte-level description.
"""

from __future__ import annotations

import datetime
import json
import json.encoder
import re
import reprlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import xxhash

from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.history import Line, line_from_json, line_to_json

FORMAT_VERSION = 2  # version 2 adds sharded (DTensor) chunks to the layout and the step index
READABLE_VERSIONS = (1, 2)
# A commit record in an object store that says where the step's shard objects lie (docs/FORMAT.md): a reader
# of versions 1-2 refuses it rather than look for them beside it. Only the object tier reads or writes it.
OBJECT_KEYS_VERSION = 3
CHUNK_SIZE_BYTES = 4 << 20
MAX_CHUNK_SIZE_BYTES = 1 << 30
MAX_SHARD_BYTES = 1 << 50
MAX_STEP_BYTES = (1 << 63) - 1  # what an int64 of the wire holds
TENSOR_ALIGN_BYTES = 64
DIRECT_IO_ALIGN_BYTES = 4096
COMMIT_NAME = "COMMIT.json"
INDEX_NAME = "INDEX.json"
PARTIAL_SUFFIX = ".partial"
TIERS = ("memory", "nvme", "peer", "object")

JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_STEP = 2**62 - 1  # the highest step the format holds
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80


def shown(value: object) -> str:
    """Return a repr of value short enough to quote in an error: what a caller sent may be megabytes long."""
    return _SHOWN.repr(value)


def counted(count: int, noun: str) -> str:
    """Return count and noun, the noun plural unless count is 1 ("1 rank", "2 ranks")."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def validate_job(job: object) -> str:
    """Return job if it is a valid job name, else raise InvalidArgument."""
    if not isinstance(job, str) or not JOB_RE.fullmatch(job):
        raise InvalidArgument(
            f"invalid job name {shown(job)}: "
            "use 1 to 128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return job


def validate_step(step: object) -> int:
    """Return step if it is a non-negative integer, else raise InvalidArgument."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"invalid step {shown(step)}: a step is an integer from 0 to 2**62-1")
    return step


def validate_rank(rank: object, world_size: object) -> tuple[int, int]:
    """Return (rank, world_size) if 0 <= rank < world_size, else raise InvalidArgument."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 1 << 20:
        raise InvalidArgument(f"invalid world_size {shown(world_size)}: an integer from 1 to 2**20")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgument(f"invalid rank {shown(rank)}: an integer from 0 to world_size-1 ({world_size - 1})")
    return rank, world_size


def validate_tier(tier: object) -> str:
    """Return tier if it names a tier, else raise InvalidArgument."""
    if tier not in TIERS:
        raise InvalidArgument(f"invalid tier {shown(tier)}: one of {', '.join(TIERS)}")
    return str(tier)


def data_name(rank: int) -> str:
    """Name the file that holds a rank's tensor bytes."""
    return f"rank-{rank:05d}.data"


def meta_name(rank: int) -> str:
    """Name the file that holds a rank's shard metadata."""
    return f"rank-{rank:05d}.meta.json"


def utc_timestamp(unix_s: float) -> str:
    """Return a time as records hold it: UTC, ISO 8601, to the millisecond ("2026-11-26T18:49:16.123Z")."""
    moment = datetime.datetime.fromtimestamp(unix_s, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def round_up(n: int, multiple: int) -> int:
    """Round n up to a multiple of multiple."""
    return -(-n // multiple) * multiple


def keyed_leaves(state: Any, is_leaf: Callable[[Any], bool]) -> Iterator[tuple[Any, str]]:
    """Yield each leaf reachable through dicts, lists and tuples with its key: its path, joined with dots.

    The keys are those of torch.distributed.checkpoint's flattened state dicts
    ("model.layers.0.weight"). A container reached twice is walked once; a leaf reached
    twice is yielded twice (callers keep its first key). No torch: the client names a
    state's tensors with it (sharding.tensor_keys), `ckptd inspect` a saved skeleton's.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(state, "")]
    while stack:
        obj, path = stack.pop()
        if is_leaf(obj):
            yield obj, path
        elif isinstance(obj, dict | list | tuple) and id(obj) not in seen:
            seen.add(id(obj))
            items = list(obj.items() if isinstance(obj, dict) else enumerate(obj))
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(items))


def layout_offset(data_size_bytes: int) -> int:
    """Return where a shard's layout lies in its staging slot: right after the data, at the next 4 KiB."""
    return round_up(data_size_bytes, DIRECT_IO_ALIGN_BYTES)


def digest(data: Any) -> str:
    """Return the xxh3-128 digest of a bytes-like object, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def chunk_ranges(size_bytes: int, chunk_size_bytes: int = CHUNK_SIZE_BYTES) -> Iterator[tuple[int, int]]:
    """Yield (offset, length) of each checksum chunk of a shard of size_bytes."""
    for offset in range(0, size_bytes, chunk_size_bytes):
        yield offset, min(chunk_size_bytes, size_bytes - offset)


def seal(record: dict[str, Any], compact: bool = False) -> bytes:
    """Serialise a record as JSON carrying the xxh3-128 of its own canonical body (sorted keys, no spaces).

    compact writes the body as it is hashed: a record (a shard's, with a layout of
    megabytes) is escaped once, and a reader checks the hash on the bytes as they lie.
    Otherwise the record is indented for people to read.
    """
    if compact:
        pieces = _canonical_pieces(record)
        hasher = xxhash.xxh3_128()
        for piece in pieces:
            hasher.update(piece)
        return b"".join([b'{"record":', *pieces, b',"xxh3_128":"', hasher.hexdigest().encode(), b'"}\n'])
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({"xxh3_128": digest(body), "record": record}, indent=1, sort_keys=True).encode()


LARGE_TEXT_CHARS = 1 << 20  # text values longer than this are escaped a piece at a time


def _canonical_pieces(record: dict[str, Any]) -> list[bytes]:
    """Return the canonical body of record in pieces: a long text value (a layout) is escaped a MiB at a time.

    Escaping 18 MB of layout in one call holds the GIL for tens of ms, and every other
    thread of the process (a daemon's event loop) waits that long; a piece at a time, it
    waits a millisecond. The pieces join into exactly json.dumps(record, canonical).
    """
    long = {k for k, v in record.items() if isinstance(v, str) and len(v) > LARGE_TEXT_CHARS}
    text = json.dumps({k: "" if k in long else v for k, v in record.items()}, sort_keys=True, separators=(",", ":"))
    pieces: list[bytes] = []
    for key in sorted(long):
        marker = json.dumps(key) + ':""'  # a key's own quotes never occur unescaped inside a value
        head, text = text.split(marker, 1)
        pieces.append((head + marker[:-1]).encode())
        value = record[key]
        for at in range(0, len(value), LARGE_TEXT_CHARS):
            pieces.append(json.encoder.encode_basestring_ascii(value[at : at + LARGE_TEXT_CHARS])[1:-1].encode())
        text = '"' + text
    pieces.append(text.encode())
    return pieces


_SEALED_HEAD = b'{"record":'
_SEALED_TAIL_BYTES = len(b',"xxh3_128":"') + 32 + len(b'"}\n')


def unseal(data: bytes, what: str) -> dict[str, Any]:
    """Parse a sealed record, raising CorruptCheckpoint naming what if it does not check."""
    body = data[len(_SEALED_HEAD) : -_SEALED_TAIL_BYTES]
    tail = data[-_SEALED_TAIL_BYTES:]
    if data.startswith(_SEALED_HEAD) and tail.startswith(b',"xxh3_128":"') and tail.endswith(b'"}\n'):
        if digest(body) != tail[13:45].decode("ascii", "replace"):  # the bytes as written by seal()
            raise CorruptCheckpoint(f"{what}: record checksum mismatch")
        try:
            record = json.loads(body)
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python recurses
            raise CorruptCheckpoint(f"{what}: unreadable record ({e})") from None
    else:  # written by an older ckptd (indented): the body is hashed in its canonical form
        try:
            outer = json.loads(data)
            record = outer["record"]
            expected = outer["xxh3_128"]
        except (ValueError, RecursionError, KeyError, TypeError) as e:
            raise CorruptCheckpoint(f"{what}: unreadable record ({e})") from None
        if digest(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()) != expected:
            raise CorruptCheckpoint(f"{what}: record checksum mismatch")
    if not isinstance(record, dict):
        raise CorruptCheckpoint(f"{what}: record is not an object")
    return record


def _history_fields(line: Line, time_name: str, time: str) -> dict[str, Any]:
    """Return a record's line and time fields, where set: a record without them reads as it did before them."""
    fields: dict[str, Any] = {"line": line_to_json(line)} if line else {}
    return fields | ({time_name: time} if time else {})


_SEALED: dict[int, bytes] = {}  # id(ShardMeta) -> its sealed bytes, dropped when the record dies


@dataclass(frozen=True)
class ShardMeta:
    """Describe one rank's shard of one step: its size, checksums and tensor layout."""

    job: str
    step: int
    rank: int
    world_size: int
    data_size_bytes: int
    chunk_size_bytes: int
    chunk_xxh3_128: tuple[str, ...]
    layout_json: str  # the client's tensor table and skeleton, as JSON text; the daemon never parses it
    run_id: str = ""  # which run of the job wrote it: a step is sealed from one run's shards only
    line: Line = ()  # the job's line the step belongs to (ckpt_core.history): every rank's shard names the same
    saved_at: str = ""  # when the daemon took the rank's snapshot (UTC, ISO 8601): a commit is its ranks' latest
    # The signature (ckpt_core.commit_keys) by the daemon that took the snapshot over: a peer without the key
    # cannot make up a shard that a node seals. Compared by neither: the same shard, signed or not.
    key_id: str = field(default="", compare=False)  # which key signed it: 8 hex digits of the key's SHA-256
    hmac_sha256: str = field(default="", compare=False)  # HMAC-SHA256 of signed_body() under that key; "" unsigned

    RECORD_NAME: ClassVar[str] = "shard record"  # how CommitKeys.check names it

    def signed_body(self) -> bytes:
        """Return what the signature is of: the record's fields as canonical JSON, key_id in, the version out."""
        return b"".join(_canonical_pieces(self._fields() | {"format": "ckpt-shard", "key_id": self.key_id}))

    def _fields(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "data_size_bytes": self.data_size_bytes,
            "chunk_size_bytes": self.chunk_size_bytes,
            "chunk_xxh3_128": list(self.chunk_xxh3_128),
            "layout_json": self.layout_json,
            "run_id": self.run_id,
        } | _history_fields(self.line, "saved_at", self.saved_at)

    def to_bytes(self) -> bytes:
        """Serialise as a sealed record, written as it is hashed.

        A record is sealed once and its bytes kept while it lives (sealing megabytes
        of layout holds the GIL for tens of ms); one read from bytes keeps those very
        bytes, which commit records' digests are of (records written by older
        versions are indented, and must not be re-sealed in another form).
        """
        sealed = _SEALED.get(id(self))
        if sealed is None:
            sealed = self._seal()
            self._keep_sealed(sealed)
        return sealed

    def _keep_sealed(self, sealed: bytes) -> None:
        if id(self) not in _SEALED:
            _SEALED[id(self)] = sealed
            weakref.finalize(self, _SEALED.pop, id(self), None)  # runs before the id can be reused

    def _seal(self) -> bytes:
        record = {"format": "ckpt-shard", "version": FORMAT_VERSION} | self._fields()
        if self.hmac_sha256:
            record |= {"key_id": self.key_id, "hmac_sha256": self.hmac_sha256}
        return seal(record, compact=True)

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> ShardMeta:
        """Parse a sealed shard record, raising CorruptCheckpoint if it does not check."""
        r = unseal(data, what)
        try:
            if r["format"] != "ckpt-shard" or r["version"] not in READABLE_VERSIONS:
                raise CorruptCheckpoint(f"{what}: not a shard record of version {READABLE_VERSIONS}")
            meta = cls(
                job=validate_job(r["job"]),
                step=validate_step(r["step"]),
                rank=r["rank"],
                world_size=r["world_size"],
                data_size_bytes=int(r["data_size_bytes"]),
                chunk_size_bytes=int(r["chunk_size_bytes"]),
                chunk_xxh3_128=tuple(r["chunk_xxh3_128"]),
                layout_json=str(r["layout_json"]),
                run_id=str(r.get("run_id", "")),
                line=line_from_json(r.get("line", []), what),
                saved_at=str(r.get("saved_at", "")),
                key_id=r.get("key_id", ""),
                hmac_sha256=r.get("hmac_sha256", ""),
            )
            validate_rank(meta.rank, meta.world_size)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"{what}: malformed shard record ({e})") from None
        if not isinstance(meta.key_id, str) or not isinstance(meta.hmac_sha256, str):
            raise CorruptCheckpoint(f"{what}: the signature fields are not text")
        # Bounded before anything is sized from them: a record may come from the network.
        if not 0 < meta.chunk_size_bytes <= MAX_CHUNK_SIZE_BYTES or not 0 <= meta.data_size_bytes <= MAX_SHARD_BYTES:
            raise CorruptCheckpoint(f"{what}: sizes out of range")
        if len(meta.chunk_xxh3_128) != -(-meta.data_size_bytes // meta.chunk_size_bytes):
            raise CorruptCheckpoint(f"{what}: chunk checksums do not cover the data")
        meta._keep_sealed(bytes(data))  # the bytes as they lie: what a commit record's digest is of
        return meta


@dataclass(frozen=True)
class CommitRecord:
    """Mark a step complete on a tier: every rank's shard is there and checks."""

    job: str
    step: int
    world_size: int
    shard_meta_xxh3_128: tuple[str, ...]  # by rank
    size_bytes: int
    line: Line = ()  # its ranks' line (ckpt_core.history)
    committed_at: str = ""  # its ranks' latest saved_at (UTC, ISO 8601): the same on every node that seals it
    # The signature (ckpt_core.commit_keys): two nodes that seal one step with different keys (a rotation under
    # way) seal the same record, so it takes no part in comparing records.
    key_id: str = field(default="", compare=False)  # which key signed it: 8 hex digits of the key's SHA-256
    hmac_sha256: str = field(default="", compare=False)  # HMAC-SHA256 of signed_body() under that key; "" unsigned

    RECORD_NAME: ClassVar[str] = "commit record"  # how CommitKeys.check names it

    def signed_body(self) -> bytes:
        """Return what the signature is of: the record's fields as canonical JSON, the same on every tier.

        The version and an object store's object_keys are left out (they differ by tier, and a
        shard found elsewhere still has to match the digests signed here); key_id is in.
        """
        body = self._fields() | {"format": "ckpt-commit", "key_id": self.key_id}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def _fields(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "shard_meta_xxh3_128": list(self.shard_meta_xxh3_128),
            "size_bytes": self.size_bytes,
        } | _history_fields(self.line, "committed_at", self.committed_at)

    def to_bytes(self, object_keys: str = "") -> bytes:
        """Serialise as a sealed record; with object_keys, as an object store's record of version 3.

        object_keys names how the store keys the step's shard objects (docs/FORMAT.md). It is
        no field: the same step has the same record on every tier, and only the object tier
        knows where its store keeps the shards.
        """
        record = {"format": "ckpt-commit", "version": FORMAT_VERSION} | self._fields()
        if self.hmac_sha256:
            record |= {"key_id": self.key_id, "hmac_sha256": self.hmac_sha256}
        if object_keys:
            record |= {"version": OBJECT_KEYS_VERSION, "object_keys": object_keys}
        return seal(record)

    @classmethod
    def from_bytes(cls, data: bytes, what: str, commit_keys: CommitKeys = UNSIGNED) -> CommitRecord:
        """Parse a sealed commit record of a step directory, raising CorruptCheckpoint if it does not check.

        With commit_keys that sign, a record without a valid signature by one of them does not check.
        """
        return commit_keys.check(cls._parse(data, what, READABLE_VERSIONS)[0], what)

    @classmethod
    def from_object_bytes(cls, data: bytes, what: str, commit_keys: CommitKeys = UNSIGNED) -> tuple[CommitRecord, str]:
        """Parse a sealed commit record of an object store: (the record, its object_keys; "" for version 1 or 2)."""
        record, r = cls._parse(data, what, (*READABLE_VERSIONS, OBJECT_KEYS_VERSION))
        commit_keys.check(record, what)
        if r["version"] != OBJECT_KEYS_VERSION:
            return record, ""
        keys = r.get("object_keys")
        if not isinstance(keys, str) or not keys:
            raise CorruptCheckpoint(f"{what}: a commit record of version {OBJECT_KEYS_VERSION} names no object_keys")
        return record, keys

    @classmethod
    def _parse(cls, data: bytes, what: str, versions: tuple[int, ...]) -> tuple[CommitRecord, dict[str, Any]]:
        r = unseal(data, what)
        try:
            if r["format"] != "ckpt-commit" or r["version"] not in versions:
                hint = (
                    " (an object store's, read through the object tier)" if r["version"] == OBJECT_KEYS_VERSION else ""
                )
                raise CorruptCheckpoint(f"{what}: not a commit record of version {versions}{hint}")
            rec = cls(
                job=validate_job(r["job"]),
                step=validate_step(r["step"]),
                world_size=validate_rank(0, r["world_size"])[1],
                shard_meta_xxh3_128=tuple(r["shard_meta_xxh3_128"]),
                size_bytes=r["size_bytes"],
                line=line_from_json(r.get("line", []), what),
                committed_at=str(r.get("committed_at", "")),
                key_id=r.get("key_id", ""),
                hmac_sha256=r.get("hmac_sha256", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"{what}: malformed commit record ({e})") from None
        if not isinstance(rec.key_id, str) or not isinstance(rec.hmac_sha256, str):
            raise CorruptCheckpoint(f"{what}: the signature fields are not text")
        # Checked before anything is named or sized from it: a record may come from the network.
        if not isinstance(r["shard_meta_xxh3_128"], list) or not all(
            isinstance(d, str) for d in rec.shard_meta_xxh3_128
        ):
            raise CorruptCheckpoint(f"{what}: the shard digests are not a list of text")
        size = rec.size_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_STEP_BYTES:
            raise CorruptCheckpoint(f"{what}: size_bytes {shown(size)} is not a byte count up to {MAX_STEP_BYTES}")
        if len(rec.shard_meta_xxh3_128) != rec.world_size:
            raise CorruptCheckpoint(f"{what}: commit record does not list every rank")
        return rec, r
