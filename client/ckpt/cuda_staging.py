"""Copy CUDA tensors into a staging slot: pinned slots, copies ordered by events, overlap and spill.

The one module of ckpt that touches CUDA; imported only when a state holds CUDA tensors,
so CPU-only machines never load it. Who calls what, in which order, on which thread:

1. Checkpointer.save_async, on the training thread, calls ready_events(arrays) first: an
   event recorded on the caller's current stream of every device the state touches. The
   current stream is per thread, so it is looked up there and only there; every copy of
   that save, on any thread, waits on these events (and so on every kernel the caller
   queued before saving, on whatever stream it trains), never on a stream looked up later.
2. pin(slot) registers the slot with cudaHostRegister (once per mapping; also done ahead of
   need by Checkpointer.prepare and the spare slot's prefault, on a background thread).
3. Eager: copy_from_device() copies on a side stream per device and synchronizes before it
   returns, so save_async returns with the snapshot whole.
4. Lazy: a DeviceCopy is made on the training thread; its run() goes on the lazy thread and
   issues the device-to-host copies in chunks on the side stream, a bounded number of bytes
   in flight, so they run beside the forward and backward pass. When an optimizer is about
   to step, the optimizer step pre-hook (ckpt.lazy, training thread) calls before_step():
   chunks already issued are awaited by the stepping stream *on the GPU* (wait_event, no
   CPU block); chunks not issued yet are copied device to device into a spill buffer on the
   stepping stream (bounded by spill_bytes) and go to the host from there after the step,
   or, past the bound, are issued at once and awaited on the GPU as well.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

CHUNK_BYTES = 32 << 20  # one device-to-host copy of a lazy save; a contiguous tensor is split into these
IN_FLIGHT_BYTES = 128 << 20  # issued and not yet landed: what a stepping optimizer may have to wait for on the GPU
SPILL_SHARE_OF_FREE = 0.5  # default spill bound: this share of the device memory free at the first step

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, not only the calling thread's current one

_registered: dict[int, int] = {}  # address -> bytes pinned
_refused: set[tuple[int, int]] = set()  # (address, bytes) cudaHostRegister refused: copies go unpinned, never retried
_pin_lock = threading.Lock()  # the training, lazy and prefault threads all pin; registering takes long
_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def ready_events(arrays: list[Any]) -> dict[int, torch.cuda.Event]:
    """Record an event on the calling thread's current stream of every CUDA device the arrays are on."""
    events = {}
    for array in arrays:
        if isinstance(array, torch.Tensor) and array.is_cuda:
            device = _index(array)
            if device not in events:
                events[device] = torch.cuda.Event()
                events[device].record(torch.cuda.current_stream(device))
    return events


def pin(slot: torch.Tensor, device: int) -> None:
    """Register a slot's memory with CUDA (page-locked), once per mapping; any thread.

    device: the GPU the state is on, made current for the call, so that a thread that never
    touched CUDA creates no context on GPU 0. Where registration is refused (some sandboxes),
    copies still work, unpinned and slower, and it is not tried again for that mapping.
    """
    ptr, size = slot.data_ptr(), slot.numel()
    with _pin_lock:
        if _registered.get(ptr) == size or (ptr, size) in _refused:
            return
        _unregister(ptr)  # a slot mapped again at the same address, maybe with another size
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            if int(cudart.cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE)) == 0:
                _registered[ptr] = size
            else:
                _refused.add((ptr, size))
                clear = getattr(cudart, "cudaGetLastError", None)
                if clear is not None:
                    clear()  # else the runtime's sticky last error fails this thread's next kernel launch


def pinned(slot: torch.Tensor) -> bool:
    """Say whether pin() has nothing left to do for a slot (then a save does not wait for it)."""
    key = (slot.data_ptr(), slot.numel())
    return _registered.get(key[0]) == key[1] or key in _refused


def unregister(slot: torch.Tensor) -> None:
    """Unpin a slot's memory before its mapping goes away."""
    with _pin_lock:
        _unregister(slot.data_ptr())
        _refused.discard((slot.data_ptr(), slot.numel()))


