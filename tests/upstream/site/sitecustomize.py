"""In a process that PyTorch's tests spawn (their ranks), put ckptd under DCP as the parent has (conftest.py)."""

import os

if os.environ.get("CKPTD_UPSTREAM_STORAGE") == "ckptd":
    import ckptd_upstream_storage

    ckptd_upstream_storage.install(activate=True)
