"""Keep checkpoints in a local directory tree: the node's NVMe tier, and restore targets.

Shards are written with large aligned direct-I/O writes from page-aligned memory,
under a temporary name, fsynced, then renamed; the step's commit record is
written last, once every rank's shard is in. Layout: <root>/<job>/<step>/.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt.format import (
    CHUNK_SIZE_BYTES,
    COMMIT_NAME,
    DIRECT_IO_ALIGN_BYTES,
    JOB_RE,
    PARTIAL_SUFFIX,
    CommitRecord,
    ShardMeta,
    chunk_ranges,
    data_name,
    digest,
    meta_name,
    round_up,
    validate_job,
)
from ckpt.shard_io import ShardSource

from ckptd.cluster import Holding, seal_record
from ckptd.tiers.base import DurableTier

log = logging.getLogger(__name__)

WRITE_BLOCK_BYTES = 32 << 20
WRITE_THREADS = 4
DELETING_PREFIX = ".deleting-"


class ShardWriteError(CheckpointError):
    """Writing a shard failed; the message names the shard and the cause."""


class LocalDirTier(DurableTier):
    """Store steps under a root directory with the atomic commit protocol."""

    def __init__(self, root: Path, name: str = "nvme") -> None:
        self.root = root
        self.name = name
        self._io = ThreadPoolExecutor(max_workers=WRITE_THREADS, thread_name_prefix=f"{name}-io")
        self._commits: dict[Path, tuple[tuple[int, int, int], CommitRecord | str]] = {}
        self._holdings: dict[Path, tuple[tuple[int, int, int], Holding | None]] = {}
        self._step_locks: dict[tuple[str, int], threading.Lock] = {}
        self._step_locks_lock = threading.Lock()

    def close(self) -> None:
        """Stop the writer threads."""
        self._io.shutdown(wait=True)

    def step_dir(self, job: str, step: int) -> Path:
        """Return the directory of a job's step."""
        return self.root / validate_job(job) / str(step)

    # -- listing -----------------------------------------------------------

    def jobs(self) -> list[str]:
        """Return the jobs with a directory under the root (other entries, like lost+found, are not jobs)."""
        return sorted(name for name in _names(self.root) if JOB_RE.fullmatch(name) and (self.root / name).is_dir())

    def all_steps(self, job: str) -> list[int]:
        """Return every step directory of the job, complete or not, oldest first."""
        return sorted(int(n) for n in _names(self.root / job) if n.isdigit())

    def complete_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is in place and checks; a damaged one is logged and left out."""
        return [s for s in self.all_steps(job) if self.checked_commit(job, s) is not None]

    def checked_commit(self, job: str, step: int) -> CommitRecord | None:
        """Return the step's commit record if it is there and checks, else None (not complete here)."""
        record = self._commit_state(job, step)
        return record if isinstance(record, CommitRecord) else None

    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check: never removed, only reported."""
        return [s for s in self.all_steps(job) if self._commit_state(job, s) == "damaged"]

    def _commit_state(self, job: str, step: int) -> CommitRecord | str:
        """Return the step's checked commit record, "missing", or "damaged"."""
        path = self.root / job / str(step) / COMMIT_NAME
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._commits.get(path)
        if cached is not None and cached[0] == identity:
            return cached[1]
        try:
            state: CommitRecord | str = CommitRecord.from_bytes(path.read_bytes(), str(path))
        except (CheckpointError, OSError) as e:
            log.error("%s step %d on tier %s has a damaged commit record: %s", job, step, self.name, e)
            state = "damaged"
        self._commits[path] = (identity, state)
        return state

    def _step_lock(self, job: str, step: int) -> threading.Lock:
        with self._step_locks_lock:
            return self._step_locks.setdefault((job, step), threading.Lock())

    def commit_record(self, job: str, step: int) -> CommitRecord:
        """Return a complete step's commit record."""
        record = self.checked_commit(validate_job(job), step)
        if record is None:
            raise NotFound(f"{job} step {step} is not complete on tier {self.name}")
        return record

    def committed_unix_s(self, job: str, step: int) -> float:
        """Return when a complete step's commit record was written (its mtime)."""
        return (self.step_dir(job, step) / COMMIT_NAME).stat().st_mtime

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        """Point at a step directory."""
        return ShardSource(self.name, "dir", str(self.step_dir(job, step)), job, step)

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        """Say whether a rank's shard is fully written (its metadata is renamed last)."""
        return (self.step_dir(job, step) / meta_name(rank)).exists()

    def holds(self, meta: ShardMeta) -> bool:
        """Say whether this exact shard record is installed here."""
        path = self.step_dir(meta.job, meta.step) / meta_name(meta.rank)
        try:
            return path.read_bytes() == meta.to_bytes()
        except OSError:
            return False

    def saved_world_size(self, job: str, step: int) -> int | None:
        """Return the world_size recorded by the shards of a step, or None if no readable shard is there."""
        for path in sorted(self.step_dir(job, step).glob("rank-*.meta.json")):
            try:
                return ShardMeta.from_bytes(path.read_bytes(), str(path)).world_size
            except (CheckpointError, OSError) as e:
                log.error("ignoring damaged shard record %s: %s", path, e)
        return None

    # -- writing -----------------------------------------------------------

    def write_shard(
        self,
        meta: ShardMeta,
        data: memoryview,
        on_hashed: Callable[[ShardMeta], None] | None = None,
    ) -> ShardMeta:
        """Write a shard's bytes and metadata durably; return the metadata with checksums.

        data must be page-aligned and at least the data size rounded up to 4 KiB.
        If meta carries chunk checksums the bytes are checked against them as they
        are written; if not, they are computed here, once, and on_hashed is called
        with the completed metadata as soon as they are known (before the writes
        are durable).
        """
        what = f"rank {meta.rank} shard of {meta.job} step {meta.step} on tier {self.name}"
        partial = self.partial_path(meta, uuid.uuid4().hex[:8])
        try:
            self.prepare_shard(meta, what)
            meta = self._write_data(partial, meta, data, on_hashed, what)
            self.install_shard(meta, partial, what)
        except BaseException as e:
            partial.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise ShardWriteError(f"{what}: {e.strerror or e}") from e
            raise
        return meta

    def partial_path(self, meta: ShardMeta, transfer: str) -> Path:
        """Name the temporary file that receives a shard's bytes before install_shard (removed at start-up)."""
        return self.step_dir(meta.job, meta.step) / f"{data_name(meta.rank)}.{transfer}{PARTIAL_SUFFIX}"

    def prepare_shard(self, meta: ShardMeta, what: str) -> None:
        """Make the step directory ready for a shard, and drop an older copy of it.

        Refused when the step is complete, unless meta is exactly the record the
        step's commit lists for that rank (a replica, or a shard fetched back).
        """
        step_dir = self.step_dir(meta.job, meta.step)
        with self._step_lock(meta.job, meta.step):
            self._check_writable(meta, what)
            if not step_dir.is_dir():
                step_dir.mkdir(parents=True, exist_ok=True)
                _fsync_dir(step_dir.parent)
                _fsync_dir(self.root)
            # A shard saved again replaces the old one: drop it first, so a failure
            # later leaves the step without this rank rather than with stale bytes.
            (step_dir / meta_name(meta.rank)).unlink(missing_ok=True)

    def install_shard(self, meta: ShardMeta, partial: Path, what: str) -> None:
        """Make a fully written and fsynced data file the rank's shard: its record is renamed in last."""
        step_dir = self.step_dir(meta.job, meta.step)
        meta_path = step_dir / meta_name(meta.rank)
        meta_partial = meta_path.with_name(f"{meta_path.name}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
        try:
            write_file_durably(meta_partial, meta.to_bytes())
            with self._step_lock(meta.job, meta.step):
                self._check_writable(meta, what)
                os.replace(partial, step_dir / data_name(meta.rank))
                os.replace(meta_partial, meta_path)  # the shard counts as written from here on
                _fsync_dir(step_dir)
        except BaseException:
            meta_partial.unlink(missing_ok=True)
            raise

    def _check_writable(self, meta: ShardMeta, what: str) -> None:
        record = self.checked_commit(meta.job, meta.step)
        if record is None:
            return
        listed = meta.rank < record.world_size and record.shard_meta_xxh3_128[meta.rank] == digest(meta.to_bytes())
        if not (meta.chunk_xxh3_128 and listed):
            raise ShardWriteError(f"{what}: the step is already complete; a complete step is never rewritten")

    def _write_data(
        self,
        path: Path,
        meta: ShardMeta,
        data: memoryview,
        on_hashed: Callable[[ShardMeta], None] | None,
        what: str,
        direct: bool = True,
    ) -> ShardMeta:
        size = meta.data_size_bytes
        if len(data) < round_up(size, DIRECT_IO_ALIGN_BYTES):
            raise ValueError(f"{what}: buffer of {len(data)} bytes is short of {size} rounded to 4 KiB")
        fd, direct = _open_for_write(path, direct)
        try:
            return self._write_from(fd, direct, meta, data, on_hashed, what)
        except _DirectIORefused:
            return self._write_data(path, meta, data, on_hashed, what, direct=False)
        finally:
            os.close(fd)

    def _write_from(
        self,
        fd: int,
        direct: bool,
        meta: ShardMeta,
        data: memoryview,
        on_hashed: Callable[[ShardMeta], None] | None,
        what: str,
    ) -> ShardMeta:
        size = meta.data_size_bytes
        expected = meta.chunk_xxh3_128 or None
        digests: list[str] = []
        writes: list[Future[Any]] = []
        try:
            block_bytes = max(1, WRITE_BLOCK_BYTES // CHUNK_SIZE_BYTES) * CHUNK_SIZE_BYTES
            for offset, length in chunk_ranges(size, block_bytes):
                for start, n in chunk_ranges(length, meta.chunk_size_bytes):
                    digests.append(digest(data[offset + start : offset + start + n]))
                    index = len(digests) - 1
                    if expected is not None and digests[index] != expected[index]:
                        lo = offset + start
                        raise ShardWriteError(f"{what}: chunk {index} (bytes {lo}-{lo + n - 1}) checksum mismatch")
                padded = round_up(length, DIRECT_IO_ALIGN_BYTES) if direct else length
                writes.append(self._io.submit(_pwrite_all, fd, data[offset : offset + padded], offset, direct))
            if expected is None:
                meta = ShardMeta(**{**meta.__dict__, "chunk_xxh3_128": tuple(digests)})
                if on_hashed is not None:
                    on_hashed(meta)
            for w in writes:
                w.result()
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            wait(writes)  # never let the caller close the descriptor under a write still running
        return meta

    def try_commit(self, job: str, step: int, world_size: int, run_id: str = "") -> CommitRecord | None:
        """Write the step's commit record if every rank's shard is in, all of one run; return it, or None.

        With a run_id, shards of the step written by another run are stale and removed first.
        """
        with self._step_lock(job, step):
            state = self._commit_state(job, step)
            if isinstance(state, CommitRecord):
                return state
            self._drop_other_runs(job, step, run_id)
        held = self.holdings(job, step)
        record = seal_record(job, step, held, run_id or None, world_size)
        if record is None:
            odd = next((h for h in held if h.world_size != world_size), None)
            if odd is not None:
                raise ShardWriteError(f"{job} step {step}: rank {odd.rank} was saved with world_size {odd.world_size}")
            return None
        return record if self.adopt_commit(record) else None

    def holdings(self, job: str, step: int, node: str = "") -> list[Holding]:
        """Return the readable shard records of a step on this tier (a damaged one is logged and left out).

        Peers ask for these every few seconds, and a record carries the whole tensor
        table: each file is read and parsed once, then known by its identity.
        """
        found = []
        step_dir = self.step_dir(job, step)
        for name in sorted(_names(step_dir)):
            if not (name.startswith("rank-") and name.endswith(".meta.json")):
                continue
            path = step_dir / name
            try:
                st = path.stat()
                identity = (st.st_ino, st.st_size, st.st_mtime_ns)
                cached = self._holdings.get(path)
                if cached is None or cached[0] != identity:
                    cached = (identity, self._read_holding(path, job, step, name))
                    self._holdings[path] = cached
            except FileNotFoundError:
                continue  # replaced or removed since it was listed
            if cached[1] is not None:
                found.append(dataclasses.replace(cached[1], node=node))
        return found

    def _read_holding(self, path: Path, job: str, step: int, name: str) -> Holding | None:
        try:
            raw = path.read_bytes()
            meta = ShardMeta.from_bytes(raw, str(path))
        except (CheckpointError, OSError) as e:
            log.error("ignoring damaged shard record %s: %s", path, e)
            return None
        if (meta.job, meta.step, meta_name(meta.rank)) != (job, step, name):
            log.error("ignoring shard record %s: it describes %s", path, meta_name(meta.rank))
            return None
        tier = "peer" if self.name == "peer" else "nvme"
        return Holding("", tier, job, step, meta.rank, meta.world_size, meta.data_size_bytes, digest(raw), meta.run_id)

    def adopt_commit(self, record: CommitRecord) -> bool:
        """Seal a step with its commit record; return whether the step is complete here with that record.

        Used once the step is complete across the cluster, on every node holding part
        of it. Shards the record does not list (an earlier run's, a stale copy) are
        removed first; the step directory must exist.
        """
        job, step = record.job, record.step
        step_dir = self.step_dir(job, step)
        with self._step_lock(job, step):
            state = self._commit_state(job, step)
            if isinstance(state, CommitRecord):
                if state != record:
                    log.error(
                        "%s step %d on tier %s: kept its commit record over a different one", job, step, self.name
                    )
                return state == record
            if not step_dir.is_dir():
                return False
            for h in self.holdings(job, step):
                if h.rank >= record.world_size or record.shard_meta_xxh3_128[h.rank] != h.meta_digest:
                    log.warning(
                        "%s step %d on tier %s: dropping rank %d's shard, not the committed one",
                        job,
                        step,
                        self.name,
                        h.rank,
                    )
                    (step_dir / meta_name(h.rank)).unlink(missing_ok=True)
                    (step_dir / data_name(h.rank)).unlink(missing_ok=True)
            commit = step_dir / COMMIT_NAME
            if state == "damaged":
                os.replace(commit, step_dir / f"{COMMIT_NAME}.damaged-{uuid.uuid4().hex[:8]}")
                log.warning("%s step %d on tier %s: moved a damaged commit record aside", job, step, self.name)
            temporary = step_dir / f"{COMMIT_NAME}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}"  # never shared by two writers
            write_file_durably(temporary, record.to_bytes())
            os.replace(temporary, commit)
            _fsync_dir(step_dir)
        return True

    def _drop_other_runs(self, job: str, step: int, run_id: str) -> None:
        # Shards left by an earlier run of the job that died before this step was whole:
        # each rank saves the step again in this run, and only then is it sealed.
        if not run_id:
            return
        step_dir = self.step_dir(job, step)
        for path in sorted(step_dir.glob("rank-*.meta.json")):
            try:
                stale = ShardMeta.from_bytes(path.read_bytes(), str(path)).run_id != run_id
            except CorruptCheckpoint:
                stale = True
            digits = path.name.removeprefix("rank-").removesuffix(".meta.json")
            if stale and digits.isdigit():
                rank = int(digits)
                log.warning(
                    "%s step %d on tier %s: dropping rank %d's shard of an earlier run", job, step, self.name, rank
                )
                path.unlink(missing_ok=True)
                (step_dir / data_name(rank)).unlink(missing_ok=True)
        _fsync_dir(step_dir)

    def remove_step(self, job: str, step: int) -> None:
        """Unlist the step (commit record first), then delete its directory."""
        step_dir = self.step_dir(job, step)
        if not step_dir.exists():
            raise NotFound(f"{job} step {step} is not on tier {self.name}")
        doomed = step_dir.parent / f"{DELETING_PREFIX}{step}"
        (step_dir / COMMIT_NAME).unlink(missing_ok=True)
        self._commits.pop(step_dir / COMMIT_NAME, None)
        for path in [p for p in list(self._holdings) if p.parent == step_dir]:
            self._holdings.pop(path, None)
        with self._step_locks_lock:
            self._step_locks.pop((job, step), None)
        os.replace(step_dir, doomed)
        _fsync_dir(step_dir.parent)
        shutil.rmtree(doomed, ignore_errors=True)

    def remove_leftovers(self) -> list[str]:
        """Delete temporary files and half-deleted steps that an interrupted run left; return them."""
        removed: list[str] = []
        for job in self.jobs():
            for name in _names(self.root / job):
                entry = self.root / job / name
                if name.startswith(DELETING_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(str(entry))
                elif name.isdigit():
                    for f in _names(entry):
                        if f.endswith(PARTIAL_SUFFIX):
                            (entry / f).unlink(missing_ok=True)
                            removed.append(str(entry / f))
        return removed


def write_file_durably(path: Path, data: bytes) -> None:
    """Write a small file and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class _DirectIORefused(Exception):
    """The filesystem took O_DIRECT at open but refused a direct write."""


def _open_for_write(path: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _pwrite_all(fd: int, view: memoryview, offset: int, direct: bool) -> None:
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise _DirectIORefused() from e
            raise
        view, offset = view[n:], offset + n


def _names(directory: Path) -> list[str]:
    """List a directory's entries; an unreadable or missing one is logged and counts as empty."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        log.warning("cannot list %s: %s", directory, e)
        return []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
