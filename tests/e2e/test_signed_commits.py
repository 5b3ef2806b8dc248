"""Signed commit records end to end: a step forged with consistent xxh3 digests is never loaded or adopted.

The forger is who the issue names: an object-store writer and a peer. Both can recompute every
xxh3-128 (chunks, shard record, commit record) with the project's own code; neither holds the
cluster key ([security] key_file), so a daemon with the key refuses what they made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ckpt
import pytest
import torch
from certs import CertificateAuthority
from ckpt_core.chunks import chunk_digests
from ckpt_core.commit_keys import KEY_FILE_ENV, CommitKeys
from ckpt_core.errors import CorruptCheckpoint, NotFound
from ckpt_core.format import COMMIT_NAME, CommitRecord, ShardMeta, data_name, digest, meta_name
from conftest import eventually
from states import assert_same

from ckptd.cluster.peer_link import PeerLink, ReplicaRejected
from ckptd.config import PeerConfig
from ckptd.errors import PeerError

pytestmark = pytest.mark.e2e

JOB = "train"
KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))  # the forger's own key: a record signed with it is as bad as an unsigned one


def rank_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=g), "step": step}


def key_file(path: Path, key: bytes) -> Path:
    path.write_text(key.hex() + "\n")
    path.chmod(0o600)
    return path


def security(key: Path, previous: tuple[Path, ...] = ()) -> str:
    listed = ", ".join(f'"{p}"' for p in previous)
    return f'[security]\nkey_file = "{key}"\nprevious_key_files = [{listed}]\n'


def save(node, step: int, tier: str) -> None:
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        c.save_async(rank_state(step), step=step).wait(tier, timeout=60)


def forge(step_dir: Path, signer: bytes | None) -> None:
    """Zero a page of rank 0's tensor bytes and recompute every digest with the project's code, as a writer would."""
    data = step_dir / data_name(0)
    raw = bytearray(data.read_bytes())
    raw[5 << 20 : (5 << 20) + 4096] = bytes(4096)  # inside "w": a page of zeros
    data.write_bytes(raw)
    meta = ShardMeta.from_bytes((step_dir / meta_name(0)).read_bytes(), "test")
    meta = dataclasses.replace(meta, chunk_xxh3_128=tuple(chunk_digests(memoryview(raw), meta.chunk_size_bytes)))
    (step_dir / meta_name(0)).write_bytes(meta.to_bytes())
    record, object_keys = CommitRecord.from_object_bytes((step_dir / COMMIT_NAME).read_bytes(), "test")
    forged = CommitRecord(JOB, record.step, 1, (digest(meta.to_bytes()),), record.size_bytes, record.line)
    if signer is not None:
        forged = CommitKeys((signer,)).sign(forged)
    (step_dir / COMMIT_NAME).write_bytes(forged.to_bytes(object_keys=object_keys))
    (step_dir / "INDEX.json").unlink(missing_ok=True)


@pytest.mark.parametrize("signer", [None, OTHER_KEY], ids=["unsigned", "other-key"])
def test_a_step_forged_in_the_object_store_is_never_loaded(make_daemon, short_tmp, monkeypatch, signer):
    store = short_tmp / "bucket"
    key = key_file(short_tmp / "cluster.key", KEY)
    node = make_daemon(f'[object]\nurl = "file://{store}"\n' + security(key)).start()
    save(node, 1, "object")
    forge(store / JOB / "1", signer)
    node.lose()  # the store's copy is the only one left
    node.start()
    why = "is not signed" if signer is None else "signed with an unknown key"
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        assert c.latest_step() is None
        with pytest.raises((NotFound, CorruptCheckpoint)):
            c.load(1)
    out = node.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout + out.stderr
    assert sum(why in line for line in node.log().splitlines()) == 1, node.log()  # once per step and tier
    out = node.cli("restore", "--job", JOB, "--step", "1", "--from", f"file://{store}", "--to", str(short_tmp / "o"))
    assert out.returncode == 1 and why in out.stderr, out.stderr
    assert not (short_tmp / "o" / JOB / "1").exists()
    # With no daemon: the key in CKPTD_KEY_FILE is what load_local and ckpt.dcp.Reader(path=) check with.
    monkeypatch.setenv(KEY_FILE_ENV, str(key))
    with pytest.raises(CorruptCheckpoint, match=why):
        ckpt.load_local(store / JOB / "1")


def test_the_forgery_is_what_loads_without_a_key(make_daemon, short_tmp, monkeypatch):
    """Signing off (no key_file) is today's behaviour: the same forgery loads; what the key is there to stop."""
    store = short_tmp / "bucket"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n').start()
    save(node, 1, "object")
    forge(store / JOB / "1", None)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    loaded = ckpt.load_local(store / JOB / "1")
    assert not torch.equal(loaded["w"], rank_state(1)["w"]) and int((loaded["w"] == 0).sum()) >= 1000
    assert "no key_file: commit records are neither signed nor checked" in node.log()


