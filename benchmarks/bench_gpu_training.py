"""Benchmark GPU training with checkpoints: ckptd eager and lazy against dcp.async_save, a save every 1 to 50 steps.

A GPT-style model (default 20 layers of width 1536, vocabulary 50,304: about 640 M
parameters, 7.7 GB of parameters and AdamW moments) trains on one GPU with fused AdamW and
bf16 autocast, on random tokens. In interleaved windows of --steps steps it runs, for each
save interval N in --every (1, 2, 10, 50):

    none         no checkpoints (one window per interval: the baseline beside it)
    ckptd        Checkpointer.save_async(state, step) at the top of every Nth step
    ckptd-lazy   the same with lazy=True: parameters and moments copied beside the next
                 forward and backward pass, the optimizer's stream waiting on the GPU
    dcp-thread   torch.distributed.checkpoint.async_save as most users call it (a thread writes)
    dcp-process  async_save with the PROCESS executor and a DefaultStager (pinned, shared,
                 background staging); where it fails, its error is printed

DCP's windows hold two saves (a save waits for the previous one, seconds each; more would
not fit the GPU machine's time). It prints, per variant and interval: the overhead over the
whole window against `none` beside it, the time save_async blocks per save as a ratio to a
plain device-to-host copy_ of the same bytes into pinned memory measured in the same run,
the cost per save ((window - none) / saves) against the same copy, the GPU memory the lazy
spill used, and the first save of a prepared Checkpointer against a steady one. Targets
(docs/DESIGN.md, Performance): lazy stall <= 0.05x, eager <= 1.1x, first save <= 1.2x,
overhead <= 1 % at a save every 10 steps and <= 5 % every 2 steps. Without CUDA it says so
and exits 0. It is not a test; scripts/gpu_check.sh runs it.

    python benchmarks/bench_gpu_training.py                 # about 4 minutes on an H100
    python benchmarks/bench_gpu_training.py --layers 4      # a quick look (about 1.3 GB of state)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckpt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from daemon import BenchDaemon
from report import Row, held, table, write_results
from torch import nn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
JOB = "bench-gpu-training"
WAIT_TIMEOUT_S = 900.0
WARMUP_STEPS = 5
DCP_SAVES = 2  # per window: each waits for the previous one, seconds on a state of gigabytes
VARIANTS = ("ckptd", "ckptd-lazy", "dcp-thread", "dcp-process")
STALL_TARGETS = {"ckptd": "<= 1.1", "ckptd-lazy": "<= 0.05"}
OVERHEAD_TARGETS = {10: "<= 0.01", 2: "<= 0.05"}  # window / none's - 1, for ckptd's variants


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (
            z.view(b, t, self.heads, width // self.heads).transpose(1, 2)
            for z in self.qkv(self.norm1(x)).split(width, -1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, width)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token embedding (tied to the output), blocks, a final norm."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


class Trainer:
    """The model, fused AdamW, and one step on random tokens under bf16 autocast."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.device = args.device
        self.model = GPT(args.vocab, args.width, args.layers, args.heads).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=self.device == "cuda")
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.device)

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            logits = self.model(self.tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}

    def tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)

        walk(self.state(0))
        return found


def synchronize() -> None:
    """Wait for the GPU's queued work, where there is a GPU (--device cpu: a smoke run of this script)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pinned_copy_s(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """Return the median time of a copy_ of every tensor into preallocated pinned host memory (the limit)."""
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
    times = []
    for _ in range(repeats + 1):  # the first also faults the pinned pages in
        synchronize()
        start = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t, non_blocking=True)
        synchronize()
        times.append(time.perf_counter() - start)
    del dst
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # gigabytes of pinned memory the run needs elsewhere
    return statistics.median(times[1:])


class CkptdSaver:
    """save_async through the daemon; one Checkpointer for the run, prepared ahead of its first save."""

    def __init__(self, trainer: Trainer, address: str, spill_bytes: int | None) -> None:
        self.c = ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=address, spill_bytes=spill_bytes)
        self.step = 0
        self.handle: Any = None
        self.spilled_max = 0
        self.skipped = 0

    def save(self, trainer: Trainer, lazy: bool) -> None:
        if self.handle is not None:
            self.spilled_max = max(self.spilled_max, self.handle.spilled_bytes)
        self.step += 1
        self.handle = self.c.save_async(trainer.state(self.step), step=self.step, lazy=lazy)
        self.skipped += self.handle.skipped

    def copied(self) -> None:
        """Wait for the last save's copy (lazy: in the background): part of the window."""
        if self.handle is not None:
            self.handle.wait("memory", timeout=WAIT_TIMEOUT_S)
            self.spilled_max = max(self.spilled_max, self.handle.spilled_bytes)

    def durable(self) -> None:
        """Wait for the last save on NVMe, outside the window: the next window starts with an idle disk."""
        if self.handle is not None and not self.handle.skipped:
            self.handle.wait("nvme", timeout=WAIT_TIMEOUT_S)


