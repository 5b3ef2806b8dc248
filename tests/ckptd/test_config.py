"""Configuration: defaults, TOML, CKPTD_<SECTION>__<KEY> overrides, and errors naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptd.addresses import endpoints
from ckptd.config import ConfigError, load_config, parse_cpus


def test_defaults_need_no_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    c = load_config(None, env={})
    assert c.root == tmp_path / ".local" / "share" / "ckptd"
    assert c.staging.policy == "block" and c.retention.nvme == 3 and c.object.url == ""
    assert c.staging_dir.is_absolute()


def test_toml_then_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[node]\nroot = "/data/a"\n[retention]\nnvme = 5\n[object]\nstorage_options = {endpoint_url = "x"}\n'
    )
    c = load_config(str(path), env={"CKPTD_NODE__ROOT": "/data/b", "CKPTD_STAGING__POLICY": "skip"})
    assert str(c.root) == "/data/b"
    assert c.retention.nvme == 5
    assert c.staging.policy == "skip"
    assert c.object.storage_options == {"endpoint_url": "x"}


def test_env_values_are_parsed_as_toml():
    env = {"CKPTD_STAGING__BUDGET_BYTES": "1024", "CKPTD_PEER__ADDRESSES": '["h:1", "g:2"]'}
    c = load_config(None, env={**env, "CKPTD_PEER__INSECURE": "true"})
    assert c.staging.budget_bytes == 1024
    assert c.peer.addresses == ("h:1", "g:2")


@pytest.mark.parametrize(
    "toml, env, message",
    [
        ("[node]\nrooot = 1\n", {}, "node.rooot"),
        ("[nodes]\n", {}, r"\[nodes\]"),
        ("", {"CKPTD_STAGING__POLICY": "drop"}, "staging.policy"),
        ("[retention]\nnvme = -1\n", {}, "retention.nvme"),
        ('[staging]\nbudget_bytes = "lots"\n', {}, "staging.budget_bytes"),
        ('[peer]\naddresses = ["nohost"]\n', {}, "peer.addresses"),
        ("[peer]\nresolve_interval_s = -1\n", {}, "peer.resolve_interval_s: must be 0"),
        # Peers are authenticated by default: plaintext only when asked for, and never beside TLS files.
        ('[node]\nlisten = "127.0.0.1:7070"\n', {}, "peer.cert: peers are authenticated by default"),
        ('[peer]\naddresses = ["10.0.0.2:7070"]\n', {}, "peer.cert: peers are authenticated by default"),
        ('[peer]\ninsecure = "yes"\n', {}, "peer.insecure must be true or false"),
        ("", {"CKPTD_NODE__FOO": "1"}, "node.foo"),
        ("[node\n", {}, "c.toml"),
        ('[node]\ncpus = "a"\n', {}, "node.cpus: 'a' has 'a', which is not a CPU number"),
        ('[node]\ncpus = "3-1"\n', {}, "node.cpus: '3-1' has '3-1', a range that ends before it starts"),
        ('[node]\ncpus = "0,100000"\n', {}, "node.cpus: '0,100000': this machine has CPUs 0 to"),
        ('[node]\ncpus = ","\n', {}, "node.cpus: ',' names no CPU"),
        ('[cluster]\nbackend = "zookeeper"\n', {}, "cluster.backend: must be peers or etcd"),
        ('[cluster]\nbackend = "etcd"\n', {}, 'cluster.endpoints: backend = "etcd" needs its endpoints'),
        ('[cluster]\nbackend = "etcd"\nendpoints = ["etcd"]\n', {}, "cluster.endpoints: 'etcd' is not host:port"),
        ('[cluster]\nbackend = "etcd"\nendpoints = ["e:2379"]\n', {}, 'node.listen: backend = "etcd" names'),
        ('[cluster]\nprefix = "ckptd"\n', {}, "cluster.prefix: must start and end with /"),
        ("[cluster]\nlease_ttl_s = 1\n", {}, "cluster.lease_ttl_s: must be at least 2"),
        ("[nvme]\nflush_every = -1\n", {}, "nvme.flush_every: must be 0"),
        ("", {"CKPTD_NVME__FLUSH_EVERY": "2.5"}, "nvme.flush_every must be an integer"),
        ("[nvme]\nevery = 2\n", {}, "nvme.every"),
        ('[cluster]\ncert = "/no/such.pem"\n', {}, "cluster.cert: set cluster.cert, cluster.key and cluster.ca"),
        ("[retention]\nkeep_every = -1\n", {}, "retention.keep_every: must be 0"),
        ("[retention.jobs.a]\nkeep = 2\nkep_every = 4\n", {}, "unknown config key retention.jobs.a.kep_every"),
        ("[retention.jobs.a]\nkeep = -2\n", {}, "retention.jobs.a.keep: must be 0 or positive"),
        ('[retention.jobs.a]\nkeep = "2"\n', {}, "retention.jobs.a.keep must be an integer"),
        ('[retention.jobs."a/b"]\nkeep = 2\n', {}, "retention.jobs.a/b: invalid job name"),
        ("[retention]\njobs = 3\n", {}, "retention.jobs must be a table"),
        ("[retention]\njobs = {a = 3}\n", {}, "retention.jobs.a must be a table"),
    ],
)
def test_bad_config_names_the_key(tmp_path, toml, env, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), env=env)


def test_the_cluster_section_defaults_to_the_built_in_view_and_reads_etcd_settings():
    assert load_config(None, env={}).cluster.backend == "peers"
    c = load_config(
        None,
        env={
            "CKPTD_NODE__LISTEN": '"10.0.0.1:7070"',
            "CKPTD_PEER__INSECURE": "true",
            "CKPTD_CLUSTER__BACKEND": '"etcd"',
            "CKPTD_CLUSTER__ENDPOINTS": '["etcd-0:2379", "etcd-1:2379"]',
        },
    )
    assert c.cluster.endpoints == ("etcd-0:2379", "etcd-1:2379") and c.cluster.prefix == "/ckptd/"


def test_plaintext_peers_only_when_asked_for(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[node]\nlisten = "127.0.0.1:7070"\n[peer]\naddresses = ["127.0.0.1:7071"]\ninsecure = true\n')
    c = load_config(str(path), env={})
    assert c.peer.insecure and c.peer_hosts == {"127.0.0.1"}
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("pem")
    tls = "".join(f'{name} = "{tmp_path / name}"\n' for name in ("cert", "key", "ca"))
    path.write_text(f"[peer]\n{tls}insecure = true\n")
    with pytest.raises(ConfigError, match=r"peer\.insecure: set it only without"):
        load_config(str(path), env={})


def test_cli_exits_2_naming_the_bad_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[staging]\npolicy = "sometimes"\n')
    r = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--config", str(path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "staging.policy" in r.stderr


def test_cli_usage_error_exits_2():
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "--job", "x"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--to" in r.stderr


def test_flags_come_last_and_the_staging_dir_follows_the_root(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[node]\nroot = "/data/a"\n')
    plain = load_config(str(path), env={})
    flagged = load_config(str(path), env={"CKPTD_NODE__ROOT": "/data/b"}, flags={"node": {"root": "/data/c"}})
    assert str(flagged.root) == "/data/c"
    assert flagged.staging_dir != plain.staging_dir  # derived from the root actually used
    with pytest.raises(ConfigError, match=r"node\.sockett"):
        load_config(str(path), env={}, flags={"node": {"sockett": "x"}})


def test_a_node_recognises_itself_in_the_peer_list():
    c = load_config(
        env={
            "CKPTD_NODE__LISTEN": '"127.0.0.1:7070"',
            "CKPTD_PEER__ADDRESSES": '["localhost:7070", "127.0.0.1:7071"]',
            "CKPTD_PEER__INSECURE": "true",
        }
    )
    # Each entry stands for the addresses its host resolves to (of this node's family, IPv4 here, where it
    # has both), less this node's own.
    assert c.peers == ("127.0.0.1:7071",)


def test_endpoints_are_ip_and_port_and_what_cannot_be_resolved_is_an_os_error():
    assert endpoints("127.0.0.1:7070") == ["127.0.0.1:7070"]
    assert endpoints("[::1]:7070") == ["[::1]:7070"]
    with pytest.raises(OSError):
        endpoints("localhost:http")


def test_with_a_dns_name_a_peer_certificate_may_name_the_service():
    # Peers are dialled by the addresses the name resolves to, and each presents a certificate naming the
    # service (and its own IP, which the dialler checks): the service name is what _admit finds in it.
    c = load_config(
        env={
            "CKPTD_NODE__LISTEN": '"10.0.0.1:7070"',
            "CKPTD_PEER__ADDRESSES": '["ckptd-peers.ckptd.svc.cluster.local:7070"]',
            "CKPTD_PEER__INSECURE": "true",
            "CKPTD_PEER__RESOLVE_INTERVAL_S": "5",
        }
    )
    assert c.peer_hosts == {"ckptd-peers.ckptd.svc.cluster.local", "10.0.0.1"}
    assert c.peer.resolve_interval_s == 5


def test_a_wildcard_listen_address_is_refused_beside_peers():
    with pytest.raises(ConfigError, match=r"node\.listen"):
        load_config(env={"CKPTD_NODE__LISTEN": '"0.0.0.0:7070"', "CKPTD_PEER__ADDRESSES": '["10.0.0.2:7070"]'})


@pytest.mark.parametrize("text, cpus", [("", set()), ("0", {0}), ("6-7", {6, 7}), ("0, 2,4-5", {0, 2, 4, 5})])
def test_cpu_lists_read_as_taskset_writes_them(text, cpus):
    assert parse_cpus(text) == cpus


def test_flush_every_defaults_to_the_newest_snapshot_winning_and_reads_a_cadence(tmp_path):
    assert load_config(None, env={}).nvme.flush_every == 0
    path = tmp_path / "c.toml"
    path.write_text("[nvme]\nflush_every = 10\n")
    assert load_config(str(path), env={}).nvme.flush_every == 10
    assert load_config(str(path), env={"CKPTD_NVME__FLUSH_EVERY": "1"}).nvme.flush_every == 1


def test_a_jobs_retention_table_overrides_keys_it_sets(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[retention]\nnvme = 4\nkeep_every = 10\n[retention.jobs."llama.7b"]\nkeep_every = 1000\n')
    c = load_config(str(path), env={})
    assert c.retention.keep_every == 10 and c.retention.nvme == 4
    assert c.retention.jobs["llama.7b"].keep_every == 1000 and c.retention.jobs["llama.7b"].keep is None
