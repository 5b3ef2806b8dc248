"""The committed gRPC stubs are exactly what the floor grpcio-tools makes of protos/ today (scripts/gen_protos.sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# proto -> where its committed stubs are
PROTOS = {
    "ckpt_core/wire/v1/ckptd.proto": REPO / "client",
    "ckpt_core/wire/v1/peer.proto": REPO / "client",
    "ckpt_core/wire/v1/cluster.proto": REPO / "client",
    "ckptd/cluster/etcd_wire/kv.proto": REPO,
    "ckptd/cluster/etcd_wire/watch.proto": REPO,
    "ckptd/cluster/etcd_wire/lease.proto": REPO,
}
# The environment scripts/check_floors.sh makes, with the grpcio-tools of scripts/floors.txt.
FLOOR_PYTHON = REPO / ".venv-floors" / "daemon" / "bin" / "python"


@pytest.mark.parametrize("proto", sorted(PROTOS))
def test_generated_stubs_are_fresh(tmp_path, proto):
    assert FLOOR_PYTHON.exists(), f"{FLOOR_PYTHON} is missing: run scripts/check_floors.sh (scripts/test.sh does)"
    subprocess.run(
        [
            str(FLOOR_PYTHON),
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(REPO / "protos" / proto),
        ],
        check=True,
    )
    package, name = Path(proto).parent, Path(proto).stem
    generated = sorted((tmp_path / package).glob(f"{name}_pb2*"))
    assert [p.name for p in generated] == [f"{name}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    for fresh in generated:
        committed = PROTOS[proto] / package / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run scripts/gen_protos.sh and commit the result"
        )
