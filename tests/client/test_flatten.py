"""Flattening a state and staging it: every dtype and structure round-trips bit for bit."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from ckpt.flatten import flatten, unflatten
from ckpt.key_filter import KeyFilter
from ckpt.staging import copy_into
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import TENSOR_ALIGN_BYTES
from states import assert_same, every_kind_state
from torch.testing._internal.two_tensor import TwoTensor


def _round_trip(state):
    flat = flatten(state)
    buffer = torch.zeros(flat.data_size_bytes, dtype=torch.uint8)
    with ThreadPoolExecutor(3) as pool:
        copy_into(flat, buffer, pool, threads=3)
    return flat, unflatten(flat.layout(), buffer.numpy())


def test_every_kind_round_trips_bit_for_bit():
    state = every_kind_state()
    _, back = _round_trip(state)
    assert_same(state, back)


def test_tensor_seen_twice_comes_back_as_one_object():
    _, back = _round_trip(every_kind_state())
    assert back["shared"][0] is back["shared"][1]


def test_offsets_are_aligned_and_do_not_overlap():
    flat = flatten(every_kind_state())
    ends = 0
    for entry in sorted(flat.entries, key=lambda e: e["offset"]):
        assert entry["offset"] % TENSOR_ALIGN_BYTES == 0
        assert entry["offset"] >= ends
        ends = entry["offset"] + entry["nbytes"]
    assert flat.data_size_bytes >= ends


def test_large_state_copies_in_parallel_correctly():
    state = {f"t{i}": torch.randn(1 << 20) for i in range(20)}  # 80 MiB: above the parallel threshold
    _, back = _round_trip(state)
    assert_same(state, back)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"f": lambda x: x}, "cannot be checkpointed"),
        ({"lock": threading.Lock()}, "cannot be checkpointed"),
        ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
        ({"meta": torch.empty(3, device="meta")}, "device meta"),
    ],
)
def test_unsupported_objects_are_a_clear_error(bad, message):
    with pytest.raises(InvalidArgument, match=message):
        flatten(bad)


def test_a_wrapper_tensor_is_refused_by_its_key_or_as_a_tensor_where_it_has_none():
    two = TwoTensor(torch.ones(2), torch.ones(2))
    with pytest.raises(InvalidArgument, match=r"cannot checkpoint model\.x: a TwoTensor is a wrapper"):
        flatten({"n": 1, "model": {"w": torch.ones(2), "x": two}})
    with pytest.raises(InvalidArgument, match="cannot checkpoint a tensor: a TwoTensor is a wrapper"):
        flatten({"holder": SimpleNamespace(x=two)})  # inside an object: no key


def test_loaded_tensors_have_storages_of_their_own():
    rng = torch.get_rng_state()
    _, back = _round_trip({"pad": torch.ones(1000), "rng": rng})
    assert back["rng"].storage_offset() == 0
    assert back["rng"].untyped_storage().nbytes() == rng.numel()
    torch.set_rng_state(back["rng"])  # torch reads the storage from its start
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_loaded_state_frees_its_buffer_when_dropped_not_when_the_collector_runs():
    import gc
    import weakref

    import numpy as np

    flat = flatten({"w": torch.arange(1000, dtype=torch.float32), "extra": [1, 2]})
    buffer = torch.zeros(flat.data_size_bytes, dtype=torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        copy_into(flat, buffer, pool, threads=1)
    data = np.array(buffer.numpy())  # the shard's bytes, as a load reads them into fresh memory
    gone = weakref.finalize(data, lambda: None)
    gc.disable()  # a reference cycle would keep the bytes until the collector runs: none may
    try:
        state = unflatten(flat.layout(), data)
        del data
        assert gone.alive
        del state
        assert not gone.alive, "the loaded state's bytes outlived the state"
    finally:
        gc.enable()


def test_replicated_keys_become_one_chunk_that_only_rank_0_writes():
    weight = torch.ones(3, 2)
    state = {"model": {"w": weight, "again": weight}, "rng": torch.zeros(4)}
    owner = flatten(state, KeyFilter.of("model", None), rank=0)
    other = flatten(state, KeyFilter.of("model", None), rank=1)
    assert owner.dtensors["model.w"]["placements"] == ["Replicate()"] and "model.again" not in owner.dtensors
    assert [e["kind"] for e in owner.entries] == ["chunk", "torch"]  # the tensor once, under its first key
    assert [e["kind"] for e in other.entries] == ["torch"] and "model.w" in other.dtensors  # listed, not written
    assert other.data_size_bytes < owner.data_size_bytes


def test_a_value_that_cannot_be_pickled_is_named_by_its_key():
    with pytest.raises(InvalidArgument, match=r"at key 'a\.b\.1\.c': .*pickle"):
        flatten({"a": {"b": [1, {"c": lambda: 0}]}, "w": torch.zeros(2)})


def test_flattening_a_state_without_dtensors_never_imports_torch_distributed_tensor():
    # That import takes about half a second: a first prepare() or save_async would block on it.
    code = (
        "import sys, torch\nfrom ckpt.flatten import flatten\n"
        "flatten({'model': torch.nn.Linear(4, 4).state_dict(), 'step': 3})\n"
        "print('torch.distributed.tensor' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
