"""Copy CUDA tensors into a staging slot: pinned slots, copies ordered by events, the lazy schedule.

The one module of ckpt that touches CUDA; imported only when a state holds CUDA tensors,
so CPU-only machines never load it. Who calls what, in which order, on which thread:

1. The save path (ckpt.save_path, for save_async), on the training thread, calls ready_events(arrays) first: an
   event recorded on the caller's current stream of every device the state touches. The
   current stream is per thread, so it is looked up there and only there; every copy of
   that save, on any thread, waits on these events (and so on every kernel the caller
   queued before saving, on whatever stream it trains), never on a stream looked up later.
2. pin(slot) registers the slot with cudaHostRegister (once per mapping; also done ahead of
   need by Checkpointer.prepare and the spare slot's prefault, on a background thread).
3. Eager: copy_from_device() copies on a side stream per device and synchronizes before it
   returns, so save_async returns with the snapshot whole.
4. Lazy: the schedule of DeviceCopy, for a trainer whose GPU runs the forward and backward
   pass long after the CPU launched it.
   - At the save (DeviceCopy(), training thread) the *head* of the state is issued on the side
     stream at once, unpaced: as many bytes as the link moves in the GPU time from the save to
     the optimizer's step, which Link learns from the events of earlier saves (prepare() gives
     the first rate). Arrays no optimizer owns are copied device to device into the spill arena
     on the caller's stream (the forward pass may change them); what does not fit goes over PCIe
     first and the caller's stream waits for it on the GPU.
   - At the optimizer step pre-hook (before_step(), training thread) the *tail* the head does not
     cover is copied device to device into the spill arena on the stepping stream (milliseconds at
     device bandwidth), the stepping stream waits on the GPU for the head, and the spill drains to
     the host on the side stream after the head, beside the next forward and backward pass.
   - run(), on the lazy thread, waits for the head to land; if no step came by then it issues the
     tail itself (IN_FLIGHT_BYTES ahead at most, so a step that comes meanwhile waits for little);
     then it waits for every copy, and teaches Link what this save's events measured.
   Nothing of a lazy save blocks the training thread on the GPU.

Every call this module makes on the device goes through a Gpu (TorchCuda here, on torch.cuda):
benchmarks/gpu_timeline.py answers the same calls with a timeline model of one device, so that
the schedule itself, unchanged, can be run and checked without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from ckpt_core.errors import CheckpointError

log = logging.getLogger("ckpt")

CHUNK_BYTES = 32 << 20  # one device-to-host copy of a lazy save's tail; a contiguous tensor is split into these
IN_FLIGHT_BYTES = 128 << 20  # the tail run() issues itself, ahead of what landed: what a late step may wait for
HEAD_MARGIN = 0.9  # the head is this share of what the link moves before the step: a late head stalls the step
ARENA_SHARE = 0.6  # the first spill arena, before any save taught the tail: this share of the lazy CUDA bytes
ARENA_SLACK = 1.1  # the arena follows the predicted tail with this much room to spare
ARENA_FREE_SHARE = 0.5  # an arena takes at most this share of the device memory free (cache included)
SAMPLES = 5  # Link keeps the median of this many of the latest measurements
RATE_PROBE_BYTES = 128 << 20  # prepare()'s timed device-to-host copy, the first estimate of the link's rate
MIN_TIMED_BYTES = 16 << 20  # copies smaller than this teach Link no rate: their fixed costs dominate

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, not only the calling thread's current one

_registered: dict[int, int] = {}  # address -> bytes pinned
_refused: set[tuple[int, int]] = set()  # (address, bytes) cudaHostRegister refused: copies go unpinned, never retried
_pin_lock = threading.Lock()  # the training, lazy and prefault threads all pin; registering takes long
_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


class GraphCaptured(CheckpointError):
    """An optimizer step of a running lazy save is being captured into a CUDA graph."""


class Gpu(Protocol):
    """The device calls of the schedule: TorchCuda on a GPU, benchmarks/gpu_timeline.Timeline in its model.

    Streams answer wait_event(event); events answer record(stream), query(), synchronize() and
    elapsed_time(other) in milliseconds, as torch.cuda's do. Any thread may call.
    """

    def holds(self, array: Any) -> bool: ...

    def device_of(self, tensor: torch.Tensor) -> int: ...

    def current_stream(self, device: int) -> Any: ...

    def side_stream(self, device: int) -> Any: ...

    def event(self) -> Any: ...

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None: ...

    def empty(self, nbytes: int, device: int) -> torch.Tensor: ...

    def host_empty(self, nbytes: int) -> torch.Tensor: ...

    def free_bytes(self, device: int) -> int: ...

    def capturing(self, device: int) -> bool: ...

    def set_device(self, device: int) -> None: ...

    def leave_captures_alone(self) -> None: ...


class TorchCuda:
    """The Gpu of a real process: torch.cuda's streams, events and copies."""

    def holds(self, array: Any) -> bool:
        return isinstance(array, torch.Tensor) and array.is_cuda

    def device_of(self, tensor: torch.Tensor) -> int:
        return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()

    def current_stream(self, device: int) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def side_stream(self, device: int) -> torch.cuda.Stream:
        with _streams_lock:
            stream = _streams.get(device)
            if stream is None:
                # From the high-priority pool: a trainer's torch.cuda.Stream() comes from the other one,
                # so the copies do not queue behind its kernels on a shared stream.
                stream = _streams[device] = torch.cuda.Stream(device=device, priority=-1)
            return stream

    def event(self) -> torch.cuda.Event:
        # Timed, so that Link learns from it; blocking, so that run() sleeps rather than spins on the daemon's CPUs.
        return torch.cuda.Event(enable_timing=True, blocking=True)

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
        # The sources stay referenced by their pieces until run() saw every copy land: never freed and reused meanwhile.
        with torch.cuda.stream(stream):  # once for all: entering it costs microseconds of the training thread
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def empty(self, nbytes: int, device: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def free_bytes(self, device: int) -> int:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)  # the caching allocator's free blocks are free to us too

    def capturing(self, device: int) -> bool:
        with torch.cuda.device(device):
            return bool(torch.cuda.is_current_stream_capturing())

    def set_device(self, device: int) -> None:
        torch.cuda.set_device(device)

    def leave_captures_alone(self) -> None:
        leave_captures_alone()


