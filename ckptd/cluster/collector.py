"""What a job's coordinator gathered: each node's report of each step, and the step's record once every rank is in.

Used by both cluster views on the event loop: PeersView feeds it Report calls, EtcdView
the reports it reads and watches under its prefix. Pure bookkeeping, no I/O. A report
costs the coordinator work in proportion to its own size: the rules of seal_record run
over the whole step only once its ranks are all held somewhere.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence

from ckpt_core.commit_keys import CommitKeys
from ckpt_core.format import CommitRecord

from ckptd.cluster.placement import Holding, seal_record
from ckptd.errors import MixedLines

STEPS_KEPT = 64  # steps per job whose reports a coordinator keeps (committed or not): the newest


class _StepReports:
    """One step's reports by node, and how many holdings each rank has among them."""

    def __init__(self) -> None:
        self.by_node: dict[str, tuple[Holding, ...]] = {}
        self.per_rank: Counter[int] = Counter()

    def put(self, node: str, held: tuple[Holding, ...]) -> None:
        for h in self.by_node.get(node, ()):
            self.per_rank[h.rank] -= 1
            if not self.per_rank[h.rank]:
                del self.per_rank[h.rank]
        self.by_node[node] = held
        self.per_rank.update(h.rank for h in held)

    def seal(self, job: str, step: int, alive: Collection[str] | None, commit_keys: CommitKeys) -> CommitRecord | None:
        world = next((h.world_size for held in self.by_node.values() for h in held), 0)
        if not world or len(self.per_rank) < world:
            return None  # a rank is held nowhere: no need to weigh the reports
        live = [h for n, held in self.by_node.items() if alive is None or n in alive for h in held]
        try:
            return seal_record(job, step, live, commit_keys=commit_keys)
        except MixedLines:
            return None  # never complete: the nodes that wrote its shards told the ranks waiting on them


class Collector:
    """Gather reports per (job, step) and node; say when a step can be sealed.

    A node's report replaces its earlier one of the same step (it says all it holds).
    Memory is bounded: the newest STEPS_KEPT steps of each job.
    """

    def __init__(self, commit_keys: CommitKeys, steps_kept: int = STEPS_KEPT) -> None:
        """commit_keys: what the records of the steps it seals are signed with (Config.commit_keys)."""
        self.commit_keys = commit_keys
        self.steps_kept = steps_kept
        self._jobs: dict[str, OrderedDict[int, _StepReports]] = {}

    def add(
        self,
        node: str,
        job: str,
        step: int,
        shards: Sequence[Holding],
        alive: Collection[str] | None = None,
        seal: bool = True,
    ) -> CommitRecord | None:
        """Take a node's report of a step; return the step's commit record if every rank is now held somewhere.

        alive: the nodes up now; the copies of the others (gone with their node) do not count.
        seal: False where the step is known committed (the report is kept for holders() only).
        """
        steps = self._jobs.setdefault(job, OrderedDict())
        if step not in steps:
            if len(steps) >= self.steps_kept and step < next(iter(steps)):
                return None  # long superseded
            newest = next(reversed(steps), None)
            steps[step] = _StepReports()
            if newest is not None and step < newest:  # came late: keep the steps in order
                self._jobs[job] = steps = OrderedDict(sorted(steps.items()))
            while len(steps) > self.steps_kept:
                steps.popitem(last=False)
        steps[step].put(node, tuple(h for h in shards if (h.job, h.step, h.node) == (job, step, node)))
        return steps[step].seal(job, step, alive, self.commit_keys) if seal else None

    def seal_again(self, job: str, alive: Collection[str]) -> list[CommitRecord]:
        """Return the records of the job's steps that the reports complete among the nodes alive now."""
        found = []
        for step, reports in self._jobs.get(job, {}).items():
            record = reports.seal(job, step, alive, self.commit_keys)
            if record is not None:
                found.append(record)
        return found

    def reported(self, job: str, step: int) -> dict[str, tuple[Holding, ...]]:
        """Return {node: its holdings} of a step, as reported."""
        reports = self._jobs[job].get(step) if job in self._jobs else None
        return dict(reports.by_node) if reports is not None else {}

    def holders(self, job: str, step: int, rank: int) -> list[Holding]:
        """Return every reported holding of a rank's shard of a step."""
        return [h for held in self.reported(job, step).values() for h in held if h.rank == rank]

    def jobs(self) -> list[str]:
        return list(self._jobs)

    def steps(self, job: str) -> list[int]:
        """Return the steps of a job with reports, oldest first."""
        return list(self._jobs.get(job, {}))

    def drop(self, job: str, step: int) -> None:
        if job in self._jobs:
            self._jobs[job].pop(step, None)

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)
