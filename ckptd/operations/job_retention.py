"""Each job's retention on this node: what its client asked for, its pins, and what applies (client, config, default).

A job's settings come from three places, the first that sets a value winning: its
client (`Checkpointer(keep=, keep_every=)`, sent on every Reserve: one that sends neither takes
the job back to the config's; a Reserve with no retention at all, from an older client, changes
nothing), its config table (`[retention.jobs.<job>]`), then `[retention]`. `keep` applies to NVMe and the replica
store; the object store keeps `[retention] object`. A pinned step (`ckptd pin`) is never
removed by retention, on any tier of this node.

Persisted per job in a sealed record (ckpt_core.format.seal), `<node root>/.ckptd-jobs/<job>.json`,
so that a restarted daemon honours the pins and the client's settings before the client
saves again. The directory's name starts with a dot: it is never taken for a job (job
names start with a letter or digit, ckpt_core.format.JOB_RE), nor listed by any tier.

Who calls what: Node calls load() once at start, on a worker thread, before any RPC.
On the event loop: the Reserve handler (through SavePath.reserve_for) calls client_asked(); the
retention runner calls effective() and pinned() during its passes and set_pin() for
`ckptd pin`/`unpin` and `ckptd rm`; the Locator's listings call pinned() to mark pins; JobRemoval
calls forget() (`gc --job J --all`); the status report calls describe(). The record is
written on the save threads (a small file, fsync'd), only when it changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_core.errors import CheckpointError, InvalidArgument
from ckpt_core.format import JOB_RE, seal, unseal, validate_job

from ckptd.config import Config
from ckptd.storage.durable_write import fsync_dir, make_dirs, replace_file

log = logging.getLogger(__name__)

JOBS_DIR_NAME = ".ckptd-jobs"  # under the node root
RECORD_FORMAT = "ckptd-job-retention"
RECORD_VERSION = 1
KEPT_TIERS = ("nvme", "peer", "object")


@dataclass(frozen=True)
class ClientRetention:
    """What a job's client asked for (Checkpointer keep=, keep_every=); None: not asked, the config's applies."""

    keep: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidArgument(f"retention {name} must be 0 or a positive integer, not {value!r}")


@dataclass(frozen=True)
class EffectiveRetention:
    """What retention keeps of one job on this node."""

    keep: dict[str, int]  # by tier (nvme, peer, object): the newest complete steps of the line; 0 = all
    keep_every: int  # also the steps of the line that are multiples of it; 0 = none
    pinned: frozenset[int]  # never removed by retention
    source: dict[str, str]  # "keep", "keep_every" -> "client", "config" or "default"

    def to_json(self) -> dict[str, Any]:
        """Return the job's entry of the status document's "retention" object."""
        return {
            "keep": dict(self.keep),
            "keep_every": self.keep_every,
            "pinned": sorted(self.pinned),
            "from": dict(self.source),
        }


@dataclass
class _JobRecord:
    client: ClientRetention = field(default_factory=ClientRetention)
    pinned: frozenset[int] = frozenset()
    version: int = 0  # bumped at each change: a slower write of an older version never lands over a newer one

    def to_bytes(self, job: str) -> bytes:
        return seal(
            {
                "format": RECORD_FORMAT,
                "version": RECORD_VERSION,
                "job": job,
                "keep": self.client.keep,
                "keep_every": self.client.keep_every,
                "pinned": sorted(self.pinned),
            },
            compact=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> _JobRecord:
        r = unseal(data, what)
        try:
            if r["format"] != RECORD_FORMAT or r["version"] != RECORD_VERSION:
                raise CheckpointError(f"{what}: not a job retention record of version {RECORD_VERSION}")
            pinned = r["pinned"]
            if not isinstance(pinned, list) or not all(type(s) is int and s >= 0 for s in pinned):
                raise CheckpointError(f"{what}: pinned is not a list of steps")
            return cls(ClientRetention(r["keep"], r["keep_every"]), frozenset(pinned))
        except (KeyError, TypeError, InvalidArgument) as e:
            raise CheckpointError(f"{what}: malformed job retention record ({e})") from None


class JobRetention:
    """Keep each job's retention settings and pins on this node, persisted under the node root."""

    def __init__(self, config: Config, threads: Executor) -> None:
        """threads: where the records are written (Executors.save: small writes, awaited by the Reserve
        that changes them)."""
        self.config = config
        self.directory = config.root / JOBS_DIR_NAME
        self._threads = threads
        self._records: dict[str, _JobRecord] = {}
        self._written: dict[str, int] = {}  # job -> the version on disk (under _write_lock)
        self._write_lock = threading.Lock()

    def load(self) -> None:
        """Read every job's record (a worker thread, at start); a damaged one is logged and left where it is."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in sorted(names):
            job = name.removesuffix(".json")
            if not name.endswith(".json") or not JOB_RE.fullmatch(job):
                continue
            path = self.directory / name
            try:
                self._records[job] = _JobRecord.from_bytes(path.read_bytes(), str(path))
            except (CheckpointError, OSError) as e:
                log.error("ignoring the retention record of job %s (its pins and client settings are lost): %s", job, e)

    # -- queries (any thread; the event loop changes the records) ----------------------------

    def jobs(self) -> list[str]:
        """Return the jobs with a client setting or a pin here."""
        return sorted(self._records)

    def pinned(self, job: str) -> frozenset[int]:
        """Return the job's pinned steps."""
        record = self._records.get(job)
        return record.pinned if record else frozenset()

    def effective(self, job: str) -> EffectiveRetention:
        """Return what retention keeps of a job: the client's settings, else its config table's, else [retention]'s."""
        r = self.config.retention
        client = self._records.get(job, _JobRecord()).client
        table = r.jobs.get(job)
        keep_source, keep_every_source = "default", "default"
        keep_nvme, keep_peer, keep_every = r.nvme, r.peer, r.keep_every
        if client.keep is not None:
            keep_nvme = keep_peer = client.keep
            keep_source = "client"
        elif table is not None and table.keep is not None:
            keep_nvme = keep_peer = table.keep
            keep_source = "config"
        if client.keep_every is not None:
            keep_every, keep_every_source = client.keep_every, "client"
        elif table is not None and table.keep_every is not None:
            keep_every, keep_every_source = table.keep_every, "config"
        return EffectiveRetention(
            {"nvme": keep_nvme, "peer": keep_peer, "object": r.object},
            keep_every,
            self.pinned(job),
            {"keep": keep_source, "keep_every": keep_every_source},
        )

    def describe(self, jobs: list[str]) -> dict[str, dict[str, Any]]:
        """Return the status document's "retention" object: jobs given, with a setting, a pin or a config table."""
        every = set(jobs) | set(self._records) | set(self.config.retention.jobs)
        return {job: self.effective(job).to_json() for job in sorted(every)}

    # -- changes (event loop) --------------------------------------------------------------------

    async def client_asked(self, job: str, asked: ClientRetention) -> None:
        """Take a job's client's settings (each Reserve that carries them); written only when they change."""
        record = self._records.get(job, _JobRecord())
        if record.client == asked:
            return
        await self._change(job, replace(record, client=asked))
        # Debug only: a caller could flood the log by asking otherwise at every save; `ckptd status` shows it.
        log.debug("job %s asks for retention keep=%s keep_every=%s", job, asked.keep, asked.keep_every)

    async def set_pin(self, job: str, step: int, pinned: bool) -> frozenset[int]:
        """Pin a step (never removed by retention) or unpin it; return the job's pinned steps now."""
        record = self._records.get(validate_job(job), _JobRecord())
        steps = record.pinned | {step} if pinned else record.pinned - {step}
        if steps != record.pinned:
            await self._change(job, replace(record, pinned=steps))
        return steps

    async def forget(self, job: str) -> None:
        """Drop a removed job's record (`ckptd gc --job J --all`)."""
        if self._records.pop(job, None) is not None:
            await asyncio.get_running_loop().run_in_executor(self._threads, self._remove, job)

    async def _change(self, job: str, record: _JobRecord) -> None:
        record.version = self._records.get(job, _JobRecord()).version + 1
        self._records[job] = record  # at once: a pass that runs meanwhile already honours it
        data = record.to_bytes(job)
        await asyncio.get_running_loop().run_in_executor(self._threads, self._write, job, record.version, data)

    # -- the records on disk (worker threads) ------------------------------------------------------

    def _path(self, job: str) -> Path:
        return self.directory / f"{job}.json"

    def _write(self, job: str, version: int, data: bytes) -> None:
        with self._write_lock:
            if self._written.get(job, 0) > version:
                return  # a newer version is there already
            make_dirs(self.directory)
            replace_file(self._path(job), data)
            self._written[job] = version

    def _remove(self, job: str) -> None:
        with self._write_lock:
            self._written.pop(job, None)
            with contextlib.suppress(FileNotFoundError):
                self._path(job).unlink()
                fsync_dir(self.directory)