CUDA = TorchCuda()


def ready_events(arrays: list[Any], gpu: Gpu = CUDA) -> dict[int, Any]:
    """Record an event on the calling thread's current stream of every CUDA device the arrays are on."""
    events = {}
    for array in arrays:
        if gpu.holds(array):
            device = gpu.device_of(array)
            if device not in events:
                events[device] = gpu.event()
                events[device].record(gpu.current_stream(device))
    return events


def pin(slot: torch.Tensor, device: int) -> None:
    """Register a slot's memory with CUDA (page-locked), once per mapping; any thread.

    device: the GPU the state is on, made current for the call, so that a thread that never
    touched CUDA creates no context on GPU 0. Where registration is refused (some sandboxes),
    copies still work, unpinned and slower, and it is not tried again for that mapping.
    A slot pinned already returns at once, without the lock another slot's registration holds.
    """
    if pinned(slot):
        return
    ptr, size = slot.data_ptr(), slot.numel()
    with _pin_lock:
        if pinned(slot):
            return
        with torch.cuda.device(device):
            _unregister(ptr)  # a slot mapped again at the same address, maybe with another size
            status = int(torch.cuda.cudart().cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE))
            if status == 0:
                _registered[ptr] = size
            else:
                _refused.add((ptr, size))
                log.warning(
                    "ckpt: cudaHostRegister of a %d-byte staging slot was refused (CUDA error %d): its copies go "
                    "unpinned, slower, and a lazy save's copies cannot overlap training",
                    *(size, status),
                )
                clear_cuda_error("cudaHostRegister")


def pinned(slot: torch.Tensor) -> bool:
    """Say whether pin() has nothing left to do for a slot (then a save does not wait for it)."""
    ptr, size = slot.data_ptr(), slot.numel()
    return _registered.get(ptr) == size or (ptr, size) in _refused


def page_locked(slot: torch.Tensor) -> bool:
    """Say whether a slot is registered with CUDA: a copy into it does not block the thread that issues it."""
    return _registered.get(slot.data_ptr()) == slot.numel()


def unregister(slot: torch.Tensor) -> None:
    """Unpin a slot's memory before its mapping goes away."""
    with _pin_lock:
        _unregister(slot.data_ptr())
        _refused.discard((slot.data_ptr(), slot.numel()))


