"""Retention planning: keep the newest N complete steps, drop abandoned partial ones."""

from ckptd.operations.retention import plan_removals


def test_keeps_the_newest_complete_steps():
    plan = plan_removals(all_steps=[1, 2, 3, 4, 5], complete_steps=[1, 2, 3, 4, 5], keep=2, busy=set())
    assert [s for s, _ in plan] == [1, 2, 3]


def test_zero_keeps_everything_complete():
    assert plan_removals(all_steps=[1, 2], complete_steps=[1, 2], keep=0, busy=set()) == []


def test_incomplete_steps_go_once_a_newer_step_is_complete_unless_busy():
    plan = plan_removals(all_steps=[1, 2, 3, 4, 6], complete_steps=[3, 4], keep=0, busy={2})
    assert [s for s, _ in plan] == [1]
    assert "incomplete" in plan[0][1]


def test_incomplete_steps_newer_than_every_complete_step_stay():
    assert plan_removals(all_steps=[3, 4, 5], complete_steps=[3], keep=1, busy=set()) == []


def test_never_removes_the_newest_complete_step():
    plan = plan_removals(all_steps=[7], complete_steps=[7], keep=1, busy=set())
    assert plan == []


def test_a_busy_complete_step_stays_past_the_newest_n():
    plan = plan_removals(all_steps=[1, 2, 3, 4], complete_steps=[1, 2, 3, 4], keep=1, busy={2})
    assert [s for s, _ in plan] == [1, 3]
