"""Load errors that say what is wrong and what to do, and map_location in every form, against a real ckptd."""

from __future__ import annotations

import ckpt
import pytest
import torch
from ckpt_core.errors import CheckpointError, InvalidArgument, NotFound
from states import assert_same, every_kind_state

pytestmark = pytest.mark.e2e
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_a_step_that_is_not_complete_names_the_newest_complete_ones(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()  # keep all twelve
    with ckpt.Checkpointer(job="twelve", address=daemon.address) as c:
        for step in range(1, 13):
            c.save_async({"x": torch.full((4,), float(step))}, step=step).wait("nvme", timeout=60)
        newest = r"\(the newest 10 of 12\): 12, 11, 10, 9, 8, 7, 6, 5, 4, 3$"
        with pytest.raises(NotFound, match=rf"twelve step 12345 is not complete on any tier; .*newest first {newest}"):
            c.load(step=12345)
        with pytest.raises(NotFound, match=rf"is not complete on tier nvme; .*{newest}"):
            c.load(step=12345, tier="nvme")
        with pytest.raises(NotFound, match=rf"twelve step 12345 is not complete on any tier; .*{newest}"):
            c.load(step=12345, into={"x": torch.zeros(4)})  # the sharded path asks LocateStep: the same answer
    with ckpt.Checkpointer(job="two", address=daemon.address) as c:
        for step in (1, 5):
            c.save_async({"x": torch.zeros(2)}, step=step).wait("nvme", timeout=60)
        with pytest.raises(NotFound, match=r"two step 3 is not complete on any tier; .*\(all 2\): 5, 1$"):
            c.load(step=3)
    with ckpt.Checkpointer(job="none-yet", address=daemon.address) as c:
        with pytest.raises(NotFound, match="step 7 is not complete on any tier: job none-yet has no complete step"):
            c.load(step=7)
        with pytest.raises(NotFound, match="job none-yet has no complete step on any tier"):
            c.load()


@pytest.mark.s3
def test_the_steps_named_include_those_only_the_object_store_holds(make_daemon, s3_server):
    node = make_daemon(s3_server.toml(f"s3://{s3_server.new_bucket()}/ckpts")).start()
    with ckpt.Checkpointer(job="stored", address=node.address) as c:
        for step in (1, 2):
            c.save_async({"x": torch.zeros(2)}, step=step).wait("object", timeout=60)
    node.lose()  # the store alone holds them: a load asks it for the one step, the error lists it
    node.start()
    with ckpt.Checkpointer(job="stored", address=node.address) as c:
        with pytest.raises(NotFound, match=r"stored step 99 is not complete on any tier; .*\(all 2\): 2, 1$"):
            c.load(step=99)
        with pytest.raises(NotFound, match=r"stored step 99 is not complete on any tier; .*\(all 2\): 2, 1$"):
            c.load(step=99, into={"x": torch.zeros(2)})


def test_a_world_size_mismatch_names_load_into_with_both_sizes(daemon):
    for rank in (0, 1):
        with ckpt.Checkpointer(job="resize", rank=rank, world_size=2, address=daemon.address) as c:
            c.save_async({"x": torch.full((4,), float(rank))}, step=1).wait(timeout=60)
    fewer = ckpt.Checkpointer(job="resize", rank=0, world_size=1, address=daemon.address)
    with fewer, pytest.raises(InvalidArgument, match=r"saved by 2 ranks.*world_size 1.*load\(step=1, into=state\)"):
        fewer.load(1)
    more = ckpt.Checkpointer(job="resize", rank=2, world_size=3, address=daemon.address)
    with more, pytest.raises(NotFound, match=r"has no rank 2: it was saved by 2 ranks.*load\(step=1, into=state\)"):
        more.load(1)
    with ckpt.Checkpointer(job="resize", rank=0, world_size=1, address=daemon.address) as c:  # the fix it names
        assert torch.equal(c.load(1, into={"x": torch.empty(4)})["x"], torch.zeros(4))


@no_cuda
def test_cuda_on_a_cpu_only_torch_is_a_checkpoint_error_before_anything_is_read(daemon):
    with ckpt.Checkpointer(job="nocuda", address=daemon.address) as c:
        c.save_async({"x": torch.ones(3)}, step=1).wait("nvme", timeout=60)
        for step, form in ((1, "cuda"), (1, torch.device("cuda:0")), (99, "cuda:1")):  # 99: the daemon is not asked
            with pytest.raises(CheckpointError, match=r'CUDA is not available here.*pass map_location="cpu"') as e:
                c.load(step, map_location=form)
            assert isinstance(e.value, InvalidArgument)
    with pytest.raises(InvalidArgument, match=r'CUDA is not available here.*pass map_location="cpu"'):
        ckpt.load_local(daemon.root / "nocuda" / "1", map_location="cuda")


def test_map_location_takes_every_form_torch_load_takes(daemon):
    state = every_kind_state()
    with ckpt.Checkpointer(job="forms", address=daemon.address) as c:
        c.save_async(state, step=1).wait("nvme", timeout=60)
        locations = []

        def on_cpu(tensor, location):
            locations.append(location)
            assert tensor.device.type == "cpu"
            return tensor.cpu()

        assert_same(state, c.load(1, map_location=on_cpu))
        assert locations and set(locations) == {"cpu"}  # saved from the CPU: that is the location each one reports
        assert_same(state, c.load(1, map_location={"cuda:0": "cpu"}))  # nothing was saved on cuda:0: no tensor moves
        assert_same(state, c.load(1, map_location=torch.device("cpu")))
        wrongs = ((lambda t, loc: {}[loc], "raised KeyError"), (lambda t, loc: t.reshape(-1)[:0], "must return"))
        for wrong, said in wrongs:
            with pytest.raises(InvalidArgument, match=said):  # the map_location's fault, never a bad copy's
                c.load(1, map_location=wrong)
        moved = c.load(1, map_location={"cpu": "meta"})  # what was saved on the CPU goes to the dict's device
        assert {t.device.type for t in _tensors(moved)} == {"meta"}
    calls = []
    back = ckpt.load_local(daemon.root / "forms" / "1", map_location=lambda t, loc: calls.append(loc))
    assert_same(state, back)  # None: back where it was saved, as torch.load does
    assert calls == locations


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
