"""Load the daemon's configuration: embedded defaults, then TOML, then environment, then flags."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from ckpt_core.commit_keys import CommitKeys
from ckpt_core.daemon_socket import default_socket_path
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import validate_job

from ckptd.addresses import dialled_names, endpoints_or_none, host_of, is_host_port, peer_endpoints
from ckptd.storage.owned_dir import StagingAccess


class ConfigError(Exception):
    """A config file, environment override or flag is unknown or has a bad value."""


@dataclass(frozen=True)
class NodeConfig:
    name: str = ""
    root: str = ""
    socket: str = ""
    listen: str = ""
    cpus: str = ""  # the CPUs the daemon runs on, e.g. "6-7" or "0,2,4-5"; empty = any


@dataclass(frozen=True)
class StagingConfig:
    budget_bytes: int = 0  # 0: sized on demand, up to DEFAULT_BUDGET_SHARE of the staging filesystem
    job_budget_bytes: int = 0  # one job's slots at most; 0 = any share of the budget
    policy: str = "block"
    dir: str = ""
    idle_ttl_s: int = 86400  # a job's slots go this long after its last save, once durable; 0 = never
    group: str = ""  # name or gid of the group whose members may save through this daemon; empty: its user alone


@dataclass(frozen=True)
class NvmeConfig:
    flush_every: int = 0  # 0: the newest snapshot wins the disk; N: multiples of N are always flushed


@dataclass(frozen=True)
class PeerConfig:
    addresses: tuple[str, ...] = ()
    replicas: int = 1
    cert: str = ""  # PEM files: set all three for TLS with client certificates between peers
    key: str = ""
    ca: str = ""
    insecure: bool = False  # plaintext between peers: only when asked for, never by default
    data_channel: bool = True  # replicas' bytes on a TCP connection beside gRPC (INTERNALS); false: gRPC streams
    data_port: int = 0  # the port this node takes them on (host of node.listen); 0 = any free port
    resolve_interval_s: int = 30  # names in addresses are looked up again this often (membership); 0 = once
    failover_s: float = 10.0  # a placed peer failing this long: the next node in placement order keeps its copies


@dataclass(frozen=True)
class ClusterConfig:
    backend: str = "peers"  # who keeps the cluster view: "peers" (built in) or "etcd"
    endpoints: tuple[str, ...] = ()  # etcd's client endpoints, "host:port" (backend = "etcd")
    cert: str = ""  # PEM files for TLS to etcd with a client certificate: all three, or none (plaintext)
    key: str = ""
    ca: str = ""
    prefix: str = "/ckptd/"  # etcd keys live under it: clusters that share an etcd take different prefixes
    lease_ttl_s: int = 10  # etcd: a node whose daemon stops renewing leaves the membership this long after
    anti_entropy_s: int = 10  # peers: every node compares its commits with one random peer this often; 0 = never


@dataclass(frozen=True)
class ObjectConfig:
    url: str = ""
    every: int = 1
    compression: str = "none"
    storage_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobRetentionConfig:
    """One job's [retention.jobs.<job>] table: unset keys fall back to [retention]."""

    keep: int | None = None  # newest complete steps of the job's line kept on NVMe and the replica store
    keep_every: int | None = None  # also keep every step of the line that is a multiple of it; 0 = none


@dataclass(frozen=True)
class RetentionConfig:
    nvme: int = 3
    peer: int = 3
    object: int = 0
    keep_every: int = 0  # every tier also keeps the steps of a job's line that are multiples of it; 0 = none
    jobs: dict[str, JobRetentionConfig] = field(default_factory=dict)  # [retention.jobs.<job>], by job


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""


@dataclass(frozen=True)
class SecurityConfig:
    key_file: str = ""  # the cluster key that signs and checks commit records (ckpt_core.commit_keys); "" = signing off
    previous_key_files: tuple[str, ...] = ()  # keys that only check: records signed before a key rotation