def _unregister(ptr: int) -> None:
    if _registered.pop(ptr, None) is not None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _index(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


def _side_stream(device: int) -> torch.cuda.Stream:
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            # From the high-priority pool: a trainer's torch.cuda.Stream() comes from the other one,
            # so the copies do not queue behind its kernels on a shared stream.
            stream = _streams[device] = torch.cuda.Stream(device=device, priority=-1)
        return stream


def copy_from_device(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: torch.Tensor, ready: dict[int, torch.cuda.Event]
) -> None:
    """Copy each (host destination, CUDA source) pair after the save's ready events; return once all landed."""
    pin(slot, next(iter(ready)))
    by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        by_device.setdefault(_index(src), []).append((dst, src))
    streams = []
    for device, group in by_device.items():
        stream = _side_stream(device)
        stream.wait_event(ready[device])  # every write the caller queued before saving, on its stream
        with torch.cuda.stream(stream):
            for dst, src in group:
                dst.copy_(src.detach(), non_blocking=True)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()


@dataclass
class _Piece:
    """One device-to-host copy of a lazy save: a whole tensor, or a chunk of a contiguous one."""

    index: int  # the array of the flattened state it belongs to
    device: int
    dst: torch.Tensor  # in the pinned slot
    src: torch.Tensor
    nbytes: int
    landed: torch.cuda.Event | None = None  # set once issued on the side stream (from the source or the spill)
    issued: int = 0  # when, in the order of issue: the side stream of a device runs its copies in that order
    spill: torch.Tensor | None = None  # set once spilled: the device copy the host copy is made from
    spilled: torch.cuda.Event | None = None  # recorded on the stepping stream after the spill copy


class DeviceCopy:
    """The CUDA arrays of one lazy save, copied to the host beside training, spilled on the GPU when due.

    Made on the training thread by save_async; run() on the lazy thread; before_step() on the
    training thread, from the optimizer step pre-hook, any number of times meanwhile. A lock
    keeps each piece issued once, from the source or from its spill.
    """

    def __init__(
        self,
        slot: torch.Tensor,
        items: list[tuple[int, torch.Tensor, torch.Tensor]],
        ready: dict[int, torch.cuda.Event],
        spill_bytes: int | None,
        now: frozenset[int] = frozenset(),
    ) -> None:
        """Cut the items into pieces, and snapshot those of the arrays in now at once (training thread).

        items: (array index, host destination in the slot, CUDA source); spill_bytes: the bound of
        spills at steps (None: a share of the free memory). now: arrays no optimizer owns (buffers),
        which the forward pass may change: copied device to device on the caller's stream now, to
        the host later, so that save_async need not wait for the GPU to reach the save.
        """
        self.slot = slot
        self.device = next(iter(ready))  # the lazy thread's current device: no context made on GPU 0 for it
        self.ready = ready
        self.spill_limit = spill_bytes
        self.spilled_bytes = 0
        self.pieces: list[_Piece] = []
        for index, dst, src in items:
            self.pieces += _split(index, dst, src.detach())
        self._by_index: dict[int, list[_Piece]] = {}
        for piece in self.pieces:
            self._by_index.setdefault(piece.index, []).append(piece)
        self._lock = threading.Lock()
        self._issued = 0
        self._finished = False  # set by run() once every piece is on the host: a later step waits for nothing
        if now:
            with self._lock:
                left = self._spill([p for i in sorted(now) for p in self._by_index.get(i, ())], bounded=False)
                for piece in left:  # no GPU memory for them: copied to the host now, as an eager save does
                    self._issue(piece, _side_stream(piece.device))
                    assert piece.landed is not None
                    piece.landed.synchronize()

    def run(self) -> None:
        """Issue every piece on the side streams, IN_FLIGHT_BYTES at most ahead; return when all landed."""
        torch.cuda.set_device(self.device)
        pin(self.slot, self.device)
        streams = {device: _side_stream(device) for device in self.ready}
        in_flight: list[_Piece] = []
        in_flight_bytes = 0
        for piece in self.pieces:
            with self._lock:
                if piece.landed is not None or piece.spill is not None:
                    continue  # issued by a step's hook, or spilled by it: its host copy comes below
                self._issue(piece, streams[piece.device])
            in_flight.append(piece)
            in_flight_bytes += piece.nbytes
            while in_flight_bytes > IN_FLIGHT_BYTES and len(in_flight) > 1:
                landed = in_flight.pop(0)
                assert landed.landed is not None
                landed.landed.synchronize()  # pace: what is not issued can still be spilled at the next step
                in_flight_bytes -= landed.nbytes
        with self._lock:  # every piece is issued or spilled now: no hook spills any more
            spilled = [p for p in self.pieces if p.spill is not None]
        for piece in spilled:
            assert piece.spill is not None and piece.spilled is not None
            stream = streams[piece.device]
            stream.wait_event(piece.spilled)
            with torch.cuda.stream(stream):
                piece.dst.copy_(piece.spill, non_blocking=True)
            piece.spill.record_stream(stream)
        for stream in streams.values():
            stream.synchronize()
        with self._lock:
            self._finished = True
            for piece in spilled:
                piece.spill = None  # back to the allocator (record_stream keeps it until the copy is done)

    def before_step(self, indices: list[int]) -> None:
        """Order the stepping stream after the copies of these arrays, on the GPU (training thread, the pre-hook)."""
        with self._lock:
            if self._finished:
                return  # every byte is on the host: the step may change the sources at once
            pieces = [p for i in indices for p in self._by_index.get(i, ())]
            waits: dict[int, _Piece] = {}
            not_issued = [p for p in pieces if p.landed is None and p.spill is None]
            if not_issued:
                self._spill(not_issued)
            for piece in pieces:
                if piece.spill is not None:
                    continue  # the step overwrites the source; the spill holds the snapshot's bytes
                if piece.landed is None:
                    self._issue(piece, _side_stream(piece.device))  # over the spill bound: copied now, awaited below
                latest = waits.get(piece.device)
                if latest is None or piece.issued > latest.issued:  # a device's pieces land in the order issued:
                    waits[piece.device] = piece  # waiting for the last one issued waits for them all
            for device, piece in waits.items():
                assert piece.landed is not None
                torch.cuda.current_stream(device).wait_event(piece.landed)

    def _issue(self, piece: _Piece, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self.ready[piece.device])  # first on this stream maybe: the hook can come before run()
        with torch.cuda.stream(stream):
            piece.dst.copy_(piece.src, non_blocking=True)
            piece.landed = torch.cuda.Event(blocking=True)  # run() waits on it: sleep, not spin, on the daemon's CPUs
            piece.landed.record(stream)
        self._issued += 1
        piece.issued = self._issued

    def _spill(self, pieces: list[_Piece], bounded: bool = True) -> list[_Piece]:
        """Copy pieces device to device on the current stream, within the bound; return the rest (lock held)."""
        if self.spill_limit is None and bounded:
            free_bytes, _ = torch.cuda.mem_get_info(pieces[0].device)
            self.spill_limit = int(free_bytes * SPILL_SHARE_OF_FREE)
        by_device: dict[int, list[_Piece]] = {}
        left = []
        room = (self.spill_limit or 0) - self.spilled_bytes
        for piece in pieces:
            if not bounded or _aligned(piece.nbytes) <= room:
                by_device.setdefault(piece.device, []).append(piece)
                room -= _aligned(piece.nbytes)
            else:
                left.append(piece)
        for device, group in by_device.items():
            stepping = torch.cuda.current_stream(device)
            stepping.wait_event(self.ready[device])  # the stepping stream may not be the one that saved
            offsets = [0]
            for piece in group:  # each piece at a 256-byte boundary: any dtype views it, copies stay aligned
                offsets.append(offsets[-1] + _aligned(piece.nbytes))
            with torch.cuda.device(device), torch.cuda.stream(stepping):
                try:
                    buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=f"cuda:{device}")
                except torch.cuda.OutOfMemoryError:  # no room after all: spill no more, the step waits instead
                    self.spill_limit = self.spilled_bytes
                    left += group
                    continue
                for piece, at in zip(group, offsets, strict=False):
                    piece.spill = buffer[at : at + piece.nbytes].view(piece.src.dtype).view(piece.src.shape)
                    piece.spill.copy_(piece.src)
                done = torch.cuda.Event()
                done.record(stepping)
            for piece in group:
                piece.spilled = done
            self.spilled_bytes += offsets[-1]
        return left


def _aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _split(index: int, dst: torch.Tensor, src: torch.Tensor) -> list[_Piece]:
    """Cut a contiguous tensor into CHUNK_BYTES pieces (a strided one stays whole: copy_ gathers it)."""
    device, nbytes = _index(src), src.numel() * src.element_size()
    if not src.is_contiguous() or nbytes <= CHUNK_BYTES or src.element_size() == 0:
        return [_Piece(index, device, dst, src, nbytes)]
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    step = max(1, CHUNK_BYTES // src.element_size())
    return [
        _Piece(
            index,
            device,
            flat_dst[at : at + step],
            flat_src[at : at + step],
            min(step, src.numel() - at) * src.element_size(),
        )
        for at in range(0, src.numel(), step)
    ]
