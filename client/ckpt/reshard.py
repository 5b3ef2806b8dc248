"""Fill a state in place from a saved step, whatever the sharding on either side: the load(into=...) path.

The load path (ckpt.load_path) and load_local call load_into on the loading thread, in this order:
1. the home rank's layout (this rank's own number in the saved step, or rank 0 when
   the step had fewer ranks) gives the saved structure, its plain tensors and values;
2. plan(): `into` is walked beside it; every tensor and DTensor of `into` is matched
   by key with a saved one, and shapes are checked and dtypes cast where copy_ casts
   (check_cast), before any byte moves;
3. each target's local box (DTensor.__create_chunk_list__) is intersected with the
   saved chunks of the step index; each overlap becomes a row range of one saved
   chunk, a byte range of one rank's data;
4. StepReader reads those ranges, rank by rank, checked chunk by chunk, and each
   overlap is copied into its target as its run arrives (on the reading threads);
5. values that are not tensors are replaced by the saved ones;
6. each Stateful object of `into` (ckpt.stateful), whose state_dict() was walked in its
   place in 2, gets the filled dict through its load_state_dict(), innermost first.
Every rank plans alone, from the index: no collective.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import logging
import pickle
import warnings
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import keyed_leaves
from ckpt_core.step_index import SavedChunk, SavedTensor, StepIndex

from ckpt.flatten import unflatten
from ckpt.key_filter import ALL_KEYS, KeyFilter, LoadReport
from ckpt.range_read import StepReader
from ckpt.sharding import is_dtensor, local_box
from ckpt.skeleton_unpickler import SkeletonUnpickler
from ckpt.stateful import is_stateful

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class TensorRef:
    """A plain tensor or array of the home rank's layout, by its entry."""

    entry: int


@dataclass(frozen=True)
class DTensorRef:
    """A sharded tensor of the step, by its key in the index."""

    key: str


@dataclass(frozen=True)
class _Copy:
    """Copy one overlap: rows [row_lo, row_hi) of a saved chunk, sliced, into a region of a target."""

    chunk: SavedChunk
    dtype: torch.dtype  # the saved one: the bytes are read as it, and copy_ casts them to the target's
    row_lo: int
    row_hi: int
    source_slices: tuple[slice, ...]  # in the rows read, every dimension
    target: torch.Tensor  # the target's region, a view

    def byte_range(self) -> ByteRange:
        """Return the bytes of the saved rank's data this copy reads."""
        if not self.chunk.lengths:  # 0-d: the whole chunk
            return ByteRange(self.chunk.offset, self.chunk.nbytes)
        row_bytes = self.chunk.nbytes // self.chunk.lengths[0]
        return ByteRange(self.chunk.offset + self.row_lo * row_bytes, (self.row_hi - self.row_lo) * row_bytes)

    def apply(self, run_start: int, run: np.ndarray) -> None:
        lo, hi = (wanted := self.byte_range()).offset, wanted.end
        rows = torch.from_numpy(run[lo - run_start : hi - run_start]).view(self.dtype)
        shape = (self.row_hi - self.row_lo, *self.chunk.lengths[1:]) if self.chunk.lengths else ()
        source = rows.view(shape)[self.source_slices]
        if source.is_complex() and not self.target.is_complex():
            source = source.real  # what copy_ keeps, without its warning (check_cast logged the key)
        self.target.copy_(source)


