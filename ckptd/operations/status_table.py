"""Render the newest complete step of each job on each tier, as `ckptd status` prints it.

cmd_status (cli.py) calls newest_steps_table() with the "newest_complete" part of the
status document, passed_over_lines() with its "passed_over" part, on the CLI's only
thread; ages come from the daemon, measured when it answered, so the table does not
depend on the clock of whoever reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MINUTE_S = 60
HOUR_S = 60 * MINUTE_S
DAY_S = 24 * HOUR_S


def human_age(age_s: float) -> str:
    """Return an age the way people say it: "12 s", "3 min", "5 h", "2 d" (rounded down)."""
    if age_s < 90:
        return f"{int(age_s)} s"
    if age_s < 90 * MINUTE_S:
        return f"{int(age_s // MINUTE_S)} min"
    if age_s < 2 * DAY_S:
        return f"{int(age_s // HOUR_S)} h"
    return f"{int(age_s // DAY_S)} d"


def newest_steps_table(newest: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[str]:
    """Return the lines of a table: one row per job and tier, its newest complete step and that step's age."""
    rows = [
        (job, tier, str(int(n["step"])), human_age(n["age_s"]))
        for job, tiers in newest.items()
        for tier, n in tiers.items()
    ]
    if not rows:
        return ["no complete step seen by this daemon yet"]
    header = ("JOB", "TIER", "NEWEST STEP", "AGE")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        f"{job:<{widths[0]}}  {tier:<{widths[1]}}  {step:>{widths[2]}}  {age}"
        for job, tier, step, age in [header, *rows]
    ]


def passed_over_lines(passed_over: Mapping[str, Mapping[str, int]], flush_every: int) -> list[str]:
    """Return one line per job whose saves outran this node's disk: the steps passed over on NVMe."""
    cadence = f"flush_every {flush_every}" if flush_every else "flush_every 0: the newest snapshot wins"
    return [
        f"passed over {job}: {p['steps']} steps not written to NVMe here (last: step {p['last_step']}, "
        f"replaced by step {p['replaced_by']}; {cadence})"
        for job, p in passed_over.items()
    ]


def cluster_line(cluster: Mapping[str, Any]) -> str:
    """Return `ckptd status`'s line on the cluster view: its backend, whether it answers, what waits."""
    backend = cluster.get("backend", "none")
    if backend == "none":
        return "cluster     none (no peers: every step is sealed on this node)"
    state = "connected" if cluster.get("connected") else f"NOT CONNECTED ({cluster.get('last_error', '')})"
    where = f" at {', '.join(cluster['endpoints'])}" if cluster.get("endpoints") else ""
    return (
        f"cluster     {backend}{where}: {state}, {cluster.get('members', 0)} nodes, "
        f"{cluster.get('pending_reports', 0)} reports waiting to be delivered"
    )
