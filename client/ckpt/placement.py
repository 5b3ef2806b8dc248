"""Where a load puts each tensor: map_location, in every form torch.load takes, applied to ckpt's layout.

Checkpointer.load and ckpt.load_local call Placement.of(map_location) before anything is
asked or read: it raises InvalidArgument for a value it cannot apply, or for a device this
machine lacks that a str or torch.device names. unflatten then calls the placement, on the
loading thread, once for each tensor of the shard as it is built (a tensor that appears twice
in the state is built once), with the tensor as read into host memory and the location it was
saved from: its layout entry's `device` ("cuda:N"), or "cpu" where the entry has none (a CPU
tensor, or a step saved before the layout recorded devices). The forms, as in torch.load:

- None: every tensor stays in host memory, where it was read (torch.load would restore
  the saved devices instead; ckpt keeps its own default).
- a str or torch.device: every tensor goes to that device.
- a dict {saved location: device}: a tensor saved on a key's location goes to its value;
  any other goes back to the location it was saved from.
- a callable f(tensor, location): its result is used (a tensor of the same dtype and
  shape, on any device); None sends the tensor back to the location it was saved from.

What cannot be applied as a tensor is built (a device this machine lacks that a dict or a
saved location names, a callable's wrong result, or a KeyError, TypeError or ValueError it
raised) raises Refused, an InvalidArgument that the loader tells from a bad layout: no other
tier's copy would do better.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ckpt_core.errors import InvalidArgument

CPU = "cpu"

FORMS = (
    "a device ('cpu', 'cuda:0', a torch.device), a dict of saved locations to devices ({'cuda:0': 'cpu'}), "
    "a callable (tensor, location) -> tensor, or None"
)


class Refused(InvalidArgument):
    """map_location cannot be applied to a tensor of this shard (raised while it is built; the bytes are fine)."""


class Placement:
    """map_location made ready: call it with (tensor read into host memory, saved location) for the tensor to use."""

    def __init__(
        self,
        given: Any,
        device: torch.device | None = None,
        targets: dict[str, torch.device] | None = None,
        call: Callable[[torch.Tensor, str], Any] | None = None,
    ) -> None:
        """Use Placement.of(map_location): given is map_location as the caller passed it, for messages."""
        self.given = given
        self._device = device
        self._targets = targets
        self._call = call
        self._checked: dict[str, torch.device] = {}  # saved locations already resolved and checked

    @staticmethod
    def of(map_location: Any) -> Placement:
        """Return the placement map_location asks for; raise InvalidArgument if it cannot be applied here."""
        if isinstance(map_location, Placement):
            return map_location
        if map_location is None:
            return Placement(None)
        if isinstance(map_location, dict):
            targets = {}
            for location, target in map_location.items():
                if not isinstance(location, str):
                    raise InvalidArgument(
                        f"map_location {map_location!r}: its keys are saved locations such as 'cuda:0' or 'cpu', "
                        f"not {location!r}"
                    )
                targets[location] = _parse(target, f"map_location[{location!r}]")
            return Placement(map_location, targets=targets)
        if callable(map_location):
            return Placement(map_location, call=map_location)
        if isinstance(map_location, bytes):  # torch.load takes bytes as it takes str
            map_location = map_location.decode(errors="replace")
        device = _parse(map_location, "map_location")
        _check_available(device, f"map_location={map_location!r}")
        return Placement(map_location, device=device)

    def __call__(self, tensor: torch.Tensor, location: str) -> torch.Tensor:
        """Return tensor, read into host memory from a copy saved on location, where map_location puts it."""
        if self._call is not None:
            try:
                result = self._call(tensor, location)
            except (KeyError, TypeError, ValueError) as e:  # the loader would read these as a bad layout
                raise Refused(
                    f"map_location {self.given!r} raised {type(e).__name__} for a tensor saved on {location}: {e}"
                ) from e
            if result is None:
                return self._move(tensor, location, self._back_to(location))
            if not isinstance(result, torch.Tensor) or result.dtype != tensor.dtype or result.shape != tensor.shape:
                what = f"{type(result).__name__}" if not isinstance(result, torch.Tensor) else _describe(result)
                raise Refused(
                    f"map_location {self.given!r} returned a {what} for a {_describe(tensor)} saved on {location}: "
                    "it must return the tensor it is given, on any device, or None"
                )
            return result
        if self._targets is not None:
            return self._move(tensor, location, self._mapped(location))
        return self._move(tensor, location, self._device)

    def _mapped(self, location: str) -> torch.device:
        device = self._checked.get(location)
        if device is None:
            target = self._targets.get(location) if self._targets is not None else None
            if target is None:
                device = self._back_to(location)
            else:
                _check_available(target, f"map_location[{location!r}] = {str(target)!r}")
                device = self._checked[location] = target
        return device

    def _back_to(self, location: str) -> torch.device:
        """Return the device a tensor saved on location goes back to, checked."""
        device = self._checked.get(location)
        if device is None:
            device = _parse(location, "a saved location")
            example = f"map_location={{{location!r}: 'cpu'}}" if self._targets is not None else 'map_location="cpu"'
            because = "returned None" if self._call is not None else "does not map it"
            _check_available(
                device,
                f"a tensor saved on {location} goes back there (map_location {self.given!r} {because})",
                fix=f"map it elsewhere, e.g. {example}",
            )
            self._checked[location] = device
        return device

    @staticmethod
    def _move(tensor: torch.Tensor, location: str, device: torch.device | None) -> torch.Tensor:
        if device is None or device.type == CPU:
            return tensor  # read into host memory already: no copy
        return tensor.to(device)


def _parse(value: Any, what: str) -> torch.device:
    if isinstance(value, torch.device):
        return value
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument(f"invalid {what} {value!r}: map_location takes {FORMS}") from None


def _check_available(device: torch.device, why: str, fix: str = 'pass map_location="cpu"') -> None:
    """Raise Refused, naming why a load wants device and what to do, where this machine has no such device."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU found"
            raise Refused(f"{why}, but CUDA is not available here (torch {torch.__version__}, {build}): {fix}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise Refused(f"{why}, but this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}: {fix}")
        return
    backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...: the accelerators torch knows
    is_available = getattr(backend, "is_available", None)
    if device.type != CPU and callable(is_available) and not is_available():
        raise Refused(f"{why}, but {device.type} is not available here: {fix}")


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} tensor of shape {list(tensor.shape)} on {tensor.device}"
