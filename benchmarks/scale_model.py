"""Model ckptd at 1,000 and 10,000 nodes: bytes, times and object-store request rates per tier.

It computes; it starts nothing (no daemon, no store, no GPU). For each job size it prints the
bytes per rank, node and job; the time each tier takes at realistic bandwidths; the requests
ckptd sends to the object store (per step, per second, per prefix) in the flat layout it had and
in the hash-prefixed one it has (docs/SCALE.md section 4); and what bounds the checkpoint interval.
Every bandwidth and size is a named constant (its source beside it) or a flag. ckptd's own sizes,
thread counts and poll periods are imported from the daemon, so the model follows the code.

main() parses the flags and, for each Job, calls sizes() -> tier_times() -> requests() ->
intervals(), then skew() and tier_rows(); print_job() prints them and main() writes the JSON.
Run as a script (benchmarks/ is on sys.path, as for the other benchmarks); nothing imports it.

    .venv/bin/python benchmarks/scale_model.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckpt_core.format import CHUNK_SIZE_BYTES
from report import Row, as_json, table  # benchmarks/report.py: run as a script, this directory is on sys.path

from ckptd.node import OBJECT_THREADS
from ckptd.save.uploading import COMMIT_POLL_MAX_S, COMMIT_WATCH_LIMIT_S, UPLOAD_THREADS
from ckptd.storage.object_store import UPLOAD_CONCURRENCY
from ckptd.tiers.object.keys import PREFIX_HEX_DIGITS
from ckptd.tiers.object.layout import MAX_PARTS, MAX_RANGE_BYTES, MIN_RANGE_BYTES, PART_BYTES, READ_THREADS
from ckptd.tiers.object.shards import COMMIT_CHECK_THREADS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GB = 1e9
# ckptd's own numbers the model uses, imported above and written into the JSON.
CKPTD_CONSTANTS = ["PART_BYTES", "MAX_PARTS", "UPLOAD_THREADS", "UPLOAD_CONCURRENCY", "READ_THREADS", "OBJECT_THREADS"]
CKPTD_CONSTANTS += ["COMMIT_CHECK_THREADS", "COMMIT_POLL_MAX_S", "COMMIT_WATCH_LIMIT_S", "PREFIX_HEX_DIGITS"]

# -- the jobs ---------------------------------------------------------------------------------
GPUS_PER_NODE = 8  # DGX/HGX H100 and H200
# Mixed-precision Adam, as ZeRO (Rajbhandari et al., SC'20) counts it: 2 (bf16 weights) + 2 (bf16
# gradients) + 12 (fp32 master weights, Adam m and v) = 16 bytes per parameter. Weights + master +
# moments alone are 14 B (175B -> 2.45 TB); 16 B gives the 2.8 TB quoted for GPT-3 175B.
BYTES_PER_PARAM = 16
REPLICATED_BYTES_PER_PARAM = 2  # the bf16 weights: replicated over data parallelism under ZeRO-1


@dataclass(frozen=True)
class Job:
    """One training job: its size, and the parallelism that decides who writes which bytes."""

    name: str
    nodes: int
    params: float
    model_parallel: int  # TP x PP: the ranks one data-parallel replica spans
    shard_group: int  # HSDP: the ranks a replica group shards the whole state over


JOBS = (
    # GPT-3 175B with MegaScale's layout for it (TP 8, PP 8: NSDI'24, Table 1).
    Job("1,000 nodes, 175B", 1000, 175e9, 64, 512),
    # A ~1T-parameter model (total parameters: a dense model or an MoE of that size); TP 8 x PP 32.
    Job("10,000 nodes, 1T", 10_000, 1e12, 256, 2048),
)

# -- the hardware: realistic bandwidths (flags override them) ---------------------------------
# PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction (PCI-SIG); each H100/H200 of
# a DGX has its own x16 ("GPU-PCIe 504 GB/s" for 8, MLCommons inference v4.1 DGX H200 system
# description). 50 GB/s is the ~80% a pinned copy reaches: our assumption.
D2H_PCIE_GBPS = 50.0
# GH200 NVLink-C2C: 900 GB/s total, 450 GB/s per direction (NVIDIA GH200 whitepaper); 80% assumed.
D2H_C2C_GBPS = 360.0
# DGX H100/H200: 8 x 3.84 TB NVMe U.2 data drives in RAID 0 (DGX H100/H200 user guide), ~3.5 GB/s
# sequential write each (datasheets of 3.84 TB PCIe Gen4 U.2 drives): 28 GB/s raw, 25 assumed.
NVME_WRITE_GBPS = 25.0
NVME_EFFICIENCY = 0.9  # DESIGN.md target: durable on NVMe at >= 0.9x a direct write of the same bytes
NET_GBPS = 50.0  # one 400 Gb/s NIC (ConnectX-7) for the peer replica
PEER_EFFICIENCY = 0.8  # DESIGN.md target: >= 0.8x a raw socket doing the same work
# AWS S3 performance guidelines: "one concurrent request for each 85-90 MB/s of desired network
# throughput"; "up to 100 Gb/s on a single instance"; small-object latencies "roughly 100-200 ms".
S3_REQUEST_MBPS = 87.5
NODE_TO_STORE_GBPS = 12.5
REQUEST_LATENCY_S = 0.1
# AWS: applications "aggregate throughput across multiple instances to get multiple terabits per
# second"; no cap is published. 1 TB/s (8 Tb/s) for one job is our assumption.
STORE_AGGREGATE_GBPS = 1000.0
# AWS: "at least 3,500 PUT/COPY/POST/DELETE or 5,500 GET/HEAD requests per second per partitioned
# prefix", with 503 SlowDown while S3 adapts to a new rate. We count LIST with GET/HEAD.
PUT_PER_PREFIX_S = 3500
GET_PER_PREFIX_S = 5500
LIST_PAGE_KEYS = 1000  # ListObjectsV2 returns at most 1,000 keys a page
REPLICAS = 1  # [peer] replicas, default
NVME_KEEP, PEER_KEEP = 3, 3  # [retention] nvme and peer, defaults
HEADROOM = 0.5  # hash prefixes enough for each to run at <= half its limit

# -- what ckptd sends, per rank and step (ckptd/tiers/object/, storage/object_store.py, save/uploading.py;
# counted against moto with a hook on s3fs's calls): "before" in the flat layout ckptd had, HASHED_* in its own --
DELETES_PER_RANK = 3  # the shard record, then frames.json and data.zst (a plain upload drops them)
MEAN_POLL_S = 0.75 * COMMIT_POLL_MAX_S  # uploading._jittered: delay x U(0.5, 1)
READS_PER_RANK = 4  # HEAD + LIST of the absent COMMIT.json, ListMultipartUploads before data and record
ROUND_TRIPS_PER_UPLOAD = 10  # in turn, besides the parts: those 4 reads, 3 deletes, create, complete, record
WATCH_READS_PER_POLL = 5  # LIST <job>/, then HEAD + LIST of COMMIT.json twice (commit_record, complete_steps)
HASHED_READS_PER_RANK = 4  # holds()' LIST of its directory, 2 ListMultipartUploads, the committer's GET of its record
HASHED_ROUND_TRIPS_PER_UPLOAD = 9  # that LIST, the 3 deletes, the 2 ListMultipartUploads, create, complete, record
HASHED_RESTORE_READS_PER_RANK = 2  # a GET of its record, a LIST of its directory (then the ranged GETs)
HASHED_STEP_READS_PER_NODE = 1  # ObjectTier.open_shard's GET of COMMIT.json, once per node and step
HASHED_WATCH_READS_PER_POLL = 1  # LIST <job>/: the step's directory appears with its commit record


def part_bytes(size: int) -> int:
    """Return the part size object_layout.part_bytes picks for a shard of size bytes."""
    return max(PART_BYTES, -(-size // MAX_PARTS // CHUNK_SIZE_BYTES) * CHUNK_SIZE_BYTES)


def writes_per_rank(size: int) -> int:
    """Return the PUT-class requests one shard's upload sends: deletes, data (one PUT or multipart), record."""
    parts = max(1, -(-size // part_bytes(size)))
    return DELETES_PER_RANK + (1 if parts == 1 else parts + 2) + 1


def ranged_gets(size: int) -> int:
    """Return the ranged GETs a restore of a plain shard sends (object_layout.range_bytes, plain_pieces)."""
    per_thread = min(max(-(-size // READ_THREADS), MIN_RANGE_BYTES), MAX_RANGE_BYTES)
    return max(1, -(-size // (-(-per_thread // CHUNK_SIZE_BYTES) * CHUNK_SIZE_BYTES)))


# -- the model --------------------------------------------------------------------------------


def sizes(job: Job, layout: str) -> dict[str, Any]:
    """Return who writes how many bytes: groups of (ranks, bytes per rank) and (nodes, bytes per node)."""
    world = job.nodes * GPUS_PER_NODE
    step = job.params * BYTES_PER_PARAM
    if layout == "sharded":  # FSDP / ZeRO-3 over every rank: each rank writes 1/world of the state
        ranks, nodes = [(world, step / world)], [(job.nodes, step / job.nodes)]
    elif layout == "zero1":  # the replicated bf16 weights go to the owners, DP coordinate 0 (FORMAT.md)
        sharded = job.params * (BYTES_PER_PARAM - REPLICATED_BYTES_PER_PARAM) / world
        owner = sharded + job.params * REPLICATED_BYTES_PER_PARAM / job.model_parallel
        owners, writers = job.model_parallel, job.model_parallel // GPUS_PER_NODE
        ranks = [(owners, owner), (world - owners, sharded)]
        nodes = [(writers, owner * GPUS_PER_NODE), (job.nodes - writers, sharded * GPUS_PER_NODE)]
    else:  # hsdp: replica group 0 writes everything; the other ranks write their (tiny) shard records only
        group = job.shard_group
        ranks = [(group, step / group), (world - group, 0.0)]
        nodes = [(group // GPUS_PER_NODE, step / group * GPUS_PER_NODE), (job.nodes - group // GPUS_PER_NODE, 0.0)]
    out = {"world": world, "step_bytes": step, "ranks": ranks, "nodes": nodes}
    return out | {"rank_max": max(b for _, b in ranks), "node_max": max(b for _, b in nodes)}


def tier_times(s: dict[str, Any], a: argparse.Namespace) -> dict[str, float]:
    """Return each tier's time for the slowest node, and the job's object upload bounds."""
    node, rank = s["node_max"], s["rank_max"]
    nvme = a.nvme_gbps * GB * NVME_EFFICIENCY
    obj_node = min(UPLOAD_THREADS * UPLOAD_CONCURRENCY * a.s3_request_mbps * 1e6, a.node_to_store_gbps * GB)
    get_node = min(OBJECT_THREADS * READ_THREADS * a.s3_request_mbps * 1e6, a.node_to_store_gbps * GB)
    return {
        "copy_pcie_s": rank / (a.d2h_gbps * GB),
        "copy_c2c_s": rank / (a.c2c_gbps * GB),
        "nvme_own_s": node / nvme,
        "nvme_busy_s": node * (1 + a.replicas) / nvme,  # its own flush and the replicas it receives
        "peer_net_s": node * a.replicas / (a.net_gbps * GB * PEER_EFFICIENCY),
        "object_node_s": node / obj_node,
        "object_aggregate_s": s["step_bytes"] / (a.aggregate_gbps * GB),
        "restore_node_s": node / get_node,
    }


def requests(job: Job, s: dict[str, Any], t: dict[str, float], a: argparse.Namespace) -> dict[str, Any]:
    """Return the object-store requests of one step and of a whole-job restore, in the flat and the hashed layout.

    A node's upload window is its bytes at its bandwidth plus, for each wave of UPLOAD_THREADS ranks,
    the small requests a shard's upload makes one after the other; the job's is the longest of that,
    the store's aggregate, and the requests over what one prefix takes.
    """
    world, lat = s["world"], a.request_latency_ms / 1000
    waves, restore_waves = GPUS_PER_NODE // UPLOAD_THREADS, GPUS_PER_NODE // OBJECT_THREADS
    holds_pages, step_pages = -(-world // LIST_PAGE_KEYS), -(-2 * world // LIST_PAGE_KEYS)  # holds(): half its keys
    writes = sum(n * writes_per_rank(int(b)) for n, b in s["ranks"])
    reads = world * (holds_pages + READS_PER_RANK)
    node_s = t["object_node_s"] + waves * (holds_pages + ROUND_TRIPS_PER_UPLOAD) * lat
    bounds = {"node requests": node_s, "store aggregate": t["object_aggregate_s"]}
    bandwidth_s = max(bounds.values())
    bounds |= {"PUT/s per prefix": writes / a.put_per_prefix, "GET/s per prefix": reads / a.get_per_prefix}
    watch_per_s = job.nodes * WATCH_READS_PER_POLL / MEAN_POLL_S
    # The rank-0 node's pass: list the step, HEAD+GET every record once (COMMIT_CHECK_THREADS at a time).
    commit_s = (step_pages + math.ceil(2 * world / COMMIT_CHECK_THREADS) + 1) * lat
    # A restore: each rank reads its record and its ranges; the first wave of a node also lists the step.
    gets = sum(n * (ranged_gets(int(b)) + 3) for n, b in s["ranks"]) + job.nodes * OBJECT_THREADS * step_pages
    restore_node_s = t["restore_node_s"] + restore_waves * 3 * lat + step_pages * lat
    restore_bw_s = max(restore_node_s, t["object_aggregate_s"])
    # As built: shard objects under _shards/<hh>/<job>/<step>/; no request lists the step.
    hashed, polled = 16**PREFIX_HEX_DIGITS, min(16**PREFIX_HEX_DIGITS, world)  # the committer lists `polled` a poll
    gets_after = sum(n * (ranged_gets(int(b)) + HASHED_RESTORE_READS_PER_RANK) for n, b in s["ranks"])
    node_after_s = t["object_node_s"] + waves * HASHED_ROUND_TRIPS_PER_UPLOAD * lat
    after_s = max(node_after_s, t["object_aggregate_s"])
    restore_after_s = t["restore_node_s"] + restore_waves * HASHED_RESTORE_READS_PER_RANK * lat
    restore_after_s = max(restore_after_s, t["object_aggregate_s"])
    put_rate, get_rate = writes / after_s, world * HASHED_READS_PER_RANK / after_s + polled / MEAN_POLL_S
    load = max(put_rate / a.put_per_prefix, get_rate / a.get_per_prefix) / HEADROOM  # in prefixes' worth
    wanted = 16 ** max(1, math.ceil(math.log(load, 16)))  # the fewest powers of 16 that keep each under half
    upload_s = max(bounds.values())
    return {
        "writes_per_step": writes,
        "reads_per_step": reads,
        "holds_list_pages_per_rank": holds_pages,
        "before": {
            "upload_node_s": node_s,
            "put_per_s_step_prefix": writes / bandwidth_s,
            "get_per_s_step_prefix": reads / bandwidth_s + watch_per_s,
            "watch_get_per_s": watch_per_s,
            "upload_s": upload_s,
            "upload_bound": max(bounds, key=lambda k: bounds[k]),
            "commit_requests": step_pages + 2 * world + 1,
            "commit_s": commit_s,
            "object_s": upload_s + commit_s,
            "restore_gets": gets,
            "restore_get_per_s": gets / restore_bw_s,
            "restore_s": max(restore_bw_s, gets / a.get_per_prefix),
        },
        "after": {
            "hash_prefixes": hashed,
            "hash_prefixes_wanted": wanted,
            "put_per_s_hash_prefix": put_rate / hashed,
            "get_per_s_hash_prefix": get_rate / hashed,
            "get_per_s_job_prefix": job.nodes
            * (HASHED_STEP_READS_PER_NODE / after_s + HASHED_WATCH_READS_PER_POLL / MEAN_POLL_S),
            "upload_s": max(after_s, writes / (a.put_per_prefix * hashed)),
            "commit_requests": world + polled + 2,  # each record once, as it comes; the last poll; index, record
            "commit_s": (math.ceil(world / COMMIT_CHECK_THREADS) + math.ceil(polled / COMMIT_CHECK_THREADS) + 2) * lat,
            "restore_gets": gets_after,
            "restore_get_per_s_hash_prefix": gets_after / restore_after_s / hashed,
            "restore_s": max(restore_after_s, gets_after / (a.get_per_prefix * hashed)),
        },
    }


def intervals(t: dict[str, float], r: dict[str, Any]) -> dict[str, float]:
    """Return the shortest interval between saves that each tier sustains, with two slots per rank.

    A save takes a rank's other slot only once the snapshot in it is flushed to NVMe: save k+2
    waits for the flush of save k. Replicas and uploads hold no slot; a slower tier skips steps.
    """
    return {
        "no_stall_s": max(t["nvme_busy_s"], (t["copy_pcie_s"] + t["nvme_own_s"]) / 2),
        "every_step_on_peer_s": max(t["peer_net_s"], t["nvme_busy_s"]),
        "every_uploaded_step_in_store_s": max(r["before"]["upload_s"], r["before"]["commit_s"]),
        "every_uploaded_step_in_store_after_s": max(r["after"]["upload_s"], r["after"]["commit_s"]),
    }


def skew(job: Job, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Return, for each layout, the writer nodes and the per-node tier times of the slowest one."""
    out = []
    for layout in ("sharded", "zero1", "hsdp"):
        s = sizes(job, layout)
        t = tier_times(s, a)
        writers = sum(n for n, b in s["nodes"] if b == s["node_max"])
        times = {k: t[k] for k in ("nvme_busy_s", "peer_net_s", "object_node_s")}
        out.append({"layout": layout, "writer_nodes": writers, "node_bytes": s["node_max"], **times})
    return out


# -- printing ---------------------------------------------------------------------------------


def gb(n: float) -> str:
    """Format bytes as GB (10**9) or TB."""
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / GB:.2f} GB"


def tier_rows(s: dict[str, Any], t: dict[str, float], r: dict[str, Any], replicas: int) -> list[Row]:
    """Return the tier table: what moves, its time, and what bounds it (report.py's columns)."""
    node, rank, step, b, af = s["node_max"], s["rank_max"], s["step_bytes"], r["before"], r["after"]
    puts = f"{UPLOAD_THREADS}x{UPLOAD_CONCURRENCY} PUTs"
    return [
        Row("memory: copy GPU->slot, per rank", t["copy_pcie_s"], int(rank), "PCIe Gen5 x16"),
        Row("memory: copy GPU->slot, per rank", t["copy_c2c_s"], int(rank), "GH200 C2C"),
        Row("nvme: flush, per node", t["nvme_own_s"], int(node), "NVMe RAID 0"),
        Row("nvme: flush + replicas received", t["nvme_busy_s"], int(node * (1 + replicas)), "NVMe RAID 0"),
        Row("peer: replica, per node", t["peer_net_s"], int(node * replicas), "400 Gb/s NIC"),
        Row("object: upload, per node, bandwidth", t["object_node_s"], int(node), puts),
        Row("object: upload, per node", b["upload_node_s"], int(node), "+ requests in turn"),
        Row("object: upload, job, aggregate", t["object_aggregate_s"], int(step), "store aggregate"),
        Row("object: upload, job", b["upload_s"], int(step), b["upload_bound"]),
        Row("object: commit pass (rank-0 node)", b["commit_s"], 0, "request latency"),
        Row("object: save -> complete in store", b["object_s"], int(step), "upload + commit"),
        Row("object: restore whole job", b["restore_s"], int(step), "GET/s per prefix"),
        Row("hashed keys: upload, job", af["upload_s"], int(step), "hashed keys"),
        Row("hashed keys: commit pass", af["commit_s"], 0, "request latency"),
        Row("hashed keys: restore whole job", af["restore_s"], int(step), "hashed keys"),
    ]


def print_job(job: Job, res: dict[str, Any], a: argparse.Namespace) -> None:
    """Print one job's sizes, tier table, request rates, interval bounds and layout skew."""
    s, r, iv = res["sizes"], res["requests"], res["intervals"]
    b, af = r["before"], r["after"]
    print(
        f"\n=== {job.name}: {s['world']:,} ranks, checkpoint {gb(s['step_bytes'])} "
        f"({job.params / 1e9:,.0f}B params x {BYTES_PER_PARAM} B), layout {a.layout} ==="
    )
    keep = (NVME_KEEP + 1) + (PEER_KEEP + 1) * a.replicas
    print(f"largest: per rank {gb(s['rank_max'])}, per node {gb(s['node_max'])};   per job {gb(s['step_bytes'])}")
    print(
        f"staging per node (2 slots per rank) {gb(2 * s['node_max'])}   NVMe per node "
        f"({keep} x node: retention nvme={NVME_KEEP}, peer={PEER_KEEP}) {gb(keep * s['node_max'])}   "
        f"store per kept step {gb(s['step_bytes'])}\n"
    )
    print(table(res["rows"]))
    print("\nobject-store requests (S3 limits per prefix: 3,500 PUT-class/s, 5,500 GET-class/s)")
    print(
        f"  per step: {r['writes_per_step']:,} PUT-class (parts {PART_BYTES >> 20} MiB), {r['reads_per_step']:,} "
        f"GET-class ({r['holds_list_pages_per_rank']} LIST pages per rank's holds() check)"
    )
    prefixes = f"{af['hash_prefixes']:,} prefixes, {af['hash_prefixes_wanted']:,} wanted"
    lines = [
        ("before: PUT/s on <job>/<step>/", b["put_per_s_step_prefix"], a.put_per_prefix),
        ("before: GET/s on <job>/<step>/", b["get_per_s_step_prefix"], a.get_per_prefix),
        ("  of which watchers polling COMMIT", b["watch_get_per_s"], a.get_per_prefix),
        ("before: restore GET/s on <job>/<step>/", b["restore_get_per_s"], a.get_per_prefix),
        (f"after ({prefixes}): PUT/s each", af["put_per_s_hash_prefix"], a.put_per_prefix),
        ("after: GET/s each hashed prefix", af["get_per_s_hash_prefix"], a.get_per_prefix),
        ("after: GET/s on <job>/ (commit checks, watchers)", af["get_per_s_job_prefix"], a.get_per_prefix),
        ("after: restore GET/s each", af["restore_get_per_s_hash_prefix"], a.get_per_prefix),
    ]
    for what, rate, limit in lines:
        flag = "  HOT" if rate > limit else ""
        print(f"  {what:<48} {rate:>10,.0f} /s  {rate / limit:>7.2f}x limit{flag}")
    print(
        f"  commit pass: {b['commit_requests']:,} requests, {b['commit_s']:,.0f} s at {a.request_latency_ms:g} ms each "
        f"(watchers stop at {COMMIT_WATCH_LIMIT_S:,.0f} s); after: {af['commit_requests']:,}, {af['commit_s']:,.0f} s"
    )
    print("\nshortest interval between saves (two slots per rank; peer and object hold no slot)")
    for key, what in (
        ("no_stall_s", "training never waits (NVMe flush + replicas in)"),
        ("every_step_on_peer_s", "every step replicated to a peer"),
        ("every_uploaded_step_in_store_s", "every uploaded step complete in the store"),
        ("every_uploaded_step_in_store_after_s", "  the same with hashed keys"),
    ):
        print(f"  {what:<52} {iv[key]:>10,.1f} s")
    print("\nwho writes the bytes (ckptd writes a replicated chunk once, from its owner)")
    print(f"  {'layout':<8} {'writer nodes':>12} {'per node':>10} {'staging':>10}   nvme s   peer s  upload s")
    for k in res["skew"]:
        print(
            f"  {k['layout']:<8} {k['writer_nodes']:>12,} {gb(k['node_bytes']):>10} {gb(2 * k['node_bytes']):>10} "
            f"{k['nvme_busy_s']:>8.2f} {k['peer_net_s']:>8.2f} {k['object_node_s']:>9.1f}"
        )


def parse_args() -> argparse.Namespace:
    """Parse the command line: every bandwidth and limit of the model can be changed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layouts = ("sharded", "zero1", "hsdp")
    p.add_argument("--layout", choices=layouts, default="sharded", help="who writes the bytes (default sharded)")
    for flag, default, what in (
        ("--d2h-gbps", D2H_PCIE_GBPS, "GPU->host copy per GPU, PCIe, GB/s"),
        ("--c2c-gbps", D2H_C2C_GBPS, "GPU->host copy per GPU, Grace-Hopper C2C, GB/s"),
        ("--nvme-gbps", NVME_WRITE_GBPS, "NVMe array write per node, GB/s"),
        ("--net-gbps", NET_GBPS, "network per node for the peer replica, GB/s"),
        ("--s3-request-mbps", S3_REQUEST_MBPS, "throughput of one S3 request, MB/s"),
        ("--node-to-store-gbps", NODE_TO_STORE_GBPS, "network per node to the store, GB/s"),
        ("--aggregate-gbps", STORE_AGGREGATE_GBPS, "the store's aggregate throughput for the job, GB/s"),
        ("--request-latency-ms", REQUEST_LATENCY_S * 1000, "latency of one small request, ms"),
        ("--put-per-prefix", PUT_PER_PREFIX_S, "PUT-class requests/s one prefix takes"),
        ("--get-per-prefix", GET_PER_PREFIX_S, "GET-class requests/s one prefix takes"),
        ("--replicas", REPLICAS, "[peer] replicas"),
    ):
        p.add_argument(flag, type=type(default), default=default, help=f"{what} (default {default})")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "scale_model.json", help="where to write the results")
    return p.parse_args()


def main() -> int:
    """Model both jobs, print them, write the JSON."""
    a = parse_args()
    results = []
    for job in JOBS:
        s = sizes(job, a.layout)
        t = tier_times(s, a)
        r = requests(job, s, t, a)
        res = {"job": asdict(job), "sizes": s, "tiers": t, "requests": r, "intervals": intervals(t, r)}
        res["skew"], res["rows"] = skew(job, a), tier_rows(s, t, r, a.replicas)
        print_job(job, res, a)
        results.append({**res, "rows": as_json(res["rows"])})
    ckptd = {name: globals()[name] for name in CKPTD_CONSTANTS}
    assumptions = {**vars(a), "json": str(a.json), "bytes_per_param": BYTES_PER_PARAM, "gpus_per_node": GPUS_PER_NODE}
    out = {"argv": sys.argv, "assumptions": assumptions, "ckptd": ckptd, "jobs": results}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
