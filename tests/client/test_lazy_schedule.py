"""The lazy GPU schedule of ckpt.cuda_staging, run unchanged on the timeline model of benchmarks/gpu_timeline.py.

No GPU is needed: the model answers the schedule's device calls (streams, events, copies,
allocations) with times from given bandwidths, and with real tensors it applies each copy and
kernel in time order, so a copy that a later write overtook saves the later bytes. The first
tests check the model itself; the others check the schedule's properties at the H100 figures
the issue measured (a model's prediction: tests/client/test_cuda_staging.py checks the GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch
from ckpt import cuda_staging

_path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_timeline.py"
_spec = importlib.util.spec_from_file_location("gpu_timeline", _path)
assert _spec is not None and _spec.loader is not None
gpu_timeline = importlib.util.module_from_spec(_spec)
sys.modules["gpu_timeline"] = gpu_timeline  # its dataclasses look their module up
_spec.loader.exec_module(gpu_timeline)

Timeline, ModelTrainer, Figures, H100 = (
    gpu_timeline.Timeline,
    gpu_timeline.ModelTrainer,
    gpu_timeline.Figures,
    gpu_timeline.H100,
)
KIB = 1 << 10

# A small trainer with real tensors: 1 MiB of state over a 64 MB/s link (16 ms), a 10 ms forward and
# backward pass launched in 2 ms, so that copies are in flight when the optimizer steps.
SMALL = Figures("small", d2h_bytes_per_s=64e6, d2d_bytes_per_s=4e9, step_s=0.011, forward_backward_s=0.010,
                launch_s=0.002, kernels=4, ahead_steps=1)  # fmt: skip


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Scale the schedule's byte constants to the small states here (each is read at its use)."""
    monkeypatch.setattr(cuda_staging, "CHUNK_BYTES", 16 * KIB)
    monkeypatch.setattr(cuda_staging, "IN_FLIGHT_BYTES", 64 * KIB)
    monkeypatch.setattr(cuda_staging, "MIN_TIMED_BYTES", 16 * KIB)
    monkeypatch.setattr(cuda_staging, "RATE_PROBE_BYTES", 128 * KIB)


