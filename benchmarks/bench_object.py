"""Benchmark the object tier against plain s3fs transfers of the same bytes to the same endpoint, in one run.

An S3 endpoint runs on loopback (moto's server, a child process on a port chosen at run time).
One shard of random, incompressible bytes is written to a local NVMe tier on the disk under test,
then, in each repeat, uploaded by the object tier (`uploading.upload_file`: reads the local file
and pushes it through `ObjectTier.open_shard`, which checks every chunk, multipart with parts in
flight) and, interleaved with it, by a plain `s3fs.put_file` of the same file (the limit). Then it
is restored from the object tier (`read_meta` + `read_into`, parallel ranged GETs, every chunk
checked) against a plain `s3fs.get_file` of the same bytes. zstd uploads of the same shard and of
a half-zeros shard are measured beside them, for information. It prints a table and writes JSON;
it is not a test. See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_object.py --size-mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import botocore
import moto
import s3fs
from ckpt_core.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta, data_name, digest
from report import (  # benchmarks/report.py: run as scripts, this directory is on sys.path
    Row,
    held,
    table,
    write_results,
)
from s3_server import S3Server

from ckptd.node import Executors
from ckptd.save.uploading import upload_file
from ckptd.storage.object_store import UPLOAD_CONCURRENCY, open_store
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.keys import shard_dir
from ckptd.tiers.object.layout import MAX_RANGE_BYTES, MIN_RANGE_BYTES, PART_BYTES, READ_THREADS, zstd_name
from ckptd.tiers.object.tier import ObjectTier

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FILL_BLOCK_BYTES = 4 << 20
JOB = "bench-object"
JOB_HALF_ZEROS = "bench-object-half-zeros"
STEP = 1
UPLOAD_TARGET = ">= 0.9"  # the design's
RESTORE_TARGET = ">= 0.8"  # ours, not the design's
THREADS = Executors.build()  # the daemon's pools: the object tier's reads and requests run on them, as in ckptd


# -- the shards ------------------------------------------------------------------------------


def write_shard(nvme: LocalDirTier, job: str, size: int, half_zeros: bool) -> tuple[ShardMeta, Path]:
    """Write a shard of random bytes (its second half zeros if asked) durably; return its record and data file."""
    buf = mmap.mmap(-1, size)  # page-aligned, as write_shard wants; zero-filled
    for offset in range(0, size // 2 if half_zeros else size, FILL_BLOCK_BYTES):
        buf[offset : offset + FILL_BLOCK_BYTES] = os.urandom(min(FILL_BLOCK_BYTES, size - offset))
    try:
        meta = nvme.write_shard(ShardMeta(job, STEP, 0, 1, size, CHUNK_SIZE_BYTES, (), "{}"), memoryview(buf))
    finally:
        buf.close()
    return meta, (nvme.root / job / str(STEP)) / data_name(0)


def drop_from_page_cache(path: Path) -> None:
    """Evict a file's (clean, fsynced) pages from the page cache, so every upload reads it from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    """Return the seconds fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the run ---------------------------------------------------------------------------------