def load_into(
    into: Any,
    reader: StepReader,
    index: StepIndex | None,
    rank: int,
    strict: bool = True,
    keys: KeyFilter = ALL_KEYS,
    weights_only: bool = False,
) -> tuple[Any, LoadReport]:
    """Fill into from what reader reads (see the module docstring); return it and what was left as it was.

    rank is this rank's. Only the keys that keys takes are loaded (ckpt.key_filter); the
    others of into stay as they are. strict=False loads what both hold and reports the
    keys only one holds, where strict raises InvalidArgument naming the first. weights_only
    unpickles the saved values with torch.load(weights_only=True)'s allow-list.
    """
    home = rank if rank < len(reader.digests) else 0
    meta = reader.meta(home)
    try:
        layout = json.loads(meta.layout_json)
        saved = load_skeleton(layout, weights_only, f"rank {home} shard of {meta.job} step {meta.step}")
    except (KeyError, TypeError, ValueError, pickle.UnpicklingError) as e:
        raise CorruptCheckpoint(f"rank {home} layout of {meta.job} step {meta.step}: {e!r}") from None
    planner = _Planner(layout["tensors"], index, home, strict, keys)
    result = [into]
    planner.walk(into, saved, "", partial(_assign, result, 0))
    _execute(reader, planner.copies)
    if planner.replaced:
        needed = set().union(*(refs_in(_at(saved, path)) for _, path in planner.replaced))
        values = realize(reader, home, layout, needed, weights_only)
        for assign, path in planner.replaced:
            assign(_at(values, path))
    for rebuild in planner.rebuilds:
        rebuild()
    return result[0], LoadReport(reader.step, tuple(planner.missing), tuple(planner.unexpected))


def report_left(report: LoadReport, job: str) -> None:
    """Log what a strict=False load left: keys of into it did not fill (a warning), tensors it did not read."""
    for what, found, level in (
        ("keys of `into` the step lacks, left as they were", report.missing_keys, logging.WARNING),
        ("tensors of the step `into` has no place for, not read", report.unexpected_keys, logging.INFO),
    ):
        if found:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            log.log(level, "ckpt: %s step %d: %d %s: %s", job, report.step, len(found), what, shown)


def _execute(reader: StepReader, copies: list[_Copy]) -> None:
    """Read what the copies need, rank by rank, and copy each overlap into its target as its run arrives."""
    by_rank: dict[int, list[_Copy]] = defaultdict(list)
    for copy in copies:
        by_rank[copy.chunk.rank].append(copy)
    for rank, of_rank in sorted(by_rank.items()):
        _read_and_copy(reader, rank, of_rank)


def _read_and_copy(reader: StepReader, rank: int, copies: list[_Copy]) -> None:
    spans = sorted(((c.byte_range(), i) for i, c in enumerate(copies)), key=lambda s: s[0].offset)
    starts = [span.offset for span, _ in spans]

    def consume(run_start: int, run: np.ndarray) -> None:
        # A run is whole chunks around whole spans: the spans that start in it end in it.
        run_end = run_start + len(run)
        for span, i in spans[bisect_left(starts, run_start) : bisect_left(starts, run_end)]:
            if span.end <= run_end:
                copies[i].apply(run_start, run)

    reader.read(rank, [span for span, _ in spans], consume)


def load_skeleton(layout: dict[str, Any], weights_only: bool, what: str) -> Any:
    """Unpickle a rank's saved structure with TensorRef and DTensorRef in place of its tensors (nothing read).

    weights_only restricts the unpickling to torch.load(weights_only=True)'s allow-list
    (ckpt.skeleton_unpickler); what names the shard in the UnsafeCheckpoint that refuses a value.
    """

    def reference(pid: Any) -> Any:
        tag, i = pid
        if tag == "ckpt-dtensor":
            return DTensorRef(str(i))
        if tag != "ckpt" or not 0 <= i < len(layout["tensors"]):
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        return TensorRef(i)

    skeleton = base64.b64decode(layout["skeleton_pickle_b64"])
    return SkeletonUnpickler(skeleton, reference, weights_only, what).load()


def refs_in(value: Any, sharded: set[str] | None = None) -> set[int]:
    """Return the entries of the plain tensors and arrays that a saved value holds, wherever they sit in it.

    With sharded, the keys of the sharded tensors it holds are added to that set.
    """
    found: set[int] = set()

    class Finder(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, TensorRef | DTensorRef):
                if isinstance(obj, TensorRef):
                    found.add(obj.entry)
                elif sharded is not None:
                    sharded.add(obj.key)
                return 0
            return None

    Finder(io.BytesIO()).dump(value)
    return found


