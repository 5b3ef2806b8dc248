"""Launch a real torchrun job (gloo, CPU ranks) for the end-to-end tests: the one place that knows how."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT_S = 200


def torchrun(ranks: int, script: Path, *args: str, env: dict[str, str], timeout_s: float = TIMEOUT_S) -> str:
    """Run script on `ranks` ranks with env added (the daemons' addresses, the job); return its stdout.

    A failed run raises AssertionError with its output, torch's warnings left out. torchrun's own
    temporary files (its torchelastic_* log directories, which it never removes) go to a directory
    removed after the run.
    """
    base = {k: v for k, v in os.environ.items() if k not in ("CKPTD_ADDRESS", "CKPTD_ADDRESSES")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    # ignore_cleanup_errors: ranks a timeout left behind may still write there; the timeout is the error to see
    with tempfile.TemporaryDirectory(prefix="ckptd-torchrun-", ignore_cleanup_errors=True) as scratch:
        run = subprocess.run(
            [*command, str(script), *args],
            env={**base, "OMP_NUM_THREADS": "1", "TMPDIR": scratch, **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if run.returncode != 0:
        said = [line for line in run.stderr.splitlines() if "Warning" not in line and "warn(" not in line]
        raise AssertionError("torchrun failed:\n" + run.stdout + "\n".join(said[-200:]))
    return run.stdout
