"""Write a complete step as a stock checkpoint other tools read, with no daemon: `ckptd export`.

cli.py calls add_parser() while it builds its parser and cmd_export() to run the
command; cmd_export runs on the main thread, in this order:
1. checks --to (absent or an empty directory) and that torch (and safetensors) can be imported;
2. finds the step's directory: a local tier's own (the NVMe root, this node's replica
   store) when the step is complete there with every rank's shard; otherwise it restores
   the step with ckptd.offline.restore into a temporary directory beside --to;
3. picks the keys --include/--exclude take from rank 0's saved structure (select_keys),
   reads their tensors with ckpt.reshard.load_full (every sharded tensor whole, every
   chunk checked; nothing else is read; the values unpickled with torch.load(weights_only=True)'s
   allow-list unless --trusted), lifts --strip-prefix's entries to the top, and
   writes the state into another temporary
   directory beside --to, which is then renamed to --to (with the process's umask, as any
   file it writes);
4. removes the temporary directories, also on failure.
The daemon never needs torch: this module imports it only inside cmd_export.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt.key_filter import KeyFilter
from ckpt_core.errors import CheckpointError, InvalidArgument, UnsafeCheckpoint
from ckpt_core.format import keyed_leaves, validate_job, validate_step

from ckptd.config import Config

if TYPE_CHECKING:
    import torch

    from ckptd.tiers.base import Tier

FORMATS = ("dcp", "safetensors")
SAFETENSORS_NAME = "model.safetensors"
DESCRIPTION = """\
Write a complete step as a stock checkpoint: rank 0's state with every sharded tensor
(DTensor: FSDP2, TP, HSDP) whole, read and checked from this node's NVMe root or replica
store when the step is whole there, else restored first (as `ckptd restore --from` would)
into a temporary directory beside DIR. Needs torch (the daemon does not).

  --format dcp          a torch.distributed.checkpoint directory with the same keys as the
                        saved state: dcp.load(state, storage_reader=FileSystemReader(DIR)),
                        or format_utils.dcp_to_torch_save(DIR, FILE)
  --format safetensors  DIR/model.safetensors: every tensor of the state (dot-joined keys,
                        e.g. model.up.weight); other values are left out. Needs safetensors.

