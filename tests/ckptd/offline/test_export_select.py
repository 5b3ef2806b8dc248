"""select_keys: what `ckptd export --include/--exclude/--strip-prefix` keeps of a state, with no torch needed."""

from __future__ import annotations

import pytest
from ckpt import InvalidArgument
from ckpt.key_filter import KeyFilter

from ckptd.offline.export import _prefix_path, select_keys


def state() -> dict:
    return {
        "model": {"up": {"weight": "W", "bias": "b"}, "head": {"weight": "H"}},
        "optim": {"state": {"0": {"exp_avg": "E"}}, "param_groups": [{"lr": 0.1, "params": ["up.weight"]}]},
        "step": 5,
    }


def test_no_flag_keeps_the_state_as_it_is():
    s = state()
    assert select_keys(s, KeyFilter(), (), "j step 1") is s


def test_include_and_exclude_keep_the_keys_taken_and_lists_whole():
    picked = select_keys(state(), KeyFilter.of(["model", "optim.param_groups.0.lr"], "*.bias"), (), "j step 1")
    assert picked == {
        "model": {"up": {"weight": "W"}, "head": {"weight": "H"}},
        "optim": {"param_groups": [{"lr": 0.1, "params": ["up.weight"]}]},  # a list is kept whole
    }
    assert select_keys(state(), KeyFilter.of(None, ["optim", "step"]), (), "j")["model"] == state()["model"]


def test_strip_prefix_lifts_the_entries_under_it_and_keeps_the_others():
    s = state()
    picked = select_keys(s, KeyFilter.of("model", None), _prefix_path("model."), "j step 1")
    assert picked == {"up": {"weight": "W", "bias": "b"}, "head": {"weight": "H"}}
    assert s == state()  # the state read is not changed
    deeper = select_keys(state(), KeyFilter(), _prefix_path("model.up"), "j step 1")
    assert deeper["weight"] == "W" and deeper["model"] == {"head": {"weight": "H"}} and deeper["step"] == 5


@pytest.mark.parametrize(
    "include, exclude, prefix, message",
    [
        (["nothing*"], None, None, "leave no key of j step 1"),
        (None, None, "model.up.weight", r"--strip-prefix model.up.weight.: no dict of j step 1"),
        (None, None, "missing", "no dict of j step 1"),
        (["model.up", "step"], None, "model.up", "'step' is both a key of j step 1 and one under the prefix"),
    ],
)
def test_what_cannot_be_done_is_named(include, exclude, prefix, message):
    s = state()
    s["model"]["up"]["step"] = 1
    with pytest.raises(InvalidArgument, match=message):
        select_keys(s, KeyFilter.of(include, exclude), _prefix_path(prefix), "j step 1")


def test_a_bad_prefix_or_a_state_that_is_no_dict_is_refused():
    with pytest.raises(InvalidArgument, match="give a dotted key"):
        _prefix_path("model..up")
    with pytest.raises(InvalidArgument, match="holds a list: --include, --exclude and --strip-prefix need a dict"):
        select_keys([1], KeyFilter.of("0", None), (), "j step 1")
