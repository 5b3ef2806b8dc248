"""Copy CUDA tensors into a staging slot: pinned registration and side-stream copies.

Only imported when a state holds CUDA tensors, so CPU-only machines never
touch CUDA. The slot's memory is registered with cudaHostRegister once, so
device-to-host copies run at full PCIe bandwidth and asynchronously on a side
stream; the stream is synchronised before returning, so the snapshot is whole.
"""

from __future__ import annotations

import torch

_registered: dict[int, int] = {}  # address -> bytes pinned
_streams: dict[int, torch.cuda.Stream] = {}


def _register(slot: torch.Tensor) -> None:
    ptr, size = slot.data_ptr(), slot.numel()
    if _registered.get(ptr) == size:
        return
    unregister(slot)  # a slot mapped again at the same address, maybe with another size
    # cudaHostRegisterDefault = 0. Where it fails, copies still work, only slower (pageable memory).
    if int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0)) == 0:
        _registered[ptr] = size


def unregister(slot: torch.Tensor) -> None:
    """Unpin a slot's memory before its mapping goes away."""
    ptr = slot.data_ptr()
    if _registered.pop(ptr, None) is not None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def copy_from_device(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: torch.Tensor) -> None:
    """Copy each (host destination, CUDA source) pair and wait until every byte has landed."""
    _register(slot)
    by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        by_device.setdefault(src.device.index or 0, []).append((dst, src))
    for device, group in by_device.items():
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        # The side stream must see every write the training stream made to the sources.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in group:
                dst.copy_(src.detach(), non_blocking=True)
        stream.synchronize()
