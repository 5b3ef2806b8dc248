"""Real torchrun FSDP2 and TP x FSDP jobs (gloo, CPU) save DTensor state through real daemons and load it resharded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ckpt_core.format import INDEX_NAME, ShardMeta, data_name, meta_name
from ckpt_core.shard_io import read_commit
from ckpt_core.step_index import StepIndex
from conftest import eventually
from torchrun import torchrun as run_torchrun

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "fsdp_train.py"


def torchrun(ranks: int, addresses: list[str], job: str, *args: str) -> str:
    """Run examples/fsdp_train.py on `ranks` ranks spread evenly over the daemons at addresses; return its output."""
    return run_torchrun(ranks, SCRIPT, *args, env={"CKPTD_ADDRESSES": ",".join(addresses), "CKPT_JOB": job})


def layout(step_dir: Path, rank: int) -> dict:
    """Return a rank's layout as its shard record holds it, its data file checked to be whole."""
    meta = ShardMeta.from_bytes((step_dir / meta_name(rank)).read_bytes(), f"rank {rank}")
    assert (step_dir / data_name(rank)).stat().st_size == meta.data_size_bytes
    return json.loads(meta.layout_json)


def chunk_bytes(step_dir: Path, world_size: int) -> list[int]:
    """Return, by rank, the bytes of the sharded tensors' chunks each rank wrote."""
    return [sum(e["nbytes"] for e in layout(step_dir, r)["tensors"] if e["kind"] == "chunk") for r in range(world_size)]


def losses(path: Path) -> dict[int, float]:
    return {int(s): v for s, v in json.loads(path.read_text())["losses"].items()}


def assert_same_tensors(saved: Path, loaded: Path) -> None:
    a, b = torch.load(saved), torch.load(loaded)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in a)  # AdamW's state is there
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.timeout(600)
def test_fsdp2_resumes_bit_for_bit_on_4_ranks_and_reshards_to_2(daemon, short_tmp):
    at = [daemon.address]
    torchrun(4, at, "reference", "--steps", "10", "--losses", str(short_tmp / "reference.json"))
    reference = losses(short_tmp / "reference.json")

    first = ["--steps", "7", "--ckpt-every", "5", "--dump", str(short_tmp / "saved.pt")]
    torchrun(4, at, "fsdp", *first, "--losses", str(short_tmp / "first.json"))
    assert losses(short_tmp / "first.json") == {s: reference[s] for s in range(1, 8)}
    step_dir = daemon.root / "fsdp" / "5"
    assert (step_dir / INDEX_NAME).exists()  # merged when the step was committed

    # Resharded: 2 ranks load the 4-rank step in place, every full tensor as saved.
    out = torchrun(2, at, "fsdp", "--dump", str(short_tmp / "loaded2.pt"), "--dump-after-load")
    assert "resumed from step 5 on 2 ranks" in out
    assert_same_tensors(short_tmp / "saved.pt", short_tmp / "loaded2.pt")

    # Same size: training goes on bit for bit as if never interrupted.
    torchrun(4, at, "fsdp", "--steps", "10", "--ckpt-every", "5", "--losses", str(short_tmp / "resumed.json"))
    assert json.loads((short_tmp / "resumed.json").read_text())["resumed_from"] == 5
    assert losses(short_tmp / "resumed.json") == {s: reference[s] for s in range(6, 11)}


@pytest.mark.timeout(600)
def test_tp_x_fsdp_loads_as_4_rank_fsdp_and_writes_replicated_chunks_once(daemon, short_tmp):
    at = [daemon.address]
    torchrun(4, at, "tp", "--mesh", "tp-fsdp", "--steps", "5", "--ckpt-every", "5", "--dump", str(short_tmp / "s.pt"))
    torchrun(4, at, "tp", "--mesh", "fsdp", "--dump", str(short_tmp / "l.pt"), "--dump-after-load")
    assert_same_tensors(short_tmp / "s.pt", short_tmp / "l.pt")

    # The bytes on disk: each chunk of each sharded tensor written by one rank only, though
    # down.bias is Replicate across the TP pairs and head.* live on the data-parallel sub-mesh.
    step_dir = daemon.root / "tp" / "5"
    index = StepIndex.from_bytes((step_dir / INDEX_NAME).read_bytes(), "index")
    written = sum(chunk_bytes(step_dir, read_commit(step_dir).world_size))
    whole = sum(
        math.prod(t.shape) * torch.empty(0, dtype=getattr(torch, t.dtype)).element_size()
        for t in index.tensors.values()
    )
    assert written == whole
    assert "Replicate()" in layout(step_dir, 0)["dtensors"]["model.down.bias"]["placements"]


@pytest.mark.timeout(600)
def test_hsdp_writes_each_replicated_chunk_once_and_loads_as_2_rank_fsdp(daemon, short_tmp):
    at = [daemon.address]
    torchrun(4, at, "h", "--mesh", "hsdp", "--steps", "5", "--ckpt-every", "5", "--dump", str(short_tmp / "s.pt"))
    torchrun(2, at, "h", "--mesh", "fsdp", "--dump", str(short_tmp / "l.pt"), "--dump-after-load")
    assert_same_tensors(short_tmp / "s.pt", short_tmp / "l.pt")
    step_dir = daemon.root / "h" / "5"
    written = chunk_bytes(step_dir, 4)
    assert written[0] > 0 and written[1] > 0 and written[2:] == [0, 0]  # the replicas at coordinate 1 write none
    assert layout(step_dir, 2)["dtensors"]["model.up.weight"]["placements"] == ["Replicate()", "Shard(dim=0)"]


@pytest.mark.timeout(600)
def test_a_resharded_load_fetches_other_nodes_ranges_from_the_peer_then_the_store(make_cluster, s3_server, short_tmp):
    bucket = s3_server.new_bucket()
    nodes = [d.start() for d in make_cluster(2, replicas=0, extra_toml=s3_server.toml(f"s3://{bucket}/c"))]
    torchrun(4, [n.address for n in nodes], "x", "--steps", "5", "--ckpt-every", "5", "--dump", str(short_tmp / "s.pt"))

    def on_object() -> bool:
        listed = json.loads(nodes[0].cli("ls", "--job", "x", "--json").stdout)
        return any(s["step"] == 5 and "object" in s["tiers"] for s in listed)

    eventually(on_object, what="step 5 in the object store")
    assert not (nodes[0].root / "x" / "5" / data_name(2)).exists()  # ranks 2-3 live on the other node only

    # A byte flipped in the peer's copy of rank 2: caught, and that range comes from the store instead.
    with open(nodes[1].root / "x" / "5" / data_name(2), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    torchrun(2, [nodes[0].address], "x", "--dump", str(short_tmp / "peer.pt"), "--dump-after-load")
    assert_same_tensors(short_tmp / "s.pt", short_tmp / "peer.pt")
    log = nodes[0].log()
    assert "of rank 3 shard of x step 5 from tier peer" in log
    assert "of rank 2 shard of x step 5 from tier object" in log
    assert "checksum mismatch" in log
    status = json.loads(nodes[0].cli("status", "--json", "--address", nodes[0].address).stdout)
    assert status["counters"]["verification_failures"]["peer"] >= 1

    for node in nodes:  # both nodes lose their disks: only the store is left
        node.lose()
        node.start()
    torchrun(2, [nodes[0].address], "x", "--dump", str(short_tmp / "store.pt"), "--dump-after-load")
    assert_same_tensors(short_tmp / "s.pt", short_tmp / "store.pt")
    assert "of rank 0 shard of x step 5 from tier object" in nodes[0].log()
