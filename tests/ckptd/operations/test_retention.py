"""Retention planning: the job's line first (superseded steps go first), the newest N of the line, multiples, pins."""

from ckptd.operations.retention import plan_removals

FIRST = ()  # the job's first line (and every step saved before lines existed)
ROLLBACK_AT_3 = ((3, 1),)  # a rollback that loaded step 3 and saved on from there


def first_line(*steps):
    return dict.fromkeys(steps, FIRST)


def test_keeps_the_newest_complete_steps():
    plan = plan_removals(all_steps=[1, 2, 3, 4, 5], lines=first_line(1, 2, 3, 4, 5), keep=2, busy=set())
    assert [s for s, _ in plan] == [1, 2, 3]


def test_zero_keeps_everything_complete_superseded_too():
    lines = first_line(1, 2, 3, 4) | {5: ROLLBACK_AT_3}
    assert plan_removals(all_steps=[1, 2, 3, 4, 5], lines=lines, keep=0, busy=set()) == []


def test_incomplete_steps_go_once_a_newer_step_is_complete_unless_busy():
    plan = plan_removals(all_steps=[1, 2, 3, 4, 6], lines=first_line(3, 4), keep=0, busy={2})
    assert [s for s, _ in plan] == [1]
    assert "incomplete" in plan[0][1]


def test_incomplete_steps_newer_than_every_complete_step_stay():
    assert plan_removals(all_steps=[3, 4, 5], lines=first_line(3), keep=1, busy=set()) == []


def test_never_removes_the_newest_complete_step():
    assert plan_removals(all_steps=[7], lines=first_line(7), keep=1, busy=set()) == []


def test_a_busy_complete_step_stays_past_the_newest_n():
    plan = plan_removals(all_steps=[1, 2, 3, 4], lines=first_line(1, 2, 3, 4), keep=1, busy={2})
    assert [s for s, _ in plan] == [1, 3]


def test_superseded_steps_go_first_and_keep_counts_the_line_not_the_numbers():
    # Saved 1..6, rolled back to step 3, saved 4' and 5' on the new line: 4 and 6 (and the old 5) are superseded.
    # The numbers' newest 3 would be 4, 5, 6; the line's newest 3 are 3, 4', 5' (the head is 5', of generation 1).
    lines = first_line(1, 2, 3, 6) | {4: ROLLBACK_AT_3, 5: ROLLBACK_AT_3}
    plan = plan_removals(all_steps=[1, 2, 3, 4, 5, 6], lines=lines, keep=3, busy=set())
    assert [s for s, _ in plan] == [6, 1, 2]
    assert plan[0][1] == "superseded: off the job's line (its head is step 5)"
    assert plan[1][1] == "older than the newest 3 complete steps"


def test_the_head_is_never_removed_even_when_a_superseded_step_has_a_higher_number():
    lines = {**first_line(1, 2, 9), 3: ((1, 1),)}  # rolled back to 1; the new line's 3 is the head, 9 is superseded
    plan = plan_removals(all_steps=[1, 2, 3, 9], lines=lines, keep=1, busy=set())
    assert 3 not in [s for s, _ in plan]
    assert [s for s, _ in plan] == [2, 9, 1]  # superseded first (2 and 9 lie past the fork at 1), then the line


def test_keep_every_keeps_the_multiples_of_the_line_and_the_newest_n():
    steps = list(range(500, 4001, 500))  # 500, 1000, ..., 4000
    plan = plan_removals(all_steps=steps, lines=first_line(*steps), keep=3, busy=set(), keep_every=1000)
    assert [s for s, _ in plan] == [500, 1500, 2500]  # kept: 1000, 2000, 3000 (multiples) and 3000, 3500, 4000


def test_keep_every_does_not_keep_superseded_steps():
    lines = first_line(1000, 1500, 2000) | {1600: ((1500, 1),)}  # rolled back to 1500: 2000 is superseded
    plan = plan_removals(all_steps=sorted(lines), lines=lines, keep=1, busy=set(), keep_every=1000)
    assert [s for s, _ in plan] == [2000, 1500]  # 1000 stays (a multiple on the line), the head 1600 stays
    assert plan[0][1].startswith("superseded")


def test_a_pinned_step_stays_whatever_keep_says_superseded_or_not():
    lines = first_line(1, 2, 3, 6) | {4: ROLLBACK_AT_3, 5: ROLLBACK_AT_3}
    plan = plan_removals(all_steps=[1, 2, 3, 4, 5, 6], lines=lines, keep=1, busy=set(), pinned={2, 6})
    assert [s for s, _ in plan] == [1, 3, 4]


def test_a_pinned_incomplete_step_stays():
    plan = plan_removals(all_steps=[1, 2, 3], lines=first_line(3), keep=1, busy=set(), pinned={1})
    assert [s for s, _ in plan] == [2]


def test_busy_superseded_steps_stay():
    lines = first_line(1, 2, 3, 6) | {4: ROLLBACK_AT_3}
    plan = plan_removals(all_steps=[1, 2, 3, 4, 6], lines=lines, keep=2, busy={6, 1})
    assert [s for s, _ in plan] == [2]


def test_no_complete_step_removes_nothing():
    assert plan_removals(all_steps=[1, 2], lines={}, keep=1, busy=set()) == []