def _unregister(ptr: int) -> None:
    if _registered.pop(ptr, None) is not None:
        status = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if status != 0:
            log.warning("ckpt: cudaHostUnregister of a staging slot failed (CUDA error %d)", status)
            clear_cuda_error("cudaHostUnregister")


CUDA_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


def leave_captures_alone() -> None:
    """Let this thread's CUDA calls pass while another thread captures a graph (background threads only).

    torch.cuda.graph captures in global mode: then a synchronize, query or allocation on any other
    thread in global mode fails and spoils the capture (torch.compile's "reduce-overhead" captures
    the forward pass, maybe while a lazy copy runs). In thread-local mode this thread's calls are
    its own business, as torch's NCCL watchdog does for its event queries. Called on the lazy and
    the prefault threads; lasts for the thread.
    """
    runtime = _loaded_cudart()
    if runtime is not None:
        mode = ctypes.c_int(CUDA_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        runtime.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def clear_cuda_error(after: str) -> int | None:
    """Reset the CUDA runtime's last error of this thread after a refused call; return the error it held.

    A refused cudaHostRegister leaves its error as the thread's last error, and torch checks it after
    its next kernel launch: that launch would raise. torch binds no cudaGetLastError, so it is called
    in the libcudart this process already loaded (the one torch's calls went to). None: none found.
    """
    runtime = _loaded_cudart()
    if runtime is None:
        log.warning("ckpt: no libcudart loaded in this process: the error %s left could not be cleared", after)
        return None
    return int(runtime.cudaGetLastError())


_cudart: list[ctypes.CDLL] = []  # found once: torch loaded it at CUDA's first use, and it stays


def _loaded_cudart() -> ctypes.CDLL | None:
    """Return the CUDA runtime library mapped into this process (from /proc/self/maps), or None."""
    if _cudart:
        return _cudart[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            _cudart.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))  # the copy torch loaded
        except OSError:
            continue
        return _cudart[0]
    return None


def copy_from_device(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: torch.Tensor, ready: dict[int, Any]) -> None:
    """Copy each (host destination, CUDA source) pair after the save's ready events; return once all landed."""
    pin(slot, next(iter(ready)))
    by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        by_device.setdefault(CUDA.device_of(src), []).append((dst, src))
    streams = []
    for device, group in by_device.items():
        stream = CUDA.side_stream(device)
        stream.wait_event(ready[device])  # every write the caller queued before saving, on its stream
        CUDA.copy_all([(dst, src.detach().resolve_conj().resolve_neg()) for dst, src in group], stream)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()


class Link:
    """What a job's lazy saves taught about its GPU: the device-to-host rate, the GPU time from a save to its step.

    One per save path (ckpt.save_path). Calls: prepare() measures a first rate (measure_rate, its background
    thread); each DeviceCopy reads head_bytes() at the save (training thread) and, once its copy
    landed, learn()s from its events (lazy thread); the arena reads tail_bytes() then. A lock keeps
    the samples whole between the threads.
    """

    def __init__(self) -> None:
        self._rates_bps: deque[float] = deque(maxlen=SAMPLES)
        self._windows_s: deque[float] = deque(maxlen=SAMPLES)
        self._lock = threading.Lock()

    def learn(self, rate_bps: float | None = None, window_s: float | None = None) -> None:
        """Add a measured device-to-host rate and/or GPU time from a save's ready event to its optimizer step."""
        with self._lock:
            if rate_bps is not None and rate_bps > 0:
                self._rates_bps.append(rate_bps)
            if window_s is not None and window_s >= 0:
                self._windows_s.append(window_s)

    def estimate(self) -> tuple[float | None, float | None]:
        """Return (rate in bytes a second, window in seconds), each the median of the latest samples, or None."""
        with self._lock:
            rate = statistics.median(self._rates_bps) if self._rates_bps else None
            window = statistics.median(self._windows_s) if self._windows_s else None
        return rate, window

    def head_bytes(self, total: int, room: int) -> int:
        """Return the bytes of total to issue at the save: what lands by the step, and what the arena cannot take."""
        rate, window = self.estimate()
        landed_by_step = int(rate * window * HEAD_MARGIN) if rate is not None and window is not None else 0
        return min(total, max(landed_by_step, total - room))

    def tail_bytes(self, total: int) -> int | None:
        """Return the predicted tail of a save of total bytes (what is spilled), or None before anything is known."""
        rate, window = self.estimate()
        if rate is None or window is None:
            return None
        return max(0, total - int(rate * window * HEAD_MARGIN))

    def measure_rate(self, source: torch.Tensor, gpu: Gpu = CUDA) -> None:
        """Time a device-to-host copy of up to RATE_PROBE_BYTES of source into pinned memory (prepare's thread)."""
        nbytes = min(RATE_PROBE_BYTES, source.numel() * source.element_size())
        if nbytes < MIN_TIMED_BYTES or not source.is_contiguous():
            return
        device = gpu.device_of(source)
        gpu.set_device(device)
        gpu.leave_captures_alone()
        src = source.detach().reshape(-1).view(torch.uint8)[:nbytes]
        dst = gpu.host_empty(nbytes)
        stream = gpu.side_stream(device)
        stream.wait_event(ready_events([source], gpu)[device])
        best_s = None
        for _ in range(2):  # the first also warms the link up
            start, end = gpu.event(), gpu.event()
            start.record(stream)
            gpu.copy_all([(dst, src)], stream)
            end.record(stream)
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            best_s = seconds if best_s is None else min(best_s, seconds)
        if best_s:
            self.learn(rate_bps=nbytes / best_s)


