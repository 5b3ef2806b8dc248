"""Refusals a caller can repeat at will reach the log at most once a minute per caller and kind."""

from __future__ import annotations

import logging

from ckptd.rpc.guard import RequestGuard


class Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_refusal_asked_for_again_and_again_is_logged_once_a_minute_per_caller_and_kind(caplog):
    guard = RequestGuard()
    with caplog.at_level(logging.WARNING, logger="ckptd.rpc.guard"):
        for port in range(1000):  # a caller reconnecting is the same caller
            guard.note(Context(f"ipv4:10.0.0.1:{port}"), "skipped", "skipped j step 1: already complete")  # type: ignore[arg-type]
        guard.note(Context("ipv4:10.0.0.2:1"), "skipped", "skipped j step 1: already complete")  # type: ignore[arg-type]
        guard.note(Context("ipv4:10.0.0.1:1"), "other", "another kind of refusal")  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("skipped j step 1: already complete (from ipv4:10.0.0.1; more within 60 s")
