"""A timeline model of one GPU, behind the calls ckpt.cuda_staging makes, and a training loop to drive it.

THIS IS A MODEL. It predicts what the lazy save's schedule does to a GPU-bound trainer from a
few figures (device-to-host and device-to-device bandwidth, the step's GPU time, the CPU's
launch time); a GPU run is what counts. It exists so that the schedule can be checked where no
GPU is: the real DeviceCopy, Link and SpillArena of ckpt.cuda_staging run against Timeline,
unchanged (Timeline answers the Gpu calls: streams, events, copies, allocations).

The device: a compute engine (kernels, and device-to-device copies, which run as kernels) and a
device-to-host copy engine, each running one operation at a time; streams that run their
operations in order; events recorded on streams; wait_event. Each operation's start and end are
fixed when it is enqueued: it starts once the CPU enqueued it, its stream's previous operation
ended, every event its stream waited on fired, and its engine has room (earlier gaps are filled).
The CPU: the training thread's clock advances by the work the loop says it does and by the calls
it makes (CALL_S each); it blocks only where the code synchronizes. Other threads (the lazy
thread's run()) run only while the training thread is not running, and a synchronize() there
sleeps until the clock reaches the event; so a run is deterministic.

Data: with real (CPU) tensors, an operation's effect happens in time order: a copy reads its
source and writes its destination at its end, a kernel writes at its start. A copy that a later
write overtook therefore saves the later bytes, as on a GPU, and a test sees it. With meta
tensors (the predictions, gigabytes of state) there is no data, only time.

    python benchmarks/gpu_timeline.py            # the predictions for an H100 (PCIe Gen5) and PCIe Gen4
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import statistics
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from ckpt import cuda_staging

CALL_S = 5e-6  # the CPU time of one call into CUDA (a launch, an event, a wait) on the training thread
LAUNCH_LATENCY_S = 5e-6  # from a launch on the CPU to the earliest start on the GPU
COPY_LATENCY_S = 2e-6  # fixed cost of one copy on its engine


class _Engine:
    """One unit that runs one operation at a time: its busy intervals, an operation placed in the first gap it fits."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    def place(self, ready_s: float, duration_s: float) -> float:
        start = ready_s
        i = bisect.bisect_left(self.busy, (ready_s, ready_s))
        i = max(0, i - 1)
        while i < len(self.busy):
            s, e = self.busy[i]
            if e <= start:
                i += 1
                continue
            if s >= start + duration_s:
                break
            start = e
            i += 1
        bisect.insort(self.busy, (start, start + duration_s))
        return start

    def forget_before(self, t_s: float) -> None:
        """Drop intervals that ended before t_s: no operation enqueued from now on can start before it."""
        keep = 0
        while keep < len(self.busy) and self.busy[keep][1] < t_s:
            keep += 1
        if keep > 64:
            del self.busy[:keep]


class ModelStream:
    """A stream: operations in order; wait_event holds those after it until the event fired."""

    def __init__(self, timeline: Timeline, name: str) -> None:
        self.timeline = timeline
        self.name = name
        self.tail_s = 0.0  # when its last operation ends
        self.waited_s = 0.0  # time its operations were held by wait_event beyond their other constraints

    def wait_event(self, event: ModelEvent) -> None:
        self.timeline.call()
        if event.time_s is not None:
            start = max(self.tail_s, self.timeline.cpu_s())
            self.waited_s += max(0.0, event.time_s - start)
            self.tail_s = max(self.tail_s, event.time_s)

    def __repr__(self) -> str:
        return f"ModelStream({self.name})"


class ModelEvent:
    """An event: the time its stream reached it; query/synchronize/elapsed_time as torch.cuda.Event's."""

    def __init__(self, timeline: Timeline, recorded_on: ModelStream | None = None) -> None:
        self.timeline = timeline
        self.time_s: float | None = None
        if recorded_on is not None:
            self.record(recorded_on)

    def record(self, stream: ModelStream) -> None:
        self.timeline.call()
        self.time_s = max(stream.tail_s, self.timeline.cpu_s() + LAUNCH_LATENCY_S)

    def query(self) -> bool:
        return self.time_s is None or self.time_s <= self.timeline.cpu_s()

    def synchronize(self) -> None:
        if self.time_s is not None:
            self.timeline.wait_until(self.time_s)

    def elapsed_time(self, end: ModelEvent) -> float:
        assert self.time_s is not None and end.time_s is not None, "elapsed_time of an event never recorded"
        return (end.time_s - self.time_s) * 1e3


