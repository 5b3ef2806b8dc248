"""The table both benchmarks print: each measurement, and the limit it is held against."""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    """Hold one line of the table: a measurement, and the limit it is held against if any."""

    what: str
    time_s: float
    size_bytes: int
    limit: str = ""
    ratio: float | None = None
    target: str = ""
    ok: bool | None = None

    @property
    def gb_per_s(self) -> float:
        """Return the bandwidth in GB/s (10**9 bytes per second)."""
        return self.size_bytes / self.time_s / 1e9


def held(what: str, time_s: float, size_bytes: int, limit: str, ratio: float, target: str) -> Row:
    """Return a row whose ratio is checked against target, written "<= x" or ">= x"."""
    op, bound = target.split()
    ok = ratio <= float(bound) if op == "<=" else ratio >= float(bound)
    return Row(what, time_s, size_bytes, limit, ratio, target, ok)


def table(rows: list[Row]) -> str:
    """Format rows as an aligned table with a header."""
    width = max(36, *(len(r.what) for r in rows))
    header = f"{'what':<{width}} {'time_s':>8} {'GB/s':>7}  {'limit':<16} {'ratio':>7} {'target':>7} {'ok':>4}"

    def line(r: Row) -> str:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        ok = "" if r.ok is None else ("yes" if r.ok else "NO")
        return f"{r.what:<{width}} {r.time_s:>8.3f} {r.gb_per_s:>7.2f}  {r.limit:<16} {ratio:>7} {r.target:>7} {ok:>4}"

    return "\n".join([header, "-" * len(header), *map(line, rows)])


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    """Return rows as JSON objects, bandwidth included."""
    return [{**asdict(r), "gb_per_s": r.gb_per_s} for r in rows]


def write_results(
    path: Path, load_before: tuple[float, ...], rows: list[Row], env: dict[str, str], **fields: Any
) -> None:
    """Print the load average around the run and write its results as JSON to path."""
    load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} (on {os.cpu_count()} CPUs)")
    result = {
        "argv": sys.argv,
        **fields,
        "env": {"python": platform.python_version(), "cpus": os.cpu_count(), **env},
        "load_average_1m": {"before": load_before[0], "after": load_after[0]},
        "rows": as_json(rows),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
