"""Say what a complete step holds, with no daemon and no torch: `ckptd inspect`.

The CLI calls inspect_step() with the tiers it may read (offline.restore.readable_tiers).
It reads the step's commit record and every rank's shard record from the first tier that
holds each, and parses their layouts (docs/FORMAT.md): the tensor table, the sharded
tensors' global shapes, and the pickled skeleton, which it walks with an unpickler that
builds nothing but dicts, lists and tuples (any other class is a named placeholder), to
learn each tensor's key, as torch.distributed.checkpoint names it ("model.layers.0.weight").
"""

from __future__ import annotations

import base64
import builtins
import io
import json
import pickle
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_core.errors import CheckpointError, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, keyed_leaves

from ckptd.tiers.base import Tier

# The classes a skeleton is rebuilt with; any other is a placeholder that runs no code.
_SAFE_CLASSES: dict[tuple[str, str], Any] = {
    ("builtins", name): getattr(builtins, name)
    for name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bool")
}
_SAFE_CLASSES[("collections", "OrderedDict")] = OrderedDict


@dataclass
class TensorRow:
    """One tensor of a step: its key, what it is, and which ranks hold its bytes."""

    key: str
    kind: str  # "tensor", "numpy" or "sharded" (a DTensor: its global shape, its chunks over ranks)
    dtype: str
    shape: list[int]
    size_bytes: int  # the bytes stored: for a sharded tensor, its chunks' on every rank together
    ranks: list[int] = field(default_factory=list)


@dataclass
class StepContents:
    """What inspect_step() found: the step's record, and its tensors by key."""

    job: str
    step: int
    world_size: int
    size_bytes: int
    tier: str
    tensors: list[TensorRow]

    def to_json(self) -> dict[str, Any]:
        """Return the `--json` document."""
        return asdict(self)


def inspect_step(tiers: list[Tier], job: str, step: int) -> StepContents:
    """Return the keys, dtypes, shapes and bytes of a complete step's tensors, and the ranks holding each.

    Raises NotFound where no tier holds the step complete, CheckpointError where a record does not parse.
    """
    holding = [t for t in tiers if step in t.complete_steps(job)]
    if not holding:
        raise NotFound(f"{job} step {step} is not complete on tier(s) {', '.join(t.name for t in tiers)}")
    record: CommitRecord = holding[0].commit_record(job, step)
    rows: dict[str, TensorRow] = {}
    for rank in range(record.world_size):
        meta = _shard_record(holding, job, step, rank)
        for row in _rows_of(meta):
            known = rows.get(row.key)
            if known is None:
                rows[row.key] = row
            elif row.kind == "sharded":  # another rank's chunks of the same DTensor
                known.size_bytes += row.size_bytes
                known.ranks = sorted(set(known.ranks) | set(row.ranks))
            else:
                row.key = f"{row.key} (rank {rank})"  # each rank saved its own plain tensor of that key
                rows[row.key] = row
    return StepContents(job, step, record.world_size, record.size_bytes, holding[0].name, list(rows.values()))


def _shard_record(tiers: list[Tier], job: str, step: int, rank: int) -> ShardMeta:
    errors = []
    for tier in tiers:
        try:
            return tier.read_meta(job, step, rank)
        except (CheckpointError, OSError) as e:
            errors.append(f"{tier.name}: {e}")
    raise CheckpointError(f"rank {rank} shard record of {job} step {step}: " + "; ".join(errors))


def _rows_of(meta: ShardMeta) -> list[TensorRow]:
    """Return the tensors of one rank's shard, from its layout."""
    try:
        layout = json.loads(meta.layout_json)
        entries: list[dict[str, Any]] = layout["tensors"]
        sharded: dict[str, dict[str, Any]] = layout.get("dtensors", {})
        keys = _keys_from_skeleton(base64.b64decode(layout["skeleton_pickle_b64"]))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"rank {meta.rank} shard of {meta.job} step {meta.step}: layout unreadable: {e}") from e
    rows: dict[str, TensorRow] = {}
    for i, entry in enumerate(entries):
        if entry.get("kind") == "chunk":
            key = str(entry["key"])
            described = sharded.get(key, {})
            row = rows.setdefault(
                key,
                TensorRow(key, "sharded", str(described.get("dtype", entry["dtype"])), list(described.get("shape", [])),
                          0, [meta.rank]),
            )  # fmt: skip
            row.size_bytes += int(entry["nbytes"])
            continue
        key = keys.get(i, f"(tensor {i}, not in a dict, list or tuple)")
        kind = "numpy" if entry.get("kind") == "numpy" else "tensor"
        rows[key] = TensorRow(key, kind, str(entry["dtype"]), list(entry["shape"]), int(entry["nbytes"]), [meta.rank])
    return list(rows.values())


class _Tensor:
    def __init__(self, index: int) -> None:
        self.index = index


class _Placeholder:
    """Any class of the skeleton but dicts, lists and tuples: built from nothing, kept out of the walk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _SkeletonReader(pickle.Unpickler):
    """Unpickle a skeleton into dicts, lists, tuples, plain values, _Tensor markers and placeholders."""

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "ckpt":
            return _Tensor(int(pid[1]))
        return None  # a sharded tensor ("ckpt-dtensor", key): its key is in its chunks' entries

    def find_class(self, module: str, name: str) -> Any:
        safe = _SAFE_CLASSES.get((module, name))
        if safe is not None:
            return safe
        return type(f"{module}.{name}", (_Placeholder,), {})


def _keys_from_skeleton(skeleton: bytes) -> dict[int, str]:
    """Return each plain tensor's key by its index in the tensor table, walking dicts, lists and tuples."""
    state = _SkeletonReader(io.BytesIO(skeleton)).load()
    keys: dict[int, str] = {}
    for marker, path in keyed_leaves(state, lambda o: isinstance(o, _Tensor)):
        keys.setdefault(marker.index, path)  # the key the client named it by (sharding.tensor_keys)
    return keys
