"""What `ckptd status` prints for people: the table of newest complete steps, sizes, counters."""

from __future__ import annotations

import pytest

from ckptd.operations.status_table import counter_lines, human_age, human_size, newest_steps_table, retention_lines


@pytest.mark.parametrize(
    ("age_s", "said"),
    [
        (0.2, "0 s"),
        (12.9, "12 s"),
        (89, "89 s"),
        (90, "1 min"),
        (3 * 60 + 59, "3 min"),
        (89 * 60, "89 min"),
        (90 * 60, "1 h"),
        (47 * 3600, "47 h"),
        (2 * 86400, "2 d"),
        (40 * 86400, "40 d"),
    ],
)
def test_ages_read_as_people_say_them(age_s, said):
    assert human_age(age_s) == said


def test_one_row_per_job_and_tier_in_aligned_columns():
    newest = {
        "bert": {"nvme": {"step": 5, "completed_unix_s": 1.0, "age_s": 12.0}},
        "llama-7b": {
            "memory": {"step": 1200, "completed_unix_s": 1.0, "age_s": 3.0},
            "object": {"step": 1100, "completed_unix_s": 1.0, "age_s": 200.0},
        },
    }
    assert newest_steps_table(newest) == [
        "JOB       TIER    NEWEST STEP  AGE",
        "bert      nvme              5  12 s",
        "llama-7b  memory         1200  3 s",
        "llama-7b  object         1100  3 min",
    ]


def test_nothing_seen_yet_says_so():
    assert newest_steps_table({}) == ["no complete step seen by this daemon yet"]


@pytest.mark.parametrize(
    ("size_bytes", "said"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (12 << 20, "12.0 MiB"),
        (1098907648, "1.0 GiB"),
        (3 << 40, "3.0 TiB"),
    ],
)
def test_sizes_read_in_binary_units(size_bytes, said):
    assert human_size(size_bytes) == said


def test_counters_show_byte_counts_for_people_and_a_line_per_group_not_a_dict():
    counters = {"saves": 2, "bytes_saved": 1098907648, "verification_failures": {"memory": 0, "nvme": 1}}
    assert counter_lines(counters) == [
        "counters    saves 2, bytes_saved 1.0 GiB",
        "  verification_failures: memory 0, nvme 1",
    ]


def test_a_line_per_job_says_what_retention_keeps_and_where_it_came_from():
    retention = {
        "llama": {
            "keep": {"nvme": 3, "peer": 3, "object": 0},
            "keep_every": 1000,
            "pinned": [1200, 1500],
            "from": {"keep": "client", "keep_every": "config"},
        },
        "small": {
            "keep": {"nvme": 3, "peer": 3, "object": 0},
            "keep_every": 0,
            "pinned": [],
            "from": {"keep": "default", "keep_every": "default"},
        },
    }
    assert retention_lines(retention) == [
        "retention llama: newest nvme 3, peer 3, object all; every multiple of 1000; pinned 1200, 1500 "
        "(keep from client, keep_every from config)",
        "retention small: newest nvme 3, peer 3, object all; no multiples; pinned none "
        "(keep from default, keep_every from default)",
    ]
