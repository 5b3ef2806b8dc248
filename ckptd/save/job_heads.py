"""Each job's head on this node's durable tiers: its newest complete step of its newest line, kept, not re-read.

SavePath alone changes what its tiers hold complete, and tells JobHeads (on the event loop):
sealed() after each seal or adoption, released() after each removal. line_for() asks head()
on a save thread at every Reserve: the first ask for a job lists its complete records (one
read per complete step, as once at start), every later one answers from memory. A listing
that a seal or a removal of the job overtook is not kept (the next ask lists again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckpt_core.format import CommitRecord
from ckpt_core.history import generation


def newer(a: CommitRecord | None, b: CommitRecord | None) -> CommitRecord | None:
    """Return the record that heads a job's history of the two (the newest line, then the newest step)."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda r: (generation(r.line), r.step))


class JobHeads:
    """Keep each job's head record on this node's durable tiers, listed once per job and updated by SavePath."""

    def __init__(self, list_records: Callable[[str], dict[int, CommitRecord]]) -> None:
        """list_records(job): every complete record of the job on the durable tiers (reads the disk; a save thread)."""
        self._list_records = list_records
        self._lock = threading.Lock()  # head() runs on save threads, sealed() and released() on the event loop
        self._heads: dict[str, CommitRecord | None] = {}  # job -> its head (None: no complete step), once listed
        self._changes: dict[str, int] = {}  # job -> seals and removals seen, to tell a listing they overtook

    def head(self, job: str) -> CommitRecord | None:
        """Return the job's head record on the durable tiers, listing them only the first time (a save thread)."""
        with self._lock:
            if job in self._heads:
                return self._heads[job]
            before = self._changes.get(job, 0)
        records = self._list_records(job)
        head = None
        for record in records.values():
            head = newer(head, record)
        with self._lock:
            if self._changes.get(job, 0) == before:
                self._heads[job] = head
        return head

    def sealed(self, record: CommitRecord) -> None:
        """Count a step sealed or adopted on a durable tier here (the event loop)."""
        with self._lock:
            self._changes[record.job] = self._changes.get(record.job, 0) + 1
            if record.job in self._heads:
                self._heads[record.job] = newer(self._heads[record.job], record)

    def released(self, job: str, step: int) -> None:
        """Count a step removed from a durable tier here: the head's removal lists the job again (the event loop)."""
        with self._lock:
            self._changes[job] = self._changes.get(job, 0) + 1
            head = self._heads.get(job)
            if head is not None and head.step == step:
                del self._heads[job]
