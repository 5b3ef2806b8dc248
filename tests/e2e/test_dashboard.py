"""deploy/grafana/ckptd.json: well-formed as Grafana expects, querying only what a real daemon exports, drawable."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path

import ckpt
import matplotlib.image
import pytest
import torch
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "ckptd.json"
RENDER = REPO / "scripts" / "render_panel.py"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24
PANEL_TYPES = {"timeseries", "bargauge", "heatmap", "table", "stat", "gauge"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
# What may stand in an expression besides metric names: PromQL's keywords (functions and
# aggregations are told apart by the "(" after them).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
NAME = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
COUNTER_FUNCTIONS = re.compile(r"\b(rate|increase|irate)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def metric_names(expr: str) -> set[str]:
    """Return the series names a PromQL expression selects (label names, functions and keywords left out)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, regexes
    bare = re.sub(r"\{[^}]*\}", " ", bare)  # label matchers
    bare = re.sub(r"\[[^\]]*\]", " ", bare)  # range selectors
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)  # label lists
    bare = re.sub(r"^\s*label_values\((.*),\s*\w+\)\s*$", r"\1", bare)  # Grafana's label_values(metric, label)
    names = set()
    for found in NAME.finditer(bare):
        followed_by = bare[found.end() :].lstrip()[:1]
        if followed_by != "(" and found.group() not in KEYWORDS:
            names.add(found.group())
    return names


def test_metric_names_are_found_in_promql_as_prometheus_reads_it():
    assert metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{instance=~"$instance", x="y{z}"}[5m])))'
    ) == {"a_seconds_bucket"}
    assert metric_names("time() - max by (job_name, tier) (b_timestamp_seconds)") == {"b_timestamp_seconds"}
    assert metric_names("sum(rate(c_sum[$__rate_interval])) / sum(rate(c_count[1m])) > 0 and on (i) d") == {
        "c_sum",
        "c_count",
        "d",
    }
    assert metric_names('label_values(e{instance=~"$instance"}, job_name)') == {"e"}


def test_the_dashboard_is_well_formed_as_grafana_expects():
    board = dashboard()
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", board["uid"])
    assert board["title"] and board["schemaVersion"] >= 36
    assert isinstance(board["editable"], bool) and board["time"]["from"] and board["time"]["to"]

    variables = {v["name"]: v for v in board["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in ("job", "instance"):
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert variable["query"]["query"] == variable["definition"] and variable["query"]["refId"]
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
    assert variables["job"]["query"]["query"].endswith(", job_name)")  # our label: Prometheus keeps `job` for itself

    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        where = panel["title"]
        assert panel["type"] in PANEL_TYPES and panel["title"] and panel["datasource"] == DATASOURCE, where
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and all(isinstance(v, int) and v >= 0 for v in grid.values()), where
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, where
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        covered = {(column, row) for column in range(x, x + w) for row in range(y, y + h)}
        assert not covered & cells, f"{where} overlaps another panel"
        cells |= covered
        assert panel["targets"], where
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(refs), where
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), where
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= set(variables) | GRAFANA_VARIABLES, f"{where}: {used}"
            if "job_name" in target["expr"]:
                assert 'job_name=~"$job"' in target["expr"], where


def test_the_dashboard_shows_what_the_issue_asks_for():
    board = dashboard()
    text = " ".join(expressions(board))
    for wanted in (
        "ckptd_newest_complete_step{",
        "time() - max by (job_name, tier) (ckptd_newest_complete_step_timestamp_seconds",
        "rate(ckptd_bytes_written_total",
        "histogram_quantile(0.5, sum by (le) (rate(ckptd_save_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(ckptd_flush_duration_seconds_bucket",
        "ckptd_retries_total",
        "ckptd_flush_failures_total",
        "ckptd_staging_bytes",
        "ckptd_staging_budget_bytes",
        "ckptd_build_info",
    ):
        assert wanted in text, wanted
    assert {p["type"] for p in board["panels"]} >= {"heatmap", "table", "timeseries"}


@pytest.fixture
def daemon_after_saves(make_daemon, short_tmp):
    """A daemon with metrics and a file:// store; jobs "alpha" (steps 1-3) and "beta" (steps 1-2) saved."""
    address = f"127.0.0.1:{free_port()}"
    node = make_daemon(f'[metrics]\nlisten = "{address}"\n[object]\nurl = "file://{short_tmp / "store"}"\n').start()
    for job, last in (("alpha", 3), ("beta", 2)):
        with ckpt.Checkpointer(job=job, address=node.address) as c:
            for step in range(1, last + 1):
                c.save_async({"w": torch.randn(1000)}, step=step).wait("object", timeout=60)
    return node, address


@pytest.mark.e2e
def test_every_metric_the_dashboard_queries_is_exported_by_a_real_daemon(daemon_after_saves):
    _, address = daemon_after_saves
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        page = reply.read().decode()
    # Series names as Prometheus stores them: a histogram's _bucket, _sum and _count, a counter's _total.
    exported = {s.name: f.type for f in text_string_to_metric_families(page) for s in f.samples}
    for expr in expressions(dashboard()):
        names = metric_names(expr)
        assert names, expr
        assert names <= set(exported), f"{expr} queries {sorted(names - set(exported))}, not exported"
        for name in names:
            if name.endswith(("_bucket", "_sum", "_count")) and exported[name] == "histogram":
                continue
            assert exported[name] != "histogram", f"{expr}: {name} is a histogram's, not a series of its own"
        for function, name in COUNTER_FUNCTIONS.findall(expr):
            assert exported[name] in ("counter", "histogram"), f"{expr}: {function}() of {exported[name]} {name}"
        if "histogram_quantile" in expr:
            assert all(n.endswith("_bucket") for n in names), expr


@pytest.mark.e2e
def test_render_panel_draws_what_the_daemon_says(daemon_after_saves, tmp_path):
    node, address = daemon_after_saves
    out = tmp_path / "newest.png"
    done = subprocess.run(
        [sys.executable, str(RENDER), "--out", str(out), address], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    plotted = json.loads(done.stdout)
    panel = next(p for p in dashboard()["panels"] if p["title"] == plotted["panel"])
    assert plotted["expr"] == panel["targets"][0]["expr"]

    newest = json.loads(node.cli("status", "--json").stdout)["newest_complete"]
    said = {(job, tier): n["step"] for job, tiers in newest.items() for tier, n in tiers.items()}
    drawn = {(s["job_name"], s["tier"]): s["value"] for s in plotted["series"]}
    assert drawn == said
    assert said[("alpha", "nvme")] == said[("alpha", "memory")] == said[("alpha", "object")] == 3
    assert said[("beta", "nvme")] == said[("beta", "memory")] == 2

    raw = out.read_bytes()
    assert raw[:8] == PNG_SIGNATURE and raw[12:16] == b"IHDR"
    width, height = struct.unpack(">II", raw[16:24])
    assert (width, height) == (800, 450)  # figsize 8 x 4.5 at 100 dpi
    assert 5_000 < len(raw) < 1_000_000
    pixels = matplotlib.image.imread(out)
    assert pixels.std() > 0.05  # bars, text and axes: not a blank picture
