"""The step index: every saved chunk of every sharded (DTensor) tensor of a step, merged from the ranks' tables.

Each rank's shard record carries its own chunk table in its layout (the chunks it
wrote, with their global offsets and lengths, and the sharded keys it holds). The
daemon merges the tables with StepIndex.build when it commits a step on a tier that
holds every rank's record (NVMe on one node, the object store) and writes the result
as INDEX.json before COMMIT.json; a reader that finds no index (a step sealed across
nodes, a replica) builds the same one from the records. A load plans its reads from
the index alone: which byte ranges of which rank's data hold the parts of each key
it needs, with no collective and no other rank's layout. No torch here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_core.errors import CorruptCheckpoint
from ckpt_core.format import READABLE_VERSIONS, CommitRecord, ShardMeta, digest, seal, unseal

INDEX_FORMAT = "ckpt-index"
# How the layout's "dtensors" key appears in a sealed shard record (inside the layout's JSON text):
# a reader tells a sharded shard from its raw bytes, with no parse of a layout of megabytes.
SHARDED_RECORD_MARK = b'\\"dtensors\\"'


@dataclass(frozen=True)
class SavedChunk:
    """One box of a sharded tensor as written: by which rank, where in its data, at which global offsets."""

    rank: int
    offset: int  # byte offset in the rank's data
    nbytes: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class SavedTensor:
    """A sharded tensor of a step: its global shape and dtype, and the chunks that together cover it once."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # torch's name, e.g. "float32"
    chunks: tuple[SavedChunk, ...]


