#!/usr/bin/env python3
"""Draw the dashboard's "Newest complete step" panel from live daemons, with no Grafana, into a PNG.

    scripts/render_panel.py --out newest.png 127.0.0.1:9464 [10.0.0.2:9464 ...]

Reads the panel's query from deploy/grafana/ckptd.json, scrapes each daemon's /metrics once,
evaluates the query on those samples as Prometheus would with every job and node selected
(`max by (job_name, tier) (ckptd_newest_complete_step{...})`: the highest step any node
reports), draws one bar per job and tier with matplotlib (Agg, no display needed), and
prints what it plotted as one JSON document: {"panel", "expr", "series": [{labels..., "value"}]}.
tests/e2e/test_dashboard.py runs it against a real daemon and checks the picture's data
against `ckptd status --json`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path

import matplotlib
from prometheus_client.parser import text_string_to_metric_families

matplotlib.use("Agg")  # before pyplot: no display
import matplotlib.pyplot as plt

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "ckptd.json"
PANEL = "Newest complete step"
# The one shape of query this script evaluates: an aggregation by labels over one metric's series.
QUERY = re.compile(r"^max by \((?P<by>[a-z_, ]+)\) \((?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*)\{[^}]*\}\)$")
TIER_COLOURS = {"memory": "#8ab8ff", "nvme": "#3274d9", "peer": "#ff9830", "object": "#56a64b"}
TIMEOUT_S = 30.0


def panel_query(dashboard: Path = DASHBOARD, title: str = PANEL) -> tuple[list[str], str, str]:
    """Return (labels to group by, metric, the whole expression) of a panel's first query."""
    panels = [p for p in json.loads(dashboard.read_text())["panels"] if p["title"] == title]
    if len(panels) != 1:
        raise SystemExit(f"render_panel: {dashboard} has {len(panels)} panels titled {title!r}")
    expr = panels[0]["targets"][0]["expr"]
    shape = QUERY.match(expr)
    if shape is None:
        raise SystemExit(f"render_panel: cannot evaluate {expr!r}: only max by (labels) (metric{{...}})")
    return [label.strip() for label in shape["by"].split(",")], shape["metric"], expr


def scrape(address: str) -> str:
    """Return a daemon's /metrics page."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=TIMEOUT_S) as reply:
        return reply.read().decode()


def evaluate(pages: list[str], by: list[str], metric: str) -> dict[tuple[str, ...], float]:
    """Return max by (by) (metric) over every sample of metric in the pages (one page per node)."""
    found: dict[tuple[str, ...], float] = {}
    for page in pages:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == metric:
                    group = tuple(sample.labels.get(label, "") for label in by)
                    found[group] = max(found.get(group, sample.value), sample.value)
    return dict(sorted(found.items()))


def draw(series: dict[tuple[str, ...], float], title: str, out: Path) -> None:
    """Draw one bar per (job, tier), bars of a job side by side, each labelled with its step."""
    jobs = sorted({job for job, _ in series})
    tiers = [t for t in TIER_COLOURS if any(tier == t for _, tier in series)]
    width = 0.8 / max(len(tiers), 1)
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    for i, tier in enumerate(tiers):
        xs = [j + (i - (len(tiers) - 1) / 2) * width for j, job in enumerate(jobs) if (job, tier) in series]
        values = [series[(job, tier)] for job in jobs if (job, tier) in series]
        bars = axes.bar(xs, values, width, label=tier, color=TIER_COLOURS[tier])
        axes.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=2, fontsize=8)
    axes.set_xticks(range(len(jobs)), jobs)
    axes.set_xlabel("job")
    axes.set_ylabel("newest complete step")
    axes.set_title(title)
    axes.legend(title="tier", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(out, format="png")
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Scrape, evaluate, draw; print the series plotted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("addresses", nargs="+", metavar="HOST:PORT", help="daemons' [metrics] listen addresses")
    parser.add_argument("--out", required=True, type=Path, help="the PNG to write")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = parser.parse_args(argv)
    by, metric, expr = panel_query(args.dashboard)
    if by != ["job_name", "tier"]:
        raise SystemExit(f"render_panel: draws bars by job_name and tier, the panel groups by {by}")
    series = evaluate([scrape(a) for a in args.addresses], by, metric)
    draw(series, PANEL, args.out)
    plotted = [{**dict(zip(by, group, strict=True)), "value": value} for group, value in series.items()]
    json.dump({"panel": PANEL, "expr": expr, "series": plotted}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