class Copy(NamedTuple):
    """One copy the model ran: its kind, when, its bytes, and whether the training thread issued it."""

    kind: str  # "d2h" or "d2d"
    start_s: float
    end_s: float
    nbytes: int
    by_training_thread: bool


@dataclass
class _Sleeper:
    time_s: float
    woken: bool = False


@dataclass
class Job:
    """A thread started by Timeline.spawn: when it ended, what it raised."""

    done_s: float | None = None
    error: BaseException | None = None


class Timeline:
    """One modelled GPU and the CPU that drives it; the Gpu of ckpt.cuda_staging (see the module's docstring).

    The training thread is the thread that made it. It calls cpu() for its own work, kernel() for
    the trainer's GPU work, spawn()/join() for background threads, and the code under test calls
    the Gpu methods from any thread.
    """

    def __init__(
        self,
        d2h_bytes_per_s: float,
        d2d_bytes_per_s: float,
        free_bytes: int = 40 << 30,
        meta: bool = True,
    ) -> None:
        self.d2h_bytes_per_s = d2h_bytes_per_s
        self.d2d_bytes_per_s = d2d_bytes_per_s
        self.free = free_bytes
        self.meta = meta
        self.now_s = 0.0  # the clock: the training thread's, and a woken background thread's
        self.debt_s = 0.0  # the training thread's calls since its clock last moved
        self.training_thread = threading.get_ident()
        self.training_waits: list[tuple[float, float]] = []  # (at, seconds) the training thread blocked on the GPU
        self.engines = {"compute": _Engine(), "d2h": _Engine()}
        self.compute = ModelStream(self, "compute")
        self.side = ModelStream(self, "side")
        self.capture = False  # the compute stream is capturing a CUDA graph
        self.copies: list[Copy] = []  # in the order of issue
        self._host: dict[int, torch.Tensor] = {}  # kept: a storage freed could pass its address to device memory
        self._cv = threading.Condition()
        self._running = 0
        self._sleepers: list[_Sleeper] = []
        self._effects: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    # --- the Gpu calls of ckpt.cuda_staging ---

    def holds(self, array: Any) -> bool:
        return isinstance(array, torch.Tensor) and self._storage(array) not in self._host

    def device_of(self, tensor: torch.Tensor) -> int:
        return 0

    def current_stream(self, device: int) -> ModelStream:
        return self.compute

    def side_stream(self, device: int) -> ModelStream:
        return self.side

    def event(self) -> ModelEvent:
        return ModelEvent(self)

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: ModelStream) -> None:
        for dst, src in pairs:
            self.copy(dst, src, stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: ModelStream) -> None:
        """Copy src into dst on stream: device to host where dst is host memory, else device to device."""
        self.call()
        nbytes = src.numel() * src.element_size()
        to_host = self._storage(dst) in self._host
        rate = self.d2h_bytes_per_s if to_host else self.d2d_bytes_per_s
        engine = "d2h" if to_host else "compute"
        start, end = self._run(stream, engine, COPY_LATENCY_S + nbytes / rate)
        training = threading.get_ident() == self.training_thread
        self.copies.append(Copy("d2h" if to_host else "d2d", start, end, nbytes, training))
        if not self.meta:
            self._effect(end, lambda: dst.copy_(src))

    def empty(self, nbytes: int, device: int) -> torch.Tensor:
        if nbytes > self.free:
            raise torch.cuda.OutOfMemoryError(f"the model's device has {self.free} bytes free, not {nbytes}")
        self.free -= nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device="meta" if self.meta else "cpu")

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return self.host(torch.empty(nbytes, dtype=torch.uint8, device="meta" if self.meta else "cpu"))

    def free_bytes(self, device: int) -> int:
        return self.free

    def capturing(self, device: int) -> bool:
        return self.capture

    def set_device(self, device: int) -> None:
        pass

    def leave_captures_alone(self) -> None:
        pass

    # --- the trainer's side ---

    def host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Say that tensor is host memory (a staging slot): copies into it are device to host."""
        self._host[self._storage(tensor)] = tensor
        return tensor

    def tensor(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return a new tensor of device memory (zeros, or meta)."""
        return torch.zeros(*shape, dtype=dtype, device="meta" if self.meta else "cpu")

    def kernel(
        self, duration_s: float, effect: Callable[[], None] | None = None, stream: ModelStream | None = None
    ) -> None:
        """Launch a kernel of duration_s on the compute stream (or stream); effect, with real tensors, at its start."""
        self.call()
        start, _ = self._run(stream or self.compute, "compute", duration_s)
        if effect is not None and not self.meta:
            self._effect(start, effect)

    def cpu(self, seconds: float) -> None:
        """The training thread works for seconds (and pays for its calls since the clock last moved)."""
        self.advance(self.now_s + self.debt_s + seconds)

    def spawn(self, work: Callable[[], None]) -> Job:
        """Start work on a background thread; return once it sleeps or ended (training thread)."""
        job = Job()

        def body() -> None:
            try:
                work()
            except BaseException as e:  # the caller's join() raises it
                job.error = e
            finally:
                with self._cv:
                    self._running -= 1
                    job.done_s = self.now_s
                    self._cv.notify_all()

        with self._cv:
            self._running += 1
        threading.Thread(target=body, daemon=True).start()
        with self._cv:
            self._cv.wait_for(lambda: self._running == 0)
        return job

    def join(self, job: Job) -> None:
        """Block the training thread until job ended, the clock moving as its waits are met; raise what it raised."""
        began = self.now_s + self.debt_s
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._running == 0)
                if job.done_s is not None:
                    break
                if not self._sleepers:
                    raise RuntimeError("a background thread waits for something that never comes")
                next_s = min(s.time_s for s in self._sleepers)
            self.advance(max(next_s, self.now_s + self.debt_s))
        self.advance(max(job.done_s, self.now_s + self.debt_s))
        if self.now_s > began:
            self.training_waits.append((began, self.now_s - began))
        if job.error is not None:
            raise job.error

    def finish(self) -> float:
        """Let every operation end (training thread); return when the device went idle."""
        idle_s = max(self.compute.tail_s, self.side.tail_s)
        self.advance(max(idle_s, self.now_s + self.debt_s))
        return idle_s

    # --- the clock ---

    def call(self) -> None:
        if threading.get_ident() == self.training_thread:
            self.debt_s += CALL_S

    def cpu_s(self) -> float:
        """Return the calling thread's clock: the training thread's includes its calls not yet paid for."""
        return self.now_s + (self.debt_s if threading.get_ident() == self.training_thread else 0.0)

    def wait_until(self, t_s: float) -> None:
        """Block the calling thread until the clock reaches t_s (an event's synchronize)."""
        if threading.get_ident() == self.training_thread:
            began = self.cpu_s()
            if t_s > began:
                self.training_waits.append((began, t_s - began))
            self.advance(max(t_s, began))
            return
        with self._cv:
            if t_s <= self.now_s:
                return
            sleeper = _Sleeper(t_s)
            self._sleepers.append(sleeper)
            self._running -= 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: sleeper.woken)

    def advance(self, to_s: float) -> None:
        """Move the clock to to_s (training thread), waking each background thread at its time on the way."""
        self.debt_s = 0.0
        with self._cv:
            while True:
                self._cv.wait_for(lambda: self._running == 0)
                due = [s for s in self._sleepers if s.time_s <= to_s]
                if not due:
                    break
                wake_s = min(s.time_s for s in due)
                self._apply(wake_s)
                self.now_s = max(self.now_s, wake_s)
                for sleeper in [s for s in due if s.time_s <= wake_s]:
                    sleeper.woken = True
                    self._sleepers.remove(sleeper)
                    self._running += 1
                self._cv.notify_all()
            self._apply(to_s)
            self.now_s = max(self.now_s, to_s)
        for engine in self.engines.values():
            engine.forget_before(self.now_s)

    def _run(self, stream: ModelStream, engine: str, duration_s: float) -> tuple[float, float]:
        ready_s = max(stream.tail_s, self.cpu_s() + LAUNCH_LATENCY_S)
        start = self.engines[engine].place(ready_s, duration_s)
        stream.tail_s = start + duration_s
        return start, stream.tail_s

    def _effect(self, at_s: float, effect: Callable[[], None]) -> None:
        heapq.heappush(self._effects, (at_s, next(self._order), effect))

    def _apply(self, to_s: float) -> None:
        while self._effects and self._effects[0][0] <= to_s:
            heapq.heappop(self._effects)[2]()

    @staticmethod
    def _storage(tensor: torch.Tensor) -> int:
        return int(tensor.untyped_storage()._cdata)


