"""The envelope of the small JSON pointers the trainer adapters leave where their trainer expects a checkpoint.

Lightning's CkptdCheckpointIO (at each .ckpt path), Hugging Face's CkptdTrainer and
AcceleratorCheckpoints (ckptd.json in each checkpoint-N directory) and DeepSpeed's
CkptdCheckpointEngine (at each .pt path) write one, naming the ckptd job and step that hold the
checkpoint. Each adapter has its own format name and fields, and its own Pointer class; the
envelope around them ("format", "version", a newline) and its checks are here, one way:
pointer_bytes() makes a pointer's bytes, write_local_pointer() puts them at a local path whole,
pointer_fields() checks the envelope of bytes read back, and broken_pointer() wraps the adapter's
reading of its own fields. Called on whichever thread saves or loads (the training thread, the
Lightning plugin's file writer).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ckpt_core.errors import InvalidArgument


def pointer_bytes(format_name: str, version: int, fields: Mapping[str, Any]) -> bytes:
    """Return a pointer's bytes: one JSON object, its format and version first, and a newline."""
    return (json.dumps({"format": format_name, "version": version, **fields}) + "\n").encode()


def write_local_pointer(path: str, data: bytes) -> None:
    """Write a pointer's bytes at a local path, whole or not at all: into path.partial, then renamed over path."""
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def pointer_fields(data: bytes, path: str, format_name: str, version: int) -> dict[str, Any]:
    """Return the fields of a pointer's bytes read from path, once its envelope checks; else InvalidArgument."""
    try:
        fields = json.loads(data)
    except ValueError as e:
        raise InvalidArgument(f"{path} is not a ckptd pointer: {e}") from None
    if not isinstance(fields, dict) or fields.get("format") != format_name:
        raise InvalidArgument(f'{path} holds JSON that is not a ckptd pointer (no "format": "{format_name}")')
    if fields.get("version") != version:
        raise InvalidArgument(
            f"{path} is a ckptd pointer of version {fields.get('version')!r}; this ckpt reads version {version}"
        )
    return fields


@contextlib.contextmanager
def broken_pointer(path: str) -> Iterator[None]:
    """Turn a missing or bad field met while the adapter reads a pointer's fields into InvalidArgument naming path."""
    try:
        yield
    except (KeyError, TypeError, InvalidArgument) as e:
        raise InvalidArgument(f"{path} is a broken ckptd pointer: {type(e).__name__}: {e}") from None
