"""The CUDA path, on a real GPU (skipped without one, never faked).

Copies are ordered by events recorded on the saving thread's current stream; the lazy copy
overlaps training, the optimizer's stream waits for it on the GPU, and what PCIe has not
moved when the optimizer steps is spilled into GPU memory; prepare() makes the first save
cost what any save costs.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import ckpt
import pytest
import torch
from ckpt import cuda_staging
from ckpt.flatten import flatten, unflatten
from ckpt.staging import copy_into
from states import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WAIT_S = 120
MIB = 1 << 20
# GPU clock cycles of torch.cuda._sleep that keep a stream busy for far longer than a save_async call takes.
BUSY_CYCLES = 2_000_000_000


def test_device_tensors_land_whole_before_copy_into_returns():
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(4096, 1024, device="cuda", generator=g),
        "bf16": torch.randn(333, device="cuda", generator=g).to(torch.bfloat16),
        "view": torch.randn(64, 64, device="cuda", generator=g).t(),
        "cpu": torch.arange(10),
    }
    expected = {k: v.cpu().clone() for k, v in state.items()}
    flat = flatten(state)
    with mmap.mmap(-1, flat.data_size_bytes) as m:
        slot = torch.frombuffer(m, dtype=torch.uint8)
        with ThreadPoolExecutor(2) as pool:
            copy_into(flat, slot, pool)
        for t in (state["w"], state["bf16"]):
            t.zero_()  # the snapshot must not see later writes on the training stream
        back = unflatten(flat.layout(), slot.numpy().copy())
        cuda_staging.unregister(slot)  # before the mapping goes: a later mapping may take its addresses
    assert_same(expected, back)


def _trainer(size_mib: int, tensors: int = 4) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Parameters of size_mib in all (fp32, one of them a strided view's base), with gradients of one, and SGD(lr=1)."""
    params = [torch.zeros(size_mib * MIB // 4 // tensors, device="cuda", requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    return params, torch.optim.SGD(params, lr=1.0)


def _save_behind_queued_work(c: ckpt.Checkpointer, params, optimizer, lazy: bool, stream: torch.cuda.Stream):
    """On stream: queue a long kernel, then the values 7 written after it, save, step at once; return the handle.

    At save_async the values 7 are not written yet (they are queued behind the busy kernel): a copy not
    ordered after the caller's stream reads zeros, and one that is not ordered before the step reads 6.
    The slots are prepared first, so that the save itself is quick and the premise holds.
    """
    state = {"params": params, "note": "at the call"}
    c.prepare(state).result(timeout=WAIT_S)
    with torch.no_grad(), torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        for p in params:
            p.fill_(7.0)
        h = c.save_async(state, step=1, lazy=lazy)
        if lazy:
            assert not stream.query()  # the premise: the values 7 were not written when save_async returned
        optimizer.step()  # p = 7 - 1 = 6, after the snapshot
    return h


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("on", ["own-stream", "default-stream"])
def test_a_snapshot_holds_the_values_at_the_call_whatever_stream_trains(daemon, lazy, on):
    params, optimizer = _trainer(64)
    stream = torch.cuda.Stream() if on == "own-stream" else torch.cuda.default_stream()
    with ckpt.Checkpointer(job=f"gpu-order-{on}-{lazy}", address=daemon.address) as c:
        h = _save_behind_queued_work(c, params, optimizer, lazy, stream)
        h.wait("nvme", timeout=WAIT_S)
        torch.cuda.synchronize()
        assert all(bool((p == 6.0).all()) for p in params)  # the step ran after the snapshot
        back = c.load(1)
    assert back["note"] == "at the call"
    assert all(bool((t == 7.0).all()) for t in back["params"])


def test_the_optimizer_waits_on_the_gpu_and_spills_what_pcie_has_not_moved(daemon):
    # The lazy thread keeps a bounded amount of copies in flight; while the busy kernel holds them
    # back, the step must not wait for the rest: they are copied into GPU memory on its stream.
    params, optimizer = _trainer(1024, tensors=8)
    with ckpt.Checkpointer(job="gpu-spill", address=daemon.address) as c:
        h = _save_behind_queued_work(c, params, optimizer, True, torch.cuda.current_stream())
        h.wait("memory", timeout=WAIT_S)
        spilled = h.spilled_bytes
        h.wait("nvme", timeout=WAIT_S)
        back = c.load(1)
    assert spilled > 512 * MIB  # most of the GiB had not crossed PCIe when the optimizer stepped
    assert all(bool((t == 7.0).all()) for t in back["params"])
    assert all(bool((p == 6.0).all()) for p in params)


@pytest.mark.parametrize("spill_mib", [0, 256])
def test_the_spill_keeps_to_its_bound(daemon, spill_mib):
    params, optimizer = _trainer(1024, tensors=8)
    with ckpt.Checkpointer(job=f"gpu-spill-{spill_mib}", address=daemon.address, spill_bytes=spill_mib * MIB) as c:
        h = _save_behind_queued_work(c, params, optimizer, True, torch.cuda.current_stream())
        h.wait("nvme", timeout=WAIT_S)
        back = c.load(1)
    if spill_mib == 0:
        assert h.spilled_bytes == 0  # the optimizer's stream waited for the copies on the GPU instead
    else:
        assert 0 < h.spilled_bytes <= spill_mib * MIB
    assert all(bool((t == 7.0).all()) for t in back["params"])


def test_a_prepared_first_save_waits_for_nothing_and_an_unprepared_one_says_what_it_waited_for(daemon):
    params, _ = _trainer(512)
    state = {"params": params}
    with ckpt.Checkpointer(job="gpu-first-unprepared", address=daemon.address) as c:
        first = c.save_async(state, step=1)
        for step in (2, 3):  # the second maps the spare slot prefaulted meanwhile; the third is steady
            steady = c.save_async(state, step=step)
            steady.wait("nvme", timeout=WAIT_S)
    assert first.blocked_s > 0 and first.reason  # a new slot: allocated, mapped, faulted in, registered
    with ckpt.Checkpointer(job="gpu-first-prepared", address=daemon.address) as c:
        c.prepare(state).result(timeout=WAIT_S)
        prepared = c.save_async(state, step=1)
        prepared.wait("memory", timeout=WAIT_S)
    assert (prepared.blocked_s, prepared.reason) == (0.0, "")
    assert (steady.blocked_s, steady.reason) == (0.0, "")


def test_a_lazy_save_snapshots_buffers_at_the_call_without_waiting_for_the_gpu(daemon):
    # A buffer no optimizer owns (BatchNorm statistics, say) may change in the next forward pass: it is
    # copied on the GPU at the call, and save_async does not wait for the queued kernels to finish.
    params, optimizer = _trainer(64)
    buffer = torch.zeros(MIB, device="cuda")
    state = {"params": params, "buffer": buffer}
    with ckpt.Checkpointer(job="gpu-buffers", address=daemon.address) as c:
        c.prepare(state).result(timeout=WAIT_S)
        stream = torch.cuda.current_stream()
        with torch.no_grad():
            torch.cuda._sleep(BUSY_CYCLES)
            buffer.fill_(3.0)
            h = c.save_async(state, step=1, lazy=True)
            assert not stream.query()  # returned while the GPU was still busy before the save
            buffer.fill_(4.0)  # the next forward pass changes it
            optimizer.step()
        h.wait("nvme", timeout=WAIT_S)
        back = c.load(1)
    assert bool((back["buffer"] == 3.0).all())
    assert all(bool((t == 0.0).all()) for t in back["params"])
