"""The object tier end to end: real daemons uploading to a real S3 endpoint (moto's server) and to file://."""

from __future__ import annotations

import json
import shutil
import signal
import threading

import ckpt
import pytest
import torch
from ckpt_core.errors import CheckpointError, SaveFailed
from ckpt_core.format import COMMIT_NAME, data_name, meta_name
from conftest import eventually, free_port
from states import assert_same

from ckptd.tiers.object.keys import HASHED_KEYS, SHARDS_DIR, shard_dir

pytestmark = [pytest.mark.e2e, pytest.mark.s3]

JOB = "train"


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "w": torch.randn(3 << 20, generator=g),  # 12 MiB of noise: not compressible
        "zeros": torch.zeros(1 << 20),  # very compressible
        "rank": rank,
        "step": step,
    }


def save(node, step: int, rank: int = 0, world_size: int = 1, wait: tuple[str, ...] = ("object",)) -> None:
    with ckpt.Checkpointer(job=JOB, rank=rank, world_size=world_size, address=node.address) as c:
        h = c.save_async(rank_state(rank, step), step=step)
        for tier in wait:
            h.wait(tier, timeout=60)


def ls(node) -> dict[int, list[str]]:
    """Return {step: tiers} as `ckptd ls` says, leaving out memory (it keeps whatever the slots hold)."""
    out = node.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    return {item["step"]: [t for t in item["tiers"] if t != "memory"] for item in json.loads(out.stdout)}


def object_keys(s3_server, bucket: str) -> list[str]:
    listed = s3_server.client().list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def shard_key(step: int, rank: int, name: str, prefix: str = "") -> str:
    """Return the key of one of a rank's shard objects, under its hash prefix."""
    return "/".join([*([prefix] if prefix else []), *shard_dir(JOB, step, rank, HASHED_KEYS), name])


def test_a_wiped_node_restores_from_the_object_tier_and_with_no_daemon(make_daemon, s3_server, short_tmp):
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ckpts"
    node = make_daemon(s3_server.toml(url)).start()
    for step in (1, 2):
        save(node, step)
    assert ls(node) == {1: ["nvme", "object"], 2: ["nvme", "object"]}
    assert f"ckpts/{JOB}/2/{COMMIT_NAME}" in object_keys(s3_server, bucket)
    status = json.loads(node.cli("status", "--json").stdout)["tiers"]["object"]
    assert (status["uploaded_shards"], status["commits_written"], status["pending_uploads"]) == (2, 2, 0)

    node.lose()  # the disk and the shared memory are gone
    node.start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        assert c.latest_step() == 2
        assert_same(c.load(), rank_state(0, 2))
        assert_same(c.load(step=1), rank_state(0, 1))
    assert (node.root / JOB / "2" / data_name(0)).exists(), "the fetched shard is written to NVMe"
    assert "from s3://" in node.log()

    node.lose()  # nothing left but the bucket, and no daemon
    out = node.cli("restore", "--job", JOB, "--step", "latest", "--from", url, "--to", str(short_tmp / "out"))
    assert out.returncode == 0, out.stderr
    assert "rank 0/1" in out.stderr and "from object, verified" in out.stderr  # progress, rank by rank
    assert_same(ckpt.load_local(short_tmp / "out" / JOB / "2"), rank_state(0, 2))
    out = node.cli("restore", "--job", JOB, "--step", "1", "--from", "object", "--to", str(short_tmp / "out"))
    assert out.returncode == 0, out.stderr
    assert_same(ckpt.load_local(short_tmp / "out" / JOB / "1"), rank_state(0, 1))
    assert ls(node) == {1: ["object"], 2: ["object"]}  # read by the CLI itself, no daemon


