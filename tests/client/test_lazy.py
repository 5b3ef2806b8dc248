"""Which arrays of a state an optimizer owns, and the pre-hook that holds a step for them (ckpt.lazy)."""

from __future__ import annotations

import threading
import weakref

import torch
from ckpt import lazy


def test_parameters_states_and_their_views_are_owned_by_the_optimizers_that_hold_them():
    a, b, other = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(8)), torch.zeros(3)
    first, second = torch.optim.SGD([a], lr=0.1, momentum=0.9), torch.optim.AdamW([a, b])
    a.grad, b.grad = torch.ones(4, 4), torch.ones(8)
    first.step()
    second.step()
    moment = second.state[b]["exp_avg"]
    arrays = [a.detach(), a[1], b, moment, other, second.state[b]["step"], torch.empty(0)]
    found = lazy.owners(arrays)
    assert found[0] == found[1] == frozenset({id(first), id(second)})  # a and a view of it
    assert found[2] == found[3] == found[5] == frozenset({id(second)})
    assert 4 not in found and 6 not in found  # a tensor of no optimizer, and no bytes at all


def test_an_array_is_owned_where_any_of_its_bytes_meets_an_optimizers_whether_contiguous_or_strided(monkeypatch):
    buffer = torch.zeros(4, 8)  # an optimizer over views of one buffer, as a flat-parameter wrapper holds them
    middle = torch.nn.Parameter(buffer.view(-1)[12:20])  # from the middle of row 1 into row 2
    optimizer = torch.optim.SGD([middle], lr=0.1)
    monkeypatch.setattr(lazy, "_known", weakref.WeakSet([optimizer]))
    arrays = [
        buffer.view(-1)[:12],  # contiguous, ends where the parameter begins
        buffer.view(-1)[19:],  # contiguous, shares the parameter's last element
        buffer.t(),  # strided, spans the whole buffer
        buffer[:, :2],  # strided: columns 0 and 1 of every row, elements 16 and 17 of the parameter among them
        buffer[0, ::2],  # strided within row 0, before the parameter
        buffer.view(-1)[20:],  # contiguous, right after it
    ]
    assert not arrays[2].is_contiguous() and not arrays[3].is_contiguous() and not arrays[4].is_contiguous()
    assert sorted(lazy.owners(arrays)) == [1, 2, 3]


def test_an_optimizer_not_known_yet_owns_nothing_until_its_first_step(monkeypatch):
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    monkeypatch.setattr(lazy, "_known", weakref.WeakSet([dummy]))  # some optimizer known: no scan of the heap
    late = torch.optim.SGD([torch.nn.Parameter(torch.ones(5))], lr=0.1)
    x = late.param_groups[0]["params"][0]
    assert lazy.owners([x]) == {}  # so it is copied at once: not knowing is safe
    x.grad = torch.ones(5)
    late.step()  # the pre-hook records every optimizer that steps
    assert lazy.owners([x]) == {0: frozenset({id(late)})}


def test_the_first_lazy_save_finds_the_optimizers_on_the_heap(monkeypatch):
    monkeypatch.setattr(lazy, "_known", weakref.WeakSet())
    p = torch.nn.Parameter(torch.ones(2))
    found = torch.optim.SGD([p], lr=0.1)
    assert lazy.owners([p]) == {0: frozenset({id(found)})}


def test_the_pre_hook_holds_a_step_until_the_groups_of_that_optimizer_are_copied():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    held, free = torch.optim.SGD([p], lr=1.0), torch.optim.SGD([q], lr=1.0)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    lazy.install_hook()
    gate = threading.Event()
    copy = lazy.LazyCopy({0: frozenset({id(held)})})
    worker = threading.Thread(target=copy.run, args=(lambda indices: gate.wait(30), lambda: None, lambda: None))
    worker.start()
    free.step()  # owns nothing of this copy: not held
    assert torch.equal(q, torch.zeros(3))
    stepping = threading.Thread(target=held.step)
    stepping.start()
    stepping.join(timeout=0.3)
    assert stepping.is_alive() and torch.equal(p, torch.ones(3))
    gate.set()
    stepping.join(30)
    worker.join(30)
    assert torch.equal(p, torch.zeros(3)) and copy.wait(0)


def test_a_failed_copy_releases_the_slot_frees_the_optimizer_and_reports_the_error():
    released = threading.Event()
    copy = lazy.LazyCopy({0: frozenset({1})})

    def fail(indices):
        raise OSError("the slot went away")

    copy.run(fail, lambda: None, released.set)
    assert released.is_set()
    copy.wait_for(1)  # returns at once
    try:
        copy.wait(0)
    except OSError as e:
        assert "went away" in str(e)
    else:
        raise AssertionError("the error was not reported")