@dataclass(frozen=True)
class Config:
    """Hold every setting, resolved: paths are absolute and defaults filled in."""

    node: NodeConfig = NodeConfig()
    staging: StagingConfig = StagingConfig()
    nvme: NvmeConfig = NvmeConfig()
    peer: PeerConfig = PeerConfig()
    cluster: ClusterConfig = ClusterConfig()
    object: ObjectConfig = ObjectConfig()
    retention: RetentionConfig = RetentionConfig()
    metrics: MetricsConfig = MetricsConfig()
    security: SecurityConfig = SecurityConfig()

    @property
    def root(self) -> Path:
        return Path(self.node.root)

    @property
    def socket_path(self) -> Path:
        return Path(self.node.socket)

    @property
    def staging_dir(self) -> Path:
        return Path(self.staging.dir)

    @property
    def peer_hosts(self) -> set[str]:
        """Return the hosts of [peer] addresses and of node.listen: the names a peer's certificate may carry."""
        return {host_of(a) for a in (*self.peer.addresses, self.node.listen) if a}

    @property
    def cpu_set(self) -> set[int]:
        """Return the CPUs of [node] cpus (empty: any). The value was checked at load."""
        return parse_cpus(self.node.cpus)

    @property
    def staging_access(self) -> StagingAccess:
        """Return who besides the daemon's user uses the staging directory ([staging] group)."""
        return StagingAccess.of_group(self.staging.group)

    @property
    def replica_root(self) -> Path:
        """Return where this node keeps the replicas other nodes send it (the peer tier's local part)."""
        return self.root / ".peer"

    @functools.cached_property
    def peers(self) -> tuple[str, ...]:
        """Return the other nodes' "ip:port" addresses, looked up once: for commands that run without a daemon.

        Each entry of [peer] addresses stands for the addresses its host resolves to (peer_endpoints);
        the node's own ([node] listen) are left out, so one list serves every node. A daemon follows
        changes instead (ckptd.cluster.peer_membership).
        """
        return tuple(sorted(peer_endpoints(self.peer.addresses, self.node.listen, self._resolved)))

    @functools.cached_property
    def peer_names(self) -> dict[str, str]:
        """Return {peer address: the name its certificate must carry} for peers found by a name (dialled_names)."""
        return dialled_names(self.peer.addresses, self._resolved)

    @functools.cached_property
    def commit_keys(self) -> CommitKeys:
        """Return the keys of [security], read once (the files were checked when the config was loaded)."""
        return CommitKeys.from_files(self.security.key_file, self.security.previous_key_files)

    @functools.cached_property
    def _resolved(self) -> dict[str, list[str]]:
        return {a: endpoints_or_none(a) for a in (*self.peer.addresses, self.node.listen) if a}


_SECTION_TYPES = {
    "node": NodeConfig,
    "staging": StagingConfig,
    "nvme": NvmeConfig,
    "peer": PeerConfig,
    "cluster": ClusterConfig,
    "object": ObjectConfig,
    "retention": RetentionConfig,
    "metrics": MetricsConfig,
    "security": SecurityConfig,
}


def load_config(
    path: str | None = None, env: dict[str, str] | None = None, flags: dict[str, dict[str, Any]] | None = None
) -> Config:
    """Build the config from a TOML file (or $CKPTD_CONFIG), then CKPTD_<SECTION>__<KEY>, then flags.

    flags maps section to key to value; None values are ignored.
    """
    env = dict(os.environ if env is None else env)
    path = path or env.get("CKPTD_CONFIG") or None
    raw: dict[str, dict[str, Any]] = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path}: {e}") from None
        for section, values in data.items():
            if section not in _SECTION_TYPES:
                raise ConfigError(f"unknown config section [{section}] in {path}")
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] in {path} must be a table")
            raw[section] = dict(values)
    for name, value in env.items():
        if not name.startswith("CKPTD_") or "__" not in name:
            continue
        section, _, key = name[len("CKPTD_") :].lower().partition("__")
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown config section in environment variable {name}")
        raw.setdefault(section, {})[key] = _parse_env_value(value)
    for section, values in (flags or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return _resolve(_build(raw))


def _parse_env_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _build(raw: dict[str, dict[str, Any]]) -> Config:
    sections = {}
    for section, cls in _SECTION_TYPES.items():
        values = raw.get(section, {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"unknown config key {section}.{key}")
            values[key] = _check_type(f"{section}.{key}", known[key], value)
        if section == "retention" and "jobs" in values:
            values["jobs"] = _job_retention(values["jobs"])
        sections[section] = cls(**values)
    config = Config(**sections)
    _check_values(config)
    return config


def _check_type(name: str, f: dataclasses.Field[Any], value: Any) -> Any:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"config key {name} must be true or false, not {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {name} must be an integer, not {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {name} must be a number, not {value!r}")
        value = float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"config key {name} must be a string, not {value!r}")
    elif isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config key {name} must be a list of strings, not {value!r}")
        value = tuple(value)
    elif isinstance(default, dict) and not isinstance(value, dict):
        raise ConfigError(f"config key {name} must be a table, not {value!r}")
    return value


