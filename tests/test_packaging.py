"""Two distributions, one version, declared floors that are the ones CI installs (scripts/floors.txt)."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path

import ckpt
import pytest
from ckpt.torch_version import MIN_TORCH, require_torch

import ckptd

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = {"ckptd": REPO / "pyproject.toml", "ckptd-client": REPO / "client" / "pyproject.toml"}


def floors() -> dict[str, str]:
    pins = [line.split("==") for line in (REPO / "scripts" / "floors.txt").read_text().splitlines() if "==" in line]
    return {name.strip(): version.strip() for name, version in pins}


def declared(path: Path) -> dict[str, str]:
    """Return {distribution: its floor} of a pyproject's dependencies."""
    found = {}
    for requirement in tomllib.loads(path.read_text())["project"]["dependencies"]:
        name, floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<\d+)?", requirement).group(1, 2)
        found[name] = floor
    return found


def test_every_declared_floor_is_the_version_ci_installs():
    pins = floors()
    for distribution, path in DISTRIBUTIONS.items():
        for name, floor in declared(path).items():
            if name == "torch":  # not installable here at its floor: checked at import instead
                assert tuple(int(p) for p in floor.split(".")) == MIN_TORCH, distribution
                continue
            assert pins.get(name) == floor, f"{distribution} declares {name}>={floor}; floors.txt pins {pins.get(name)}"
    assert set(pins) - {"grpcio-tools"} == set(declared(DISTRIBUTIONS["ckptd"])), "a floor no distribution declares"


def test_the_client_needs_only_torch_and_the_wire_and_the_daemon_no_torch():
    assert set(declared(DISTRIBUTIONS["ckptd-client"])) == {"torch", "grpcio", "protobuf", "numpy", "xxhash"}
    assert "torch" not in declared(DISTRIBUTIONS["ckptd"])


def test_the_stubs_were_generated_with_the_floor_tools():
    stub = (REPO / "client" / "ckpt_core" / "wire" / "v1" / "peer_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{floors()['grpcio-tools']}'" in stub


def test_one_version_for_both():
    for path in DISTRIBUTIONS.values():
        project = tomllib.loads(path.read_text())["project"]
        assert project["dynamic"] == ["version"] and "version" not in project
        assert tomllib.loads(path.read_text())["tool"]["setuptools"]["dynamic"]["version"] == {
            "attr": "ckpt_core._version.__version__"
        }
    assert ckpt.__version__ == ckptd.__version__
    assert all((REPO / p / "py.typed").exists() for p in ("client/ckpt", "client/ckpt_core", "ckptd"))


def test_an_old_or_missing_torch_is_named_at_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.3.1+cu121"))
    with pytest.raises(ImportError, match=r"ckpt needs torch >= 2\.4; this is torch 2\.3\.1"):
        require_torch()
    monkeypatch.setitem(sys.modules, "torch", None)  # what an environment without torch looks like to import
    with pytest.raises(ImportError, match="ckpt's training API needs torch"):
        require_torch()
