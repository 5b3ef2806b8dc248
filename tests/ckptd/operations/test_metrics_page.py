"""The /metrics page: rendered from memory alone, with a registry of the daemon's own."""

from __future__ import annotations

import asyncio
import builtins
import os

import prometheus_client
from ckpt_core.shard_key import ShardKey
from prometheus_client.parser import text_string_to_metric_families

from ckptd.config import Config, NodeConfig, StagingConfig
from ckptd.node import Executors, Node

DISK_CALLS = (
    (os, "scandir"), (os, "listdir"), (os, "stat"), (os, "lstat"), (os, "open"), (builtins, "open"),
)  # fmt: skip


class TouchedTheDisk(AssertionError):
    """A scrape reached for the filesystem."""


def test_a_scrape_touches_no_disk_where_status_lists_the_jobs(tmp_path, monkeypatch):
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), staging=StagingConfig(dir=str(tmp_path / "shm")))

    def refuse(*args: object, **kwargs: object) -> None:
        raise TouchedTheDisk(f"disk call with {args}")

    async def body(node: Node) -> tuple[str, BaseException | None]:
        progress, report = node.progress, node.report
        key = ShardKey("j", 4, 0, 1)
        progress.copy_committed(key)  # complete in memory: every rank's copy is in
        progress.step_completed("nvme", "j", 4, 1_700_000_000.0)
        with monkeypatch.context() as blocked:
            for module, name in DISK_CALLS:
                blocked.setattr(module, name, refuse)
            page = await report.metrics_page()
            try:
                await report.document()  # the Status RPC lists each tier's jobs: the guard does catch that
                listed = None
            except TouchedTheDisk as e:
                listed = e
        await node.drain()
        return page, listed

    async def run() -> tuple[str, BaseException | None]:
        node = Node(config, Executors.build())
        await node.start()
        return await body(node)

    page, listed = asyncio.run(run())
    assert isinstance(listed, TouchedTheDisk)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    assert samples[("ckptd_newest_complete_step", (("job_name", "j"), ("tier", "nvme")))] == 4
    assert samples[("ckptd_newest_complete_step_timestamp_seconds", (("job_name", "j"), ("tier", "nvme")))] == 1.7e9
    # Every rank's copy was reported committed, but the job holds no slot here (this test made none): memory is
    # reported only for jobs whose slots are still there.
    assert ("ckptd_newest_complete_step", (("job_name", "j"), ("tier", "memory"))) not in samples


def test_nothing_lands_in_prometheus_clients_global_registry(tmp_path):
    config = Config(node=NodeConfig(root=str(tmp_path / "nvme")), staging=StagingConfig(dir=str(tmp_path / "shm")))

    async def run() -> str:
        node = Node(config, Executors.build())
        await node.start()
        page = await node.report.metrics_page()
        await node.drain()
        return page

    assert "ckptd_saves_total 0.0" in asyncio.run(run())
    assert "ckptd_" not in prometheus_client.generate_latest().decode()
