"""Read shards and steps from files with no daemon: load_local, and the loads of Checkpointer once located.

The load path (ckpt.load_path, for Checkpointer.load) calls load_first_good with the sources the daemon located (on the
loading thread); ckpt.load_local and ckpt.dcp's Reader open a step directory here
directly. The index of a step is checked against its commit record before use.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckpt_core.errors import CheckpointError, CorruptCheckpoint, InvalidArgument, NotFound, UnsafeCheckpoint
from ckpt_core.format import COMMIT_NAME, DIRECT_IO_ALIGN_BYTES, INDEX_NAME, JOB_RE, CommitRecord, round_up
from ckpt_core.shard_io import ShardSource, read_commit, read_index, read_meta, read_shard_into, step_dir_source
from ckpt_core.step_index import StepIndex, index_bytes, is_sharded

from ckpt.flatten import unflatten
from ckpt.key_filter import KeyFilter
from ckpt.placement import Placement, Refused
from ckpt.range_read import StepReader, fresh_buffer
from ckpt.reshard import load_into, report_left

log = logging.getLogger("ckpt")


def load_local(
    path: str | os.PathLike[str],
    rank: int = 0,
    map_location: Any = "cpu",
    into: Any = None,
    strict: bool = True,
    keys: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    weights_only: bool = False,
) -> Any:
    """Read one rank's state from a local directory, with no daemon.

    path is a step directory (it holds COMMIT.json), a job directory (its newest step
    with a commit record is read), or a directory holding one job's directories, as
    `ckptd restore --to DIR` and an NVMe root of one job are. With into, fill it in
    place as Checkpointer.load does (rank is the loading rank). map_location takes what
    Checkpointer.load takes (ckpt.placement), and applies only without into; strict, keys
    and exclude only with it, as Checkpointer.load takes them (what is left is logged).
    weights_only=True unpickles the values that are not tensors as torch.load(weights_only=True)
    does, as Checkpointer.load(weights_only=True) does.
    """
    selection = KeyFilter.of(keys, exclude)
    if into is not None:
        reader, index = open_step_dir(find_step_dir(Path(path)))
        loaded, report = load_into(into, reader, index, rank, strict, selection, weights_only)
        report_left(report, reader.job)
        return loaded
    if not strict or not selection.takes_all:
        raise InvalidArgument("strict=False, keys= and exclude= apply to load_local(into=...): pass the state to fill")
    place = Placement.of(map_location)  # first: a map_location this machine cannot honour costs no read
    return load_first_good([step_dir_source(find_step_dir(Path(path)), "local")], rank, place, weights_only)


def find_step_dir(path: Path) -> Path:
    """Return the step directory that path names: itself, its newest complete step, or its one job's newest."""
    if not path.is_dir():
        raise NotFound(f"{path} is not a directory")
    if (path / COMMIT_NAME).is_file():
        return path
    steps = [p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and str(int(p.name)) == p.name]
    if steps:
        complete = [p for p in steps if (p / COMMIT_NAME).is_file()]
        if not complete:
            raise NotFound(f"{path}: none of its {len(steps)} step directories is complete (no {COMMIT_NAME})")
        return max(complete, key=lambda p: int(p.name))
    jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and JOB_RE.fullmatch(p.name))
    if len(jobs) == 1:
        return find_step_dir(path / jobs[0])
    if jobs:
        raise InvalidArgument(f"{path} holds {len(jobs)} jobs ({', '.join(jobs[:5])}): name one, e.g. {path / jobs[0]}")
    raise NotFound(f"{path} holds no complete step: no {COMMIT_NAME}, no step directories, no job's directory")


def open_step_dir(step_dir: Path) -> tuple[StepReader, StepIndex | None]:
    """Return a reader of every rank's bytes of the step in a local directory, and the step's index (no daemon)."""
    source = step_dir_source(step_dir, "local")
    record = read_commit(step_dir)
    data = read_index(step_dir, record) or index_bytes(record, lambda r: read_meta(source, r))
    reader = StepReader(
        record.job, record.step, record.shard_meta_xxh3_128, {r: [source] for r in range(record.world_size)}
    )
    return reader, checked_index(data or b"", record, str(step_dir / INDEX_NAME))


def checked_index(data: bytes, record: CommitRecord, what: str) -> StepIndex | None:
    if not data:
        return None
    index = StepIndex.from_bytes(data, what)
    index.check(record, what)
    return index


def load_first_good(sources: list[ShardSource], rank: int, map_location: Any, weights_only: bool) -> Any:
    """Load from the first source that holds a good copy; say what was wrong with each one that did not.

    map_location: any form Placement.of takes, or a Placement. A value weights_only refuses
    (UnsafeCheckpoint) is raised at once: every good copy holds the same skeleton.
    """
    place = Placement.of(map_location)  # before any read: a map_location this machine cannot honour is refused
    errors: list[Exception] = []
    for source in sources:
        try:
            return _load_shard(source, rank, place, weights_only)
        except (InvalidArgument, UnsafeCheckpoint):
            raise  # the step itself does not fit this load: another tier's copy would not either
        except (CheckpointError, OSError) as e:
            if source is not sources[-1]:
                log.warning("ckpt: %s; trying the next tier", e)
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    summary = "; ".join(map(str, errors))
    if any(isinstance(e, CorruptCheckpoint) for e in errors):
        raise CorruptCheckpoint("no tier holds a good copy: " + summary)
    if all(isinstance(e, NotFound) for e in errors):
        raise NotFound("no tier holds the shard any more: " + summary)
    raise CheckpointError("no tier could be read: " + summary)


def _load_shard(source: ShardSource, rank: int, place: Placement, weights_only: bool) -> Any:
    meta = read_meta(source, rank)
    if is_sharded(meta):
        raise InvalidArgument(
            f"{meta.job} step {meta.step} holds DTensors: load it with load(into=state), a state with the "
            "DTensors to fill (a device mesh cannot be guessed), or the tensors that Checkpointer(replicated=) "
            "wrote once for every rank"
        )
    buffer = fresh_buffer(round_up(meta.data_size_bytes, DIRECT_IO_ALIGN_BYTES))
    read_shard_into(source, meta, memoryview(buffer))  # type: ignore[arg-type]  # ndarray is a buffer
    try:
        what = f"rank {rank} shard of {meta.job} step {meta.step}"
        return unflatten(json.loads(meta.layout_json), buffer[: meta.data_size_bytes], place, None, weights_only, what)
    except Refused:
        raise  # map_location cannot be applied here: no copy anywhere would do better
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"rank {rank} shard on tier {source.tier}: bad layout ({e})") from None
