"""Split a state into a table of tensors plus a pickled skeleton, and put it back together.

The skeleton is the state pickled with every tensor and numpy array replaced by
a reference into the table, so any nesting of dicts, lists, tuples and picklable
objects round-trips exactly, and a tensor that appears twice comes back as one.
A DTensor is replaced by its key (ckpt.sharding): the layout records its global
shape and placements, and the table holds the chunks of it that this rank writes.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import TENSOR_ALIGN_BYTES, keyed_leaves, round_up

from ckpt.key_filter import KeyFilter
from ckpt.sharding import (
    check_plain_tensor,
    describe,
    is_sharded_value,
    is_wrapper_tensor,
    owned_chunks,
    replicated_chunks,
    tensor_keys,
)
from ckpt.skeleton_unpickler import SkeletonUnpickler
from ckpt.stateful import expand_stateful

PICKLE_PROTOCOL = 5
# Exact types that are never an array or a sharded value: flatten's pickler lets them through at once.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, dict, list, tuple, OrderedDict})


@dataclass(frozen=True)
class Flattened:
    """A state ready for staging: its arrays, where each goes, and the skeleton."""

    arrays: list[torch.Tensor | np.ndarray]
    entries: list[dict[str, Any]]  # one per array: kind, dtype, shape, offset, nbytes (a chunk: key, offsets)
    skeleton: bytes
    data_size_bytes: int
    dtensors: dict[str, dict[str, Any]]  # by key: global shape, dtype, placements, mesh shape

    def layout(self) -> dict[str, Any]:
        """Return the JSON-able layout stored in the shard metadata."""
        layout: dict[str, Any] = {
            "tensors": self.entries,
            "skeleton_pickle_b64": base64.b64encode(self.skeleton).decode(),
        }
        if self.dtensors:
            layout["dtensors"] = self.dtensors
        return layout


def _entry(obj: torch.Tensor | np.ndarray) -> dict[str, Any]:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise InvalidArgument(f"cannot checkpoint a {obj.layout} tensor; convert it to dense first")
        if obj.is_quantized:
            raise InvalidArgument("cannot checkpoint a quantized tensor")
        if not (obj.is_cpu or obj.is_cuda):
            raise InvalidArgument(f"cannot checkpoint a tensor on device {obj.device}")
        entry = {
            "kind": "torch",
            "dtype": str(obj.dtype).removeprefix("torch."),
            "shape": list(obj.shape),
            "nbytes": obj.numel() * obj.element_size(),
            "requires_grad": bool(obj.requires_grad),
            "parameter": isinstance(obj, torch.nn.Parameter),
        }
        if not obj.is_cpu:  # the location a load's map_location sees (absent: "cpu")
            entry["device"] = str(obj.device)
    else:
        entry = {
            "kind": "numpy",
            "dtype": np.lib.format.dtype_to_descr(obj.dtype),
            "shape": list(obj.shape),
            "nbytes": int(obj.nbytes),
        }
    return entry


def flatten(state: Any, replicated: KeyFilter | None = None, rank: int = 0) -> Flattened:
    """Flatten state; raise InvalidArgument if it holds something that cannot be checkpointed.

    Stateful objects (ckpt.stateful) are flattened as their state_dict(), never pickled whole.
    A plain tensor whose key replicated takes is the same on every rank: it is stored as a
    sharded tensor whose one chunk rank 0 writes (ckpt.sharding.replicated_chunks).
    """
    state = expand_stateful(state)
    arrays: list[torch.Tensor | np.ndarray] = []
    entries: list[dict[str, Any]] = []
    index_of: dict[int, int] = {}
    dtensors: dict[str, dict[str, Any]] = {}
    sharded_ids: dict[str, int] = {}
    keys: dict[int, str] | None = None  # tensor_keys(state), walked at the first need: most states have none
    offset = 0

    def key_of(obj: Any) -> str | None:
        nonlocal keys
        if keys is None:
            keys = tensor_keys(state)
        return keys.get(id(obj))

    def add(array: torch.Tensor | np.ndarray, entry: dict[str, Any]) -> None:
        nonlocal offset
        entry["offset"] = offset
        offset = round_up(offset + entry["nbytes"], TENSOR_ALIGN_BYTES)
        arrays.append(array)
        entries.append(entry)

    def add_dtensor(dt: Any, key: str | None, ident: int) -> str:
        if key is None:
            raise InvalidArgument(
                "a DTensor inside an object that is not a dict, list or tuple has no key to reshard it by; "
                "keep DTensors in dicts, lists and tuples"
            )
        if sharded_ids.setdefault(key, ident) != ident:
            raise InvalidArgument(f"two sharded tensors of the state have the key {key!r}: rename one of them")
        if key not in dtensors:
            dtensors[key] = describe(dt)
            for chunk in owned_chunks(dt, key):
                entry = _entry(chunk.data)
                add(chunk.data, {**entry, "kind": "chunk", "key": key, "offsets": list(chunk.offsets)})
        return key

    def persistent_id(obj: Any) -> Any:
        if type(obj) in _PLAIN_TYPES:  # most of what a state pickles; no array, DTensor or chunk list
            return None
        if is_sharded_value(obj):
            return ("ckpt-dtensor", add_dtensor(obj, key_of(obj), id(obj)))
        if replicated is not None and isinstance(obj, torch.Tensor) and replicated.takes(key_of(obj) or ""):
            key = key_of(obj)
            if key is not None:
                check_plain_tensor(obj, key)
                return ("ckpt-dtensor", add_dtensor(replicated_chunks(obj, rank), key, id(obj)))
        is_array = isinstance(obj, np.ndarray) and not obj.dtype.hasobject
        if not (isinstance(obj, torch.Tensor) or is_array):
            return None
        if id(obj) not in index_of:
            if isinstance(obj, torch.Tensor) and is_wrapper_tensor(obj):
                check_plain_tensor(obj, key_of(obj) or "")  # raises, naming the tensor
            index_of[id(obj)] = len(arrays)
            add(obj, _entry(obj))
        return ("ckpt", index_of[id(obj)])

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)
    pickler.persistent_id = persistent_id  # type: ignore[method-assign]  # the C pickler takes it per instance
    try:
        pickler.dump(state)
    except InvalidArgument:
        raise
    except Exception as e:  # pickle raises many types for unpicklable objects
        at_key = _at_unpicklable_key(state)
        raise InvalidArgument(
            f"the state holds an object that cannot be checkpointed{at_key}: {type(e).__name__}: {e}"
        ) from None
    return Flattened(arrays, entries, buf.getvalue(), offset, dtensors)


def _at_unpicklable_key(state: Any) -> str:
    """Return " at key K" for the first value of state that pickle refuses (its dotted key), else "".

    Called by flatten only once the state failed to pickle: each value is pickled again alone.
    """
    for value, key in keyed_leaves(state, lambda obj: not isinstance(obj, dict | list | tuple)):
        if not key or isinstance(value, torch.Tensor | np.ndarray):
            continue
        try:
            pickle.dumps(value, protocol=PICKLE_PROTOCOL)
        except Exception:  # pickle raises many types for unpicklable objects
            return f" at key {key!r}"
    return ""


def unflatten(
    layout: dict[str, Any],
    data: np.ndarray,
    place: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    dtensor_ref: Any = None,
    weights_only: bool = False,
    what: str = "the step",
) -> Any:
    """Rebuild a state from its layout and a uint8 array of its shard bytes, without copying them.

    Each tensor gets a storage of its own that starts at its first byte (torch
    code that assumes storage_offset 0, such as set_rng_state, works on it),
    while all of them share data's memory. With place (ckpt.placement), every
    tensor, wherever it sits in the state, becomes place(tensor, the location its
    entry was saved from). A DTensor of the step becomes dtensor_ref(key); with no
    dtensor_ref, it is an InvalidArgument. weights_only unpickles the skeleton with
    torch.load(weights_only=True)'s allow-list (ckpt.skeleton_unpickler; what names the
    shard in its UnsafeCheckpoint).
    """
    entries = layout["tensors"]
    built: list[Any] = [None] * len(entries)

    def build(i: int) -> Any:
        e = entries[i]
        start, nbytes, shape = e["offset"], e["nbytes"], tuple(e["shape"])
        if e["kind"] == "numpy":
            dtype = np.lib.format.descr_to_dtype(_descr(e["dtype"]))
            return np.ndarray(shape, dtype=dtype, buffer=data, offset=start) if nbytes else np.empty(shape, dtype)
        torch_dtype = getattr(torch, e["dtype"], None)
        if not isinstance(torch_dtype, torch.dtype):
            raise InvalidArgument(f"this torch has no dtype {e['dtype']}; load with a newer torch")
        if nbytes:
            t = torch.from_numpy(data[start : start + nbytes]).view(torch_dtype).view(shape)
        else:
            t = torch.empty(shape, dtype=torch_dtype)
        if place is not None:
            t = place(t, e.get("device", "cpu"))
        if e.get("parameter"):
            return torch.nn.Parameter(t, requires_grad=e["requires_grad"])
        return t.requires_grad_(True) if e["requires_grad"] else t

    def resolve(pid: Any) -> Any:
        tag, i = pid
        if tag == "ckpt-dtensor" and dtensor_ref is not None:
            return dtensor_ref(i)
        if tag == "ckpt-dtensor":
            raise InvalidArgument(
                f"the step holds {i!r} sharded or written once for every rank (a DTensor, or a key of "
                "Checkpointer(replicated=)): load it with load(into=state)"
            )
        if tag != "ckpt" or not 0 <= i < len(entries):
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        if built[i] is None:
            built[i] = build(i)
        return built[i]

    skeleton = base64.b64decode(layout["skeleton_pickle_b64"])
    return SkeletonUnpickler(skeleton, resolve, weights_only, what).load()


def _descr(d: Any) -> Any:
    # JSON turns the tuples of a structured dtype's descr into lists.
    if isinstance(d, list):
        return [tuple(_descr(x) for x in f) if isinstance(f, list) else f for f in d]
    return d
