"""Stateful objects in a state: saved as their state_dict(), loaded in place with load_state_dict().

An object with state_dict() and load_state_dict() (torch.distributed.checkpoint's Stateful
protocol: nn.Module, torch.optim.Optimizer, an AppState of the user's) is never pickled whole.
flatten() calls expand_stateful() on the saving thread first: each such object reached through
dicts, lists and tuples is replaced by what its state_dict() returns, whose tensors are staged
like any others. The step holds that dict, so a load without `into` returns it in the object's
place; ckpt.reshard's load(into=...) fills the object's state_dict() and hands the result to its
load_state_dict(), as dcp.load does. Objects inside other objects (attributes) are pickled as
they are, as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# Exact types that are never Stateful: most of a state's values, a tensor's attribute lookup being slow.
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, bytes})


def is_stateful(obj: Any) -> bool:
    """Say whether obj is an instance with state_dict() and load_state_dict() (a class is not)."""
    return (
        not isinstance(obj, type)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def expand_stateful(state: Any) -> Any:
    """Return state with each Stateful object reached through dicts, lists and tuples replaced by its state_dict().

    Containers on no path to one are returned as they are (the same objects), so a
    state without any is returned itself; a state_dict() result is expanded in turn.
    """
    return _expand(state, set())


def _expand(value: Any, walking: set[int]) -> Any:
    if type(value) in _LEAF_TYPES:
        return value
    if is_stateful(value):
        return _expand(value.state_dict(), walking)
    if not isinstance(value, dict | list | tuple) or id(value) in walking:
        return value
    walking.add(id(value))
    try:
        if isinstance(value, dict):
            items = {k: _expand(v, walking) for k, v in value.items()}
            if all(items[k] is v for k, v in value.items()):
                return value
            expanded = copy.copy(value)  # its class and attributes kept (an nn.Module state_dict's _metadata)
            expanded.update(items)
            return expanded
        members = [_expand(v, walking) for v in value]
        if all(m is v for m, v in zip(members, value, strict=True)):
            return value
        if isinstance(value, list):
            return members
        return type(value)(*members) if hasattr(value, "_fields") else type(value)(members)
    finally:
        walking.discard(id(value))