def realize(
    reader: StepReader,
    home: int,
    layout: dict[str, Any],
    needed: set[int],
    weights_only: bool,
    dtensor_ref: Any = None,
) -> Any:
    """Rebuild the home rank's state with the needed plain tensors read and checked (the rest stay zeros).

    DTensors become dtensor_ref(key), references by default: the planner has made sure
    none sits where a value is replaced. weights_only as for load_skeleton.
    """
    entries = [layout["tensors"][i] for i in sorted(needed)]
    size = max((e["offset"] + e["nbytes"] for e in layout["tensors"] if e["kind"] != "chunk"), default=0)
    data = np.zeros(size, dtype=np.uint8)  # pages never written are never allocated

    def consume(run_start: int, run: np.ndarray) -> None:
        end = min(run_start + len(run), size)
        data[run_start:end] = run[: end - run_start]

    reader.read(home, [ByteRange(e["offset"], e["nbytes"]) for e in entries], consume)
    what = f"rank {home} shard of {reader.job} step {reader.step}"
    return unflatten(layout, data, None, dtensor_ref or DTensorRef, weights_only, what)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _describe(path: str) -> str:
    return repr(path) if path else "the state"


class _Planner:
    """Walk `into` beside the saved structure; collect the copies and replacements, or raise before any read."""

    def __init__(
        self, entries: list[dict[str, Any]], index: StepIndex | None, home: int, strict: bool, keys: KeyFilter
    ) -> None:
        self.entries = entries
        self.index = index
        self.home = home
        self.strict = strict
        self.keys = keys
        self.missing: list[str] = []  # strict=False: keys of into the step lacks, left as they were
        self.unexpected: list[str] = []  # strict=False: tensors of the step into has no place for, not read
        self._in_stateful = 0  # how many Stateful objects the walk is inside
        self.copies: list[_Copy] = []
        self.replaced: list[tuple[Callable[[Any], None], tuple[Any, ...]]] = []
        self.rebuilds: list[Callable[[], None]] = []  # tuples, innermost first
        self._path: list[Any] = []

    def walk(self, into: Any, saved: Any, key: str, assign: Callable[[Any], None]) -> None:
        """Fill into in place at key, or plan its replacement by the saved value through assign.

        A key the filter does not take is left as into holds it, whatever the step holds there.
        """
        if is_stateful(into) and not isinstance(into, torch.Tensor) and isinstance(saved, dict):
            self._fill_stateful(into, saved, key)
            return
        if not self.keys.takes_all and key and not _taken_leaves(into, key, self.keys):
            return
        if isinstance(into, torch.Tensor):
            self._fill(into, self._saved_tensor(saved, key), key)
        elif isinstance(into, dict):
            if not isinstance(saved, dict):
                raise InvalidArgument(f"{_describe(key)} is a dict in `into` but a {type(saved).__name__} in the step")
            for k in list(into):
                if k not in saved:
                    self._missing(into[k], _join(key, k))
                    continue
                self._at_child(k, into[k], saved[k], _join(key, k), partial(_assign, into, k))
            for k in saved:
                if k not in into:
                    taken = _taken_leaves(saved[k], _join(key, k), self.keys)
                    if not taken:
                        continue
                    # A Stateful's state_dict() may lack what its load_state_dict() takes (a fresh
                    # optimizer's state): plain tensors are read for it, as values are.
                    lenient = self._in_stateful and not _holds_dtensors(saved[k])
                    if _holds_tensors(saved[k]) and not lenient:
                        if self.strict:
                            raise InvalidArgument(f"{_join(key, k)!r} is in the step but missing from `into`")
                        self.unexpected += [leaf for leaf, value in taken if _holds_tensors(value)]
                        continue
                    self.replaced.append((partial(_assign, into, k), (*self._path, k)))
        elif isinstance(into, list | tuple) and isinstance(saved, list | tuple) and len(into) == len(saved):
            items = into if isinstance(into, list) else list(into)
            for i in range(len(items)):
                self._at_child(i, items[i], saved[i], _join(key, i), partial(_assign, items, i))
            if isinstance(into, tuple):  # rebuilt once its items are final, after the replacements
                self.rebuilds.append(partial(_rebuild_tuple, type(into), items, assign))
        elif _holds_dtensors(saved):
            raise InvalidArgument(f"{_describe(key)} holds DTensors in the step: `into` must hold tensors there")
        else:
            self.replaced.append((assign, tuple(self._path)))

    def _fill_stateful(self, into: Any, saved: dict[Any, Any], key: str) -> None:
        """Plan to fill into.state_dict() as any state, then hand it to into.load_state_dict() (ckpt.stateful)."""
        template = [into.state_dict()]
        if not self.keys.takes_all and key and not _taken_leaves(template[0], key, self.keys):
            return
        self._in_stateful += 1
        try:
            self.walk(template[0], saved, key, partial(_assign, template, 0))
        finally:
            self._in_stateful -= 1
        self.rebuilds.append(lambda: into.load_state_dict(template[0]))  # after what it holds was rebuilt

    def _missing(self, into: Any, key: str) -> None:
        """Raise for a key of into the step lacks, or with strict=False report its leaves the filter takes."""
        taken = _taken_leaves(into, key, self.keys)
        if taken and self.strict:
            raise InvalidArgument(f"{key!r} is missing from the step")
        self.missing += [leaf for leaf, _ in taken]

    def _at_child(self, k: Any, into: Any, saved: Any, key: str, assign: Callable[[Any], None]) -> None:
        self._path.append(k)
        self.walk(into, saved, key, assign)
        self._path.pop()

    def _saved_tensor(self, saved: Any, key: str) -> SavedTensor:
        if isinstance(saved, DTensorRef):
            if self.index is None or saved.key not in self.index.tensors:
                raise CorruptCheckpoint(f"{key!r}: the step's index has no {saved.key!r}")
            return self.index.tensors[saved.key]
        if isinstance(saved, TensorRef):
            e = self.entries[saved.entry]
            if e["kind"] != "torch":
                raise InvalidArgument(f"{key!r} is a numpy array in the step and a tensor in `into`")
            shape = tuple(e["shape"])
            chunk = SavedChunk(self.home, e["offset"], e["nbytes"], (0,) * len(shape), shape)
            return SavedTensor(key, shape, e["dtype"], (chunk,))
        raise InvalidArgument(f"{key!r} is a tensor in `into` but a {type(saved).__name__} in the step")

    def _fill(self, target: Any, saved: SavedTensor, key: str) -> None:
        if tuple(target.shape) != saved.shape:
            raise InvalidArgument(f"{key!r}: the step holds shape {list(saved.shape)}, `into` {list(target.shape)}")
        if is_dtensor(target):
            local, offsets = local_box(target, key)
        else:
            local, offsets = target, (0,) * target.dim()
        self.copies += plan_copies(saved, local.detach(), offsets)


