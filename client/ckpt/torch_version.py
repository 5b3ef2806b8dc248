"""Say clearly when torch is missing or older than the client is written for.

The floor (MIN_TORCH) is the oldest release whose public APIs the client uses
(torch.distributed.tensor, the DCP stager); it is not tested: the suite runs the one
torch it pins. ckpt/__init__'s lazy API and ckpt.dcp call require_torch before they
import torch's training-side modules.
"""

from __future__ import annotations

import re

MIN_TORCH = (2, 4)


def require_torch() -> None:
    """Raise ImportError naming what to install if torch is missing or older than MIN_TORCH."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            "ckpt's training API needs torch >= {}.{}: install it (pip install 'ckptd-client[torch]', or your "
            "image's torch)".format(*MIN_TORCH)
        ) from None
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None or (int(found[1]), int(found[2])) < MIN_TORCH:
        raise ImportError(f"ckpt needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is torch {torch.__version__}")
