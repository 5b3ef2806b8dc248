"""Render the status document for people, as `ckptd status` prints it (`--json` prints the document itself).

cmd_status (cli.py) calls status_lines() with the whole document, on the CLI's only thread;
it renders the newest complete step of each job on each tier with newest_steps_table(), the
steps passed over with passed_over_lines(), each job's retention with retention_lines() and
the cluster view with cluster_line(). Ages
come from the daemon, measured when it answered, so the table does not depend on the clock
of whoever reads it. Sizes are in KiB, MiB, GiB (human_size, also `ls`'s and restore's);
no line shows a Python dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MINUTE_S = 60
HOUR_S = 60 * MINUTE_S
DAY_S = 24 * HOUR_S


def human_size(n: int) -> str:
    """Return a byte count for people: 512.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


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


def retention_lines(retention: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Return one line per job on what retention keeps of it here: the newest steps by tier, multiples, pins."""
    lines = []
    for job, r in retention.items():
        keep = ", ".join(f"{tier} {n or 'all'}" for tier, n in r["keep"].items())
        every = f"every multiple of {r['keep_every']}" if r["keep_every"] else "no multiples"
        pinned = ", ".join(map(str, r["pinned"])) or "none"
        source = ", ".join(f"{name} from {where}" for name, where in r["from"].items())
        lines.append(f"retention {job}: newest {keep}; {every}; pinned {pinned} ({source})")
    return lines


def cluster_line(cluster: Mapping[str, Any]) -> str:
    """Return `ckptd status`'s line on the cluster view: its backend, whether it answers, what waits."""
    backend = cluster.get("backend", "none")
    if backend == "none":
        return "cluster     none (no peers: every step is sealed on this node)"
    state = "connected" if cluster.get("connected") else f"NOT CONNECTED ({cluster.get('last_error', '')})"
    if backend == "peers" and not cluster.get("connected"):
        state = f"NOT CONNECTED: no peer answers, this node is cut off ({cluster.get('last_error', '')})"
    where = f" at {', '.join(cluster['endpoints'])}" if cluster.get("endpoints") else ""
    return (
        f"cluster     {backend}{where}: {state}, {cluster.get('members', 0)} nodes, "
        f"{cluster.get('pending_reports', 0)} reports waiting to be delivered"
    )


def status_lines(doc: Mapping[str, Any]) -> list[str]:
    """Return `ckptd status`'s lines: where the daemon runs, each tier, the counters, the newest steps, errors."""
    st, tiers = doc["staging"], doc["tiers"]
    budget = f"of a {human_size(st['budget_bytes'])} budget" if st["budget_bytes"] else "(sized on demand)"
    if st.get("job_budget_bytes"):
        budget += f" ({human_size(st['job_budget_bytes'])} a job)"
    lines = [
        f"ckptd {doc['version']} on {doc['node']}, up {doc['uptime_s']:.0f} s, socket {doc['socket']}",
        f"nvme root   {tiers['nvme']['root']}",
        f"staging     {tiers['memory']['dir']}: {human_size(st['in_use_bytes'])} in {st['slots']} slots {budget}, "
        f"{st['pending_flushes']} flushes pending, policy {st['policy']}",
        *counter_lines(doc["counters"]),
    ]
    peer = tiers["peer"]
    if peer["enabled"]:
        tls = "TLS" if peer["tls"] else "plaintext"
        listen = peer["listen"] or "(none)"
        lines.append(f"peer tier   listen {listen} ({tls}), {peer['replicas']} replica(s) per shard")
        for address, p in peer["peers"].items():
            state = "unreachable" if address in peer["unreachable"] else "ok"
            if address in peer.get("connecting", []):
                state = "connecting"
            line = f"  {address}: {state}, {p['pending_replicas']} replicas pending"
            if p.get("stood_in_for"):
                line += f", standing in for a failing peer with {p['stood_in_for']} replicas"
            if p["consecutive_failures"]:
                line += f", {p['consecutive_failures']} failures in a row, retry in {p['retry_in_s']:.1f} s"
            lines.append(line)
        short = peer.get("under_replicated", {})
        if short.get("shards") or short.get("on_stand_in"):
            lines.append(
                f"  under-replicated: {short['shards']} shards (the oldest for {short['oldest_s']:.0f} s); "
                f"{short['on_stand_in']} kept by a stand-in while their peer fails"
            )
    else:
        lines.append("peer tier   off (no [peer] addresses)")
    lines.append(cluster_line(doc.get("cluster", {})))
    obj = tiers["object"]
    if obj["enabled"]:
        lines.append(
            f"object tier {obj['url']} (every {obj['every']} steps, compression {obj['compression']}): "
            f"{obj['pending_uploads']} uploads pending, {obj['waiting_for_commit']} steps waiting for their commit, "
            f"{obj['uploaded_shards']} shards ({human_size(obj['uploaded_bytes'])}) uploaded, "
            f"{obj['commits_written']} commits written"
        )
        lines += [f"  failing {shard}: {error}" for shard, error in obj["failing"].items()]
    else:
        lines.append("object tier off (no [object] url)")
    lines += newest_steps_table(doc["newest_complete"])
    lines += passed_over_lines(doc.get("passed_over", {}), tiers["nvme"].get("flush_every", 0))
    lines += retention_lines(doc.get("retention", {}))
    lines += [f"error       {err['tier']}: {err['error']}" for err in doc["recent_errors"]]
    return lines


def counter_lines(counters: Mapping[str, Any]) -> list[str]:
    """Return the counters: counts as they are, byte counts in KiB/MiB/GiB, a counter by tier on a line of its own."""

    def shown(name: str, value: Any) -> str:
        return f"{name} {human_size(value)}" if "bytes" in name and isinstance(value, int) else f"{name} {value}"

    flat = [shown(name, v) for name, v in counters.items() if not isinstance(v, Mapping)]
    lines = ["counters    " + ", ".join(flat)]
    for name, by in counters.items():
        if isinstance(by, Mapping):
            lines.append(f"  {name}: " + ", ".join(shown(k, v) for k, v in by.items()))
    return lines
