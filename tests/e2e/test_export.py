"""`ckptd export`: a step a real FSDP2 torchrun job saved through a real daemon, read back by stock DCP."""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import ckpt
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CKPTD
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torchrun import torchrun as run_torchrun

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "fsdp_train.py"
JOB = "fsdp-export"
STEPS = 5
TORCHRUN_TIMEOUT_S = 180


def torchrun_fsdp(node, dump: Path) -> None:
    """Train 5 steps of the FSDP2 example on 4 ranks, saving step 5 through node; rank 0 dumps the full tensors."""
    args = ["--steps", str(STEPS), "--ckpt-every", str(STEPS), "--dump", str(dump)]
    run_torchrun(4, SCRIPT, *args, env={"CKPTD_ADDRESS": node.address, "CKPT_JOB": JOB}, timeout_s=TORCHRUN_TIMEOUT_S)


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """Return every leaf of a nested state by its dot-joined key (as DCP and the example's dump name them)."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
    if items is None:
        return {prefix: state}
    found: dict[str, Any] = {}
    for k, v in items:
        found.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return found


def dcp_load_flat(directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load the tensors named in like from a DCP directory with stock dcp.load, in one process."""
    into = {k: torch.full_like(v, -7) for k, v in like.items()}  # nothing right by accident
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(into, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return into


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


@pytest.mark.timeout(400)
def test_an_fsdp2_step_exports_to_a_dcp_checkpoint_stock_torch_reads(make_daemon, short_tmp):
    node = make_daemon().start()
    dump = short_tmp / "dump.pt"
    torchrun_fsdp(node, dump)
    want = torch.load(dump, weights_only=True)
    assert any(k.startswith("model.") for k in want) and any(k.startswith("optim.state.") for k in want)

    out = node.cli("export", "--job", JOB, "--format", "dcp", "--to", str(short_tmp / "dcp"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"job": JOB, "step": STEPS, "format": "dcp", "dir": str(short_tmp / "dcp")}
    assert f"reading it on tier nvme ({node.root / JOB / str(STEPS)})" in out.stderr  # no restore needed
    assert_same(dcp_load_flat(short_tmp / "dcp", want), want)

    torch_file = short_tmp / "exported.pt"
    dcp_to_torch_save(str(short_tmp / "dcp"), str(torch_file))
    whole = flat(torch.load(torch_file, weights_only=False))
    assert_same({k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}, want)
    assert whole["step"] == STEPS  # the values that are not tensors come along
    assert whole["optim.param_groups.0.lr"] == 1e-2 and whole["optim.param_groups.0.params.0"].startswith("up.")

    # Through a restore: the memory tier is no directory to read in place; the temporary copy goes away.
    (short_tmp / "from-memory").mkdir()  # an empty directory is fine
    out = node.cli("export", "--job", JOB, "--step", str(STEPS), "--from", "memory", "--format", "dcp")
    assert out.returncode == 2  # --to is required
    out = node.cli(
        "export", "--job", JOB, "--step", str(STEPS), "--from", "memory", "--format", "dcp",
        "--to", str(short_tmp / "from-memory"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "restoring it into" in out.stderr and "rank 3/4: " in out.stderr
    assert_same(dcp_load_flat(short_tmp / "from-memory", want), want)
    assert not [p for p in short_tmp.iterdir() if ".export-" in p.name]


def test_bad_input_gets_exit_1_or_2_and_leaves_nothing(make_daemon, short_tmp):
    node = make_daemon().start()
    with ckpt.Checkpointer(job="plain", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(6.0), "n": 3}, step=2).wait(timeout=60)
    to = short_tmp / "out"

    out = node.cli("export", "--job", "nobody", "--format", "dcp", "--to", str(to))
    assert out.returncode == 1 and "nobody has no complete step" in out.stderr
    out = node.cli("export", "--job", "plain", "--step", "7", "--format", "dcp", "--to", str(to))
    assert out.returncode == 1 and "plain step 7 is not complete" in out.stderr
    out = node.cli("export", "--job", "plain", "--step", "seven", "--format", "dcp", "--to", str(to))
    assert out.returncode == 2 and "invalid step 'seven'" in out.stderr
    out = node.cli("export", "--job", "plain", "--format", "npz", "--to", str(to))
    assert out.returncode == 2 and "invalid choice: 'npz'" in out.stderr
    assert not to.exists()
    assert sorted(p.name for p in short_tmp.iterdir()) == ["d0"]  # no temporary directory left behind

    to.mkdir()
    (to / "keep.txt").write_text("mine")
    out = node.cli("export", "--job", "plain", "--format", "dcp", "--to", str(to))
    assert out.returncode == 2 and "is not empty" in out.stderr
    assert [p.name for p in to.iterdir()] == ["keep.txt"]
    out = node.cli("export", "--job", "plain", "--format", "dcp", "--to", str(to / "keep.txt"))
    assert out.returncode == 2 and "is not a directory" in out.stderr

    # A plain state exports too; its values that are not tensors with it.
    out = node.cli("export", "--job", "plain", "--format", "dcp", "--to", str(short_tmp / "plain"))
    assert out.returncode == 0, out.stderr
    got = {"w": torch.zeros(6), "n": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, storage_reader=dcp.FileSystemReader(str(short_tmp / "plain")), no_dist=True)
    assert torch.equal(got["w"], torch.arange(6.0)) and got["n"] == 3


def test_without_torch_or_safetensors_export_says_what_to_install(make_daemon, short_tmp):
    node = make_daemon().start()
    with ckpt.Checkpointer(job="plain", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(6.0)}, step=1).wait(timeout=60)
    missing = short_tmp / "missing"
    (missing / "torch").mkdir(parents=True)
    (missing / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(missing), os.environ.get("PYTHONPATH", "")])}
    command = [*CKPTD, "export", "--job", "plain", "--format", "dcp", "--to", str(short_tmp / "x")]
    out = subprocess.run(
        [*command, "--config", str(node.config_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "ckptd export needs torch: pip install torch" in out.stderr
    assert not (short_tmp / "x").exists()

    to = short_tmp / "st"
    out = node.cli("export", "--job", "plain", "--format", "safetensors", "--to", str(to))
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert out.returncode == 2 and "needs safetensors: pip install safetensors" in out.stderr
        assert not to.exists()
        return
    assert out.returncode == 0, out.stderr
    assert torch.equal(load_file(str(to / "model.safetensors"))["w"], torch.arange(6.0))


def test_include_exclude_and_strip_prefix_pick_the_keys_and_files_follow_the_umask(make_daemon, short_tmp):
    node = make_daemon().start()
    state = {
        "model": {"up": {"weight": torch.ones(2, 3), "bias": torch.ones(2)}, "down": {"weight": torch.zeros(3, 2)}},
        "optim": {"state": {"0": {"exp_avg": torch.ones(6)}}},
        "step": 9,
    }
    with ckpt.Checkpointer(job="pick", rank=0, world_size=1, address=node.address) as c:
        c.save_async(state, step=1).wait(timeout=60)
    to = short_tmp / "weights"
    before = os.umask(0o027)  # the command inherits it
    try:
        out = node.cli(
            "export", "--job", "pick", "--format", "dcp", "--to", str(to),
            "--include", "model", "--exclude", "*.bias", "--strip-prefix", "model.",
        )  # fmt: skip
    finally:
        os.umask(before)
    assert out.returncode == 0, out.stderr
    assert "read 2 tensors" in out.stderr  # the optimizer's and the biases' bytes are not read
    keys = dcp.FileSystemReader(str(to)).read_metadata().state_dict_metadata
    assert sorted(keys) == ["down.weight", "up.weight"]
    got = dcp_load_flat(to, {"up.weight": torch.zeros(2, 3), "down.weight": torch.zeros(3, 2)})
    assert torch.equal(got["up.weight"], torch.ones(2, 3))
    assert oct(to.stat().st_mode & 0o777) == oct(0o750)
    assert {oct(p.stat().st_mode & 0o777) for p in to.iterdir()} == {oct(0o640)}

    out = node.cli("export", "--job", "pick", "--format", "dcp", "--to", str(short_tmp / "none"), "--include", "x*")
    assert out.returncode == 2 and "--include/--exclude leave no key of pick step 1" in out.stderr
    assert not (short_tmp / "none").exists() and not [p for p in short_tmp.iterdir() if ".export-" in p.name]