def bench(server: S3Server, work: Path, size: int, repeats: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Run every measurement repeats times, interleaved; return the raw seconds and the bytes zstd stored."""
    fs = s3fs.S3FileSystem(**server.storage_options)  # the same cached instance ObjectTier's store uses
    nvme = LocalDirTier(work / "nvme")
    raw: dict[str, list[float]] = defaultdict(list)
    stored: dict[str, int] = {}
    meta, path = write_shard(nvme, JOB, size, half_zeros=False)
    meta_hz, path_hz = write_shard(nvme, JOB_HALF_ZEROS, size, half_zeros=True)
    whole = digest_of_file(path)
    record = CommitRecord(JOB, STEP, 1, (digest(meta.to_bytes()),), size)
    fetched = work / "fetched.data"

    # Warm up: moto loads its S3 backend on first use, and both paths share one connection pool.
    warm = server.new_bucket("warmup")
    fs.pipe_file(f"{warm}/x", b"x" * 1024)
    fs.cat_file(f"{warm}/x")
    server.drop_bucket(warm)

    for repeat in range(repeats):
        print(f"repeat {repeat + 1}/{repeats} ...", flush=True)
        bucket = server.new_bucket("data")
        tier = ObjectTier(
            open_store(f"s3://{bucket}/ckpts", server.storage_options), THREADS.object_reads, THREADS.object_requests
        )

        def plain_put(bucket: str = bucket) -> None:
            drop_from_page_cache(path)
            raw["plain_put"].append(timed(lambda: fs.put_file(str(path), f"{bucket}/plain")))

        def ours_put(tier: ObjectTier = tier) -> None:
            drop_from_page_cache(path)
            raw["upload"].append(timed(lambda: upload_file(tier, meta, path)))

        def plain_get(bucket: str = bucket, key: str = "plain_get", **kwargs: int) -> None:
            raw[key].append(timed(lambda: fs.get_file(f"{bucket}/plain", str(fetched), **kwargs)))
            if fetched.stat().st_size != size:
                raise RuntimeError(f"get_file fetched {fetched.stat().st_size} bytes, expected {size}")
            fetched.unlink()

        def ours_restore(tier: ObjectTier = tier) -> None:
            out = mmap.mmap(-1, size)  # fresh memory, as a restore into new tensors has
            try:
                start = time.perf_counter()
                tier.read_into(tier.read_meta(JOB, STEP, 0), memoryview(out))
                raw["restore"].append(time.perf_counter() - start)
                # read_into has checked every chunk against meta; check the whole once more, untimed.
                if digest(out) != whole:
                    raise RuntimeError("the restored bytes differ from the shard")
            finally:
                out.close()

        # Interleaved, the order alternating between repeats, so machine noise hits both alike.
        for measure in (plain_put, ours_put) if repeat % 2 == 0 else (ours_put, plain_put):
            measure()
        if not tier.adopt_commit(record):
            raise RuntimeError("the uploaded shard does not match its commit record")
        restores = (plain_get, ours_restore)
        for measure in restores if repeat % 2 == 0 else reversed(restores):
            measure()
        server.drop_bucket(bucket)

        for key, m, p in (("zstd", meta, path), ("zstd_half_zeros", meta_hz, path_hz)):
            bucket = server.new_bucket("zstd")
            tier = ObjectTier(
                open_store(f"s3://{bucket}/ckpts", server.storage_options),
                THREADS.object_reads,
                THREADS.object_requests,
                compression="zstd",
            )
            drop_from_page_cache(p)
            raw[key].append(timed(lambda tier=tier, m=m, p=p: upload_file(tier, m, p)))
            names = tier.store.names(*shard_dir(m.job, STEP, 0, tier.keys))  # under the rank's hash prefix
            stored[key] = names[zstd_name(0)]
            server.drop_bucket(bucket)
        fs.invalidate_cache()
    return dict(raw), stored


def digest_of_file(path: Path) -> str:
    """Return the xxh3-128 of a file's bytes."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return digest(m)


def build_rows(size: int, raw: dict[str, list[float]], stored: dict[str, int]) -> list[Row]:
    """Turn raw timings into table rows: the limits' best, ours best and median held against them."""
    best = {k: min(v) for k, v in raw.items()}
    median = {k: statistics.median(v) for k, v in raw.items()}
    put_s, get_s = best["plain_put"], best["plain_get"]
    rows = [Row("s3fs put_file (limit)", put_s, size)]
    for label, stat in (("best", best), ("median", median)):
        t = stat["upload"]
        rows.append(held(f"object upload ({label})", t, size, "put_file", put_s / t, UPLOAD_TARGET))
    rows.append(Row("s3fs get_file (limit)", get_s, size))
    for label, stat in (("best", best), ("median", median)):
        t = stat["restore"]
        rows.append(held(f"object restore ({label})", t, size, "get_file", get_s / t, RESTORE_TARGET))
    for key, what in (("zstd", "random"), ("zstd_half_zeros", "half zeros")):
        stored_pct = 100 * stored[key] / size
        rows.append(
            Row(f"upload zstd, {what}, {stored_pct:.0f}% stored (best)", best[key], size, "put_file", put_s / best[key])
        )
    return rows


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512, help="size of the shard in MiB (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement (default 3)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR / "tmp", help="where the shard goes, on the disk under test")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "object.json", help="where to write the results")
    return p.parse_args()


def main() -> int:
    """Start the endpoint, run every measurement, print the table and write the JSON."""
    args = parse_args()
    size = args.size_mib << 20
    load_before = os.getloadavg()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-object-", dir=args.dir))
    print(f"a shard of {args.size_mib} MiB; working in {work}", flush=True)
    moto_peak_rss = 0
    try:
        server = S3Server(work / "moto.log")
        print(f"moto's S3 server on {server.endpoint}", flush=True)
        try:
            raw, stored = bench(server, work, size, args.repeats)
            s3fs_concurrency = s3fs.S3FileSystem(**server.storage_options).max_concurrency  # put_file's, get_file's
        finally:
            moto_peak_rss = server.peak_rss_bytes()
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = build_rows(size, raw, stored)
    print()
    print(table(rows))
    print(
        f"\nours: parts of {PART_BYTES >> 20} MiB, {UPLOAD_CONCURRENCY} in flight; restore in one range per thread "
        f"({MIN_RANGE_BYTES >> 20}-{MAX_RANGE_BYTES >> 20} MiB), {READ_THREADS} threads; "
        f"s3fs: parts of 50 MiB, {s3fs_concurrency} at a time; moto's peak memory {moto_peak_rss / (1 << 30):.2f} GiB"
    )
    write_results(
        args.json,
        load_before,
        rows,
        {"s3fs": s3fs.__version__, "botocore": botocore.__version__, "moto": moto.__version__},
        size_bytes=size,
        repeats=args.repeats,
        dir=str(args.dir.resolve()),
        raw_s=raw,
        zstd_stored_bytes=stored,
        moto_peak_rss_bytes=moto_peak_rss,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