def check_cast(key: str, saved_dtype: str, target_dtype: torch.dtype) -> torch.dtype:
    """Return the saved dtype; raise InvalidArgument naming key and both dtypes where copy_ cannot cast them.

    A load casts as torch.distributed.checkpoint does, by copy_ into the target: fp32 into
    bf16 rounds, int64 into int32 wraps, complex into real keeps the real part (logged
    here). What copy_ refuses (the bits dtypes, packed fp4) is refused before any byte moves.
    """
    source = torch_dtype(saved_dtype)
    if source != target_dtype:
        if not _castable(source, target_dtype):
            target_name = str(target_dtype).removeprefix("torch.")
            raise InvalidArgument(
                f"{key!r}: the step holds dtype {saved_dtype}, `into` {target_name}, and torch cannot cast "
                "one to the other; load it into a tensor of the saved dtype"
            )
        if source.is_complex and not target_dtype.is_complex:
            log.warning("ckpt: %r: loading complex %s into real %s keeps only the real part", key, source, target_dtype)
    return source


@functools.cache
def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex into real: copy_ warns, and casts
            torch.zeros(1, dtype=target).copy_(torch.zeros(1, dtype=source))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def plan_copies(saved: SavedTensor, local: torch.Tensor, offsets: tuple[int, ...]) -> list[_Copy]:
    """Return the copies that fill local, the box of saved's global tensor at offsets, from its saved chunks.

    The saved bytes are read as the saved dtype and cast to local's (check_cast).
    """
    source_dtype = check_cast(saved.key, saved.dtype, local.dtype)
    if local.numel() == 0:
        return []
    copies = []
    box = list(zip(offsets, local.shape, strict=True))
    for chunk in saved.chunks:
        lo = [max(o, t) for o, (t, _) in zip(chunk.offsets, box, strict=True)]
        hi = [min(o + n, t + s) for o, n, (t, s) in zip(chunk.offsets, chunk.lengths, box, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        if not box:  # a 0-d tensor: the whole chunk
            copies.append(_Copy(chunk, source_dtype, 0, 0, (), local))
            continue
        across = zip(lo[1:], hi[1:], chunk.offsets[1:], strict=True)
        source = (slice(0, hi[0] - lo[0]), *(slice(a - o, b - o) for a, b, o in across))
        region = local[tuple(slice(a - t, b - t) for a, b, (t, _) in zip(lo, hi, box, strict=True))]
        row_lo, row_hi = lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0]
        copies.append(_Copy(chunk, source_dtype, row_lo, row_hi, source, region))
    return copies


def fill_boxes(reader: StepReader, fills: list[tuple[SavedTensor, torch.Tensor, tuple[int, ...]]]) -> None:
    """Fill each (saved tensor, local box, its global offsets) from the step, reading each rank's ranges once."""
    _execute(reader, [copy for saved, local, offsets in fills for copy in plan_copies(saved, local, offsets)])


def load_full(reader: StepReader, index: StepIndex | None, weights_only: bool, wanted: Any = None) -> Any:
    """Return rank 0's saved state with every sharded tensor whole (for export: it all lives in memory).

    wanted, a part of rank 0's skeleton (load_skeleton), names the tensors to read; the
    others are left zeros (plain) or None (sharded), for the caller to drop. None: all.
    weights_only as for load_skeleton.
    """
    layout = json.loads(reader.meta(0).layout_json)
    sharded: set[str] = set()
    if wanted is None:
        plain = {i for i, e in enumerate(layout["tensors"]) if e["kind"] != "chunk"}
        sharded = set(index.tensors) if index else set()
    else:
        plain = refs_in(wanted, sharded)
    fills = []
    full: dict[str, torch.Tensor] = {}
    for key, saved in (index.tensors if index else {}).items():
        if key in sharded:
            full[key] = torch.empty(saved.shape, dtype=torch_dtype(saved.dtype))
            fills.append((saved, full[key], (0,) * len(saved.shape)))
    fill_boxes(reader, fills)
    return realize(reader, 0, layout, plain, weights_only, dtensor_ref=full.get)


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype a layout names, or raise InvalidArgument if this torch has none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"this torch has no dtype {name}; load with a newer torch")
    return dtype