def _trainer(figures=SMALL, spill_bytes=None, buffers=frozenset(), tensors=16, kib=64):
    timeline = Timeline(figures.d2h_bytes_per_s, figures.d2d_bytes_per_s, free_bytes=64 << 20, meta=False)
    state = [timeline.tensor(kib * KIB // 4) for _ in range(tensors)]
    trainer = ModelTrainer(figures, spill_bytes, timeline, state, buffers)
    trainer.wrong = []
    trainer.on_copied = lambda index: trainer.wrong.extend(trainer.check_saved())
    return trainer


# --- without the model ---


def test_pin_returns_at_once_for_a_pinned_slot_while_another_slot_registers(monkeypatch):
    slot = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setitem(cuda_staging._registered, slot.data_ptr(), slot.numel())  # as pin() leaves a pinned slot
    with cuda_staging._pin_lock:  # held by a registration of gigabytes, on the prefault thread
        done = threading.Event()
        threading.Thread(target=lambda: (cuda_staging.pin(slot, 0), done.set()), daemon=True).start()
        assert done.wait(10)


def test_the_link_issues_what_lands_by_the_step_and_what_the_arena_cannot_take():
    link = cuda_staging.Link()
    assert link.head_bytes(1000, room=600) == 400  # nothing known: spill what the arena takes
    assert link.tail_bytes(1000) is None
    link.learn(rate_bps=10_000, window_s=0.05)
    assert link.head_bytes(1000, room=600) == int(10_000 * 0.05 * cuda_staging.HEAD_MARGIN)
    assert link.head_bytes(1000, room=100) == 900
    assert link.head_bytes(100, room=1000) == 100
    assert link.tail_bytes(1000) == 1000 - int(10_000 * 0.05 * cuda_staging.HEAD_MARGIN)


# --- the model itself ---


def test_the_model_runs_a_copy_on_the_side_stream_beside_a_kernel_and_wait_event_holds_a_stream():
    tl = Timeline(d2h_bytes_per_s=1e9, d2d_bytes_per_s=1e12, meta=False)
    src, slot = tl.tensor(250_000), tl.host_empty(1_000_000)
    tl.kernel(0.010)
    tl.copy(slot.view(torch.float32), src, tl.side)  # 1 ms, at once: the side stream does not wait for compute
    landed = tl.event()
    landed.record(tl.side)
    tl.compute.wait_event(landed)
    after = tl.event()
    after.record(tl.compute)
    assert landed.time_s == pytest.approx(0.001, abs=1e-4)
    assert after.time_s == pytest.approx(0.010, abs=1e-4)  # the kernel ran beside the copy
    tl.side.wait_event(after)
    tl.copy(slot.view(torch.float32), src, tl.side)
    assert tl.copies[-1].start_s == pytest.approx(0.010, abs=1e-4)  # held until the compute stream got there


def test_the_model_applies_effects_in_time_order_so_an_overtaken_copy_saves_the_later_bytes():
    tl = Timeline(d2h_bytes_per_s=1e6, d2d_bytes_per_s=1e12, meta=False)
    src, slot = tl.tensor(250), tl.host_empty(1000).view(torch.float32)
    tl.copy(slot, src, tl.side)  # 1 ms: it reads its source at its end
    tl.kernel(0.0005, lambda: src.fill_(7))  # starts before the copy ends
    tl.finish()
    assert bool((slot == 7).all())


def test_a_background_thread_sleeps_on_the_model_clock_and_the_training_thread_sees_when_it_ended():
    tl = Timeline(d2h_bytes_per_s=1e6, d2d_bytes_per_s=1e12)
    src, slot = tl.tensor(250), tl.host_empty(1000)
    tl.copy(slot.view(torch.float32), src, tl.side)
    landed = tl.event()
    landed.record(tl.side)
    job = tl.spawn(landed.synchronize)
    assert job.done_s is None and tl.now_s < landed.time_s
    tl.join(job)
    assert job.done_s == pytest.approx(landed.time_s)


# --- the schedule on it ---


def test_the_head_is_issued_at_the_save_and_only_the_tail_is_spilled_at_the_step():
    trainer = _trainer()
    trainer.run(every=100, steps=1, save=False)
    trainer.save()
    copy = trainer.copies[-1]
    head = copy.direct_bytes
    issued = [c for c in trainer.timeline.copies if c.kind == "d2h"]
    assert head > 0 and copy.spilled_bytes == 0  # before any step: the head is on its way, nothing spilled
    assert sum(c.nbytes for c in issued[-len([p for p in copy.pieces if p.landed is not None]) :]) == head
    assert all(c.by_training_thread and c.start_s <= copy.ready[0].time_s + 1e-4 for c in issued[:1])
    trainer.step()  # its hook spills what the head does not cover
    trainer.copied()
    assert copy.spilled_bytes == trainer.state_bytes - head
    assert copy.direct_bytes == head
    assert trainer.wrong == []


def test_the_training_thread_never_waits_for_the_gpu_in_a_save_or_a_step_and_every_save_holds_its_step():
    trainer = _trainer()
    trainer.run(every=3, steps=30)
    assert len(trainer.copies) == 10
    assert trainer.schedule_waits == []
    assert trainer.wrong == []


def test_the_head_follows_what_the_link_moves_before_the_step():
    trainer = _trainer()
    trainer.run(every=4, steps=24)
    rate, window = trainer.schedule.link.estimate()
    assert rate == pytest.approx(SMALL.d2h_bytes_per_s, rel=0.1)
    assert window == pytest.approx(SMALL.forward_backward_s, rel=0.15)  # from the save's event to the step's
    last = trainer.copies[-1]
    assert last.direct_bytes == pytest.approx(rate * window * cuda_staging.HEAD_MARGIN, abs=16 * KIB)
    assert last.gpu_wait_s < 0.05 * trainer.state_bytes / SMALL.d2h_bytes_per_s
    assert trainer.wrong == []


def test_with_no_step_the_lazy_thread_copies_the_tail_itself_once_the_head_landed():
    trainer = _trainer()
    trainer.save()
    trainer.copied()
    copy = trainer.copies[-1]
    assert copy.spilled_bytes == 0 and copy.direct_bytes == trainer.state_bytes
    assert trainer.wrong == []


def test_a_step_that_comes_while_the_lazy_thread_issues_the_tail_spills_the_rest_and_waits_for_the_issued():
    late = Figures("a slow CPU", d2h_bytes_per_s=64e6, d2d_bytes_per_s=4e9, step_s=0.040, forward_backward_s=0.039,
                   launch_s=0.030, kernels=4, ahead_steps=1)  # fmt: skip
    trainer = _trainer(late, tensors=32)
    trainer.run(every=5, steps=10)
    first = trainer.copies[0]
    assert 0 < first.spilled_bytes < trainer.state_bytes - first._head[0][2]  # some of the tail went directly
    assert trainer.schedule_waits == [] and trainer.wrong == []


@pytest.mark.parametrize("spill_kib", [0, 96])
def test_with_no_arena_or_a_small_one_the_step_waits_on_the_gpu_and_every_save_is_right(spill_kib):
    trainer = _trainer(spill_bytes=spill_kib * KIB)
    trainer.run(every=3, steps=12)
    assert all(c.spilled_bytes <= spill_kib * KIB for c in trainer.copies)
    assert all(c.gpu_wait_s > 0 for c in trainer.copies)  # what the arena could not take, the step waited for
    assert trainer.schedule_waits == [] and trainer.wrong == []


@pytest.mark.parametrize("arena_kib", [None, 0])
def test_arrays_no_optimizer_owns_are_saved_as_they_were_before_the_next_forward_pass_changes_them(arena_kib):
    trainer = _trainer(spill_bytes=None if arena_kib is None else arena_kib * KIB, buffers=frozenset({0, 5}))
    trainer.run(every=2, steps=8)
    held = [c.held_bytes for c in trainer.copies]
    assert held == ([0] * 4 if arena_kib is None else [2 * 64 * KIB] * 4)  # past the arena: over PCIe, waited for
    assert trainer.schedule_waits == [] and trainer.wrong == []


def test_the_arena_fits_the_tail_the_saves_taught():
    trainer = _trainer()
    first = trainer.schedule.arena.capacity(0)
    assert first == pytest.approx(trainer.state_bytes * cuda_staging.ARENA_SHARE, abs=256)
    trainer.run(every=4, steps=16)
    tail = trainer.schedule.link.tail_bytes(trainer.state_bytes)
    assert trainer.schedule.arena.capacity(0) >= tail
    assert trainer.copies[-1].spilled_bytes <= trainer.schedule.arena.capacity(0)


def test_a_step_captured_into_a_cuda_graph_while_a_lazy_copy_runs_is_refused():
    trainer = _trainer()
    trainer.save()
    trainer.timeline.capture = True
    with pytest.raises(cuda_staging.GraphCaptured, match="captured into a CUDA graph"):
        trainer.copies[-1].before_step([0])


@pytest.mark.parametrize("every, overhead_at_most", [(2, 0.05), (10, 0.01)])
def test_at_h100_figures_a_lazy_save_costs_within_the_targets(every, overhead_at_most, monkeypatch):
    monkeypatch.undo()  # the real byte constants: gigabytes of meta tensors
    r = gpu_timeline.predict(H100, every)
    d2h_s = H100.state_bytes / H100.d2h_bytes_per_s
    assert r.overhead <= overhead_at_most
    assert r.optimizer_wait_s <= 0.05 * d2h_s
    assert r.first_wait_s <= 1.2 * r.optimizer_wait_s
    assert r.spilled_share <= 0.6
    assert r.schedule_waits_s == 0


def test_a_cpu_that_runs_steps_ahead_does_not_hold_the_copy_back_until_the_gpu_reaches_those_steps(monkeypatch):
    monkeypatch.undo()
    r = gpu_timeline.predict(dataclasses.replace(H100, ahead_steps=3), every=10)
    d2h_s = H100.state_bytes / H100.d2h_bytes_per_s
    assert r.host_copy_s < 1.2 * d2h_s  # from the GPU reaching the save to the copy done: the link's time
    assert r.overhead <= 0.01