def test_a_peers_forged_commit_record_is_not_adopted(make_cluster, short_tmp):
    key = key_file(short_tmp / "cluster.key", KEY)
    (a,) = make_cluster(1, extra_toml=security(key))
    a.start()
    # Rank 0 of two is durable here; rank 1 never came. A record naming both would seal the step.
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=2, address=a.address) as c:
        c.save_async(rank_state(3), step=3).wait("nvme", timeout=60)
    step_dir = a.root / JOB / "3"
    mine = digest((step_dir / meta_name(0)).read_bytes())
    forged = CommitRecord(JOB, 3, 2, (mine, "0" * 32), 2 * (step_dir / data_name(0)).stat().st_size)
    link = PeerLink(a.listen, PeerConfig(), "a-stranger")
    try:
        with pytest.raises(PeerError, match="is not signed"):
            link.commit_step(forged, timeout_s=10)
        with pytest.raises(PeerError, match="signed with an unknown key"):
            link.commit_step(CommitKeys((OTHER_KEY,)).sign(forged), timeout_s=10)
    finally:
        link.close()
    assert not (step_dir / COMMIT_NAME).exists()
    out = a.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout


def test_a_step_signed_with_a_previous_key_loads_only_while_that_key_is_kept(make_daemon, short_tmp):
    store = short_tmp / "bucket"
    old, new = key_file(short_tmp / "old.key", KEY), key_file(short_tmp / "new.key", OTHER_KEY)
    node = make_daemon(f'[object]\nurl = "file://{store}"\n' + security(old)).start()
    save(node, 1, "object")
    assert node.stop() == 0
    config = node.config_path.read_text().replace(security(old), "")
    url = f"file://{store}"

    node.config_path.write_text(config + security(new, (old,)))  # the rotation: new key, old one kept to check
    out = node.cli("restore", "--job", JOB, "--from", url, "--to", str(short_tmp / "kept"))
    assert out.returncode == 0, out.stderr
    assert_same(ckpt.load_local(short_tmp / "kept" / JOB / "1"), rank_state(1))
    node.start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        assert_same(c.load(1), rank_state(1))
    assert node.stop() == 0

    node.config_path.write_text(config + security(new))  # the old key dropped: its steps no longer check
    out = node.cli("restore", "--job", JOB, "--from", url, "--to", str(short_tmp / "dropped"))
    assert out.returncode == 1 and "signed with an unknown key" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "mode, content, why",
    [
        (0o644, KEY.hex(), "other users may read it"),
        (0o600, "abcd", "holds 2 bytes of key"),
    ],
)
def test_a_key_file_others_may_read_or_too_short_is_a_config_error(make_daemon, short_tmp, mode, content, why):
    path = short_tmp / "cluster.key"
    path.write_text(content)
    os.chmod(path, mode)
    node = make_daemon(security(path))
    out = node.cli("ls")
    assert out.returncode == 2 and "security.key_file" in out.stderr and why in out.stderr, out.stderr


