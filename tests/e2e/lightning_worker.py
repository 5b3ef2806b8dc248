"""One process (or torchrun rank) of tests/e2e/test_lightning.py: examples/lightning_train.py, with probes.

    python lightning_worker.py OUT --job J --address SOCK --dirpath DIR --max-epochs 3
    torchrun --nproc-per-node 2 lightning_worker.py OUT ... --devices 2      # DDP on gloo

It fits the example's model with ckpt_path="last" (the first run finds none) and writes into OUT:
- saved-<global_step>.pt (rank 0): the model and optimizer states of each checkpoint dict, as
  Lightning handed it to the CheckpointIO (on_save_checkpoint sees the dict it saves);
- restored-rank<r>.pt (every rank): global_step, model and optimizer states at on_train_start,
  after a resume restored them;
- run.json (rank 0): the number of saves Lightning made, ModelCheckpoint's best_k_models at the
  end and every path that was ever among them (each of those was saved);
- refused-rank<r>.txt (every rank but 0): what CkptdCheckpointIO.save_checkpoint said there;
- losses-<pid>.json (rank 0): each trained step's loss by global step, rewritten after every step.

With --die-at N, rank 0 kills its own process (SIGKILL, nothing flushed) once step N has trained,
before ModelCheckpoint (which Lightning runs after every other callback) could save step N.
With --stateful-data the batches come from torchdata's StatefulDataLoader, whose position
Lightning saves in each checkpoint: only then does a resume mid-epoch see the batches an
unbroken run would (a plain DataLoader starts the epoch over, with ckptd as with torch files).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from ckpt_core.errors import InvalidArgument

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_train import TinyRegressor, data, make_trainer


class Probe(L.Callback):
    """Record what was saved, what a resume restored, and how many saves Lightning made."""

    def __init__(self, out: Path, die_at: int | None) -> None:
        self.out = out
        self.die_at = die_at
        self.saves = 0
        self.ever_best_k: set[str] = set()
        self.losses: dict[int, float] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self.losses[trainer.global_step] = float(outputs["loss"])
        (self.out / f"losses-{os.getpid()}.json").write_text(json.dumps(self.losses))
        if trainer.global_step == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            self.saves += 1
            self.ever_best_k |= set(trainer.checkpoint_callback.best_k_models)  # type: ignore[union-attr]
            saved = {k: checkpoint[k] for k in ("global_step", "state_dict", "optimizer_states")}
            torch.save(saved, self.out / f"saved-{checkpoint['global_step']}.pt")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        restored = {
            "global_step": trainer.global_step,
            "state_dict": pl_module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
        }
        torch.save(restored, self.out / f"restored-rank{trainer.global_rank}.pt")
        if trainer.global_rank != 0:
            try:
                trainer.strategy.checkpoint_io.save_checkpoint({"global_step": 1}, str(self.out / "never.ckpt"))
            except InvalidArgument as e:
                (self.out / f"refused-rank{trainer.global_rank}.txt").write_text(str(e))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            best_k = sorted(trainer.checkpoint_callback.best_k_models)  # type: ignore[union-attr]
            run = {"saves": self.saves, "best_k": best_k, "ever_best_k": sorted(self.ever_best_k)}
            (self.out / "run.json").write_text(json.dumps(run))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--job", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--die-at", type=int, default=None, help="SIGKILL this process once this step has trained")
    parser.add_argument("--stateful-data", action="store_true", help="torchdata's StatefulDataLoader")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = make_trainer(
        args.job, args.dirpath, args.max_epochs, args.devices, args.address, callbacks=[Probe(args.out, args.die_at)]
    )
    batches = data()
    if args.stateful_data:
        from torchdata.stateful_dataloader import StatefulDataLoader

        batches = StatefulDataLoader(batches.dataset, batch_size=batches.batch_size)
    trainer.fit(TinyRegressor(), batches, ckpt_path="last")


if __name__ == "__main__":
    main()
