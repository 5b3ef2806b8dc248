"""The skeleton unpickler under weights_only=True: torch.load(weights_only=True)'s allow-list, nothing else."""

from __future__ import annotations

import argparse
import collections
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from ckpt.flatten import flatten, unflatten
from ckpt.staging import copy_into
from ckpt_core.errors import UnsafeCheckpoint
from states import Planted, Point, assert_same


def _load(state, weights_only: bool = True):
    flat = flatten(state)
    buffer = torch.zeros(flat.data_size_bytes, dtype=torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        copy_into(flat, buffer, pool, threads=1)
    return unflatten(flat.layout(), buffer.numpy(), weights_only=weights_only, what="rank 0 shard of j step 1")


def test_what_torch_load_weights_only_takes_round_trips():
    state = {
        "ordered": collections.OrderedDict(a=torch.ones(2), b=1),
        "counter": collections.Counter("aab"),
        "torch": {"size": torch.Size([2, 3]), "dtype": torch.float8_e4m3fn, "device": torch.device("cpu")},
        "python": {"set": {1, 2}, "frozen": frozenset({3}), "complex": 1 + 2j, "bytearray": bytearray(b"\x00")},
        "arrays": [np.arange(6, dtype=">f4").reshape(2, 3), np.zeros(2, dtype=[("a", "<i4")])],  # in the table
        "param": torch.nn.Parameter(torch.randn(2)),
    }
    assert_same(_load(state), state)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (argparse.Namespace(lr=0.1), "argparse.Namespace"),
        (Point(1, 2), "states.Point"),
        (collections.defaultdict(int), "collections.defaultdict"),
        (np.float64(2.5), "numpy"),  # a numpy scalar, as torch.load(weights_only=True) refuses it
        (np.array([1, "x"], dtype=object), "numpy"),  # an object array is pickled, not in the table
    ],
)
def test_any_other_global_is_refused_by_name(value, named):
    with pytest.raises(UnsafeCheckpoint, match=f"rank 0 shard of j step 1 holds {named}") as refused:
        _load({"v": value})
    assert refused.value.global_name.startswith(named)
    assert _load({"v": value}, weights_only=False)["v"] is not None  # weights_only=False: in full


def test_the_users_safe_globals_are_taken_and_torchs_blocked_modules_never(tmp_path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert _load({"v": argparse.Namespace(lr=0.1)})["v"] == argparse.Namespace(lr=0.1)
    with pytest.raises(UnsafeCheckpoint, match="argparse"):
        _load({"v": argparse.Namespace(lr=0.1)})

    class Shell:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    with torch.serialization.safe_globals([os.system]), pytest.raises(UnsafeCheckpoint, match=r"posix\.system"):
        _load({"v": Shell()})  # torch blocks os (posix) whatever the user allows
    with pytest.raises(UnsafeCheckpoint, match=r"builtins\.exec"):
        _load({"v": Planted(tmp_path / "ran")})
    assert not (tmp_path / "ran").exists()
