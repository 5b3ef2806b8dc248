"""A job's history: its steps form a line, and a rollback starts a new one (torch-free; client and daemon).

A step's record names its line (docs/FORMAT.md): the forks that led to it, each a
(base step, generation) pair, oldest first. A job's first run is the line of no forks
(generation 0). A rank that loads a step older than the job's head and saves after it
forks a new line from that step, of the next generation: every step of the older lines
newer than the fork is then *superseded*. The head is the newest step of the newest
line; the steps that lead to it form the job's line, and every other complete step is
superseded: never latest, loaded only by number, removed by retention first.

Who calls what: the daemon builds a History from the lines of a job's complete steps
(its Locator for latest and ls, its SavePath before a reserve, its retention); the
client only carries the line it was handed (ckpt.save_path, between a load and its saves).
Pure functions of the records: the same records give the same answer on every node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_core.errors import CorruptCheckpoint

Fork = tuple[int, int]  # (the step the line continues from, the line's generation)
Line = tuple[Fork, ...]  # oldest fork first; () is the job's first line


def generation(line: Line) -> int:
    """Return a line's generation: a later rollback's line has a higher one."""
    return line[-1][1] if line else 0


def leads_to(step: int, line: Line, head_line: Line) -> bool:
    """Say whether a step of line is on head_line: a step of it, or one it continues from."""
    n = len(line)
    if head_line[:n] != line:
        return False
    return n == len(head_line) or step <= head_line[n][0]


def line_text(line: Line) -> str:
    """Return a line as canonical JSON text ("" the first line), as the wire and shard holdings carry it."""
    return json.dumps(line_to_json(line), separators=(",", ":")) if line else ""


def line_from_text(text: str, what: str) -> Line:
    """Parse line_text's form, raising CorruptCheckpoint if it is not a line."""
    if not text:
        return ()
    try:
        value = json.loads(text)
    except ValueError as e:
        raise CorruptCheckpoint(f"{what}: malformed line {text[:80]!r} ({e})") from None
    return line_from_json(value, what)


def line_to_json(line: Line) -> list[list[int]]:
    """Return a line as records hold it: [[base step, generation], ...]."""
    return [[base, gen] for base, gen in line]


def line_from_json(value: Any, what: str) -> Line:
    """Parse a record's line, raising CorruptCheckpoint if it is not one (bases and generations increase)."""
    try:
        line = tuple((base, gen) for base, gen in value)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"{what}: malformed line {value!r} ({e})") from None
    previous: Fork = (-1, 0)
    for fork in line:
        if not all(type(x) is int for x in fork) or fork[0] <= previous[0] or fork[1] <= previous[1]:
            raise CorruptCheckpoint(f"{what}: malformed line {value!r}: bases and generations must increase")
        previous = fork
    return line


@dataclass(frozen=True)
class History:
    """A job's complete steps in the order of its line: the head, the steps leading to it, the superseded."""

    head: int | None  # the newest step of the newest line; None: no complete step
    head_line: Line
    in_line: tuple[int, ...]  # the steps on the head's line, oldest first (the head last)
    superseded: tuple[int, ...]  # every other complete step, oldest first
    next_generation: int  # the generation a rollback's new line gets

    @classmethod
    def of(cls, lines: Mapping[int, Line]) -> History:
        """Order a job's complete steps, given each one's line."""
        if not lines:
            return cls(None, (), (), (), 1)
        head = max(lines, key=lambda s: (generation(lines[s]), s))
        head_line = lines[head]
        on = sorted(s for s, line in lines.items() if leads_to(s, line, head_line))
        off = sorted(s for s in lines if s not in set(on))
        return cls(head, head_line, tuple(on), tuple(off), 1 + generation(head_line))

    def line_after_load(self, step: int, line: Line) -> Line:
        """Return the line a rank's saves continue after it loaded step (of line): the head's, or a new one."""
        if step == self.head:
            return line
        return (*line, (step, self.next_generation))

    def is_superseded(self, step: int) -> bool:
        """Say whether a complete step is off the job's line."""
        return step in self.superseded
