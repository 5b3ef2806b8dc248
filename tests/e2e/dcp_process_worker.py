"""One torchrun rank of tests/e2e/test_dcp_interop.py: dcp.async_save with DCP's process executor into ckptd.

    torchrun --nproc-per-node 1 dcp_process_worker.py OUT

Saves three steps with async_checkpointer_type=PROCESS (5 from checkpoint_id, then one
past it, staged by the Writer; then 7, staged by DCP's DefaultStager), changing the
state as soon as each async_save returns, and writes what each step must hold to
OUT/saved.pt. CKPTD_ADDRESS names the daemon; CKPT_JOB the job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ckpt.dcp
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

FUTURE_TIMEOUT_S = 300


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    writer = ckpt.dcp.Writer(job=os.environ["CKPT_JOB"])
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3, 3), "note": "first"}
    steps = {}
    dcps_own = DefaultStager(StagingOptions(False, True, False, False))  # copies into shared memory, in this thread
    for checkpoint_id, name, stager in ((5, "first", None), (None, "second", None), (7, "third", dcps_own)):
        state["note"] = name
        expected = {"w": state["w"].clone(), "b": state["b"].clone(), "note": name}
        future = dcp.async_save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        state["w"].add_(1)  # at once: the snapshot is taken when async_save returns
        state["b"].mul_(3)
        future.result(timeout=FUTURE_TIMEOUT_S)
        steps[name] = expected
    torch.save(steps, out / "saved.pt")
    dcps_own.close()
    writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
