"""Train a tiny character-level transformer language model on CPU, checkpointing through ckptd.

    python examples/tiny_transformer.py --steps 60 --losses ref.json                      # no checkpoints
    python examples/tiny_transformer.py --steps 60 --ckpt-every 10 --address ckptd.sock   # resumes if it can

With --ckpt-every, the script first asks the daemon for the job's latest complete
step and, if there is one, resumes from it. A checkpoint holds everything the next
step depends on: the model and AdamW state, the number of completed steps and the
torch RNG state (dropout). Batches are a pure function of the step number, so there
is no data-loader state to save, and a resumed run computes exactly the losses an
uninterrupted run would.

Every step prints one flushed line, `step N loss L` (L as repr, so it round-trips),
which lets a driver follow the run; --losses writes the losses of this process's
steps to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import ckpt
import torch
from torch import nn

TEXT = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
"""

VOCAB = sorted(set(TEXT))
TOKENS = torch.tensor([VOCAB.index(ch) for ch in TEXT], dtype=torch.long)

SEED = 1234
CONTEXT = 32
BATCH = 16
D_MODEL = 64
HEADS = 4
LAYERS = 2
DROPOUT = 0.1
LEARNING_RATE = 3e-3


class TinyTransformer(nn.Module):
    """Predict the next character with a small pre-norm causal transformer."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, D_MODEL)
        self.position = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, dropout=DROPOUT, batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab_size)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return next-character logits of shape (batch, context, vocab)."""
        x = self.embed(tokens) + self.position
        for layer in self.layers:
            x = layer(x, src_mask=self.causal_mask, is_causal=True)
        return self.head(self.norm(x))


def batch_for_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the (inputs, targets) of a step, drawn from a generator seeded by the step alone."""
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    starts = torch.randint(0, len(TOKENS) - CONTEXT - 1, (BATCH,), generator=generator)
    windows = torch.stack([TOKENS[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """Collect everything the step after `step` depends on."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "torch_rng": torch.get_rng_state(),
    }


def restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint's state into model, optimizer and RNG; return its number of completed steps."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    """Train for --steps steps, resuming from and saving to ckptd when --ckpt-every is set."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="train until this many steps are complete")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="save every K steps (0: no checkpoints)")
    p.add_argument("--job", default="tiny-transformer", help="ckpt job name")
    p.add_argument("--address", help="ckptd socket (default: $CKPTD_ADDRESS, else the daemon's default)")
    p.add_argument("--losses", type=Path, help="write {step: loss} of the steps run here to this JSON file")
    args = p.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = TinyTransformer(len(VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)

    checkpointer = ckpt.Checkpointer(job=args.job, address=args.address) if args.ckpt_every > 0 else None
    completed = 0
    if checkpointer is not None and checkpointer.latest_step() is not None:
        completed = restore(checkpointer.load(), model, optimizer)
        print(f"resumed from step {completed}", flush=True)

    losses: dict[int, float] = {}
    handle = None
    started = time.perf_counter()
    model.train()
    for step in range(completed + 1, args.steps + 1):
        inputs, targets = batch_for_step(step)
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        if not math.isfinite(losses[step]):
            raise RuntimeError(f"loss is {losses[step]} at step {step}")
        print(f"step {step} loss {losses[step]!r}", flush=True)

        if checkpointer is not None and step % args.ckpt_every == 0:
            t0 = time.perf_counter()
            handle = checkpointer.save_async(training_state(model, optimizer, step), step=step)
            print(f"checkpoint step {step} save_async {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)

    if handle is not None:
        handle.wait("nvme", timeout=60)
    if checkpointer is not None:
        checkpointer.close()
    print(f"done {len(losses)} steps in {time.perf_counter() - started:.1f} s", flush=True)
    if args.losses is not None:
        args.losses.write_text(json.dumps({str(step): loss for step, loss in losses.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