class SpillArena:
    """GPU memory set aside for the spills of lazy saves, one buffer per device; one save uses it at a time.

    Calls: Checkpointer.prepare() sizes it (ensure(), training thread) so that no save allocates; a
    lazy save that finds none makes it (and says so); each DeviceCopy takes its regions from offset
    0 (the next lazy save starts only once the previous copy landed, so regions are never shared);
    after a copy landed, its lazy thread fits the arena to the predicted tail (fit()), between saves.
    limit: Checkpointer(spill_bytes=...), a bound per device; None: ARENA_FREE_SHARE of free memory.
    """

    def __init__(self, limit: int | None, gpu: Gpu = CUDA) -> None:
        self.limit = limit
        self.gpu = gpu
        self.buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def capacity(self, device: int) -> int:
        """Return the bytes of the device's buffer (0: none)."""
        buffer = self.buffers.get(device)
        return 0 if buffer is None else buffer.numel()

    def ensure(self, device: int, nbytes: int) -> None:
        """Make the device's buffer nbytes large (within the bounds), unless it is."""
        wanted = _aligned(nbytes if self.limit is None else min(nbytes, self.limit))
        with self._lock:
            have = self.capacity(device)
            if wanted == have or wanted <= 0:
                return
            bound = int((self.gpu.free_bytes(device) + have) * ARENA_FREE_SHARE)
            self.buffers.pop(device, None)  # its memory first (no save holds a view of it): a larger one may need it
            size = min(wanted, _aligned(bound) if self.limit is None else wanted)
            for attempt in (size, have):  # on no memory for the new size, the old size again rather than none
                try:
                    self.buffers[device] = self.gpu.empty(attempt, device)
                    return
                except torch.cuda.OutOfMemoryError:
                    log.warning("ckpt: no GPU memory for a %d-byte spill arena on cuda:%d", attempt, device)

    def fit(self, device: int, tail_bytes: int) -> None:
        """Resize the buffer to the predicted tail and ARENA_SLACK when too small or twice too large (lazy thread)."""
        want = int(tail_bytes * ARENA_SLACK)
        have = self.capacity(device)
        if want > have or want < have // 2:
            self.ensure(device, want)


@dataclass
class _Piece:
    """One device-to-host copy of a lazy save: a whole tensor, or a chunk of a contiguous one."""

    index: int  # the array of the flattened state it belongs to
    device: int
    dst: torch.Tensor  # in the pinned slot
    src: torch.Tensor
    nbytes: int
    landed: Any = None  # an event, set once issued from the source: recorded after it on the side stream
    issued: int = 0  # when, in the order of issue: the side stream of a device runs its copies in that order
    spill: torch.Tensor | None = None  # set once spilled: its region of the arena, which the host copy is made from


