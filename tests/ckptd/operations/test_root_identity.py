"""The staging slots are tied to the NVMe root they were taken for (ckptd.operations.root_identity)."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

from ckptd.operations import root_identity
from ckptd.operations.root_identity import ROOT_ID_NAME


def _slot(staging, job="j", size=4096):
    (staging / job).mkdir(parents=True, exist_ok=True)
    path = staging / job / "rank-00000.slot-0"
    path.write_bytes(b"\0" * size)
    return path


def test_a_root_gets_an_identity_once_and_its_staging_keeps_its_slots(tmp_path):
    root, staging = tmp_path / "root", tmp_path / "staging"
    root.mkdir()
    first = root_identity.claim(root, staging)
    slot = _slot(staging)
    assert root_identity.claim(root, staging) == first == (root / ROOT_ID_NAME).read_text()
    assert (staging / ROOT_ID_NAME).read_text() == first
    assert slot.exists()


def test_a_staging_directory_from_before_identities_is_adopted_with_its_slots(tmp_path):
    root, staging = tmp_path / "root", tmp_path / "staging"
    root.mkdir()
    slot = _slot(staging)
    ident = root_identity.claim(root, staging)
    assert slot.exists() and (staging / ROOT_ID_NAME).read_text() == ident


def test_slots_of_another_root_are_removed_and_the_staging_directory_tied_to_the_new_one(tmp_path, caplog):
    root, staging = tmp_path / "root", tmp_path / "staging"
    root.mkdir()
    old = root_identity.claim(root, staging)
    _slot(staging, "a", 8192)
    _slot(staging, "b", 4096)
    shutil.rmtree(root)
    root.mkdir()  # wiped: a new root at the same path
    new = root_identity.claim(root, staging)
    assert new != old
    assert sorted(p.name for p in staging.iterdir()) == [ROOT_ID_NAME]
    assert (staging / ROOT_ID_NAME).read_text() == new
    assert "removed 2 staging files (12288 bytes)" in caplog.text


def test_watch_returns_once_the_root_is_removed_or_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(root_identity, "CHECK_S", 0.01)
    root, staging = tmp_path / "root", tmp_path / "staging"
    root.mkdir()
    ident = root_identity.claim(root, staging)

    async def removed_while_watched() -> bool:
        watching = asyncio.create_task(root_identity.watch(root, ident, threads))
        await asyncio.sleep(0.05)  # several checks of a root that is still there
        still = not watching.done()
        (root / ROOT_ID_NAME).write_text("another root's")
        await asyncio.wait_for(watching, timeout=10)
        return still

    with ThreadPoolExecutor(1) as threads:  # Executors.status
        assert asyncio.run(removed_while_watched())