def test_zstd_round_trips_bit_for_bit(make_daemon, s3_server, short_tmp):
    bucket = s3_server.new_bucket()
    node = make_daemon(s3_server.toml(f"s3://{bucket}", 'compression = "zstd"\n')).start()
    save(node, 3)
    keys = object_keys(s3_server, bucket)
    assert shard_key(3, 0, f"{data_name(0)}.zst") in keys and shard_key(3, 0, data_name(0)) not in keys
    stored = s3_server.client().head_object(Bucket=bucket, Key=shard_key(3, 0, f"{data_name(0)}.zst"))["ContentLength"]
    on_disk = (node.root / JOB / "3" / data_name(0)).read_bytes()
    assert stored < len(on_disk) - (3 << 20), "the zeros were not compressed"
    node.lose()
    out = node.cli("restore", "--job", JOB, "--from", f"s3://{bucket}", "--to", str(short_tmp / "out"))
    assert out.returncode == 0, out.stderr
    assert (short_tmp / "out" / JOB / "3" / data_name(0)).read_bytes() == on_disk
    assert_same(ckpt.load_local(short_tmp / "out" / JOB / "3"), rank_state(0, 3))


def test_a_corrupted_object_is_detected_and_reported(make_daemon, s3_server, short_tmp):
    bucket = s3_server.new_bucket()
    node = make_daemon(s3_server.toml(f"s3://{bucket}")).start()
    save(node, 4)
    s3 = s3_server.client()
    key = shard_key(4, 0, data_name(0))
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[(4 << 20) + 99] ^= 0x40  # one bit, in the second chunk
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    out = node.cli("verify", "--job", JOB, "--tier", "object")
    assert out.returncode == 1
    assert "BAD  object train step 4 rank 0" in out.stdout and "chunk 1" in out.stdout, out.stdout
    node.lose()
    out = node.cli("restore", "--job", JOB, "--from", "object", "--to", str(short_tmp / "out"))
    assert out.returncode == 1
    assert "rank 0 shard of train step 4 on tier object" in out.stderr and "checksum mismatch" in out.stderr
    assert not (short_tmp / "out" / JOB / "4").exists(), "nothing half-restored is left"
    node.start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c, pytest.raises(CheckpointError, match="chunk 1"):
        c.load()
    assert not (node.root / JOB / "4" / data_name(0)).exists(), "nothing bad was written to NVMe"


def test_an_upload_killed_midway_is_finished_by_the_restarted_daemon(make_daemon, own_s3_server):
    server = own_s3_server
    bucket = server.new_bucket()
    node = make_daemon(server.toml(f"s3://{bucket}")).start()
    s3 = server.client()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        big = {"w": torch.randn(40 << 20)}  # 160 MiB: ten parts
        c.save_async(big, step=7).wait("nvme", timeout=60)
        eventually(lambda: s3.list_multipart_uploads(Bucket=bucket).get("Uploads"), what="a multipart upload")
    node.kill()  # in the middle of the upload
    assert f"{JOB}/7/{COMMIT_NAME}" not in object_keys(server, bucket)
    assert "object" not in ls(node)[7]  # no daemon: the CLI lists the tiers itself, and no reader takes it

    node.start()  # derives the pending upload from its disk, aborts the abandoned one, uploads again
    eventually(lambda: 7 in ls(node) and "object" in ls(node)[7], what="the resumed upload")
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "resuming upload of" in node.log()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        assert_same(c.load(step=7, tier="object"), big)  # read from the store, every chunk checked
    assert f"fetched rank 0 shard of {JOB} step 7 from s3://" in node.log()


def test_a_store_that_is_down_never_holds_up_training_or_nvme(make_daemon, own_s3_server):
    server = own_s3_server
    bucket = server.new_bucket()
    node = make_daemon(server.toml(f"s3://{bucket}", "every = 2\n")).start()
    server.proc.send_signal(signal.SIGSTOP)  # the endpoint hangs: every request times out
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        h = c.save_async(rank_state(0, 2), step=2)
        h.wait("nvme", timeout=60)
        with pytest.raises(SaveFailed, match="is not uploaded: \\[object\\] every = 2"):
            c.save_async(rank_state(0, 3), step=3).wait("object", timeout=10)
        c.save_async(rank_state(0, 4), step=4).wait("nvme", timeout=60)
        assert c.latest_step() == 4  # the hung store is asked, and left out after a few seconds
        assert_same(c.load(), rank_state(0, 4))
        status = json.loads(node.cli("status", "--json").stdout)["tiers"]["object"]
        assert status["pending_uploads"] >= 1
        server.proc.send_signal(signal.SIGCONT)
        h.wait("object", timeout=120)
    eventually(lambda: ls(node).get(4) == ["nvme", "object"], what="the upload of step 4")