class DeviceCopy:
    """The CUDA arrays of one lazy save: the head issued at the save, the tail spilled at the step, drained after.

    Made on the training thread by save_async (which issues the head); run() on the lazy thread;
    before_step() on the training thread, from the optimizer step pre-hook, any number of times
    meanwhile. A lock keeps each piece issued once, from the source or from its spill.
    """

    def __init__(
        self,
        items: list[tuple[int, torch.Tensor, torch.Tensor]],
        ready: dict[int, Any],
        link: Link,
        arena: SpillArena,
        now: frozenset[int] = frozenset(),
        gpu: Gpu = CUDA,
    ) -> None:
        """Cut the items into pieces, spill the arrays in now, issue the head (training thread).

        items: (array index, host destination in the slot, CUDA source). now: arrays no optimizer
        owns, which the forward pass may change: copied device to device into the arena on the
        caller's stream now (past the arena, over PCIe with the caller's stream waiting on the GPU).
        The slot must be page-locked (pin()): a copy into pageable memory blocks the thread that issues it.
        """
        self.gpu = gpu
        self.device = next(iter(ready))  # the lazy thread's current device: no context made on GPU 0 for it
        self.ready = ready
        self.link = link
        self.arena = arena
        self._now = now
        self.pieces: list[_Piece] = []
        for index, dst, src in items:
            # A conjugate or negative view is resolved on the CPU after an async copy, before it landed: not here.
            self.pieces += _split(index, dst, src.detach().resolve_conj().resolve_neg(), gpu.device_of(src))
        self._by_index: dict[int, list[_Piece]] = {}
        for piece in self.pieces:
            self._by_index.setdefault(piece.index, []).append(piece)
        self.spilled_bytes = 0  # copied into the arena (at the save or at a step), then to the host
        self.direct_bytes = 0  # copied from the source to the host
        self.held_bytes = 0  # of the arrays no optimizer owns: over PCIe before the caller's stream went on
        self.gpu_wait_s: float | None = None  # once run() finished: the GPU time stepping streams waited for this save
        self._lock = threading.Lock()
        self._issued = 0
        self._taken: dict[int, int] = {}  # arena bytes this save took, per device
        self._finished = False  # set by run() once every piece is on the host: a later step waits for nothing
        self._head: dict[int, tuple[Any, Any, int]] = {}  # device -> (started, landed events, bytes) of the head
        self._drains: list[tuple[Any, Any, int]] = []  # (started, landed events, bytes) of each spill's drain
        self._steps: list[tuple[Any, Any]] = []  # (before, after) events of each step's waits, on its stream
        self._step_began: dict[int, Any] = {}  # device -> the first step's before event: the end of the window
        self._held_bytes_in_arena: dict[int, int] = {}  # per device: the arena taken by arrays no optimizer owns
        with self._lock:
            held = [p for i in sorted(now) for p in self._by_index.get(i, ())]
            left, spilled = self._spill(held, {p.device: gpu.current_stream(p.device) for p in held})
            for piece in left:  # no room in the arena: over PCIe, and the caller's stream waits for it on the GPU
                self._issue(piece)
                self.held_bytes += piece.nbytes
            for device, last in _latest(left).items():
                gpu.current_stream(device).wait_event(last.landed)
            self._held_bytes_in_arena = dict(self._taken)
            self._issue_head([p for p in self.pieces if p.landed is None and p.spill is None])
            self._drain([p for p in held if p.spill is not None], spilled)  # after the head: it is on the clock

    def _issue_head(self, pieces: list[_Piece]) -> None:
        """Issue the head of each device's pieces at once, in state order, with one event after it (lock held)."""
        for device, group in _by_device(pieces).items():
            total = sum(p.nbytes for p in group)
            room = self.arena.capacity(device) - self._taken.get(device, 0)
            head_bytes = self.link.head_bytes(total, room)
            if head_bytes <= 0:
                continue
            stream = self.gpu.side_stream(device)
            stream.wait_event(self.ready[device])
            started, landed = self.gpu.event(), self.gpu.event()
            started.record(stream)
            issued = 0
            head = []
            for piece in group:
                if issued >= head_bytes:
                    break
                head.append((piece.dst, piece.src))
                piece.landed = landed
                self._issued += 1
                piece.issued = self._issued
                issued += piece.nbytes
            self.gpu.copy_all(head, stream)
            landed.record(stream)
            self.direct_bytes += issued
            self._head[device] = (started, landed, issued)

    def run(self) -> None:
        """Wait for the head, issue what no step spilled, wait for every copy, learn (lazy thread).

        Then it lets go of the sources and the arena's regions: a handle kept for long holds neither.
        """
        self.gpu.set_device(self.device)
        self.gpu.leave_captures_alone()
        for _, landed, _ in self._head.values():
            landed.synchronize()  # the step's time: a step that comes before this spills the tail
        in_flight: list[_Piece] = []
        in_flight_bytes = 0
        for piece in self.pieces:
            with self._lock:
                if piece.landed is not None or piece.spill is not None:
                    continue  # in the head, issued by a step's hook, or spilled by it
                self._issue(piece)
                self.direct_bytes += piece.nbytes
            in_flight.append(piece)
            in_flight_bytes += piece.nbytes
            while in_flight_bytes > IN_FLIGHT_BYTES and len(in_flight) > 1:
                landed = in_flight.pop(0)
                landed.landed.synchronize()  # pace: what is not issued can still be spilled at the next step
                in_flight_bytes -= landed.nbytes
        with self._lock:  # every piece is issued or spilled, its drain issued: no hook adds copies any more
            ends = {}
            for device in {p.device for p in self.pieces}:
                ends[device] = self.gpu.event()
                ends[device].record(self.gpu.side_stream(device))
        for end in ends.values():
            end.synchronize()
        with self._lock:
            self._finished = True
            totals = self._owned_bytes()
            self.pieces, self._by_index = [], {}  # the sources, and views of the arena a resize would keep alive
        self._learn(totals)
        self.arena = None  # type: ignore[assignment]  # a kept handle holds no GPU memory

    def _owned_bytes(self) -> dict[int, int]:
        """Return per device the bytes of the arrays an optimizer owns (not those in now)."""
        totals: dict[int, int] = {}
        for piece in self.pieces:
            if piece.index not in self._now:
                totals[piece.device] = totals.get(piece.device, 0) + piece.nbytes
        return totals

    def _learn(self, owned_bytes: dict[int, int]) -> None:
        """Measure this save from its events (all landed): the GPU wait, the link's rate, the window; fit the arena.

        The first step's events are complete once the GPU passed its wait, which may come after the
        copy landed (a small state): that is waited for here, on the lazy thread, before the commit.
        Later steps (a CPU that runs ahead launches several while the copy runs) whose events the GPU
        has not reached yet are not waited for: all they wait for has landed, so they wait for nothing.
        """
        for began in self._step_began.values():
            _, after = next(step for step in self._steps if step[0] is began)
            after.synchronize()
        reached = [(before, after) for before, after in self._steps if after.query()]
        self.gpu_wait_s = sum(before.elapsed_time(after) for before, after in reached) / 1e3
        timed = [(s, e, n) for s, e, n in [*self._head.values(), *self._drains] if n >= MIN_TIMED_BYTES]
        for started, landed, nbytes in timed:
            seconds = started.elapsed_time(landed) / 1e3
            if seconds > 0:
                self.link.learn(rate_bps=nbytes / seconds)
        for device, began in self._step_began.items():
            self.link.learn(window_s=self.ready[device].elapsed_time(began) / 1e3)
        for device, owned in owned_bytes.items():
            tail = self.link.tail_bytes(owned)
            if tail is not None:
                self.arena.fit(device, tail + self._held_bytes_in_arena.get(device, 0))

    def before_step(self, indices: list[int]) -> None:
        """Order the stepping stream after the copies of these arrays, on the GPU (training thread, the pre-hook).

        Pieces not issued yet are spilled into the arena on the stepping stream and drained after the
        head; the stepping stream waits for the last piece issued from a source. A stream capturing a
        CUDA graph is refused (GraphCaptured): a replay would run the step without this hook.
        """
        with self._lock:
            if self._finished:
                return  # every byte is on the host: the step may change the sources at once
            for device, group in _by_device([p for i in indices for p in self._by_index.get(i, ())]).items():
                if self.gpu.capturing(device):
                    raise GraphCaptured(
                        "an optimizer step is being captured into a CUDA graph while a lazy save's copy of its "
                        "tensors is running: a replay of the graph would step without waiting for it. Wait for "
                        "the save (h.wait('memory')) before capturing, or save with lazy=False"
                    )
                not_issued = [p for p in group if p.landed is None and p.spill is None]
                last = _latest([p for p in group if p.landed is not None]).get(device)
                if not not_issued and (last is None or last.landed.query()):
                    continue  # every source copied already (a later step while the spill drains): nothing to wait for
                stepping = self.gpu.current_stream(device)
                before = self.gpu.event()
                before.record(stepping)
                self._step_began.setdefault(device, before)
                left, spilled = self._spill(not_issued, {device: stepping})
                for piece in left:  # past the arena: copied now and awaited below
                    self._issue(piece)
                    self.direct_bytes += piece.nbytes
                self._drain([p for p in not_issued if p.spill is not None], spilled)
                last = _latest([p for p in group if p.landed is not None]).get(device)
                if last is not None:  # a device's copies land in the order issued: the last one issued covers all
                    stepping.wait_event(last.landed)
                after = self.gpu.event()
                after.record(stepping)
                self._steps.append((before, after))

    def _issue(self, piece: _Piece) -> None:
        """Copy a piece from its source to the host on its side stream, with its own event (lock held)."""
        stream = self.gpu.side_stream(piece.device)
        stream.wait_event(self.ready[piece.device])  # first on this stream maybe: the hook can come before run()
        self.gpu.copy_all([(piece.dst, piece.src)], stream)
        piece.landed = self.gpu.event()
        piece.landed.record(stream)
        self._issued += 1
        piece.issued = self._issued

    def _spill(self, pieces: list[_Piece], streams: dict[int, Any]) -> tuple[list[_Piece], dict[int, Any]]:
        """Copy pieces device to device into the arena on their device's stream, as room allows (lock held).

        Return the pieces that did not fit, and per device an event recorded after the spill copies.
        """
        left = []
        used: dict[int, Any] = {}
        pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for piece in pieces:
            buffer = self.arena.buffers.get(piece.device)
            at = self._taken.get(piece.device, 0)
            if buffer is None or at + _aligned(piece.nbytes) > buffer.numel():
                left.append(piece)
                continue
            stream = used.get(piece.device)
            if stream is None:
                stream = used[piece.device] = streams[piece.device]
                stream.wait_event(self.ready[piece.device])  # the stepping stream may not be the one that saved
            # Each piece at a 256-byte boundary: any dtype views it, copies stay aligned.
            piece.spill = buffer[at : at + piece.nbytes].view(piece.src.dtype).view(piece.src.shape)
            pairs.setdefault(piece.device, []).append((piece.spill, piece.src))
            self._taken[piece.device] = at + _aligned(piece.nbytes)
            self.spilled_bytes += piece.nbytes
        spilled = {}
        for device, stream in used.items():
            self.gpu.copy_all(pairs[device], stream)
            spilled[device] = self.gpu.event()
            spilled[device].record(stream)
        return left, spilled

    def _drain(self, pieces: list[_Piece], spilled: dict[int, Any]) -> None:
        """Copy spilled pieces to the host on the side stream, once their spill is done (lock held)."""
        for device, group in _by_device(pieces).items():
            stream = self.gpu.side_stream(device)
            stream.wait_event(spilled[device])
            started, landed = self.gpu.event(), self.gpu.event()
            started.record(stream)
            self.gpu.copy_all([(p.dst, p.spill) for p in group if p.spill is not None], stream)
            landed.record(stream)
            self._drains.append((started, landed, sum(p.nbytes for p in group)))


def _by_device(pieces: list[_Piece]) -> dict[int, list[_Piece]]:
    """Group pieces by their device, each group in the order given."""
    groups: dict[int, list[_Piece]] = {}
    for piece in pieces:
        groups.setdefault(piece.device, []).append(piece)
    return groups


def _latest(pieces: list[_Piece]) -> dict[int, _Piece]:
    """Return the piece issued last on each device: waiting for it waits for every earlier one there."""
    latest: dict[int, _Piece] = {}
    for piece in pieces:
        if piece.landed is not None and (piece.device not in latest or piece.issued > latest[piece.device].issued):
            latest[piece.device] = piece
    return latest


def _aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _split(index: int, dst: torch.Tensor, src: torch.Tensor, device: int) -> list[_Piece]:
    """Cut a contiguous tensor into CHUNK_BYTES pieces (a strided one stays whole: copy_ gathers it)."""
    nbytes = src.numel() * src.element_size()
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
