"""torch.distributed.checkpoint on ckptd: a StorageWriter (its own AsyncStager) and a StorageReader.

    dcp.save(state, storage_writer=ckpt.dcp.Writer(job="llama"))             # returns once durable on NVMe
    f = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(job="llama"))   # returns after one copy
    f.result()                                                               # durable on NVMe
    dcp.load(state, storage_reader=ckpt.dcp.Reader(job="llama"))             # the latest step, resharded
    dcp.load(state, storage_reader=ckpt.dcp.Reader(path="/ckpt/llama/40"))   # any step directory, no daemon

A checkpoint_id given to dcp.save, async_save or load names the step (an integer or
a string of digits; for the Reader also a step directory). Steps saved through the
Writer and by Checkpointer.save_async are alike: each API reads the other's.
Importing this module imports torch.distributed.checkpoint; `import ckpt` does not.
"""

from __future__ import annotations

from ckpt.torch_version import require_torch

require_torch()

from ckpt.dcp_reader import Reader  # noqa: E402 (torch checked first)
from ckpt.dcp_writer import Writer  # noqa: E402

__all__ = ["Reader", "Writer"]
