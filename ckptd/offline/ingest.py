"""Make an existing checkpoint a step of a job, through the daemon: `ckptd import`.

cli.py calls add_parser() while it builds its parser and cmd_import() to run the
command; cmd_import runs on the main thread, in this order:
1. checks that torch can be imported and that exactly one source is given;
2. reads the whole state into memory: a torch.save file with torch.load (on the CPU;
   weights_only unless --trusted), or a torch.distributed.checkpoint directory with
   DCP's own reader (every tensor whole, in the nested structure it was saved with;
   only with --trusted: DCP unpickles its .metadata in full, and the CLI unpickles
   nothing it was not told to trust);
3. saves it as the step with ckpt.Checkpointer.save_async through the local daemon,
   as the one rank of a world of one, and waits until it is durable on NVMe; the
   daemon replicates and uploads it as any step.
Unlike export and restore, this needs a running daemon: the step is an ordinary save,
with the job's history (a step older than the job's head is refused) and retention.
The daemon never needs torch: this module imports it only inside cmd_import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ckpt_core.errors import CheckpointError, InvalidArgument
from ckpt_core.format import validate_job, validate_step

from ckptd.config import Config

DESCRIPTION = """\
Make an existing checkpoint step N of job J, so that a run can move onto ckptd: the
state goes through this node's daemon as one save (one rank of a world of one), to
NVMe, peers and the object store as configured, and ckpt's load(), load(into=...)
(any world size, resharded), ckpt.dcp.Reader and the Lightning plugin read it.

  --torch FILE   a torch.save file (a Lightning .ckpt, a state dict, any nesting),
                 read with torch.load(weights_only=True) on the CPU; --trusted reads
                 it with weights_only=False (arbitrary pickles: only files you trust)
  --dcp DIR      a torch.distributed.checkpoint directory (FileSystemWriter's), read
                 whole with DCP's own reader, keys nested as they were saved; needs
                 --trusted, because DCP unpickles the directory's .metadata in full
                 (arbitrary pickles: only directories you trust)

The whole state is held in memory once. The step must be newer than the job's newest
(its head); a complete step is never rewritten. Needs torch (the daemon does not)."""


def add_parser(command: Any, common: argparse.ArgumentParser, daemon: argparse.ArgumentParser) -> None:
    """Add the import subcommand and its flags; cli.py calls this once, from its _parser()."""
    s = command(
        "import",
        parents=[common, daemon],
        help="make a torch.save file or a DCP checkpoint a step of a job (needs torch and the daemon)",
        description=DESCRIPTION,
        epilog="examples:\n"
        "  ckptd import --job llama-7b --step 1200 --dcp /mnt/ckpt/llama-7b/step-1200 --trusted\n"
        "  ckptd import --job run-7 --step 4000 --torch ckpts/last.ckpt --trusted",
    )
    s.add_argument("--job", required=True, help="the job the step belongs to")
    s.add_argument("--step", required=True, type=int, help="the step number it becomes")
    source = s.add_mutually_exclusive_group(required=True)
    source.add_argument("--torch", type=Path, metavar="FILE", help="a torch.save file")
    source.add_argument("--dcp", type=Path, metavar="DIR", help="a torch.distributed.checkpoint directory")
    s.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle the source in full: --torch with weights_only=False; --dcp needs it (DCP's .metadata)",
    )
    s.add_argument("--json", action="store_true", help='print {"job", "step", "size_bytes", "seconds"} when done')


def cmd_import(args: argparse.Namespace, config: Config) -> int:
    """Run `ckptd import` (see the module docstring); return the exit code, raise CheckpointError on failure."""
    job, step = validate_job(args.job), validate_step(args.step)
    if args.dcp is not None and not args.trusted:
        raise InvalidArgument(
            f"import --dcp {args.dcp}: DCP's reader unpickles the directory's .metadata in full, which runs "
            "whatever code that pickle names; pass --trusted if you trust the directory"
        )
    try:
        import torch  # noqa: F401 - only to say clearly that it is missing
    except ImportError:
        print("ckptd import needs torch: pip install torch", file=sys.stderr)
        return 2
    from ckpt.checkpointer import Checkpointer
    from ckpt.flatten import flatten

    started = time.monotonic()
    state = read_torch_file(args.torch, args.trusted) if args.torch is not None else read_dcp_dir(args.dcp)
    size_bytes = flatten(state).data_size_bytes
    address = args.address or os.environ.get("CKPTD_ADDRESS") or str(config.socket_path)
    with Checkpointer(job=job, rank=0, world_size=1, address=address) as c:
        handle = c.save_async(state, step=step)
        if handle.skipped:
            raise CheckpointError(f"{job} step {step} was not saved: {handle.reason}")
        del state
        print(f"ckptd import: {job} step {step} copied into the daemon; waiting until durable on NVMe", file=sys.stderr)
        handle.wait("nvme")
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps({"job": job, "step": step, "size_bytes": size_bytes, "seconds": round(seconds, 3)}))
    else:
        print(f"imported {job} step {step} ({size_bytes} bytes of tensors) in {seconds:.1f} s")
    return 0


def read_torch_file(path: Path, trusted: bool) -> Any:
    """Return what torch.save wrote at path, its tensors on the CPU."""
    import pickle
    import zipfile

    import torch

    if not path.is_file():
        raise InvalidArgument(f"--torch {path}: no such file")
    with path.open("rb") as f:
        legacy = f.read(1) == b"\x80"  # torch.save's format before 1.6: a pickle stream
    if not (legacy or zipfile.is_zipfile(path)):
        raise CheckpointError(f"--torch {path} is not a torch.save file (neither its zip archive nor a pickle)")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as e:
        if trusted:
            raise CheckpointError(f"--torch {path} is not a torch.save file torch can read: {e}") from None
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else type(e).__name__)
        raise CheckpointError(
            f"--torch {path} holds values weights_only=True refuses ({why}); if you trust the file, "
            "pass --trusted to load it with weights_only=False"
        ) from None
    except (RuntimeError, EOFError) as e:  # not a torch file, truncated
        raise CheckpointError(f"--torch {path} is not a torch.save file torch can read: {e}") from None
    except (AttributeError, ImportError) as e:  # --trusted: a class pickle cannot find here
        raise CheckpointError(
            f"--torch {path} holds an object of a class this process cannot import ({e}): a class defined in the "
            "script that saved it (__main__) or in a module not on this PYTHONPATH. Re-save plain values "
            "(model.state_dict(), not the model), or run ckptd with the defining module importable"
        ) from None


def read_dcp_dir(path: Path) -> dict[str, Any]:
    """Return the whole state of a DCP checkpoint directory, as dcp_to_torch_save would write it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not (path / ".metadata").is_file():
        raise InvalidArgument(f"--dcp {path} is not a torch.distributed.checkpoint directory (no .metadata in it)")
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming the intent is to load in a single process"
        _load_state_dict(
            state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    return state
