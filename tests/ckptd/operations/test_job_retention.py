"""Each job's retention: the client's settings over its config table over [retention], pins that outlive a restart."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.errors import InvalidArgument

from ckptd.config import Config, JobRetentionConfig, NodeConfig, RetentionConfig
from ckptd.operations.job_retention import JOBS_DIR_NAME, ClientRetention, JobRetention
from ckptd.tiers.nvme import LocalDirTier


def config(root, **retention):
    return Config(node=NodeConfig(root=str(root)), retention=RetentionConfig(**retention))


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def threads():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def test_the_client_wins_over_the_jobs_table_which_wins_over_retention(tmp_path, threads):
    table = {"a": JobRetentionConfig(keep=5), "b": JobRetentionConfig(keep_every=100)}
    jobs = JobRetention(config(tmp_path, nvme=3, peer=4, object=7, keep_every=10, jobs=table), threads)
    assert jobs.effective("other").to_json() == {
        "keep": {"nvme": 3, "peer": 4, "object": 7},
        "keep_every": 10,
        "pinned": [],
        "from": {"keep": "default", "keep_every": "default"},
    }
    a = jobs.effective("a")
    assert a.keep == {"nvme": 5, "peer": 5, "object": 7} and a.keep_every == 10
    assert a.source == {"keep": "config", "keep_every": "default"}
    assert jobs.effective("b").keep_every == 100 and jobs.effective("b").keep["nvme"] == 3

    run(jobs.client_asked("a", ClientRetention(keep=0)))  # 0: keep every step, the client's word
    a = jobs.effective("a")
    assert a.keep == {"nvme": 0, "peer": 0, "object": 7} and a.source == {"keep": "client", "keep_every": "default"}
    run(jobs.client_asked("b", ClientRetention(keep_every=0)))
    assert jobs.effective("b").keep_every == 0 and jobs.effective("b").source["keep_every"] == "client"
    assert set(jobs.describe(["c"])) == {"a", "b", "c"}  # asked for, set by a client, or named in the config


def test_pins_and_the_clients_settings_outlive_a_restart_beside_the_steps(tmp_path, threads):
    root = tmp_path / "nvme"
    jobs = JobRetention(config(root), threads)
    assert run(jobs.set_pin("j", 20, True)) == {20}
    assert run(jobs.set_pin("j", 10, True)) == {10, 20}
    assert run(jobs.set_pin("j", 20, False)) == {10}
    run(jobs.client_asked("j", ClientRetention(keep=2, keep_every=50)))
    assert (root / JOBS_DIR_NAME / "j.json").is_file()
    assert [p.name for p in (root / JOBS_DIR_NAME).iterdir()] == ["j.json"]  # no temporary file left

    again = JobRetention(config(root), threads)
    assert again.jobs() == []
    again.load()
    assert again.pinned("j") == {10}
    assert again.effective("j").keep["nvme"] == 2 and again.effective("j").keep_every == 50

    tier = LocalDirTier(root)  # the records never look like a job, nor like a step of one
    assert tier.jobs() == [] and tier.remove_leftovers() == []
    assert (root / JOBS_DIR_NAME / "j.json").is_file()

    run(again.forget("j"))
    assert again.pinned("j") == frozenset() and not (root / JOBS_DIR_NAME / "j.json").exists()


def test_a_damaged_record_is_logged_and_left_alone(tmp_path, threads, caplog):
    root = tmp_path / "nvme"
    jobs = JobRetention(config(root), threads)
    run(jobs.set_pin("j", 1, True))
    path = root / JOBS_DIR_NAME / "j.json"
    path.write_bytes(path.read_bytes().replace(b'"pinned":[1]', b'"pinned":[2]'))  # its checksum no longer matches
    again = JobRetention(config(root), threads)
    again.load()
    assert again.pinned("j") == frozenset()
    assert "ignoring the retention record of job j" in caplog.text and "checksum" in caplog.text
    assert path.exists()


def test_an_unchanged_setting_is_not_written_again(tmp_path, threads):
    jobs = JobRetention(config(tmp_path), threads)
    run(jobs.client_asked("j", ClientRetention(keep=1)))
    path = tmp_path / JOBS_DIR_NAME / "j.json"
    written = path.stat().st_mtime_ns, path.stat().st_ino
    run(jobs.client_asked("j", ClientRetention(keep=1)))  # every Reserve carries it
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == written


@pytest.mark.parametrize("field", ["keep", "keep_every"])
@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_a_bad_client_setting_is_an_invalid_argument(field, value):
    with pytest.raises(InvalidArgument, match=f"retention {field} must be 0 or a positive integer"):
        ClientRetention(**{field: value})


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientRetention(keep=1).keep = 2  # type: ignore[misc]