@pytest.mark.parametrize("cluster_backend", ["peers", "etcd"])
def test_a_signed_cluster_seals_replicates_and_restores_a_lost_node(make_cluster, short_tmp, cluster_backend):
    key = key_file(short_tmp / "cluster.key", KEY)
    a, b = make_cluster(2, extra_toml=security(key))
    a.start(), b.start()
    with ckpt.Checkpointer(job=JOB, address=a.address) as c:
        h = c.save_async(rank_state(2), step=2)
        h.wait("nvme", timeout=60), h.wait("peer", timeout=60)
    record = CommitRecord.from_bytes((a.root / JOB / "2" / COMMIT_NAME).read_bytes(), "t", CommitKeys((KEY,)))
    assert record.hmac_sha256
    for shard in (a.root / JOB / "2" / meta_name(0), b.root / ".peer" / JOB / "2" / meta_name(0)):  # a's, b's replica
        assert CommitKeys((KEY,)).check(ShardMeta.from_bytes(shard.read_bytes(), str(shard)), "t").hmac_sha256
    a.lose()
    a.start()
    with ckpt.Checkpointer(job=JOB, address=a.address) as c:
        assert_same(c.load(2), rank_state(2))  # from b's replica, its record checked on the way


def test_replicas_of_a_made_up_step_from_a_peer_certificate_without_the_key_are_refused(
    make_cluster, make_daemon, short_tmp
):
    """A holder of a certificate from the cluster's CA, but not of the key, sends every rank of a step: not sealed."""
    ca = CertificateAuthority(short_tmp / "ca")
    key = key_file(short_tmp / "cluster.key", KEY)
    a, b = make_cluster(2, extra_toml=security(key), tls=[(*ca.issue(n), ca.ca_path) for n in ("a", "b")])
    a.start(), b.start()
    # The forger's material: a step of two ranks saved by its own daemon (no key), every xxh3 consistent.
    forger = make_daemon().start()
    for rank in (0, 1):
        with ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=forger.address) as c:
            c.save_async(rank_state(7), step=7).wait("nvme", timeout=60)
    made_up = forger.root / JOB / "7"
    cert, cert_key = ca.issue("mallory")  # names 127.0.0.1, a listed host: admitted as any peer
    link = PeerLink(a.listen, PeerConfig(cert=str(cert), key=str(cert_key), ca=str(ca.ca_path)), "mallory")

    def send(signer: bytes | None) -> None:
        for rank in (0, 1):
            meta = ShardMeta.from_bytes((made_up / meta_name(rank)).read_bytes(), "forger's")
            if signer is not None:
                meta = CommitKeys((signer,)).sign(meta)
            link.put_shard(meta, made_up / data_name(rank), streams)

    streams = ThreadPoolExecutor(4)
    try:
        with pytest.raises(ReplicaRejected, match="the shard record is not signed"):
            send(None)
        with pytest.raises(ReplicaRejected, match="shard record is signed with an unknown key"):
            send(OTHER_KEY)
        # Nothing received: no replica of the step in a's replica store, nothing sealed, listed or loaded.
        assert not (a.root / ".peer" / JOB / "7").exists() or not any((a.root / ".peer" / JOB / "7").iterdir())
        for node in (a, b):
            out = node.cli("ls", "--job", JOB, "--json")
            assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout + out.stderr
            with ckpt.Checkpointer(job=JOB, address=node.address) as c, pytest.raises(NotFound):
                c.load(7)
        assert a.log().count("refused a replica") == 1, a.log()  # once a minute per step
        # The same replicas signed with the cluster's key (what the forger lacks) are received and sealed.
        send(KEY)
        eventually(lambda: json.loads(a.cli("ls", "--job", JOB, "--json").stdout) != [], what="the signed step")
    finally:
        link.close()
        streams.shutdown()
