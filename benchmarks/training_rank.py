"""The trainer of benchmarks/bench_training.py: a small training loop on CPU, checkpointing one way.

bench_training.py starts it once per run, already pinned as the layout says, and reads the
JSON it writes. The model is embedding-heavy (a large nn.Embedding, two small transformer
layers, a small head) and trained with AdamW (fused): its state (parameters, both moments,
the step) is --state-gib, while a step stays short. After WARMUP_STEPS untimed steps (so the
optimizer's moments exist) and WARMUP_SAVES untimed saves waited until durable (so ckptd's
slots, DCP's checkpoint process and staging memory exist), it runs --steps timed steps and
saves at the top of steps 1, N+1, 2N+1, ... (N = --every), then waits until the last
checkpoint is durable. Every variant gets the same data from the same seed. Not meant to be
run by hand:

    training_rank.py --variant V --threads T --steps S --every N --state-gib G --dir D --address A --out F
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ckpt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.optim.optimizer import register_optimizer_step_pre_hook

VARIANTS = ("none", "ckptd", "ckptd-lazy", "dcp-thread", "dcp-process", "torch-save")
MODEL_DIM = 256
LAYERS = 2
HEADS = 4
CLASSES = 1024  # the head predicts one of these: a vocabulary-sized head would dominate the step
BATCH = 8
SEQUENCE = 64
WARMUP_STEPS = 3
WARMUP_SAVES = 2
JOB = "train"
WAIT_TIMEOUT_S = 600.0


class EmbeddingHeavyModel(nn.Module):
    """Embed tokens from a large vocabulary, run LAYERS small transformer layers, classify each position."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, MODEL_DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(MODEL_DIM, HEADS, 4 * MODEL_DIM, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(MODEL_DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def build(state_bytes: int) -> tuple[EmbeddingHeavyModel, torch.optim.Optimizer]:
    """Return a model whose AdamW state (parameters and two moments, fp32) is about state_bytes, and its optimizer."""
    torch.manual_seed(0)
    rest = sum(p.numel() for p in EmbeddingHeavyModel(1).parameters())
    vocab = max(CLASSES, (state_bytes // 12 - rest) // MODEL_DIM)
    model = EmbeddingHeavyModel(vocab)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def state_bytes_of(model: nn.Module) -> int:
    """Return the bytes of the checkpointed tensors: the parameters and AdamW's two moments (the steps are tiny)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def process_cpu_s(pid: int) -> float:
    """Return the CPU seconds (user + system) process pid has used so far; 0 for pid 0."""
    if not pid:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def train_step(model: EmbeddingHeavyModel, generator: torch.Generator) -> None:
    """Run the forward and backward pass of one batch drawn from generator (the optimizer step is the caller's)."""
    tokens = torch.randint(0, model.embed.num_embeddings, (BATCH, SEQUENCE), generator=generator)
    targets = torch.randint(0, CLASSES, (BATCH, SEQUENCE), generator=generator)
    model.zero_grad()
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()


class OptimizerWaitClock:
    """Time what the global optimizer step pre-hooks registered after this one (ckpt's lazy wait) take.

    Registered before the first lazy save, so its global hook runs before ckpt's; the
    optimizer's own pre-hook runs after every global one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.started = 0.0
        self.waited_s = 0.0
        register_optimizer_step_pre_hook(lambda *_: setattr(self, "started", time.perf_counter()))
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "waited_s", time.perf_counter() - self.started))


class Saver:
    """Checkpoint one way; the base class saves nothing (the baseline).

    The loop calls, all on the training thread: save(state) at the top of a step,
    before_optimizer_step() before each optimizer step, finish() after the warm-up saves and
    after the last step (until the last checkpoint is durable), and close() once. Each saver
    numbers its saves itself: 0, 1, 2, ... (plus a base for ckptd, so that every run saves new steps).
    """

    saves = 0

    def save(self, state: dict[str, Any]) -> None:
        """Checkpoint state as the next save; return when the caller may go on."""

    def before_optimizer_step(self) -> None:
        """Wait for what must be copied before the optimizer changes the state."""

    def finish(self) -> None:
        """Return once the last checkpoint is durable."""

    def close(self) -> None:
        """Release what the saver holds."""


class CkptdSaver(Saver):
    """save_async into the daemon's shared memory (lazy: optimizer-owned tensors copied in the background)."""

    def __init__(self, address: str, step_base: int, lazy: bool) -> None:
        self.checkpointer = ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=address)
        self.step_base, self.lazy = step_base, lazy
        self.handle: Any = None
        self.skipped = 0  # saves the daemon refused for lack of staging room: none expected
        self.blocked_s = 0.0  # time save_async waited before its copy (its handles' blocked_s: part of its stall)

    def save(self, state: dict[str, Any]) -> None:
        self.handle = self.checkpointer.save_async(state, step=self.step_base + self.saves, lazy=self.lazy)
        self.saves += 1
        self.skipped += self.handle.skipped
        self.blocked_s += self.handle.blocked_s

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.wait("nvme", timeout=WAIT_TIMEOUT_S)

    def close(self) -> None:
        self.checkpointer.close()


class DcpSaver(Saver):
    """torch.distributed.checkpoint.async_save to a FileSystemWriter, on a 1-rank gloo group.

    thread: everything default (synchronous staging into new memory, a thread that writes).
    process: a DefaultStager staging in the background into shared memory (pinned too where
    CUDA exists: this CPU build ignores the pinning flag), a checkpoint process, cached plans.
    A save first waits for the previous one, as DCP's users do.
    """

    def __init__(self, directory: Path, process: bool) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's checkpoint process picks a free port on it
        dist.init_process_group("gloo", store=dist.FileStore(str(directory / "store"), 1), rank=0, world_size=1)
        self.directory = directory
        self.kwargs: dict[str, Any] = {}
        self.stager: DefaultStager | None = None
        if process:
            options = StagingOptions(torch.cuda.is_available(), True, True, False)  # non-blocking copies: CUDA only
            self.stager = DefaultStager(options)
            self.kwargs = {
                "async_checkpointer_type": AsyncCheckpointerType.PROCESS,
                "async_stager": self.stager,
                "planner": dcp.DefaultSavePlanner(enable_plan_caching=True),
            }
        self.upload: Future[Any] | None = None
        self.staging: Future[Any] | None = None

    def save(self, state: dict[str, Any]) -> None:
        self.finish()
        writer = dcp.FileSystemWriter(self.directory / f"save-{self.saves}")
        self.saves += 1
        response = dcp.async_save(state, storage_writer=writer, **self.kwargs)
        if isinstance(response, Future):
            self.upload = response
        else:
            self.upload, self.staging = response.upload_completion, response.staging_completion

    def before_optimizer_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def finish(self) -> None:
        self.before_optimizer_step()
        if self.upload is not None:
            self.upload.result()
            self.upload = None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        dist.destroy_process_group()


class TorchSaver(Saver):
    """torch.save to a file, flushed and fsynced: synchronous."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def save(self, state: dict[str, Any]) -> None:
        with open(self.directory / f"save-{self.saves}.pt", "wb") as f:
            self.saves += 1
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def make_saver(args: argparse.Namespace) -> Saver:
    """Return the saver of args.variant."""
    if args.variant in ("ckptd", "ckptd-lazy"):
        return CkptdSaver(args.address, args.step_base, lazy=args.variant == "ckptd-lazy")
    if args.variant in ("dcp-thread", "dcp-process"):
        return DcpSaver(args.dir, process=args.variant == "dcp-process")
    return TorchSaver(args.dir) if args.variant == "torch-save" else Saver()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, run the timed steps with their saves, wait for the last checkpoint; return the timings."""
    torch.set_num_threads(args.threads)
    model, optimizer = build(int(args.state_gib * (1 << 30)))
    clock = OptimizerWaitClock(optimizer)
    saver = make_saver(args)
    generator = torch.Generator().manual_seed(1)

    def snapshot(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}

    def one_step(saving: bool) -> float:
        """Train one step; return how long the optimizer step was held back for a save (saving: one began)."""
        train_step(model, generator)
        start = time.perf_counter()
        saver.before_optimizer_step()
        held_s = time.perf_counter() - start
        optimizer.step()
        return held_s + clock.waited_s if saving else 0.0

    for _ in range(WARMUP_STEPS):
        one_step(False)
    for _ in range(WARMUP_SAVES if args.variant != "none" else 0):
        saver.save(snapshot(0))
        one_step(True)
        saver.finish()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    daemon_cpu_before_s = process_cpu_s(args.daemon_pid)
    stalls_s, step_ends_s = [], []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        saving = args.variant != "none" and (step - 1) % args.every == 0
        if saving:
            began = time.perf_counter()
            saver.save(snapshot(step))
            stalls_s.append(time.perf_counter() - began)
        held_s = one_step(saving)
        if saving:
            stalls_s[-1] += held_s
        step_ends_s.append(time.perf_counter() - start)
    saver.finish()
    window_s = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    daemon_cpu_s = process_cpu_s(args.daemon_pid) - daemon_cpu_before_s
    saver.close()
    step_s = [b - a for a, b in zip([0.0, *step_ends_s], step_ends_s, strict=False)]
    return {
        "variant": args.variant,
        "threads": args.threads,
        "cpus": sorted(os.sched_getaffinity(0)),
        "state_bytes": state_bytes_of(model),
        "vocab": model.embed.num_embeddings,
        "steps": args.steps,
        "saves": len(stalls_s),
        "warmup_saves": saver.saves - len(stalls_s),
        "window_s": window_s,
        "loop_s": step_ends_s[-1],
        "tail_s": window_s - step_ends_s[-1],
        "step_s_median": statistics.median(step_s),
        "step_s": step_s,
        "stall_s": stalls_s,
        "ckptd_skipped": getattr(saver, "skipped", 0),
        "ckptd_blocked_s": getattr(saver, "blocked_s", 0.0),
        "daemon_cpu_s": daemon_cpu_s,  # over the window
        "trainer_cpu_s": cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime,
    }


def parse_args() -> argparse.Namespace:
    """Parse the flags bench_training.py hands the trainer."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--state-gib", type=float, required=True)
    p.add_argument("--dir", type=Path, required=True, help="where the peers write their checkpoints")
    p.add_argument("--address", required=True, help="the daemon's socket")
    p.add_argument("--step-base", type=int, default=0, help="added to ckptd's step numbers: each run saves new steps")
    p.add_argument("--daemon-pid", type=int, default=0, help="whose CPU seconds over the window to report")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


if __name__ == "__main__":
    # dcp warns that it assumes one process and that pinning needs CUDA; both known.
    warnings.filterwarnings("ignore", category=UserWarning)
    arguments = parse_args()
    arguments.out.write_text(json.dumps(run(arguments)))
    sys.exit(0)