def test_a_persistent_failure_shows_on_the_handle_and_in_status(make_daemon, s3_server):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    toml = (
        f'[object]\nurl = "s3://nowhere"\nstorage_options = {{key = "k", secret = "k", '
        f'client_kwargs = {{endpoint_url = "{dead}"}}, config_kwargs = {{retries = {{max_attempts = 1}}}}}}\n'
    )
    node = make_daemon(toml).start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        h = c.save_async(rank_state(0, 1), step=1)
        h.wait("nvme", timeout=60)
        failed = r"upload of rank 0/1 shard of train step 1 to s3://nowhere failed: .*Could not connect"
        with pytest.raises(SaveFailed, match=failed):
            h.wait("object", timeout=120)
    status = json.loads(node.cli("status", "--json").stdout)["tiers"]["object"]
    assert status["failing"] and "s3://nowhere" in status["last_error"]
    assert status["upload_failures"] >= 3
    out = node.cli("status")
    assert "object tier s3://nowhere" in out.stdout and "failing rank 0/1 shard of train step 1" in out.stdout


def test_only_the_node_that_uploads_rank_0_commits_the_step(make_cluster, s3_server):
    bucket = s3_server.new_bucket()
    nodes = [d.start() for d in make_cluster(2, extra_toml=s3_server.toml(f"s3://{bucket}/c"))]
    with (
        ckpt.Checkpointer(job=JOB, rank=0, world_size=2, address=nodes[0].address) as c0,
        ckpt.Checkpointer(job=JOB, rank=1, world_size=2, address=nodes[1].address) as c1,
    ):
        h0 = c0.save_async(rank_state(0, 6), step=6)
        h1 = c1.save_async(rank_state(1, 6), step=6)
        h1.wait("object", timeout=120)  # returns once the commit record is in the store
        h0.wait("object", timeout=120)
    written = [json.loads(d.cli("status", "--json").stdout)["tiers"]["object"]["commits_written"] for d in nodes]
    assert written == [1, 0]
    assert ls(nodes[1])[6] == ["nvme", "peer", "object"]


def test_a_file_url_is_an_object_tier_with_the_layout_of_every_tier(make_daemon, short_tmp):
    store = short_tmp / "bucket"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n[retention]\nobject = 2\n').start()
    for step in (1, 2, 3):
        save(node, step)
    eventually(lambda: sorted(p.name for p in (store / JOB).iterdir()) == ["2", "3"], what="object retention")
    # A filesystem has no per-prefix limit: no hash prefixes, and a plain directory readable as is.
    assert not (store / SHARDS_DIR).exists()
    assert_same(ckpt.load_local(store / JOB / "3"), rank_state(0, 3))
    node.lose()
    out = node.cli("restore", "--job", JOB, "--from", f"file://{store}", "--to", str(short_tmp / "out"))
    assert out.returncode == 0, out.stderr
    assert_same(ckpt.load_local(short_tmp / "out" / JOB / "3"), rank_state(0, 3))


def test_a_bad_object_url_is_a_config_error(make_daemon):
    node = make_daemon('[object]\nurl = "nosuchproto://x"\n')
    out = node.cli("ls")
    assert out.returncode == 2 and "object.url" in out.stderr


def test_gc_aborts_the_multipart_uploads_a_crash_left_behind(make_daemon, s3_server):
    bucket = s3_server.new_bucket()
    node = make_daemon(s3_server.toml(f"s3://{bucket}/p")).start()
    for step in (1, 2):
        save(node, step)
    s3 = s3_server.client()

    def unfinished() -> list[str]:
        return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    kept = object_keys(s3_server, bucket)
    for step in (1, 3):  # 3: newer than any complete step, maybe under way on another node
        s3.create_multipart_upload(Bucket=bucket, Key=shard_key(step, 1, data_name(1), prefix="p"))
    s3.create_multipart_upload(Bucket=bucket, Key=f"p/{JOB}/1/{data_name(2)}")  # left by a ckptd of the flat layout
    s3.put_object(Bucket=bucket, Key=shard_key(0, 0, meta_name(0), prefix="p"), Body=b"{}")  # a crash before a commit
    out = node.cli("gc", "--dry-run")
    assert "would remove object train step 1: unfinished multipart" in out.stdout, out.stdout
    assert "would remove object train step 0: incomplete" in out.stdout, out.stdout
    assert len(unfinished()) == 3
    out = node.cli("gc")
    assert "removed object train step 1: unfinished multipart" in out.stdout, out.stdout
    assert unfinished() == [shard_key(3, 1, data_name(1), prefix="p")]
    assert object_keys(s3_server, bucket) == kept  # the whole bucket: what the crashes left is gone, the rest stays
    assert ls(node) == {1: ["nvme", "object"], 2: ["nvme", "object"]}  # complete steps stay