def layout_chunk_table(layout: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Return (sharded keys with their global shape and dtype, chunk entries) of one rank's layout."""
    dtensors = layout.get("dtensors") or {}
    chunks = [e for e in layout.get("tensors", []) if e.get("kind") == "chunk"]
    return dtensors, chunks


@dataclass(frozen=True)
class StepIndex:
    """The merged chunk tables of a step's ranks, bound to the step's commit record by its shard digests."""

    job: str
    step: int
    world_size: int
    shard_meta_xxh3_128: tuple[str, ...]
    tensors: dict[str, SavedTensor]

    @classmethod
    def build(cls, record: CommitRecord, metas: list[ShardMeta]) -> StepIndex:
        """Merge the chunk tables of every rank's record (by rank) into the step's index.

        Raises CorruptCheckpoint naming the key when the ranks disagree on a tensor's
        shape or dtype, or when its chunks do not cover it exactly once.
        """
        if [m.rank for m in metas] != list(range(record.world_size)):
            raise CorruptCheckpoint(f"{record.job} step {record.step}: the index needs every rank's record")
        shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        chunks: dict[str, list[SavedChunk]] = {}
        boxes: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
        for meta in metas:
            if digest(meta.to_bytes()) != record.shard_meta_xxh3_128[meta.rank]:
                what = f"rank {meta.rank} record of {meta.job} step {meta.step}"
                raise CorruptCheckpoint(f"{what}: not the committed one")
            try:
                dtensors, entries = layout_chunk_table(json.loads(meta.layout_json))
                for key, info in dtensors.items():
                    seen = (tuple(int(n) for n in info["shape"]), str(info["dtype"]))
                    if shapes.setdefault(key, seen) != seen:
                        raise CorruptCheckpoint(
                            f"{meta.job} step {meta.step}: rank {meta.rank} saved {key!r} as {seen}, "
                            f"another rank as {shapes[key]}"
                        )
                    chunks.setdefault(key, [])
                for e in entries:
                    box = (e["key"], tuple(e["offsets"]), tuple(e["shape"]))
                    if box in boxes:
                        continue  # a replica written twice (its owner could not be told): one copy is enough
                    boxes.add(box)
                    chunks[e["key"]].append(
                        SavedChunk(
                            meta.rank,
                            int(e["offset"]),
                            int(e["nbytes"]),
                            tuple(int(n) for n in e["offsets"]),
                            tuple(int(n) for n in e["shape"]),
                        )
                    )
            except (KeyError, TypeError, ValueError) as err:
                raise CorruptCheckpoint(f"rank {meta.rank} layout of {meta.job} step {meta.step}: {err!r}") from None
        tensors = {k: SavedTensor(k, shapes[k][0], shapes[k][1], tuple(chunks[k])) for k in sorted(shapes)}
        index = cls(record.job, record.step, record.world_size, record.shard_meta_xxh3_128, tensors)
        index.check_coverage()
        return index

    def check_coverage(self) -> None:
        """Raise CorruptCheckpoint unless each tensor's chunks lie inside it and add up to it, once."""
        for t in self.tensors.values():
            covered = 0
            for c in t.chunks:
                if len(c.offsets) != len(t.shape) or len(c.lengths) != len(t.shape):
                    raise CorruptCheckpoint(f"{self._what()}: a chunk of {t.key!r} has the wrong number of dimensions")
                if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.lengths, t.shape, strict=True)):
                    raise CorruptCheckpoint(f"{self._what()}: a chunk of {t.key!r} lies outside its shape {t.shape}")
                covered += math.prod(c.lengths)
            if covered != math.prod(t.shape):
                raise CorruptCheckpoint(
                    f"{self._what()}: the chunks of {t.key!r} hold {covered} elements of {math.prod(t.shape)}"
                )
            overlap = _overlapping(t.chunks)
            if overlap is not None:
                a, b = overlap
                raise CorruptCheckpoint(
                    f"{self._what()}: chunks of {t.key!r} at {list(a.offsets)} and {list(b.offsets)} overlap"
                )

    def _what(self) -> str:
        return f"index of {self.job} step {self.step}"

    def check(self, record: CommitRecord, what: str) -> None:
        """Raise CorruptCheckpoint unless this index was built from exactly the records the commit lists."""
        if (self.job, self.step, self.shard_meta_xxh3_128) != (record.job, record.step, record.shard_meta_xxh3_128):
            raise CorruptCheckpoint(f"{what}: does not match the step's commit record")

    def to_bytes(self) -> bytes:
        """Serialise as a sealed record (compact: an index grows with the number of chunks)."""
        tensors = {
            t.key: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "chunks": [[c.rank, c.offset, c.nbytes, list(c.offsets), list(c.lengths)] for c in t.chunks],
            }
            for t in self.tensors.values()
        }
        return seal(
            {
                "format": INDEX_FORMAT,
                "version": 2,
                "job": self.job,
                "step": self.step,
                "world_size": self.world_size,
                "shard_meta_xxh3_128": list(self.shard_meta_xxh3_128),
                "tensors_json": json.dumps(tensors, separators=(",", ":")),
            },
            compact=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> StepIndex:
        """Parse a sealed index, raising CorruptCheckpoint if it does not check."""
        r = unseal(data, what)
        try:
            if r["format"] != INDEX_FORMAT or r["version"] not in READABLE_VERSIONS:
                raise CorruptCheckpoint(f"{what}: not a step index")
            tensors = {
                key: SavedTensor(
                    key,
                    tuple(int(n) for n in t["shape"]),
                    str(t["dtype"]),
                    tuple(
                        SavedChunk(int(rank), int(offset), int(nbytes), tuple(offsets), tuple(lengths))
                        for rank, offset, nbytes, offsets, lengths in t["chunks"]
                    ),
                )
                for key, t in json.loads(r["tensors_json"]).items()
            }
            index = cls(str(r["job"]), int(r["step"]), int(r["world_size"]), tuple(r["shard_meta_xxh3_128"]), tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"{what}: malformed index ({e!r})") from None
        if any(not 0 <= c.rank < index.world_size for t in tensors.values() for c in t.chunks):
            raise CorruptCheckpoint(f"{what}: a chunk names a rank outside the step")
        index.check_coverage()
        return index


def is_sharded(meta: ShardMeta) -> bool:
    """Say whether a rank's shard holds sharded (DTensor) tensors, without parsing its whole layout."""
    return '"dtensors"' in meta.layout_json


def _overlapping(chunks: tuple[SavedChunk, ...]) -> tuple[SavedChunk, SavedChunk] | None:
    """Return two non-empty chunks whose boxes intersect, or None: a sweep along the first dimension."""
    boxes = sorted((c for c in chunks if math.prod(c.lengths)), key=lambda c: c.offsets[:1])
    active: list[SavedChunk] = []
    for c in boxes:
        if not c.offsets:  # 0-d: two chunks of one would be the same element
            if active:
                return active[0], c
            active.append(c)
            continue
        active = [a for a in active if a.offsets[0] + a.lengths[0] > c.offsets[0]]
        for a in active:
            if all(
                ao < co + cn and co < ao + an
                for ao, an, co, cn in zip(a.offsets, a.lengths, c.offsets, c.lengths, strict=True)
            ):
                return a, c
        active.append(c)
    return None


def index_bytes(record: CommitRecord, read_meta: Callable[[int], ShardMeta]) -> bytes | None:
    """Return the sealed index of a step whose rank records read_meta gives, or None if none of them is sharded."""
    metas = [read_meta(rank) for rank in range(record.world_size)]
    if not any(is_sharded(m) for m in metas):
        return None
    return StepIndex.build(record, metas).to_bytes()
