"""`ckptd inspect` reads a step's tensor table with no torch: keys, dtypes, shapes, bytes, ranks."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys

import numpy as np
import torch
from ckpt.flatten import flatten
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta

from ckptd.offline.inspect import inspect_step
from ckptd.tiers.nvme import LocalDirTier


class Opaque:
    """A class the inspector may not build: it becomes a placeholder."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _save(tier: LocalDirTier, state: object, rank: int, world_size: int) -> None:
    flat = flatten(state)
    buffer = mmap.mmap(-1, max(4096, flat.data_size_bytes))
    for array, entry in zip(flat.arrays, flat.entries, strict=True):
        raw = array.contiguous().view(torch.uint8).reshape(-1).numpy() if isinstance(array, torch.Tensor) else array
        buffer[entry["offset"] : entry["offset"] + entry["nbytes"]] = np.ascontiguousarray(raw).tobytes()
    meta = ShardMeta(
        "j", 7, rank, world_size, flat.data_size_bytes, CHUNK_SIZE_BYTES, (), json.dumps(flat.layout()), "run"
    )
    tier.write_shard(meta, memoryview(buffer))


def test_keys_dtypes_shapes_bytes_and_ranks_of_every_tensor(tmp_path):
    tier = LocalDirTier(tmp_path / "nvme")
    for rank in range(2):
        state = {
            "model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
            "opt": [torch.arange(4)],
            "np": np.ones((5,), dtype=np.float16),
            "step": 5,
            "hidden": Opaque(torch.ones(1)),
        }
        _save(tier, state, rank, 2)
    assert tier.try_commit("j", 7, 2) is not None

    found = inspect_step([tier], "j", 7)

    rows = {r.key: r for r in found.tensors}
    assert found.world_size == 2 and found.tier == "nvme"
    assert (rows["model.w"].dtype, rows["model.w"].shape, rows["model.w"].size_bytes) == ("float32", [2, 3], 24)
    assert (rows["model.b"].dtype, rows["model.b"].shape, rows["model.b"].size_bytes) == ("bfloat16", [3], 6)
    assert (rows["opt.0"].dtype, rows["opt.0"].size_bytes, rows["opt.0"].kind) == ("int64", 32, "tensor")
    assert rows["np"].kind == "numpy" and rows["np"].shape == [5]
    assert rows["model.w"].ranks == [0]  # every rank saved its own: rank 1's is listed beside it
    assert rows["model.w (rank 1)"].ranks == [1]
    assert any(k.startswith("(tensor ") for k in rows)  # the tensor inside Opaque has no key


def test_the_inspector_never_imports_torch():
    code = "import sys, ckptd.offline.inspect; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
