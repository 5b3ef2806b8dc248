"""States that exercise every dtype and structure, and a bit-for-bit comparison."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import torch

Point = collections.namedtuple("Point", ["x", "y"])


class Holder:
    """A picklable object holding a tensor, as user state sometimes does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Planted:
    """A value whose unpickling writes marker, as any code a planted pickle names would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def every_kind_state(seed: int = 0) -> dict[str, Any]:
    """Return a state holding every dtype, layout and container ckpt promises to round-trip."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    dtypes = {}
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ):
        dtypes[str(dtype)] = (base * 7).to(dtype) if dtype != torch.bool else base > 0
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if hasattr(torch, name):
            dtypes[name] = base.to(getattr(torch, name))
    shared = torch.arange(5.0)
    nan_bits = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "dtypes": dtypes,
        "views": {
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "expanded": torch.arange(3.0).expand(4, 3),
            "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        },
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "nan_bits": nan_bits,
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "shared": [shared, shared],
        "tuple": (1, "two", 3.0, None),
        "namedtuple": Point(torch.ones(2), 5),
        "nested": {"list": [torch.zeros(3, dtype=torch.int64), {"deep": (torch.ones(1),)}], "set": {1, 2}},
        "numpy": {
            "f4": np.arange(12, dtype=np.float32).reshape(3, 4),
            "big_endian": np.arange(4, dtype=">i4"),
            "strided": np.arange(20.0)[::3],
            "structured": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8", (2,))]),
            "objects": np.array([1, "x", None], dtype=object),
            "scalar": np.float64(2.5),
        },
        "python": {"int": 2**70, "bytes": b"\x00\xff", "str": "résumé", "bool": True},
    }


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Assert a and b are the same structure with bit-identical tensors and arrays."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        ca = a.detach().resolve_conj().contiguous().reshape(-1)
        cb = b.detach().resolve_conj().contiguous().reshape(-1)
        assert torch.equal(ca.view(torch.uint8), cb.view(torch.uint8)), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), f"{path}: objects differ"
        else:
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