def _job_retention(tables: dict[str, Any]) -> dict[str, JobRetentionConfig]:
    """Return the [retention.jobs.<job>] tables, each job name and key checked (an unknown key is an error)."""
    found = {}
    known = {f.name for f in dataclasses.fields(JobRetentionConfig)}
    for job, table in tables.items():
        name = f"retention.jobs.{job}"
        try:
            validate_job(job)
        except InvalidArgument as e:
            raise ConfigError(f"config key {name}: {e}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"config key {name} must be a table, not {table!r}")
        for key, value in table.items():
            if key not in known:
                raise ConfigError(f"unknown config key {name}.{key}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config key {name}.{key} must be an integer, not {value!r}")
            if value < 0:
                raise ConfigError(f"config key {name}.{key}: must be 0 or positive")
        found[job] = JobRetentionConfig(**table)
    return found


def parse_cpus(text: str) -> set[int]:
    """Return the CPU numbers of a list such as "6-7" or "0,2,4-5"; raise ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last.isdigit() or not _):
            raise ValueError(f"has {part!r}, which is not a CPU number or a range such as 6-7")
        low, high = int(first), int(last or first)
        if low > high:
            raise ValueError(f"has {part!r}, a range that ends before it starts")
        cpus.update(range(low, high + 1))
    if text.strip() and not cpus:
        raise ValueError("names no CPU")
    return cpus


def _check_values(c: Config) -> None:
    def require(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config key {name}: {why}")

    try:
        cpus = parse_cpus(c.node.cpus)
    except ValueError as e:
        raise ConfigError(f"config key node.cpus: {c.node.cpus!r} {e}") from None
    count = os.cpu_count() or 1
    require(max(cpus, default=0) < count, "node.cpus", f"{c.node.cpus!r}: this machine has CPUs 0 to {count - 1}")
    require(c.staging.budget_bytes >= 0, "staging.budget_bytes", "must be 0 (on demand) or positive")
    require(c.staging.job_budget_bytes >= 0, "staging.job_budget_bytes", "must be 0 (no cap) or positive")
    require(c.staging.idle_ttl_s >= 0, "staging.idle_ttl_s", "must be 0 (never) or a number of seconds")
    require(c.staging.policy in ("block", "skip"), "staging.policy", f"must be block or skip, not {c.staging.policy!r}")
    require(c.nvme.flush_every >= 0, "nvme.flush_every", "must be 0 (the newest snapshot wins) or a number of steps")
    require(c.peer.replicas >= 0, "peer.replicas", "must not be negative")
    require(0 <= c.peer.data_port <= 65535, "peer.data_port", "must be a port number, or 0 for any free port")
    require(c.peer.resolve_interval_s >= 0, "peer.resolve_interval_s", "must be 0 (once, at start) or seconds")
    require(c.peer.failover_s > 0, "peer.failover_s", "must be seconds (more than 0)")
    require(c.object.every >= 1, "object.every", "must be at least 1")
    require(c.object.compression in ("none", "zstd"), "object.compression", "must be none or zstd")
    for tier in ("nvme", "peer", "object"):
        require(getattr(c.retention, tier) >= 0, f"retention.{tier}", "must be 0 (keep all) or positive")
    require(c.retention.keep_every >= 0, "retention.keep_every", "must be 0 (none) or a number of steps")
    for key, value in (("node.listen", c.node.listen), ("metrics.listen", c.metrics.listen)):
        require(value == "" or is_host_port(value), key, f"must be host:port, not {value!r}")
    for address in c.peer.addresses:
        require(is_host_port(address), "peer.addresses", f"{address!r} is not host:port")
    wildcard = c.node.listen.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::", "*")
    require(
        not (wildcard and c.peer.addresses),
        "node.listen",
        f"{c.node.listen!r} binds every interface; give the address the other nodes dial, as [peer] addresses "
        "lists it, so that this node knows which entry is itself",
    )
    tls = [name for name in ("cert", "key", "ca") if getattr(c.peer, name)]
    require(
        len(tls) in (0, 3),
        "peer." + ("cert" if "cert" not in tls else "key" if "key" not in tls else "ca"),
        "set peer.cert, peer.key and peer.ca together (TLS with client certificates), or none of them",
    )
    for name in tls:
        require(
            Path(getattr(c.peer, name)).expanduser().is_file(), f"peer.{name}", f"{getattr(c.peer, name)} is not a file"
        )
    require(not (tls and c.peer.insecure), "peer.insecure", "set it only without peer.cert, peer.key and peer.ca")
    require(
        bool(tls) or c.peer.insecure or not (c.node.listen or c.peer.addresses),
        "peer.cert",
        "peers are authenticated by default: set peer.cert, peer.key and peer.ca (mutual TLS), or "
        "peer.insecure = true for plaintext (then anyone who reaches node.listen can act as a peer)",
    )
    _check_cluster(c, require)
    try:
        c.commit_keys  # noqa: B018 - read now: a bad key file is a config error at start, not at the first commit
    except ValueError as e:
        require(False, "security.key_file", str(e))
    if c.object.url:
        require("://" in c.object.url, "object.url", f"{c.object.url!r} is not a URL (s3://bucket/prefix, file:///dir)")
        protocol = c.object.url.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:
            require(False, "object.url", f"fsspec cannot open {protocol}:// URLs: {e}")


def _check_cluster(c: Config, require: Callable[[bool, str, str], None]) -> None:
    k = c.cluster
    require(k.backend in ("peers", "etcd"), "cluster.backend", f"must be peers or etcd, not {k.backend!r}")
    etcd = k.backend == "etcd"
    require(not etcd or bool(k.endpoints), "cluster.endpoints", 'backend = "etcd" needs its endpoints, host:port')
    for address in k.endpoints:
        require(is_host_port(address), "cluster.endpoints", f"{address!r} is not host:port")
    require(not etcd or bool(c.node.listen), "node.listen", 'backend = "etcd" names this node by its peer address')
    require(k.prefix.startswith("/") and k.prefix.endswith("/"), "cluster.prefix", "must start and end with /")
    require(k.lease_ttl_s >= 2, "cluster.lease_ttl_s", "must be at least 2 seconds")
    require(k.anti_entropy_s >= 0, "cluster.anti_entropy_s", "must be 0 (never) or seconds")
    tls = [name for name in ("cert", "key", "ca") if getattr(k, name)]
    require(len(tls) in (0, 3), "cluster.cert", "set cluster.cert, cluster.key and cluster.ca together, or none")
    for name in tls:
        require(Path(getattr(k, name)).expanduser().is_file(), f"cluster.{name}", f"{getattr(k, name)} is not a file")


def _resolve(c: Config) -> Config:
    """Fill in the defaults that depend on the machine: name, root, socket, staging dir."""
    home = Path.home()
    data_home = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    root = Path(c.node.root or data_home / "ckptd").expanduser().absolute()
    node = dataclasses.replace(
        c.node,
        name=c.node.name or socket.gethostname(),
        root=str(root),
        socket=str(Path(c.node.socket or default_socket_path()).expanduser().absolute()),
    )
    staging_dir = c.staging.dir
    if not staging_dir:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        staging_dir = str(shm / f"ckptd-{os.getuid()}-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}")
    staging = dataclasses.replace(c.staging, dir=str(Path(staging_dir).expanduser().absolute()))

    def absolute(path: str) -> str:
        return str(Path(path).expanduser().absolute()) if path else ""

    peer = dataclasses.replace(c.peer, cert=absolute(c.peer.cert), key=absolute(c.peer.key), ca=absolute(c.peer.ca))
    k = c.cluster
    cluster = dataclasses.replace(k, cert=absolute(k.cert), key=absolute(k.key), ca=absolute(k.ca))
    s = c.security
    security = dataclasses.replace(
        s, key_file=absolute(s.key_file), previous_key_files=tuple(absolute(p) for p in s.previous_key_files)
    )
    return dataclasses.replace(c, node=node, staging=staging, peer=peer, cluster=cluster, security=security)
