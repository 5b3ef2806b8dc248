"""The commit protocol: the one order in which a step becomes complete on any tier (docs/FORMAT.md).

In a directory (NVMe, the replica store, a restore target), for one step:

    1. begin()                         the step directory exists, and is durable in its parent
                                       (a copy that fails before its shard is in: remove_if_empty())
    2. per shard, in any order:
       a. its data is written under temporary(data_name) and fsynced (durable_write.RangeWriter)
       b. install_shard()              its record is written under a temporary name and fsynced;
                                       the data is renamed into place, then the record (the shard
                                       counts from here on), and the directory is fsynced
    3. write_index()                   where every rank's record is here and some are sharded: INDEX.json
    4. write_commit()                  last, once every rank's shard is in: COMMIT.json the same way

In an object store (the uploader, through the object tier's ShardWrite), for one step:

    1. per shard, in the rank's own directory (under a hash prefix: docs/FORMAT.md):
       a. begin_shard()                its older record goes (that copy stops counting), then the
                                       objects of the data format not written this time
       b. open_data()                  its data object is written part by part (store.open_parts:
                                       a multipart upload is atomic), and finished
       c. install_shard()              the small objects that go with the data (a frame index), then
                                       its record: the shard counts from here on
    2. put_index()                     where some records are sharded: INDEX.json, in the step's directory
    3. write_commit()                  last, create-only, there too: a commit record already there is
                                       never replaced

A crash at any point leaves only temporary names (removed at start-up) or a step
with no commit record (never listed). The tiers own the locks and the checks
around these calls; calls block, so they are made from worker threads.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

from ckpt_core.errors import CheckpointError
from ckpt_core.format import COMMIT_NAME, INDEX_NAME, PARTIAL_SUFFIX, CommitRecord, ShardMeta, data_name, meta_name
from ckpt_core.step_index import SHARDED_RECORD_MARK, index_bytes

from ckptd.storage.durable_write import fsync_dir, make_dirs, write_file
from ckptd.storage.object_store import ObjectParts, ObjectStore
from ckptd.storage.owned_dir import FILE_MODE, create_new

log = logging.getLogger(__name__)


class StepDirCommit:
    """Make one step directory complete, shard by shard, commit record last."""

    def __init__(self, step_dir: Path) -> None:
        self.step_dir = step_dir

    def begin(self) -> None:
        """Create the step directory (and its job directory), each durable in its parent."""
        if not self.step_dir.is_dir():
            make_dirs(self.step_dir)

    def remove_if_empty(self) -> bool:
        """Remove the step directory if nothing is in it (what a failed copy leaves); return whether it went.

        The caller holds the step's lock, under which every copy creates its temporary file
        (create_temporary): a directory with a shard, a commit record or a copy under way stays.
        """
        try:
            self.step_dir.rmdir()
        except OSError:  # not empty, or gone already
            return False
        return True

    def temporary(self, name: str, transfer: str = "") -> Path:
        """Name a temporary file for name in the step directory (start-up removes what a crash leaves)."""
        return self.step_dir / f"{name}.{transfer or uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"

    def create_temporary(self, name: str, transfer: str = "") -> Path:
        """Create an empty temporary file for name (see temporary()): from here on the directory is not empty."""
        path = self.temporary(name, transfer)
        os.close(create_new(path, FILE_MODE))
        return path

    def install_shard(
        self, rank: int, data_temporary: Path, record: bytes, guard: AbstractContextManager[None]
    ) -> None:
        """Make a written and fsynced data file rank's shard: the data goes in first, its record last.

        The renames happen inside guard: the caller's lock, and its last checks.
        """
        record_temporary = self.temporary(meta_name(rank))
        try:
            write_file(record_temporary, [record])
            with guard:
                os.replace(data_temporary, self.step_dir / data_name(rank))
                os.replace(record_temporary, self.step_dir / meta_name(rank))  # the shard counts from here on
                fsync_dir(self.step_dir)
        finally:
            record_temporary.unlink(missing_ok=True)

    def write_index(self, record: CommitRecord) -> None:
        """Write the step's index (docs/FORMAT.md) from its records here, before its commit record.

        Only where some record is sharded. An index that cannot be built is logged, not
        written: loads build it from the records, and say what is wrong with them.
        """

        try:
            raw = [(self.step_dir / meta_name(rank)).read_bytes() for rank in range(record.world_size)]
            if not any(SHARDED_RECORD_MARK in r for r in raw):
                return  # a plain step: no layout parsed at every commit
            metas = [ShardMeta.from_bytes(r, f"{self.step_dir} rank {rank}") for rank, r in enumerate(raw)]
            index = index_bytes(record, metas.__getitem__)
        except (CheckpointError, OSError) as e:
            log.error("%s step %d: no index written in %s: %s", record.job, record.step, self.step_dir, e)
            return
        if index is not None:
            self._write_whole(INDEX_NAME, index)

    def write_commit(self, record: bytes) -> None:
        """Write the step's commit record, last: from here on the step is complete."""
        self._write_whole(COMMIT_NAME, record)

    def _write_whole(self, name: str, data: bytes) -> None:
        temporary = self.temporary(name, uuid.uuid4().hex)  # never shared by two writers
        try:
            write_file(temporary, [data])
            os.replace(temporary, self.step_dir / name)
            fsync_dir(self.step_dir)
        finally:
            temporary.unlink(missing_ok=True)


class ObjectStepCommit:
    """Make one step complete in an object store: each shard's data objects, then its record, then the commit."""

    def __init__(self, store: ObjectStore, job: str, step: int) -> None:
        self.store = store
        self.names = (job, str(step))

    def begin_shard(self, rank: int, directory: tuple[str, ...], stale_names: Iterable[str]) -> None:
        """Make rank's older copy in directory stop counting before its data changes, then remove stale_names."""
        self.store.remove(*directory, meta_name(rank))
        for name in stale_names:  # one data format per shard: a reader takes either
            self.store.remove(*directory, name)

    def open_data(self, directory: tuple[str, ...], name: str) -> ObjectParts:
        """Begin writing a data object of a shard; the caller finishes it (or aborts it) before install_shard."""
        return self.store.open_parts(*directory, name)

    def install_shard(
        self, rank: int, directory: tuple[str, ...], record: bytes, beside: Iterable[tuple[str, bytes]] = ()
    ) -> None:
        """Upload what goes with a finished data object (beside: (name, bytes) each), then rank's record, last."""
        for name, data in beside:
            self.store.put(data, *directory, name)
        self.store.put(record, *directory, meta_name(rank))  # the shard counts from here on

    def put_index(self, index: bytes) -> None:
        """Upload the step's index (docs/FORMAT.md), before its commit record."""
        self.store.put(index, *self.names, INDEX_NAME)

    def write_commit(self, record: bytes) -> bool:
        """Write the step's commit record create-only, last; return False if one was there already."""
        return bool(self.store.create(record, *self.names, COMMIT_NAME))