def _assign(container: Any, k: Any, value: Any) -> None:
    container[k] = value


def _rebuild_tuple(kind: type, items: list[Any], assign: Callable[[Any], None]) -> None:
    assign(kind(*items) if hasattr(kind, "_fields") else kind(items))


def _join(key: str, k: Any) -> str:
    return f"{key}.{k}" if key else str(k)


def _holds_dtensors(value: Any) -> bool:
    return isinstance(value, DTensorRef) or (
        isinstance(value, dict | list | tuple)
        and any(_holds_dtensors(v) for v in (value.values() if isinstance(value, dict) else value))
    )


def _taken_leaves(value: Any, key: str, keys: KeyFilter) -> list[tuple[str, Any]]:
    """Return the leaves under value (itself, if it is one), each (its key, it), that keys takes."""
    if isinstance(value, dict | list | tuple):
        leaves = keyed_leaves(value, lambda v: not isinstance(v, dict | list | tuple))
        # An empty container counts as a leaf: a strict load names it when the other side lacks it.
        found = [(_join(key, path) if path else key, leaf) for leaf, path in leaves] or [(key, value)]
    else:
        found = [(key, value)]
    return [(k, v) for k, v in found if keys.takes(k)]


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, TensorRef | DTensorRef | torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensors(v) for v in value)
    return False
