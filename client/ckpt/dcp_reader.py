"""Load ckptd steps with torch.distributed.checkpoint: a StorageReader over a step's index and rank 0's record.

DCP's metadata is made from what ckptd keeps, with no file of DCP's own: rank 0's
saved structure, walked as DCP flattens a state dict, gives every key; a sharded
tensor's chunks come from the step index (ckpt_core.step_index), a plain tensor of rank 0
is one chunk, and any other value is served as torch.save bytes. Reads go through
ckpt.range_read.StepReader, so a rank reads only the byte ranges its tensors overlap,
from a local step directory (no daemon) or from this node's daemon.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import COMMIT_NAME, validate_step
from ckpt_core.step_index import SavedChunk, SavedTensor, StepIndex
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING, flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt.checkpointer import Checkpointer
from ckpt.dcp_writer import checkpoint_step, process_rank
from ckpt.local_read import open_step_dir
from ckpt.range_read import StepReader
from ckpt.reshard import DTensorRef, TensorRef, fill_boxes, load_skeleton, realize, refs_in, torch_dtype


@dataclass(frozen=True)
class _Catalog:
    """What one step holds, by DCP key: the tensors with their saved chunks, and where each other value lies."""

    reader: StepReader
    layout: dict[str, Any]  # rank 0's
    skeleton: Any  # rank 0's saved structure, tensors as references
    tensors: dict[str, SavedTensor]
    value_paths: FLATTEN_MAPPING  # each value's path in the skeleton, as DCP's flattening names it
    metadata: Metadata
    weights_only: bool  # how the skeleton was unpickled, and so how its values are


class Reader(StorageReader):
    """Read a ckptd step for dcp.load: a step directory with no daemon (path), or a job's step through the daemon.

    dcp.load calls, on every rank and on its own thread: reset(checkpoint_id) when one
    was given; read_metadata, which opens the step (checkpoint_id, else step, else the
    latest complete one) and makes DCP's metadata from its index and rank 0's record;
    set_up_storage_reader; the two plan steps, which change nothing; read_data, which
    fills the planner's tensors (each from the byte ranges of the one saved chunk a
    read item names) and hands the values over as torch.save bytes.

    weights_only=True unpickles the step's values that are not tensors as
    Checkpointer.load(weights_only=True) does (torch.load(weights_only=True)'s allow-list).
    What DCP's planner then does with the torch.save bytes of those values is DCP's: its
    default planner reads them with torch.load(weights_only=False), but they hold only what
    this Reader built, so nothing the allow-list refused.
    """

    def __init__(
        self,
        job: str | None = None,
        path: str | os.PathLike[str] | None = None,
        step: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        address: str | None = None,
        weights_only: bool = False,
    ) -> None:
        super().__init__()
        if job is not None and path is not None:
            raise InvalidArgument("give ckpt.dcp.Reader a job or a path to a step directory, not both")
        self._path = None if path is None else Path(path)
        self._step = None if step is None else validate_step(step)
        self._checkpointer: Checkpointer | None = None
        if path is None:
            rank, world_size = process_rank(rank, world_size)
            self._checkpointer = Checkpointer(job=job, rank=rank, world_size=world_size, address=address)
            weakref.finalize(self, self._checkpointer.close)  # as ckpt.dcp.Writer's: at exit at the latest
        self._weights_only = weights_only
        self._catalog: _Catalog | None = None

    def __repr__(self) -> str:
        where = f"path={str(self._path)!r}" if self._checkpointer is None else f"job={self._checkpointer.job!r}"
        return f"ckpt.dcp.Reader({where}, step={self._step})"

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection to the daemon, if this Reader has one."""
        if self._checkpointer is not None:
            self._checkpointer.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Read the step checkpoint_id names next: an integer or a string of digits, or a step directory."""
        self._catalog = None
        if checkpoint_id is None:
            return
        step = checkpoint_step(checkpoint_id)
        if step is not None and self._checkpointer is not None:
            self._step = step
        elif _is_step_dir(checkpoint_id):
            self._path, self._checkpointer = Path(checkpoint_id), None
        else:
            raise InvalidArgument(
                f"checkpoint_id {checkpoint_id!r} names no step: give an integer or a string of digits (with a job), "
                "or a step directory"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Say whether checkpoint_id names a step directory."""
        return _is_step_dir(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """Open the step and return DCP's metadata of it."""
        if self._catalog is None:
            if self._checkpointer is not None:
                reader, index = self._checkpointer.open_step(self._step)
            else:
                assert self._path is not None
                if not self._path.is_dir():
                    raise NotFound(f"{self._path} is not a directory")
                reader, index = open_step_dir(self._path)
            self._catalog = _catalog_of(reader, index, self._weights_only)
        return self._catalog.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Make sure the step is open (read_metadata opened it on this rank)."""
        self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return plan as it is: every rank reads its own ranges."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return plans as they are (coordinator)."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill the plan's tensors from their saved chunks, then hand its values to the planner; all done on return."""
        catalog = self._catalog
        assert catalog is not None, "read_metadata opens the step first"
        fills = []
        targets: list[tuple[ReadItem, torch.Tensor]] = []
        values: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                values.append(item)
                continue
            saved = _saved_chunk(catalog, item)
            target = planner.resolve_tensor(item)
            offsets = tuple(o + n for o, n in zip(saved.chunks[0].offsets, item.storage_offsets, strict=True))
            if tuple(target.shape) != tuple(item.lengths):
                raise InvalidArgument(f"{item.dest_index.fqn}: the planner resolved a region of {list(target.shape)}")
            fills.append((saved, target.detach(), offsets))
            targets.append((item, target))
        fill_boxes(catalog.reader, fills)
        for item, target in targets:
            planner.commit_tensor(item, target)
        if values:
            realized = _values_of(catalog, [item.storage_index.fqn for item in values])
            for item in values:
                data = io.BytesIO()
                torch.save(realized[item.storage_index.fqn], data)
                data.seek(0)
                planner.load_bytes(item, data)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _is_step_dir(checkpoint_id: object) -> bool:
    return isinstance(checkpoint_id, str | os.PathLike) and (Path(checkpoint_id) / COMMIT_NAME).is_file()


def _catalog_of(reader: StepReader, index: StepIndex | None, weights_only: bool) -> _Catalog:
    """Walk rank 0's saved structure as DCP flattens a state dict and describe each key as DCP's metadata does.

    Tensors stand in as meta tensors, so DCP's own flattening decides which lists it
    enters exactly as it does for the state dict being loaded.
    """
    meta = reader.meta(0)
    what = f"{meta.job} step {meta.step}"
    try:
        layout = json.loads(meta.layout_json)
        skeleton = load_skeleton(layout, weights_only, f"rank 0 shard of {what}")
    except (KeyError, TypeError, ValueError, pickle.UnpicklingError) as e:
        raise CorruptCheckpoint(f"rank 0 layout of {what}: {e!r}") from None
    if not isinstance(skeleton, Mapping):
        raise InvalidArgument(f"{what} holds a {type(skeleton).__name__}, and DCP loads only state dicts")
    saved_of: dict[int, SavedTensor] = {}

    def stand_in(obj: Any, key: str) -> Any:
        if isinstance(obj, Mapping):
            return {k: stand_in(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [stand_in(v, f"{key}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, DTensorRef):
            if index is None or obj.key not in index.tensors:
                raise CorruptCheckpoint(f"{what}: the step's index has no {obj.key!r}")
            saved = index.tensors[obj.key]
        elif isinstance(obj, TensorRef) and layout["tensors"][obj.entry]["kind"] == "torch":
            e = layout["tensors"][obj.entry]
            shape = tuple(e["shape"])
            whole = SavedChunk(0, e["offset"], e["nbytes"], (0,) * len(shape), shape)
            saved = SavedTensor(key, shape, e["dtype"], (whole,))
        else:
            return obj  # a value (a numpy array too, as DCP sees one)
        tensor = torch.empty(saved.shape, dtype=torch_dtype(saved.dtype), device="meta")
        saved_of[id(tensor)] = saved
        return tensor

    flat, paths = flatten_state_dict(stand_in(skeleton, ""))
    tensors = {k: saved_of[id(v)] for k, v in flat.items() if isinstance(v, torch.Tensor) and id(v) in saved_of}
    value_paths = {k: paths[k] for k in flat if k not in tensors}
    described: dict[str, Any] = {key: _tensor_metadata(saved) for key, saved in tensors.items()}
    described.update((key, BytesStorageMetadata()) for key in value_paths)
    metadata = Metadata(described, planner_data=paths, storage_meta=StorageMeta(checkpoint_id=str(meta.step)))
    return _Catalog(reader, layout, skeleton, tensors, value_paths, metadata, weights_only)


def _tensor_metadata(saved: SavedTensor) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch_dtype(saved.dtype)),
        size=torch.Size(saved.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.lengths)) for c in saved.chunks],
    )


def _saved_chunk(catalog: _Catalog, item: ReadItem) -> SavedTensor:
    """Return the saved tensor an item reads, narrowed to the one saved chunk it names."""
    key = item.storage_index.fqn
    saved = catalog.tensors.get(key)
    if saved is None:
        raise InvalidArgument(f"{key!r} is not a tensor of {catalog.reader.job} step {catalog.reader.step}")
    offsets = tuple(item.storage_index.offset or ())
    for chunk in saved.chunks:
        if chunk.offsets == offsets:
            return dataclasses.replace(saved, chunks=(chunk,))
    raise InvalidArgument(f"{key!r} of {catalog.reader.job} step {catalog.reader.step} has no chunk at {list(offsets)}")


def _values_of(catalog: _Catalog, keys: list[str]) -> dict[str, Any]:
    """Return the saved values of keys, with the tensors and arrays inside them read from rank 0's data."""
    found = {key: _at(catalog.skeleton, _path_of(catalog, key)) for key in keys}
    needed = set().union(*(refs_in(value) for value in found.values()))
    if not needed:
        return found
    state = realize(catalog.reader, 0, catalog.layout, needed, catalog.weights_only)
    return {key: _at(state, _path_of(catalog, key)) for key in keys}


def _path_of(catalog: _Catalog, key: str) -> tuple[Any, ...]:
    path = catalog.value_paths.get(key)
    if path is None:
        raise InvalidArgument(f"{key!r} is not a value of {catalog.reader.job} step {catalog.reader.step}")
    return tuple(path)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    """Return the value at a DCP path: its mapping keys are str() of the saved keys."""
    for step in path:
        tree = tree[next(k for k in tree if str(k) == step)] if isinstance(tree, Mapping) else tree[step]
    if isinstance(tree, DTensorRef):
        raise InvalidArgument(f"{tree.key!r} is a DTensor inside a value DCP treats as bytes; load it with ckpt")
    return tree