Keys are paths joined with dots, as DCP names them (model.layers.0.weight). --include and
--exclude (each repeatable) take glob patterns on them; `*` crosses dots, and a pattern that
matches a key takes everything under it (--exclude optim leaves out the optimizer's state); a
list or tuple is kept or left out whole. --strip-prefix model. writes the entries under the key
model at the top (model.up.weight as up.weight); other keys stay as they are.

The values that are not tensors are unpickled as torch.load(weights_only=True) unpickles
them: a step holding any other class or function (argparse.Namespace, a class of the
training code) is refused, naming it, and nothing of it runs. --trusted unpickles them in
full, which runs whatever code the step's pickle names: only for checkpoints you trust.

The whole state is held in memory once. DIR must be absent or empty; it appears whole or not
at all (written beside it, then renamed), its files made with the process's umask. Progress goes
to stderr, DIR to stdout."""


def add_parser(command: Any, common: argparse.ArgumentParser) -> None:
    """Add the export subcommand and its flags; cli.py calls this once, from its _parser()."""
    s = command(
        "export",
        parents=[common],
        help="write a step as a stock DCP or safetensors checkpoint (needs torch)",
        description=DESCRIPTION,
        epilog="examples:\n"
        "  ckptd export --job llama-7b --format dcp --to /mnt/export/llama-7b-dcp\n"
        "  ckptd export --job llama-7b --step 1200 --format safetensors --to /mnt/export/llama-7b-1200\n"
        "  ckptd export --job llama-7b --from s3://ckpts/prod --format dcp --to /mnt/export/dcp\n"
        "  ckptd export --job llama-7b --include 'model' --strip-prefix model. --format safetensors --to DIR",
    )
    s.add_argument("--job", required=True, help="the job to export")
    s.add_argument("--step", default="latest", help="a step number, or latest (default)")
    s.add_argument("--format", required=True, choices=FORMATS, help="dcp or safetensors")
    s.add_argument(
        "--from",
        dest="source",
        default="auto",
        help="where to read the step, as for restore: auto (default), memory, nvme, peer, object, or an "
        "object-store URL",
    )
    s.add_argument("--to", required=True, metavar="DIR", type=Path, help="an absent or empty directory")
    s.add_argument(
        "--include", action="append", metavar="PATTERN", help="export only the keys it matches (and those under them)"
    )
    s.add_argument("--exclude", action="append", metavar="PATTERN", help="leave out the keys it matches (and under)")
    s.add_argument("--strip-prefix", metavar="PREFIX", help="write the entries under the key PREFIX at the top")
    s.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle the step's values in full (runs what its pickle names), not with weights_only's allow-list",
    )
    s.add_argument("--json", action="store_true", help='print {"job", "step", "format", "dir"} when done')


def cmd_export(args: argparse.Namespace, config: Config) -> int:
    """Run `ckptd export` (see the module docstring); return the exit code, raise CheckpointError on failure."""
    from ckptd.offline.restore import latest_step, readable_tiers, tool_threads

    job = validate_job(args.job)
    step = None if args.step == "latest" else _parse_step(args.step)
    to = args.to.absolute()
    _check_target(to)
    keys = KeyFilter.of(args.include, args.exclude)
    prefix = _prefix_path(args.strip_prefix)
    try:
        import torch  # noqa: F401 - only to say clearly that it is missing
    except ImportError:
        print("ckptd export needs torch: pip install torch", file=sys.stderr)
        return 2
    if args.format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            print("ckptd export --format safetensors needs safetensors: pip install safetensors", file=sys.stderr)
            return 2

    with tool_threads() as threads:
        tiers = readable_tiers(config, args.source, threads)
        step = latest_step(tiers, job) if step is None else step
        to.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{to.name}.export-", dir=to.parent))
        try:
            local = _local_step_dir(tiers, job, step)
            step_dir = local or _restore(tiers, job, step, work / "restore", threads.nvme_writes)
            state = _read_state(step_dir, keys, prefix, weights_only=not args.trusted)
            out = work / "out"
            if args.format == "dcp":
                _write_dcp(state, out)
            else:
                _write_safetensors(state, out)
            _install(out, to)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"job": job, "step": step, "format": args.format, "dir": str(to)}) if args.json else to)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parse_step(text: str) -> int:
    if not text.isdigit():
        raise InvalidArgument(f"invalid step {text!r}: a number or latest")
    return validate_step(int(text))


def _check_target(to: Path) -> None:
    """Refuse a --to that is not a directory or not empty, before any work (exit 2)."""
    if not to.exists():
        return
    if not to.is_dir():
        raise InvalidArgument(f"--to {to} exists and is not a directory")
    if any(to.iterdir()):
        raise InvalidArgument(f"--to {to} is not empty; export into an absent or empty directory")


def _local_step_dir(tiers: list[Tier], job: str, step: int) -> Path | None:
    """Return the step's directory on a local tier that holds it complete with every rank's shard, else None.

    A step spread over nodes is sealed on each with only part of its shards: such a
    directory is not enough, and the step is restored instead.
    """
    from ckptd.tiers.base import DurableTier

    for tier in tiers:
        if not isinstance(tier, DurableTier):  # a directory tier: NVMe or the replica store
            continue
        record = tier.checked_commit(job, step)
        if record is not None and all(tier.has_shard(job, step, r) for r in range(record.world_size)):
            step_dir = Path(tier.shard_source(job, step, 0).path)
            _progress(f"{job} step {step}: reading it on tier {tier.name} ({step_dir})")
            return step_dir
    return None


def _restore(tiers: list[Tier], job: str, step: int, target: Path, write_threads: Executor) -> Path:
    from ckptd.offline.restore import restore

    _progress(f"{job} step {step}: not whole in a local directory; restoring it into {target} first")
    return restore(tiers, job, step, target, _progress, write_threads)


def _read_state(step_dir: Path, keys: KeyFilter, prefix: tuple[str, ...], weights_only: bool) -> Any:
    """Return rank 0's state of the step in step_dir with every sharded tensor whole, every chunk checked.

    Only the tensors of the keys that keys takes are read (select_keys on the saved structure first).
    weights_only unpickles the values with torch.load(weights_only=True)'s allow-list; a value it
    refuses is a CheckpointError (exit 1) naming it and --trusted.
    """
    from ckpt.range_read import StepReader
    from ckpt.reshard import load_full, load_skeleton
    from ckpt_core.shard_io import read_commit, read_index, read_meta, step_dir_source
    from ckpt_core.step_index import StepIndex, index_bytes

    record = read_commit(step_dir)
    source = step_dir_source(step_dir, "local")
    data = read_index(step_dir, record) or index_bytes(record, lambda r: read_meta(source, r))
    index = None
    if data:
        index = StepIndex.from_bytes(data, str(step_dir))
        index.check(record, str(step_dir))
    reader = StepReader(
        record.job, record.step, record.shard_meta_xxh3_128, {r: [source] for r in range(record.world_size)}
    )
    started = time.monotonic()
    what = f"{record.job} step {record.step}"
    wanted = None
    try:
        if not keys.takes_all:
            skeleton = load_skeleton(json.loads(reader.meta(0).layout_json), weights_only, f"rank 0 shard of {what}")
            wanted = select_keys(skeleton, keys, (), what)
        state = select_keys(load_full(reader, index, weights_only, wanted), keys, prefix, what)
    except UnsafeCheckpoint as e:
        raise CheckpointError(
            f"{e.what} holds {e.global_name}, which export does not unpickle without --trusted (only what "
            "torch.load(weights_only=True) allows): if you trust this checkpoint, pass --trusted"
        ) from None
    tensors = _tensors(state)
    size = sum(t.nbytes for t in tensors.values())
    _progress(
        f"read {len(tensors)} tensors ({size / 2**30:.2f} GiB) of {record.world_size} rank(s) "
        f"in {time.monotonic() - started:.1f} s"
    )
    return state


def _prefix_path(prefix: str | None) -> tuple[str, ...]:
    """Return the keys that --strip-prefix walks down (none without it); raise InvalidArgument for a bad one."""
    if prefix is None:
        return ()
    path = tuple(prefix.removesuffix(".").split("."))
    if not all(path):
        raise InvalidArgument(f"--strip-prefix {prefix!r}: give a dotted key, such as model. or model.encoder.")
    return path


def select_keys(state: Any, keys: KeyFilter, prefix: tuple[str, ...], what: str) -> Any:
    """Return state with only the keys that keys takes, and the entries under prefix lifted to the top."""
    if keys.takes_all and not prefix:
        return state
    if not isinstance(state, dict):
        kind = type(state).__name__
        raise InvalidArgument(f"{what} holds a {kind}: --include, --exclude and --strip-prefix need a dict")
    picked = _picked(state, "", keys)
    if picked is _NOTHING or not picked:
        raise InvalidArgument(f"--include/--exclude leave no key of {what}")
    if not prefix:
        return picked
    parents = [picked]
    for k in prefix:
        parent = parents[-1]
        found = next((key for key in parent if str(key) == k), _NOTHING) if isinstance(parent, dict) else _NOTHING
        if found is _NOTHING or not isinstance(parent[found], dict):
            raise InvalidArgument(f"--strip-prefix {'.'.join(prefix)}.: no dict of {what} (as picked) has that key")
        parents.append(parent[found])
    lifted = parents.pop()
    for parent, k in zip(reversed(parents), reversed(prefix), strict=True):  # drop the path, and what it empties
        key = next(key for key in parent if str(key) == k)
        if parent[key] is lifted or not parent[key]:
            del parent[key]
    for k, v in lifted.items():
        if k in picked:
            raise InvalidArgument(f"--strip-prefix: {k!r} is both a key of {what} and one under the prefix")
        picked[k] = v
    return picked


_NOTHING: Any = object()


def _picked(value: Any, key: str, keys: KeyFilter) -> Any:
    """Return value with the dict entries keys takes nothing of left out, or _NOTHING if it takes nothing of it."""
    if isinstance(value, dict) and value:
        kept = {}
        for k, v in value.items():
            sub = _picked(v, f"{key}.{k}" if key else str(k), keys)
            if sub is not _NOTHING:
                kept[k] = sub
        return kept or _NOTHING
    leaves = [path for _, path in keyed_leaves(value, lambda v: not isinstance(v, dict | list | tuple))]
    full = [f"{key}.{p}" if key and p else key or p for p in leaves] or [key]
    return value if any(keys.takes(k) for k in full) else _NOTHING


def _write_dcp(state: Any, out: Path) -> None:
    """Write state as a one-process DCP checkpoint into out (created), with no process group."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(state, dict):
        _progress(f"the saved state is a {type(state).__name__}, not a dict: it is exported under the key 'state'")
        state = {"state": state}
    started = time.monotonic()
    _progress(f"writing a DCP checkpoint to {out} ...")
    writer = dcp.FileSystemWriter(out, thread_count=min(4, os.cpu_count() or 1), sync_files=True)
    try:
        with warnings.catch_warnings():
            # "assuming the intent is to save in a single process": it is, no_dist says so.
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
    except dcp.CheckpointException as e:  # a BaseException: not to escape as one
        raise CheckpointError(f"writing the DCP checkpoint failed: {e}") from None
    _progress(f"wrote the DCP checkpoint in {time.monotonic() - started:.1f} s")


def _write_safetensors(state: Any, out: Path) -> None:
    """Write every tensor of state, by its dot-joined key, into out/model.safetensors."""
    import torch
    from safetensors.torch import save_file

    tensors = _tensors(state)
    # safetensors refuses tensors that share memory; plain tensors of a step are views of one buffer.
    owned = {k: t if _owns_storage(t) else t.clone(memory_format=torch.contiguous_format) for k, t in tensors.items()}
    out.mkdir()
    started = time.monotonic()
    _progress(f"writing {len(owned)} tensors to {out / SAFETENSORS_NAME} ...")
    save_file(owned, str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    _fsync(out / SAFETENSORS_NAME)
    _progress(f"wrote {out / SAFETENSORS_NAME} in {time.monotonic() - started:.1f} s")


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Return every tensor of state by its dot-joined key (dict keys, list and tuple positions)."""
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for k, v in items:
        found.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return found


def _owns_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def _install(out: Path, to: Path) -> None:
    """Rename the finished output to --to (replacing an empty directory) and make the rename durable."""
    if to.exists():
        to.rmdir()  # empty (checked first); rename(2) would replace it too, but not on every filesystem
    os.replace(out, to)
    _fsync(to.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