class DcpSaver:
    """dcp.async_save into a directory per save; a save waits for the previous one, as DCP requires."""

    def __init__(self, directory: Path, process: bool) -> None:
        self.directory = directory
        self.saves = 0
        self.kwargs: dict[str, Any] = {}
        self.stager: Any = None
        if process:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            self.stager = DefaultStager(StagingOptions(True, True, True, True))
            self.kwargs = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": self.stager}
        self.pending: Any = None

    def save(self, trainer: Trainer, lazy: bool) -> None:
        self.durable()
        self.saves += 1
        target = self.directory / f"save-{self.saves}"
        response = dcp.async_save(trainer.state(self.saves), checkpoint_id=str(target), **self.kwargs)
        self.pending = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state may change once staged: the optimizer steps next

    def copied(self) -> None:
        pass

    def durable(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            for old in self.directory.glob("save-*"):
                if old.name != f"save-{self.saves}":
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def window(trainer: Trainer, saver: Any, variant: str, every: int, steps: int) -> dict[str, Any]:
    """Train steps steps, saving at the top of every every-th; return the window and each save's blocking time."""
    lazy = variant == "ckptd-lazy"
    stalls = []
    synchronize()
    start = time.perf_counter()
    for i in range(steps):
        if saver is not None and i % every == 0:
            began = time.perf_counter()
            saver.save(trainer, lazy)
            stalls.append(time.perf_counter() - began)
        trainer.step()
    if saver is not None:
        saver.copied()
    synchronize()
    window_s = time.perf_counter() - start
    if saver is not None:
        saver.durable()
    return {"variant": variant, "every": every, "steps": steps, "window_s": window_s, "stall_s": stalls}


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and write the JSON; without CUDA say so and return 0."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here (torch.cuda.is_available() is False): no GPU training to measure; skipped")
        return 0
    warnings.filterwarnings("ignore", category=UserWarning)  # dcp: one process, pinning notes
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (a smoke run: no GPU figures)"
    trainer = Trainer(args)
    tensors = trainer.tensors()
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(WARMUP_STEPS):
        trainer.step()
    synchronize()
    print(f"{state_bytes / 1e9:.2f} GB of state ({len(tensors)} tensors) on {device}", flush=True)
    copy_s = pinned_copy_s(tensors)
    print(f"D2H copy_ into pinned memory: {copy_s:.3f} s ({state_bytes / copy_s / 1e9:.1f} GB/s)", flush=True)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-training-", dir=args.dir))
    staging = Path(tempfile.mkdtemp(prefix="ckptd-bench-gpu-training-", dir="/dev/shm"))
    daemon = BenchDaemon("bench-gpu-training", work / "daemon", staging, toml="[retention]\nnvme = 1\n")
    (work / "daemon").mkdir()
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's checkpoint process picks a free port on it
    dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1)
    results: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    first: dict[str, float] = {}
    ckptd_saver: CkptdSaver | None = None
    try:
        daemon.start()
        ckptd_saver = CkptdSaver(trainer, str(daemon.socket_path), args.spill_bytes)
        started = time.perf_counter()
        ckptd_saver.c.prepare(trainer.state(0)).result(timeout=WAIT_TIMEOUT_S)
        first["prepare_s"] = time.perf_counter() - started
        for label in ("first", "second", "steady"):
            synchronize()
            began = time.perf_counter()
            ckptd_saver.save(trainer, lazy=False)
            first[label] = time.perf_counter() - began
            ckptd_saver.durable()
        print(
            f"prepared in {first['prepare_s']:.2f} s; first save {first['first']:.3f} s, steady {first['steady']:.3f} s"
        )
        savers: dict[str, Callable[[], Any]] = {
            "ckptd": lambda: ckptd_saver,
            "ckptd-lazy": lambda: ckptd_saver,
            "dcp-thread": lambda: DcpSaver(work / "dcp-thread", process=False),
            "dcp-process": lambda: DcpSaver(work / "dcp-process", process=True),
        }
        for every in args.every:
            results.append(window(trainer, None, "none", every, max(args.steps, 2 * every)))
            for variant in [v for v in args.variants if v not in errors]:
                steps = max(args.steps, 2 * every) if variant.startswith("ckptd") else every * (DCP_SAVES - 1) + 1
                saver = None
                try:
                    saver = savers[variant]()
                    (work / variant).mkdir(exist_ok=True)
                    results.append(window(trainer, saver, variant, every, steps))
                except Exception as e:  # a peer that fails on this state: say how, go on
                    errors[variant] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                finally:
                    if isinstance(saver, DcpSaver):
                        saver.close()
                    shutil.rmtree(work / variant, ignore_errors=True)
                r = results[-1]
                if r["variant"] == variant and r["every"] == every:
                    print(f"every {every:>2}: {variant:<11} {r['window_s'] / r['steps'] * 1e3:7.1f} ms/step, "
                          f"save_async {statistics.median(r['stall_s']):.3f} s", flush=True)  # fmt: skip
        status = daemon.status()
        daemon_warnings = daemon.stop()
    finally:
        if ckptd_saver is not None:
            ckptd_saver.c.close()
        daemon.kill()
        dist.destroy_process_group()
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = [Row("D2H copy_ into pinned host memory (limit)", copy_s, state_bytes)]
    rows.append(held("first save of a prepared job", first["first"], state_bytes, "a steady save",
                     first["first"] / first["steady"], "<= 1.2"))  # fmt: skip
    none_step_s = {r["every"]: r["window_s"] / r["steps"] for r in results if r["variant"] == "none"}
    for r in results:
        if r["variant"] == "none":
            rows.append(Row(f"none, every {r['every']}: step", none_step_s[r["every"]], 0))
            continue
        base_s = none_step_s[r["every"]] * r["steps"]
        overhead = r["window_s"] / base_s - 1
        name, stall_s = f"{r['variant']}, every {r['every']}", statistics.median(r["stall_s"])
        target = OVERHEAD_TARGETS.get(r["every"], "") if r["variant"].startswith("ckptd") else ""
        rows.append(held(f"{name}: overhead", r["window_s"], state_bytes * len(r["stall_s"]), "none's window",
                         overhead, target) if target else
                    Row(f"{name}: overhead", r["window_s"], state_bytes * len(r["stall_s"]), "none's window",
                        overhead))  # fmt: skip
        stall_target = STALL_TARGETS.get(r["variant"], "")
        rows.append(held(f"{name}: save_async blocks", stall_s, state_bytes, "D2H copy_", stall_s / copy_s,
                         stall_target) if stall_target else
                    Row(f"{name}: save_async blocks", stall_s, state_bytes, "D2H copy_", stall_s / copy_s))  # fmt: skip
        cost_s = max(r["window_s"] - base_s, 1e-9) / len(r["stall_s"])
        rows.append(Row(f"{name}: cost per save", cost_s, state_bytes, "D2H copy_", cost_s / copy_s))
    print()
    print(table(rows))
    spilled = ckptd_saver.spilled_max if ckptd_saver is not None else 0
    print(f"\nlazy spill: at most {spilled / 1e9:.2f} GB of GPU memory, {spilled / state_bytes:.0%} of the state "
          f"(Checkpointer spill_bytes={args.spill_bytes})")  # fmt: skip
    print(f"ckptd saves skipped: {ckptd_saver.skipped if ckptd_saver else 0}")
    print("ckptd passed over:", json.dumps(status.get("passed_over", {}).get(JOB, {}), default=str))
    for variant, error in errors.items():
        print(f"{variant} failed on this state: {error}")
    print("\nckptd logged:", *daemon_warnings or ["no warnings"], sep="\n  ")
    write_results(args.json, load_before, rows, {"torch": torch.__version__, "cuda": str(torch.version.cuda)},
                  device=device, state_bytes=state_bytes, copy_s=copy_s, first_save=first, windows=results,
                  errors=errors, spilled_bytes_max=spilled, args={k: str(v) for k, v in vars(args).items()},
                  )  # fmt: skip
    return 0


def parse_args() -> argparse.Namespace:
    """Parse the flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20, help="transformer blocks (default 20: about 640 M parameters)")
    p.add_argument("--width", type=int, default=1536, help="model width (default 1536)")
    p.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary (default 50304)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--steps", type=int, default=40, help="steps per window of none and ckptd (default 40)")
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 10, 50], help="save intervals (default 1 2 10 50)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="besides none")
    p.add_argument("--spill-bytes", type=int, default=None, help="Checkpointer spill_bytes (default: from free memory)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where files go, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "gpu-training.json", help="where the results go")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    arguments.dir.mkdir(parents=True, exist_ok=True)
    raise SystemExit(run(arguments))
