"""KeyFilter: glob patterns on dotted keys, a matched key taking everything under it."""

from __future__ import annotations

import pytest
from ckpt import InvalidArgument
from ckpt.key_filter import KeyFilter


def test_no_pattern_takes_every_key():
    keys = KeyFilter.of(None, None)
    assert keys.takes_all and keys.takes("model.w") and keys.takes("")


def test_a_matched_key_takes_everything_under_it_and_exclude_wins():
    keys = KeyFilter.of(["model", "extra.*.w"], "model.head*")
    assert keys.takes("model.layers.0.weight")
    assert keys.takes("extra.a.b.w")  # `*` crosses dots
    assert not keys.takes("model.head.weight") and not keys.takes("model.head")
    assert not keys.takes("optimizer.state.0.exp_avg") and not keys.takes("models.x")


def test_exclude_alone_leaves_out_a_top_level_key_and_its_subtree():
    keys = KeyFilter.of(None, ["optimizer", "lr_scheduler"])
    assert not keys.takes_all
    assert keys.takes("model.w") and not keys.takes("optimizer.state.0.step") and not keys.takes("lr_scheduler")


@pytest.mark.parametrize("bad", [[""], [3], ["a", None]])
def test_a_pattern_that_is_not_a_non_empty_string_is_refused(bad):
    with pytest.raises(InvalidArgument, match="glob patterns on dotted keys"):
        KeyFilter.of(bad, None)
