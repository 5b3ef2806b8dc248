"""TLS between peers, as an operator meets it: refused certificates said plainly on both sides, and the recipe.

Real daemons on loopback ports; gRPC's own handshake lines must reach their logs readable
(rpc.grpc_log), never as the C core's raw lines.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import ckpt
import pytest
import torch
from certs import CertificateAuthority
from ckpt_core.errors import SaveFailed
from conftest import eventually

from ckptd.cluster.peer_link import PeerLink
from ckptd.config import PeerConfig
from ckptd.errors import PeerError

pytestmark = pytest.mark.e2e

JOB = "train"
RAW_CORE_LINE = "ssl_transport_security.cc"
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"
RECIPE_MARK = "<!-- tests/e2e/test_peer_tls.py runs this very block"


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(1 << 16, generator=g), "rank": rank, "step": step}


def peer_errors(node) -> dict[str, str]:
    """Return each peer's last replication error, as `ckptd status --json` says it."""
    out = node.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return {a: p["last_error"] for a, p in json.loads(out.stdout)["tiers"]["peer"]["peers"].items()}


def save_and_fail(node, rank: int) -> str:
    """Save a rank on a node and return why its replica cannot be made (SaveFailed from wait("peer"))."""
    with ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address) as c:
        handle = c.save_async(rank_state(rank, 1), step=1)
        handle.wait("nvme", timeout=60)
        with pytest.raises(SaveFailed) as failed:
            handle.wait("peer", timeout=90)
    return str(failed.value)


def test_a_certificate_from_another_ca_is_refused_readably_on_both_sides(make_cluster, short_tmp):
    ca = CertificateAuthority(short_tmp / "ca")
    stranger = CertificateAuthority(short_tmp / "other-ca", "other-ca")
    # Node b's certificate is signed by another CA, though b trusts the cluster's: each refuses the other.
    a_files, b_files = (*ca.issue("a"), ca.ca_path), (*stranger.issue("b"), ca.ca_path)
    a, b = (d.start() for d in make_cluster(2, tls=[a_files, b_files]))

    # b's certificate reaches a (b trusts a's), which refuses it: b's waiter hears so, not "not reachable".
    said_to_b = save_and_fail(b, rank=1)
    assert f"certificate rejected by {a.listen}" in said_to_b, said_to_b
    assert "unknown CA" in said_to_b and "not reachable" not in said_to_b
    assert f"certificate rejected by {a.listen}" in peer_errors(b)[a.listen]  # and `ckptd status` says so
    # a refuses b's certificate as soon as b answers.
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=2, address=a.address) as c:
        c.save_async(rank_state(0, 1), step=1).wait("nvme", timeout=60)
    eventually(lambda: f"certificate of {b.listen} not trusted" in peer_errors(a).get(b.listen, ""), what="a's error")
    assert "unknown CA" in peer_errors(a)[b.listen]

    # a logs its refusal readably, once a minute; b, whose handshakes a ended, a readable line too; no raw
    # line of gRPC's C core anywhere.
    refused = "refused a peer's certificate in gRPC's TLS handshake: the certificate is signed by an unknown CA"
    eventually(lambda: refused in a.log(), what="a's refusal logged")
    eventually(lambda: "ckptd.grpc: a TLS handshake with a peer failed" in b.log(), what="b's failed handshake logged")
    for node in (a, b):
        assert RAW_CORE_LINE not in node.log()
    assert a.log().count(refused) == 1, a.log()  # paced: one line a minute per reason


def test_the_data_channel_names_the_caller_it_refused(make_cluster, short_tmp):
    ca = CertificateAuthority(short_tmp / "ca")
    (a,) = (d.start() for d in make_cluster(1, tls=[(*ca.issue("a"), ca.ca_path)]))
    port = json.loads(a.cli("status", "--json").stdout)["tiers"]["peer"]["data_port"]
    stranger = CertificateAuthority(short_tmp / "other-ca", "other-ca")
    cert, key = stranger.issue("stranger")
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    context.load_cert_chain(cert, key)
    for _ in range(3):  # refused every time, logged once
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as conn,
            context.wrap_socket(conn, server_hostname="127.0.0.1") as tls,
            pytest.raises(OSError),
        ):  # TLS 1.3: the refusal arrives after the client's handshake ends
            tls.sendall(bytes(16))
            tls.recv(1)
    refusal = "refused a data connection from 127.0.0.1: its certificate: the certificate is signed by an unknown CA"
    eventually(lambda: refusal in a.log(), what="the data channel's refusal logged")
    assert a.log().count(refusal) == 1, a.log()

    # Signed by the cluster's CA for a name none of [peer] addresses has: refused, caller and names logged.
    intruder_cert, intruder_key = ca.issue("intruder", dns_names=("intruder.example",))
    intruder = PeerLink(a.listen, PeerConfig(cert=str(intruder_cert), key=str(intruder_key), ca=str(ca.ca_path)))
    for _ in range(2):
        with pytest.raises(PeerError, match="names none of the hosts in"):
            intruder.inventory(timeout_s=5)
    intruder.close()
    line = "refused a peer's call: a caller at ipv4:127.0.0.1:"
    eventually(lambda: line in a.log(), what="the refused caller logged")
    assert "['intruder.example'] (subject CN=intruder)" in a.log()
    assert a.log().count(line) == 1, a.log()


def test_an_expired_certificate_is_named(make_cluster, short_tmp):
    ca = CertificateAuthority(short_tmp / "ca")
    a_files, b_files = (*ca.issue("a"), ca.ca_path), (*ca.issue("b", expired=True), ca.ca_path)
    a, b = (d.start() for d in make_cluster(2, tls=[a_files, b_files]))
    said_to_b = save_and_fail(b, rank=1)
    assert f"certificate rejected by {a.listen}: this node's certificate: the certificate has expired" in said_to_b
    eventually(lambda: "the certificate has expired" in a.log(), what="a's refusal logged")
    assert RAW_CORE_LINE not in a.log() + b.log()


def recipe() -> str:
    """Return the certificate recipe of OPERATIONS.md §6, as an operator would paste it."""
    text = OPERATIONS.read_text()
    block = re.search(r"```sh\n(.*?)```", text[text.index(RECIPE_MARK) :], re.DOTALL)
    assert block is not None
    return block.group(1)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl here")
def test_the_certificate_recipe_of_the_operations_guide_makes_peers_that_replicate(make_cluster, short_tmp):
    commands = recipe()
    nodes_line = next(line for line in commands.splitlines() if line.startswith("NODES="))
    # This machine's nodes, both on loopback: only the NODES line is ours, every command is the guide's.
    script = commands.replace(nodes_line, 'NODES="node-a.test=127.0.0.1 node-b.test=127.0.0.1"')
    made = subprocess.run(["bash", "-euc", script], cwd=short_tmp, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    files = [
        (short_tmp / f"{n}.pem", short_tmp / f"{n}.key", short_tmp / "ca.pem") for n in ("node-a.test", "node-b.test")
    ]
    a, b = (d.start() for d in make_cluster(2, tls=files))
    handles = []
    for rank, node in enumerate((a, b)):
        c = ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address)
        handles.append((c, c.save_async(rank_state(rank, 1), step=1)))
    for c, h in handles:
        h.wait("peer", timeout=60)  # each rank's replica went to the other node over TLS
        c.close()
    for node in (a, b):
        assert "ckptd.grpc" not in node.log() and "certificate rejected" not in node.log(), node.log()
