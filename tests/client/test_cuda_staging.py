"""The CUDA staging path: device tensors copied into a registered slot on a side stream."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ckpt.flatten import flatten, unflatten
from ckpt.staging import copy_into
from states import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


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
    assert_same(expected, back)
