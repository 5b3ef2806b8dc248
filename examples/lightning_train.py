"""Train a tiny PyTorch Lightning model with its checkpoints in ckptd; run it again to resume.

    ckptd serve &    # or the node's daemon
    python examples/lightning_train.py --job lightning-demo --dirpath /tmp/lightning-demo --max-epochs 2
    python examples/lightning_train.py --job lightning-demo --dirpath /tmp/lightning-demo --max-epochs 4
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --devices 2 ...   # DDP on gloo

ModelCheckpoint keeps the 2 best checkpoints by train_loss and last.ckpt in --dirpath:
each is a pointer naming a ckptd job and step when the save returns (the bytes are in
ckptd: `ckptd ls --job lightning-demo`), and a torch.save file once the step is durable
(`torch.load` or `TinyRegressor.load_from_checkpoint` opens it; it still names the step).
Every run asks for ckpt_path="last": the first finds none and starts afresh, the second
resumes from the first's last step (and saves on in its job). A run in the same --dirpath
that does not resume (ckpt_path=None) is a new run in a used job: its saves go to
lightning-demo-v1 (a warning says so) and its last checkpoint is last-v1.ckpt, as Lightning
versions its files. After fit, trainer.save_checkpoint("final.ckpt") returns once
final.ckpt is a torch file. The daemon is --address, else CKPTD_ADDRESS, else the
default socket.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from ckpt.lightning import CkptdCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234
FEATURES = 8
SAMPLES = 128
BATCH = 16


class TinyRegressor(L.LightningModule):
    """A two-layer MLP fitting a fixed random regression problem with AdamW."""

    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(SEED)
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


def data() -> DataLoader:
    """Return the same batches on every run (split among the ranks under DDP)."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x[:, :2].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def make_trainer(
    job: str,
    dirpath: str,
    max_epochs: int,
    devices: int = 1,
    address: str | None = None,
    every_n_steps: int = 4,
    callbacks: Sequence[L.Callback] = (),
) -> L.Trainer:
    """Return a CPU Trainer whose checkpoints go through ckptd: top 2 by train_loss and last.ckpt."""
    checkpoints = ModelCheckpoint(
        dirpath=dirpath, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=every_n_steps
    )
    options: dict[str, Any] = {"strategy": "ddp"} if devices > 1 else {}
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        plugins=[CkptdCheckpointIO(job=job, address=address)],
        callbacks=[checkpoints, *callbacks],
        default_root_dir=dirpath,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, help="the ckptd job of this run's checkpoints")
    parser.add_argument("--dirpath", required=True, help="where ModelCheckpoint writes its pointer files")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help="more than 1: DDP (under torchrun, one per rank)")
    parser.add_argument("--address", default=None, help="the ckptd daemon (default: CKPTD_ADDRESS, else its socket)")
    args = parser.parse_args()
    trainer = make_trainer(args.job, args.dirpath, args.max_epochs, args.devices, args.address)
    trainer.fit(TinyRegressor(), data(), ckpt_path="last")


if __name__ == "__main__":
    main()
