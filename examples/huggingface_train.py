"""Train a tiny GPT-2 with Hugging Face's Trainer, its checkpoints in ckptd; run it again to resume.

    ckptd serve &    # or the node's daemon
    python examples/huggingface_train.py --job hf-demo --output-dir /tmp/hf-demo --max-steps 24
    python examples/huggingface_train.py --job hf-demo --output-dir /tmp/hf-demo --max-steps 48 --resume

The model is built from a config in code and the data is synthetic: nothing is downloaded.
Every --save-steps steps ckpt.huggingface.CkptdTrainer saves the model, optimizer, scheduler,
RNG and trainer state into ckptd (`ckptd ls --job hf-demo`) and returns to training once they
are copied; /tmp/hf-demo/checkpoint-N is a pointer directory (trainer_state.json and ckptd.json).
--resume passes resume_from_checkpoint=True: the Trainer finds the newest checkpoint-N and
ckptd gives back its step. save_total_limit=2 keeps two checkpoints, in ckptd as in the
directory. The daemon is --address, else CKPTD_ADDRESS, else the default socket.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from ckpt.huggingface import CkptdTrainer
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

SEED = 1234
VOCAB = 64
LENGTH = 16
SAMPLES = 64


class Tokens(Dataset):
    """Random token sequences, the same on every run: a language-modelling task of no meaning."""

    def __init__(self) -> None:
        self.ids = torch.randint(VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(SEED))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    """Return a 2-layer GPT-2 of a few thousand parameters, seeded."""
    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def make_trainer(
    job: str,
    output_dir: str,
    max_steps: int,
    address: str | None = None,
    save_steps: int = 8,
    callbacks: list[TrainerCallback] | None = None,
) -> CkptdTrainer:
    """Return a CkptdTrainer of the tiny model on CPU, logging every step's loss."""
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=save_steps,
        save_total_limit=2,
        logging_steps=1,
        seed=SEED,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    return CkptdTrainer(
        model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=callbacks, job=job, address=address
    )


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--address")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint-N")
    args = parser.parse_args(argv)
    trainer = make_trainer(args.job, args.output_dir, args.max_steps, args.address)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"trained to step {trainer.state.global_step}; checkpoints: ckptd ls --job {args.job}")


if __name__ == "__main__":
    main()