@dataclass(frozen=True)
class Figures:
    """The device and the trainer to model: bandwidths, the step's GPU time, the CPU's launch time."""

    name: str
    d2h_bytes_per_s: float
    d2d_bytes_per_s: float = 1.32e12
    step_s: float = 0.0759  # the GPU time of one training step
    forward_backward_s: float = 0.0704  # of which the forward and backward pass
    launch_s: float = 0.010  # the CPU time to launch the forward and backward pass
    kernels: int = 24  # the forward and backward pass is launched as this many kernels
    ahead_steps: int = 1  # the CPU waits for the end of the step this many steps back (a loss.item()); 0: never
    state_bytes: int = 7_600_000_000  # parameters and AdamW moments, fp32


# Measured on an H100 PCIe Gen5 (issue 22): GPT-style 634 M parameters, fused AdamW, bf16 autocast.
H100 = Figures("H100 PCIe Gen5 (54.9 GB/s)", 54.9e9)
GEN4 = Figures("PCIe Gen4 (25 GB/s)", 25e9)


def gpt_tensors(timeline: Timeline, state_bytes: int, width: int = 1536, vocab: int = 50304) -> list[torch.Tensor]:
    """Return a GPT-like state of about state_bytes: each parameter and its two AdamW moments, fp32, in that order."""
    per_layer = [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                 (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]  # fmt: skip
    layer_bytes = 12 * sum(_numel(s) for s in per_layer)
    embed = [(vocab, width), (width,), (width,)]
    layers = max(1, round((state_bytes - 12 * sum(_numel(s) for s in embed)) / layer_bytes))
    shapes = embed[:1] + per_layer * layers + embed[1:]
    params = [timeline.tensor(*s) for s in shapes]
    moments = [timeline.tensor(*s) for s in shapes for _ in range(2)]
    return params + moments


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


@dataclass
class Prediction:
    """What the model predicts for one save interval (seconds, bytes); every figure is the model's."""

    figures: str
    every: int
    steps: int
    saves: int
    step_none_s: float
    overhead: float  # (window - none's window) / none's window
    optimizer_wait_s: float  # per steady save: the GPU time stepping streams waited for it (its own events)
    first_wait_s: float  # the same for the first save of a prepared job
    spilled_bytes: float  # per steady save (after the first)
    spilled_share: float
    host_copy_s: float  # per steady save: from the GPU reaching the save to its last byte on the host
    blocked_s: float  # per save: the training thread waited for the previous copy (policy block)
    schedule_waits_s: float  # per save: the training thread blocked on the GPU inside save_async or the hook
    held_by_wait_event_s: float = 0.0  # per save: the compute stream held by wait_event, as the model saw it
    note: str = "MODEL PREDICTION, not a measurement"
    saves_detail: list[dict[str, float]] = field(default_factory=list)


class ModelTrainer:
    """A GPU-bound training loop on a Timeline, saving lazily through the real DeviceCopy every few steps.

    It does what Checkpointer.save_async(lazy=True) and the optimizer's pre-hook do for CUDA arrays:
    ready events on the training thread, a DeviceCopy (which issues the head), its run() on a
    background thread, before_step() before each optimizer step while a copy runs, and under
    [staging] policy block a save that finds the previous copy running waits for it.

    Each step: the forward and backward pass (f.kernels kernels, launched over f.launch_s; with real
    tensors the first one adds 1 to the arrays in buffers, which no optimizer owns), the pre-hook,
    the optimizer's kernel (with real tensors it adds 1 to every other array). So a save after k
    steps holds k in every element: check_saved() says whether it does.
    """

    def __init__(
        self,
        figures: Figures,
        spill_bytes: int | None = None,
        timeline: Timeline | None = None,
        tensors: list[torch.Tensor] | None = None,
        buffers: frozenset[int] = frozenset(),
    ) -> None:
        self.figures = figures
        self.timeline = timeline or Timeline(figures.d2h_bytes_per_s, figures.d2d_bytes_per_s)
        self.tensors = tensors if tensors is not None else gpt_tensors(self.timeline, figures.state_bytes)
        self.buffers = buffers
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.slot = self.timeline.host_empty(self.state_bytes)
        self.items = []
        at = 0
        for i, t in enumerate(self.tensors):
            n = t.numel() * t.element_size()
            self.items.append((i, self.slot[at : at + n].view(t.dtype).view(t.shape), t))
            at += n
        self.schedule: Any = _NewSchedule(self, spill_bytes)
        self.copies: list[Any] = []
        self.jobs: list[Job] = []
        self.saved_after: list[int] = []  # per save: the steps taken before it
        self.steps_taken = 0
        self.blocked_s = 0.0  # the training thread waited for the previous copy (policy block)
        self.schedule_waits: list[tuple[float, float]] = []  # the training thread blocked inside save or the hook
        self.on_copied: Callable[[int], None] | None = None  # called with a save's index once its copy landed
        self._reported = 0  # saves handed to on_copied

    def run(self, every: int, steps: int, save: bool = True) -> float:
        """Train steps steps, saving at the top of every every-th; return the window (from start to idle)."""
        f, tl = self.figures, self.timeline
        start_s = tl.finish()
        ends: list[ModelEvent] = []
        for k in range(steps):
            if save and k % every == 0:
                self.save()
            ends.append(self.step())
            if f.ahead_steps and k >= f.ahead_steps:
                ends[k - f.ahead_steps].synchronize()
        self.copied()
        return tl.finish() - start_s

    def step(self) -> ModelEvent:
        """Launch one step: the forward and backward pass, the pre-hook, the optimizer; return its end's event."""
        f, tl = self.figures, self.timeline
        for n in range(f.kernels):
            tl.cpu(f.launch_s / f.kernels)
            tl.kernel(f.forward_backward_s / f.kernels, self._forward if n == 0 else None)
        if self.copies and self.jobs[-1].done_s is None:
            self._watched(self._pre_hook)  # the optimizer step pre-hook
        tl.cpu(0.0005)
        tl.kernel(f.step_s - f.forward_backward_s, self._step)
        self.steps_taken += 1
        return ModelEvent(tl, recorded_on=tl.compute)

    def save(self) -> None:
        """Save lazily, after the previous save's copy (policy block): the DeviceCopy, its run() in the background."""
        tl = self.timeline
        if self.jobs and self.jobs[-1].done_s is None:
            began = tl.cpu_s()
            tl.join(self.jobs[-1])
            self.blocked_s += tl.cpu_s() - began
        self.copied()
        copy = self._watched(self.schedule.save)
        self.copies.append(copy)
        self.saved_after.append(self.steps_taken)
        self.jobs.append(tl.spawn(copy.run))

    def copied(self) -> None:
        """Wait for the last save's copy (training thread) and hand it to on_copied once."""
        if not self.jobs:
            return
        self.timeline.join(self.jobs[-1])
        if self.on_copied is not None and len(self.copies) > self._reported:
            self._reported = len(self.copies)
            self.timeline.finish()  # every effect of the copy applied
            self.on_copied(len(self.copies) - 1)

    def check_saved(self) -> list[str]:
        """Return what the slot holds wrongly for the last save (real tensors): each array must hold its step."""
        expected = self.saved_after[-1]
        return [f"array {i}: {dst.unique().tolist()}, not {expected}" for i, dst, _ in self.items
                if not bool((dst == expected).all())]  # fmt: skip

    def _forward(self) -> None:
        for i in self.buffers:
            self.tensors[i].add_(1)

    def _step(self) -> None:
        for i, t in enumerate(self.tensors):
            if i not in self.buffers:
                t.add_(1)

    def _pre_hook(self) -> None:
        owned = [i for i, _, _ in self.items if i not in self.buffers]
        self.copies[-1].before_step(owned)

    def _watched(self, call: Callable[[], Any]) -> Any:
        """Make a call of the schedule on the training thread, keeping any wait of it for the GPU."""
        before = len(self.timeline.training_waits)
        result = call()
        self.schedule_waits += self.timeline.training_waits[before:]
        return result


class _NewSchedule:
    """A lazy save as Checkpointer makes it: one Link and one SpillArena for the job, prepared ahead."""

    def __init__(self, trainer: ModelTrainer, spill_bytes: int | None) -> None:
        self.trainer = trainer
        tl = trainer.timeline
        self.link = cuda_staging.Link()
        self.arena = cuda_staging.SpillArena(spill_bytes, gpu=tl)
        # prepare(): a timed copy for the first rate, an arena of ARENA_SHARE of what optimizers own.
        owned = [t for i, t in enumerate(trainer.tensors) if i not in trainer.buffers]
        self.link.measure_rate(max(owned, key=lambda t: t.numel() * t.element_size()), gpu=tl)
        if spill_bytes != 0:
            self.arena.ensure(0, int(sum(t.numel() * t.element_size() for t in owned) * cuda_staging.ARENA_SHARE))

    def save(self) -> cuda_staging.DeviceCopy:
        tl, trainer = self.trainer.timeline, self.trainer
        ready = cuda_staging.ready_events(trainer.tensors, gpu=tl)
        return cuda_staging.DeviceCopy(trainer.items, ready, self.link, self.arena, trainer.buffers, tl)


def predict(
    figures: Figures,
    every: int,
    steps: int | None = None,
    spill_bytes: int | None = None,
    schedule: Callable[[ModelTrainer], Any] | None = None,
) -> Prediction:
    """Model a window of saves every every steps against one without; return the prediction.

    schedule: a factory of another schedule to model (an object whose save() returns a DeviceCopy-like copy).
    """
    steps = steps or max(20, 4 * every if every <= 10 else 2 * every)
    none = ModelTrainer(figures)
    none.run(every, 3, save=False)
    none_s = none.run(every, steps, save=False)
    trainer = ModelTrainer(figures, spill_bytes)
    if schedule is not None:
        trainer.schedule = schedule(trainer)
    trainer.run(every, 3, save=False)  # warm, as the benchmark does
    window_s = trainer.run(every, steps)
    detail = []
    for copy, job in zip(trainer.copies, trainer.jobs, strict=True):
        ready = next(iter(copy.ready.values()))
        detail.append({
            "spilled_bytes": float(copy.spilled_bytes),
            "direct_bytes": float(getattr(copy, "direct_bytes", 0)),
            "gpu_wait_s": float(copy.gpu_wait_s or 0.0),
            "host_copy_s": float((job.done_s or 0.0) - (ready.time_s or 0.0)),
        })  # fmt: skip
    steady = detail[1:] or detail
    saves = len(detail)
    return Prediction(
        figures=figures.name,
        every=every,
        steps=steps,
        saves=saves,
        step_none_s=none_s / steps,
        overhead=window_s / none_s - 1,
        optimizer_wait_s=statistics.mean(d["gpu_wait_s"] for d in steady),
        first_wait_s=detail[0]["gpu_wait_s"],
        spilled_bytes=statistics.mean(d["spilled_bytes"] for d in steady),
        spilled_share=statistics.mean(d["spilled_bytes"] for d in steady) / trainer.state_bytes,
        host_copy_s=statistics.mean(d["host_copy_s"] for d in steady),
        blocked_s=trainer.blocked_s / saves,
        schedule_waits_s=sum(s for _, s in trainer.schedule_waits) / saves,
        held_by_wait_event_s=trainer.timeline.compute.waited_s / saves,
        saves_detail=detail,
    )


def main() -> int:
    """Print the predictions for the H100 and PCIe Gen4 figures at a save every 1, 2, 10 and 50 steps."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 10, 50], help="save intervals")
    p.add_argument("--spill-bytes", type=int, default=None, help="Checkpointer spill_bytes (default: the arena's own)")
    p.add_argument("--json", type=Path, default=None, help="also write the predictions here")
    args = p.parse_args()
    rows = []
    print("MODEL PREDICTIONS (benchmarks/gpu_timeline.py), not measurements: a GPU run is what counts")
    header = (f"{'figures':<28} {'every':>5} {'overhead':>9} {'opt wait/save':>14} {'first':>9} {'spill/save':>11} "
              f"{'spill %':>8} {'host copy':>10} {'blocked/save':>13}")  # fmt: skip
    print(header)
    for figures in (H100, GEN4):
        for every in args.every:
            r = predict(figures, every, spill_bytes=args.spill_bytes)
            rows.append(asdict(r))
            print(f"{r.figures:<28} {r.every:>5} {r.overhead:>8.1%} {r.optimizer_wait_s * 1e3:>11.1f} ms "
                  f"{r.first_wait_s * 1e3:>6.1f} ms "
                  f"{r.spilled_bytes / 1e9:>8.2f} GB {r.spilled_share:>7.0%} {r.host_copy_s * 1e3:>7.0f} ms "
                  f"{r.blocked_s * 1e3:>10.1f} ms", flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
