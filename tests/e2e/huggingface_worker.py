"""One training process of tests/e2e/test_huggingface.py: examples/huggingface_train.py, with probes.

    python huggingface_worker.py OUT --job J --address SOCK --output-dir DIR --max-steps 24 [--resume] [--die-at 12]

It writes OUT/losses-<pid>.json (global step -> the loss Trainer logged, exact, every step) and, when the
run ends, OUT/final.pt (the model's state_dict). --die-at N: SIGKILL itself at the end of global step N.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from huggingface_train import make_trainer


class Probe(TrainerCallback):
    """Write each step's loss as it is computed; die at a step when asked."""

    def __init__(self, out: Path, die_at: int | None) -> None:
        self.path = out / f"losses-{os.getpid()}.json"
        self.losses: dict[int, float] = {}
        self.die_at = die_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def record(self, step: int, loss: float) -> None:
        self.losses[step] = loss
        self.path.write_text(json.dumps(self.losses))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--job", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-at", type=int)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    probe = Probe(args.out, args.die_at)
    trainer = make_trainer(args.job, args.output_dir, args.max_steps, args.address, callbacks=[probe])
    compute_loss = trainer.compute_loss

    def recorded(*a: Any, **kw: Any) -> Any:  # the exact loss, not the rounded one Trainer logs
        loss = compute_loss(*a, **kw)
        probe.record(trainer.state.global_step + 1, (loss[0] if isinstance(loss, tuple) else loss).item())
        return loss

    trainer.compute_loss = recorded  # type: ignore[method-assign]
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    torch.save(trainer.model.state_dict(), args.out / "final.pt")


if __name__ == "__main__":
    main()
