"""A repeated line reaches the log once a period per key, and the keys remembered are bounded."""

from __future__ import annotations

from ckptd.log_pace import LogPace


def test_a_key_is_due_once_a_period_and_the_keys_remembered_are_bounded(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("ckptd.log_pace.time.monotonic", lambda: now[0])
    pace = LogPace(every_s=60.0, max_keys=3)
    assert pace.due("a") and not pace.due("a")
    now[0] += 59.0
    assert not pace.due("a")
    now[0] += 1.0
    assert pace.due("a")
    for key in range(10):  # many callers: the oldest are forgotten, never more than max_keys kept
        assert pace.due(key)
    assert len(pace) == 3
    assert pace.due("a")  # forgotten, so due again
