"""The uploader's watch of a step's commit in the store: it gives up only when the step truly cannot complete."""

from __future__ import annotations

import mmap
import time
import types
from concurrent.futures import ThreadPoolExecutor

from ckpt_core.errors import NotFound
from ckpt_core.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta, data_name, digest, round_up

from ckptd.save.uploading import Uploader, upload_file
from ckptd.storage.object_store import open_store
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.tier import ObjectTier

THREADS = ThreadPoolExecutor(4)  # Executors.object_reads and object_requests, here


def _uploaded(nvme: LocalDirTier, store: ObjectTier, step: int) -> CommitRecord:
    payload = bytes([step]) * 5000
    m = mmap.mmap(-1, round_up(len(payload), 4096))
    m[: len(payload)] = payload
    meta = nvme.write_shard(ShardMeta("job", step, 0, 1, len(payload), CHUNK_SIZE_BYTES, (), "{}"), memoryview(m))
    upload_file(store, meta, (nvme.root / "job" / str(step)) / data_name(0))
    return CommitRecord("job", step, 1, (digest(meta.to_bytes()),), len(payload))


def test_a_step_committed_by_another_node_between_two_looks_is_not_given_up(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/store"
    here, writer = (ObjectTier(open_store(url, {}), THREADS, THREADS) for _ in range(2))  # two nodes, one store
    nvme = LocalDirTier(tmp_path / "nvme")
    assert writer.adopt_commit(_uploaded(nvme, writer, 10))
    step_5 = _uploaded(nvme, writer, 5)
    read_before_the_commit = here.commit_record

    def commit_record(job: str, step: int) -> CommitRecord:
        try:
            return read_before_the_commit(job, step)  # not there yet...
        finally:
            assert writer.adopt_commit(step_5)  # ...and the other node commits it right after this look

    monkeypatch.setattr(here, "commit_record", commit_record)
    watch = types.SimpleNamespace(tier=here, nvme=nvme, counters={"commits_written": 0})
    try:
        verdict = Uploader._check_commit(watch, "job", 5, False, [], time.monotonic())  # type: ignore[arg-type]
    except NotFound:
        raise AssertionError("the watch did not look again") from None
    assert verdict == "committed", verdict
