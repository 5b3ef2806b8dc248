"""Unpickle a step's skeleton: in full, or restricted to what torch.load(weights_only=True) allows.

Every load of a skeleton goes through SkeletonUnpickler, on the loading thread:
flatten.unflatten (Checkpointer.load, load_local, and the values of load(into=...) and
ckpt.dcp.Reader) and reshard.load_skeleton (load(into=...), ckpt.dcp.Reader, `ckptd export`).
weights_only comes from the caller: the load's own argument, or `ckptd export` without --trusted.

With weights_only, every global the pickle names (GLOBAL, STACK_GLOBAL: each class or
function it would build or call) must be one torch.load(weights_only=True) allows: torch's
own list (torch._weights_only_unpickler._get_allowed_globals) or the user's
(torch.serialization.add_safe_globals and the safe_globals context), never one of the modules
torch blocks whatever the user allows (os, sys: _blocklisted_modules, where this torch has it).
Any other is refused before anything of the pickle runs, with UnsafeCheckpoint naming it.
Only what find_class hands out can be called or instantiated, so restricting it restricts
what the pickle can run (the Python docs' "Restricting Globals"). torch's own unpickler is not
used: it refuses the persistent ids that stand for the step's tensors ("ckpt", "ckpt-dtensor").
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

from ckpt_core.errors import UnsafeCheckpoint


class SkeletonUnpickler(pickle.Unpickler):
    """Unpickle one skeleton, handing its persistent ids (tensors, DTensors) to resolve.

    A class of the module's, not made per call: a class is a reference cycle, and one
    defined around resolve would hold the shard's whole buffer (through resolve's closure)
    until the garbage collector runs, rather than until the state is dropped.
    """

    def __init__(self, skeleton: bytes, resolve: Callable[[Any], Any], weights_only: bool, what: str) -> None:
        super().__init__(io.BytesIO(skeleton))
        self._resolve = resolve
        self._allowed: dict[str, Any] | None = None  # None: every global, as pickle itself finds it
        self._blocked: tuple[str, ...] = ()
        if weights_only:
            self._allowed, self._blocked = _allowed_globals()
        self._what = what

    def persistent_load(self, pid: Any) -> Any:
        return self._resolve(pid)

    def find_class(self, module: str, name: str) -> Any:
        if self._allowed is None:
            return super().find_class(module, name)
        found = None if module in self._blocked else self._allowed.get(f"{module}.{name}")
        if found is None:
            raise UnsafeCheckpoint(self._what, f"{module}.{name}")
        return found


def _allowed_globals() -> tuple[dict[str, Any], tuple[str, ...]]:
    """Return the globals torch.load(weights_only=True) allows now by dotted name, and the modules it blocks.

    Asked at every load: the user's globals change (add_safe_globals, the safe_globals context).
    """
    from torch import _weights_only_unpickler as torch_rules  # both lists are there since torch 2.4, ckpt's floor

    allowed = {**torch_rules._get_allowed_globals(), **torch_rules._get_user_allowed_globals()}
    return allowed, tuple(getattr(torch_rules, "_blocklisted_modules", ()))
