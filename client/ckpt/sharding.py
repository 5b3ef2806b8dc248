"""Name the tensors of a state and cut its DTensors into the chunks this rank writes.

flatten() calls tensor_keys() once per save, then owned_chunks() for each DTensor:
every rank decides alone, from the DTensor's mesh and placements, which of its local
chunks it writes. A chunk held by several ranks (a Replicate placement, HSDP's
replicas, a DTensor on a sub-mesh of a larger one) is written by the one whose
coordinate is 0 on every replicated mesh dimension, so each chunk is written once
per step with no collective. The chunks'
global offsets come from DTensor.__create_chunk_list__ as saved (2-D meshes produce
strided placements that must not be re-derived at load time).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import keyed_leaves
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def dtensor_type() -> type | None:
    """Return the DTensor class if torch.distributed.tensor is loaded, else None: no DTensor exists before it is.

    Asked for every tensor of every save. Never imports it: the import takes about half a second,
    which a process that has no DTensor would spend in its first prepare() or save_async.
    """
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(obj: Any) -> bool:
    """Say whether obj is a DTensor (an nn.Parameter holding one included)."""
    cls = dtensor_type()
    return cls is not None and isinstance(obj, cls)


@dataclass(frozen=True)
class OwnedChunk:
    """A local chunk of a sharded tensor that this rank writes: its data and where it lies in the global tensor."""

    data: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class LocalChunks:
    """Chunks of one global tensor that this rank writes, already chosen by a planner (ckpt.dcp's Writer).

    save_async treats it as a DTensor whose owned chunks these are.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[OwnedChunk, ...]
    placements: tuple[str, ...] = ()  # what the layout records, for a reader of it (replicated_chunks: Replicate)


def is_sharded_value(obj: Any) -> bool:
    """Say whether save_async stores obj as chunks of a global tensor: a DTensor or LocalChunks."""
    return isinstance(obj, LocalChunks) or is_dtensor(obj)


def tensor_keys(state: Any) -> dict[int, str]:
    """Return the key of each tensor reachable through dicts, lists and tuples: its path, joined with dots.

    The keys are those of torch.distributed.checkpoint's flattened state dicts
    ("model.layers.0.weight"); a tensor reached twice keeps its first path.
    """
    keys: dict[int, str] = {}
    for obj, path in keyed_leaves(state, lambda o: isinstance(o, torch.Tensor | LocalChunks)):
        keys.setdefault(id(obj), path)
    return keys


def is_wrapper_tensor(obj: torch.Tensor) -> bool:
    """Say whether obj is a tensor subclass that wraps others, a DTensor aside: its bytes are not its own."""
    return is_traceable_wrapper_subclass(obj) and not is_dtensor(obj)


def check_plain_tensor(obj: torch.Tensor, key: str) -> None:
    """Raise InvalidArgument naming key for a tensor subclass that wraps others (it cannot be copied as bytes)."""
    if is_wrapper_tensor(obj):
        raise InvalidArgument(
            f"cannot checkpoint {key or 'a tensor'}: a {type(obj).__name__} is a wrapper tensor subclass; "
            "save its plain tensors or a DTensor instead"
        )


def describe(dt: Any) -> dict[str, Any]:
    """Return what the layout records of a DTensor besides its chunks: global shape, dtype, placements, mesh."""
    if isinstance(dt, LocalChunks):
        dtype = str(dt.dtype).removeprefix("torch.")
        shape, placements = list(dt.shape), list(dt.placements)
        return {"shape": shape, "dtype": dtype, "placements": placements, "mesh_shape": [], "requires_grad": False}
    return {
        "shape": list(dt.shape),
        "dtype": str(dt.dtype).removeprefix("torch."),
        "placements": [repr(p) for p in dt.placements],
        "mesh_shape": list(dt.device_mesh.shape),
        "requires_grad": bool(dt.requires_grad),
        "parameter": isinstance(dt, torch.nn.Parameter),
    }


def owned_chunks(dt: Any, key: str) -> list[OwnedChunk]:
    """Return the non-empty local chunks of a DTensor that this rank writes (see the module docstring)."""
    if isinstance(dt, LocalChunks):
        return [c for c in dt.chunks if c.data.numel()]
    check_placements(dt, f"cannot checkpoint {key}")
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return []  # this rank is not in the DTensor's mesh: it holds nothing of it
    if any(p.is_replicate() and c != 0 for p, c in zip(dt.placements, coordinate, strict=True)):
        return []  # a replica whose owner is another rank
    if _replica_on_parent_mesh(dt.device_mesh):
        return []
    local = dt.to_local().detach()
    check_plain_tensor(local, key)
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise InvalidArgument(f"cannot checkpoint {key}: its local tensor does not form one chunk of the global one")
    if local.numel() == 0:
        return []
    return [OwnedChunk(local, tuple(int(n) for n in chunks[0].offsets))]


def replicated_chunks(tensor: torch.Tensor, rank: int) -> LocalChunks:
    """Return a plain tensor every rank holds alike (Checkpointer(replicated=)) as the chunks this rank writes.

    The owner rule of a Replicate placement over the whole job, a 1-D mesh of every rank:
    the rank at coordinate 0 writes the tensor, whole; the others write nothing of it.
    """
    data = tensor.detach()
    owned = (OwnedChunk(data, (0,) * data.dim()),) if rank == 0 else ()
    return LocalChunks(tuple(data.shape), data.dtype, owned, ("Replicate()",))


def check_placements(dt: Any, what: str) -> None:
    """Raise InvalidArgument (what: ...) unless each rank's local shard of dt is one box of the global tensor.

    A Partial placement holds partial sums. A strided shard is one box only where it
    comes first on its tensor dimension, as FSDP2 places it over tensor parallelism;
    behind another shard of the same dimension its rows are scattered.
    """
    for i, p in enumerate(dt.placements):
        if p.is_partial():
            raise InvalidArgument(f"{what}: a Partial placement holds partial sums; redistribute to Shard or Replicate")
        if type(p).__name__ == "_StridedShard" and any(q.is_shard(p.dim) for q in dt.placements[:i]):
            raise InvalidArgument(f"{what}: its placements {list(dt.placements)} scatter each rank's rows")


def _replica_on_parent_mesh(mesh: Any) -> bool:
    """Say whether this rank's copy repeats one of a rank at coordinate 0 on the dims of the root mesh its mesh lacks.

    FSDP2 on a 2-D mesh puts the parameters it alone shards on the "dp" sub-mesh: the
    ranks along the other dims hold the same chunks. A sub-mesh whose dims cannot be
    told (a flattened one) counts as no replica: the index keeps one copy of a chunk
    written twice (ckpt_core.step_index).
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    if root is None or root is mesh or not mesh.mesh_dim_names or not root.mesh_dim_names:
        return False
    coordinate = root.get_coordinate()
    if coordinate is None or any(n not in root.mesh_dim_names for n in mesh.mesh_dim_names):
        return False
    own = {root.mesh_dim_names.index(n) for n in mesh.mesh_dim_names}
    return any(c != 0 for i, c in enumerate(coordinate) if i not in own)


def local_box(dt: Any, key: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Return a DTensor's local tensor (to fill in place) and its global offsets."""
    check_placements(dt, f"cannot load {key}")
    local = dt.to_local()
    if dt.device_mesh.get_coordinate() is None or local.numel() == 0:
        return local, (0,) * local.dim()
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise InvalidArgument(f"cannot load {key}: its local tensor does not form one chunk of the global one")
    return local, tuple(int(n) for n in chunks[0].offsets)
