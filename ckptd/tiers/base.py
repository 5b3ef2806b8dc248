"""The interface every tier offers to the pipeline, retention and the CLI."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ckpt.format import CommitRecord
from ckpt.shard_io import ShardSource


class Tier(ABC):
    """Hold complete steps of jobs, each readable shard by shard.

    The pipeline writes into a tier from its worker threads; listing and reading
    may come from any thread. A step is listed only once it is complete: every
    rank's shard is there, checked, and (for durable tiers) its commit record
    written last.
    """

    name: str

    @abstractmethod
    def jobs(self) -> list[str]:
        """Return the jobs with at least one step on this tier."""

    @abstractmethod
    def complete_steps(self, job: str) -> list[int]:
        """Return the job's complete steps, oldest first."""

    @abstractmethod
    def commit_record(self, job: str, step: int) -> CommitRecord:
        """Return a complete step's commit record; raise NotFound if it is not complete."""

    @abstractmethod
    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        """Say where a rank's shard of a complete step can be read."""
