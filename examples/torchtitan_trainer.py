"""torchtitan's own Trainer (the one `torchrun -m torchtitan.train` runs) on CPU, checkpointed by ckptd.

    ckptd serve &
    python examples/torchtitan_trainer.py OUT --job titan-trainer --steps 16
    # kill -9 it mid-run and start it again: the Trainer resumes from the job's latest step

The config is torchtitan's llama3_debugmodel (its config_registry function) shrunk to 2 layers and 64-token
sequences, with `checkpoint = CkptdCheckpointManager.Config(job=...)`: the Trainer builds, trains, saves,
resumes and closes as torchtitan.train's main does. Nothing can be downloaded, so the tokenizer (a word-level
`tokenizers` model saved as tokenizer.json) and the dataset (torchtitan's c4_test loader on a JSON-lines file)
are made under OUT. The Trainer's MetricsProcessor writes each step's loss to OUT/losses-<pid>.jsonl as it
logs it. --die-at N: SIGKILL itself right after step N's save returned (the tests' crash).

torchtitan 0.3.0 pins a torch nightly and has no CPU device, so with torch 2.13's CPU build this example
(1) gives torchtitan a CPU device module of its own (one device, no memory statistics) before importing the
rest of it (tools/utils.py:55 takes "cuda" where no accelerator is found, Trainer.__init__ calls
torch.cuda.set_device at trainer.py:301, and metrics.py:39 reads the device's memory statistics);
(2) makes torch.distributed.set_timeout, the nightly's name that distributed/utils.py:595 calls after the
first step, torch 2.13's distributed_c10d._set_pg_timeout; (3) uses SDPA attention, as torchtitan's
graph_trainer tests do (FlexAttention has no backward on CPU); (4) starts the gloo process group itself
(torchtitan's init_distributed would pick nccl for "cuda"; it keeps a group that is up). torchtitan's models
import triton (distributed/minimal_async_ep/kernels.py:10), which torchtitan does not require: pip install triton.
One process only: on two gloo ranks, torch 2.13's FSDP2 reduces gradients with ReduceOp.PREMUL_SUM, which gloo
does not have, as torchtitan sets a gradient divide factor of 1 (distributed/fsdp.py:41), and before that,
with torchtitan's default spmd_backend, its fully_shard refuses the plain parameters torchtitan hands it
(models/llama3/parallelize.py:72). examples/torchtitan_train.py runs two FSDP2 ranks with torchtitan's manager.
On a GPU with the torch torchtitan pins, none of this is needed: `torchrun ... -m torchtitan.train --module M
--config C`, whose config C sets `checkpoint = CkptdCheckpointManager.Config(...)` (docs/GUIDE.md), is the way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torchtitan.tools.utils as titan_device
from torch.distributed.distributed_c10d import _set_pg_timeout

# (1) and (2) above, before the torchtitan modules that copy the device at import are imported
titan_device.device_type = "cpu"
titan_device.device_module = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    set_device=lambda device: None,
    current_device=lambda: 0,
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 30),
    memory_stats=lambda device=None: {},
    reset_peak_memory_stats=lambda device=None: None,
)
dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]

from ckpt.torchtitan import CkptdCheckpointManager  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

SENTENCE = "the quick brown fox jumps over a lazy dog while two cats sit on the warm mat and birds sing"
WORDS = SENTENCE.split()  # the vocabulary, and the words of the dataset's lines


class LossRecorder(MetricsProcessor):
    """torchtitan's MetricsProcessor that also appends each step's loss to a JSON-lines file as it logs it.

    The Trainer calls log(step, ...) on its training thread after the step's optimizer step, every log_freq steps.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """torchtitan's metrics config, and the file the losses go to."""

        losses_file: str = ""

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """Append {"step", "loss"} to the losses file, then log as torchtitan does."""
        with open(self.config.losses_file, "a") as losses:
            losses.write(json.dumps({"step": step, "loss": global_avg_loss}) + "\n")
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def write_assets(out: Path) -> tuple[Path, Path]:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json) and a JSON-lines dataset under out."""
    assets, data = out / "assets", out / "data"
    assets.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    draw = random.Random(0)
    lines = (json.dumps({"text": " ".join(draw.choice(WORDS) for _ in range(40))}) for _ in range(200))
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    return assets, data


def trainer_config(args: argparse.Namespace, assets: Path, data: Path) -> Trainer.Config:
    """Return torchtitan's llama3 debug-model config, shrunk for CPU, checkpointing to the ckptd job."""
    config = llama3_debugmodel()
    assert config.model_spec is not None
    model = config.model_spec.model
    model.layers = model.layers[:2]  # type: ignore[attr-defined]
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = str(assets)
    config.dump_folder = str(args.out)
    config.dataloader.dataset_path = str(data)  # type: ignore[attr-defined]
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = args.steps
    config.training.disable_cuda_graphs = True
    config.debug.seed = 0
    config.debug.deterministic = True
    config.validator.enable = False
    config.metrics = LossRecorder.Config(log_freq=1, losses_file=str(args.out / f"losses-{os.getpid()}.jsonl"))
    config.checkpoint = CkptdCheckpointManager.Config(
        enable=True,
        job=args.job,
        address=args.address,
        interval=args.interval,
        keep_latest_k=args.keep_latest_k,
        async_mode=args.async_mode,
        last_save_model_only=False,
    )
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--job", default="", help="the ckptd job; empty: env CKPT_JOB")
    parser.add_argument("--address", default="")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--keep-latest-k", type=int, default=2)
    parser.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    parser.add_argument("--die-at", type=int)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    init_logger()

    store = args.out / f"pg-{os.getpid()}"  # one process: a file store of this run's own, no port
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    assets, data = write_assets(args.out / "inputs")

    trainer = trainer_config(args, assets, data).build()
    if args.die_at is not None:
        save = trainer.checkpointer.save

        def save_then_die(curr_step: int, last_step: bool = False) -> None:
            save(curr_step, last_step=last_step)
            if curr_step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.checkpointer.save = save_then_die  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
    dist.destroy_process_group()
    store.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
