"""Pick the keys of a state by glob patterns, and say what a load left: load(into=, keys=, exclude=, strict=).

`ckptd export --include/--exclude` picks with the same KeyFilter.

A key is a path joined with dots, as DCP names a state's entries ("model.layers.0.weight").
A pattern is an fnmatch glob on the whole key (`*` crosses dots: "model.*.weight" matches
"model.layers.0.weight"); a pattern that matches a key picks everything under it too, so
"optimizer" picks "optimizer.state.0.exp_avg" (torchtitan's exclude_from_loading names
top-level keys so). No torch: the daemon's export imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from ckpt_core.errors import InvalidArgument


@dataclass(frozen=True)
class KeyFilter:
    """Which keys a load or an export takes: those include picks (all, when None), less those exclude picks."""

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()

    @classmethod
    def of(cls, include: str | Iterable[str] | None, exclude: str | Iterable[str] | None) -> KeyFilter:
        """Return the filter for the patterns given (a str is one pattern); raise InvalidArgument for a bad one."""
        return cls(None if include is None else _patterns(include, "keys"), _patterns(exclude or (), "exclude"))

    @property
    def takes_all(self) -> bool:
        """Say whether every key is taken (no pattern was given)."""
        return self.include is None and not self.exclude

    def excluded(self, key: str) -> bool:
        """Say whether key, and so everything under it, is left out by exclude."""
        return any(fnmatchcase(key, p) for p in self.exclude)

    def included(self, key: str) -> bool:
        """Say whether include picks key itself, and so everything under it."""
        return self.include is None or any(fnmatchcase(key, p) for p in self.include)

    def takes(self, key: str) -> bool:
        """Say whether a leaf's key is taken: it or a key above it is included, and none of them excluded."""
        above = _prefixes(key)
        return not any(self.excluded(k) for k in above) and any(self.included(k) for k in above)


ALL_KEYS = KeyFilter()


@dataclass(frozen=True)
class LoadReport:
    """What a load(into=...) left as it was: Checkpointer.last_load after each such load.

    missing_keys: keys of `into` the step does not hold (only with strict=False: left as
    they were); unexpected_keys: tensors of the step `into` has no place for (only with
    strict=False: not read). Keys a filter left out are in neither.
    """

    step: int
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _patterns(given: str | Iterable[str], name: str) -> tuple[str, ...]:
    patterns = (given,) if isinstance(given, str) else tuple(given)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise InvalidArgument(f"{name} takes glob patterns on dotted keys (non-empty strings), not {p!r}")
    return patterns
