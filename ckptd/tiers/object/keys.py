"""Name where a step's objects lie in a store: its commit record and index, and each rank's shard objects.

A step's `COMMIT.json` and `INDEX.json` lie under `<job>/<step>/`. Its shard objects (data,
compressed data, frame index, shard record) lie, in the hashed layout, under
`_shards/<hh>/<job>/<step>/`, hh being the first PREFIX_HEX_DIGITS hex digits of the XXH3-64 of
`"<job>/<step>/<rank>"`: every step spreads its requests over the same 256 prefixes (docs/SCALE.md
section 4). A step committed before this layout keeps its shard objects beside its commit record
(the flat layout); its record names no object keys. Which layout a committed step has is its commit
record's `object_keys` (docs/FORMAT.md); a step not committed yet is always in the hashed layout.
Pure functions: nothing here touches the store; the object tier calls them from any thread.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash
from ckpt_core.format import data_name, meta_name

from ckptd.tiers.object.layout import frames_name, zstd_name

SHARDS_DIR = "_shards"  # never a job name (JOB_RE wants a letter or digit first): jobs() never lists it
PREFIX_HEX_DIGITS = 2  # 256 prefixes, each at under half of S3's per-prefix limits (docs/SCALE.md section 4)
HASHED_KEYS = f"xxh3-{PREFIX_HEX_DIGITS}hex"  # a commit record's object_keys for this layout
FLAT_KEYS = ""  # a commit record with no object_keys: the shard objects lie beside it
KNOWN_KEYS = (FLAT_KEYS, HASHED_KEYS)

Directory = tuple[str, ...]  # a directory in the store, as names under its URL


def hash_prefix(job: str, step: int, rank: int) -> str:
    """Return the hash prefix of a rank's shard objects in a step."""
    return xxhash.xxh3_64_hexdigest(f"{job}/{step}/{rank}".encode())[:PREFIX_HEX_DIGITS]


def all_prefixes() -> list[str]:
    """Return every hash prefix, in order."""
    return [f"{i:0{PREFIX_HEX_DIGITS}x}" for i in range(16**PREFIX_HEX_DIGITS)]


def step_dir(job: str, step: int) -> Directory:
    """Return the directory of a step's commit record and index (and, in the flat layout, of its shards)."""
    return (job, str(step))


def hashed_job_dir(prefix: str, job: str) -> Directory:
    """Return the directory under one hash prefix whose subdirectories are steps of a job."""
    return (SHARDS_DIR, prefix, job)


def hashed_dir(prefix: str, job: str, step: int) -> Directory:
    """Return the directory under one hash prefix that holds the shard objects of some ranks of a step."""
    return (*hashed_job_dir(prefix, job), str(step))


def shard_dir(job: str, step: int, rank: int, keys: str) -> Directory:
    """Return the directory that holds a rank's shard objects, in the layout keys names."""
    return step_dir(job, step) if keys == FLAT_KEYS else hashed_dir(hash_prefix(job, step, rank), job, step)


def dirs_of(job: str, step: int, ranks: Iterable[int], keys: str) -> dict[Directory, list[int]]:
    """Return {directory: its ranks} for ranks of a step: a listing of each directory finds all of them."""
    grouped: dict[Directory, list[int]] = {}
    for rank in ranks:
        grouped.setdefault(shard_dir(job, step, rank, keys), []).append(rank)
    return grouped


def shard_names(rank: int) -> tuple[str, ...]:
    """Return the names a rank's shard objects may have: data (plain or compressed), frame index, record."""
    return (data_name(rank), zstd_name(rank), frames_name(rank), meta_name(rank))


def step_number(name: str) -> int | None:
    """Return the step a directory name stands for, or None if it is no step's name."""
    if name.isascii() and name.isdigit() and str(int(name)) == name:
        return int(name)
    return None