def test_nvme_keeps_a_step_until_the_store_has_it(make_daemon):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every upload fails
    toml = (
        f'[object]\nurl = "s3://nowhere"\nevery = 2\nstorage_options = {{key = "k", secret = "k", '
        f'client_kwargs = {{endpoint_url = "{dead}"}}, config_kwargs = {{retries = {{max_attempts = 1}}}}}}\n'
        "[retention]\nnvme = 1\n"
    )
    node = make_daemon(toml).start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        with pytest.raises(SaveFailed):
            c.save_async(rank_state(0, 2), step=2).wait("object", timeout=120)  # failed three times in a row
        c.save_async(rank_state(0, 3), step=3).wait("nvme", timeout=60)  # not uploaded: every = 2
    out = node.cli("gc", "--dry-run")
    assert "nvme train step 2" not in out.stdout, out.stdout  # the store does not have it yet
    assert (node.root / JOB / "2" / data_name(0)).exists()


def test_a_bad_nvme_copy_is_replaced_by_the_stores_good_one_on_load(make_daemon, short_tmp):
    store = short_tmp / "bucket"
    node = make_daemon(f'[object]\nurl = "file://{store}"\n').start()
    save(node, 5)
    node.kill()
    shutil.rmtree(node.staging_dir)  # no copy in memory: NVMe's is the only one on this node
    data = node.root / JOB / "5" / data_name(0)
    with open(data, "r+b") as f:
        f.seek(5 << 20)
        byte = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([byte[0] ^ 1]))
    node.start()
    with ckpt.Checkpointer(job=JOB, address=node.address) as c:
        assert_same(c.load(), rank_state(0, 5))  # NVMe's copy fails its check; the store's replaces it
    assert f"fetched rank 0 shard of {JOB} step 5 from file://" in node.log()
    out = node.cli("verify", "--job", JOB, "--tier", "nvme")
    assert out.returncode == 0, out.stdout  # the bad copy was written over


def test_a_load_whose_only_copy_is_in_a_store_slow_to_answer_waits_for_it_and_says_so(make_daemon, own_s3_server):
    # A node that lost its disk, no peers: the store is the load's last resort. Before, the daemon gave the
    # store 5 s to say which steps it holds (the newest step) and 30 s for one step, behind whole-shard
    # fetches, and the client's Locate had a 60 s deadline: a load that could succeed failed with "did not
    # answer: it may hold it; try again". Now it waits up to 120 s for the answer, saying so every 10 s.
    server = own_s3_server
    bucket = server.new_bucket()
    node = make_daemon(server.toml(f"s3://{bucket}")).start()
    save(node, 5)
    node.lose()
    node.start()
    loaded: list = []

    def load() -> None:
        with ckpt.Checkpointer(job=JOB, address=node.address) as c:
            loaded.append(c.load())

    server.proc.send_signal(signal.SIGSTOP)  # the store takes every request and answers none, until SIGCONT
    loader = threading.Thread(target=load)
    try:
        loader.start()
        eventually(
            lambda: "still waiting for the object store's answer about train's steps: 10 s" in node.log(),
            timeout_s=60,
            what="the daemon saying it still waits for the store",
        )
    finally:
        server.proc.send_signal(signal.SIGCONT)
    loader.join(timeout=120)
    assert not loader.is_alive() and len(loaded) == 1, node.log()[-3000:]
    assert_same(loaded[0], rank_state(0, 5))
    assert "fetching rank 0 shard of train step 5 from s3://" in node.log()
