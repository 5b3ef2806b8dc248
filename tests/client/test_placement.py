"""map_location in every form torch.load takes, applied to a shard's layout (ckpt.placement), with no daemon."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ckpt.flatten import flatten, unflatten
from ckpt.placement import Placement
from ckpt.staging import copy_into
from ckpt_core.errors import CheckpointError, InvalidArgument

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _saved(state, device_of=None):
    """Return (layout, data) of state as a save writes them; device_of: {tensor index: the device it was saved from}."""
    flat = flatten(state)
    buffer = torch.zeros(flat.data_size_bytes, dtype=torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        copy_into(flat, buffer, pool, threads=1)
    layout = flat.layout()
    for i, device in (device_of or {}).items():  # as a save of CUDA tensors records them (see test_gpu_path)
        layout["tensors"][i]["device"] = device
    return layout, buffer.numpy()


def test_a_cpu_tensor_records_no_device_and_loads_where_map_location_says():
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 3}
    layout, data = _saved(state)
    assert all("device" not in e for e in layout["tensors"])  # the layout of a CPU save is as it was
    for form in ("cpu", torch.device("cpu"), b"cpu", None, {"cuda:0": "cpu"}):
        back = unflatten(layout, data, Placement.of(form))
        assert back["w"].device.type == "cpu" and torch.equal(back["w"], state["w"]), form
    assert unflatten(layout, data, Placement.of({"cpu": "meta"}))["w"].device.type == "meta"
    assert unflatten(layout, data, Placement.of(torch.device("meta")))["w"].device.type == "meta"


def test_a_dict_maps_the_saved_location_and_leaves_the_others_where_they_were_saved():
    state = {"gpu": torch.ones(3), "host": torch.zeros(2), "again": None}
    state["again"] = state["gpu"]  # one tensor twice: mapped once, one object
    layout, data = _saved(state, {0: "cuda:0"})
    back = unflatten(layout, data, Placement.of({"cuda:0": "cpu", "cuda:1": "meta"}))
    assert back["gpu"].device.type == "cpu" and torch.equal(back["gpu"], torch.ones(3))
    assert back["again"] is back["gpu"] and back["host"].device.type == "cpu"
    moved = unflatten(layout, data, Placement.of({"cuda:0": torch.device("meta")}))
    assert moved["gpu"].device.type == "meta" and moved["host"].device.type == "cpu"


def test_a_callable_is_called_once_per_tensor_with_its_saved_location():
    param = torch.nn.Parameter(torch.full((2, 2), 7.0))
    state = {"gpu": torch.ones(3), "host": torch.arange(4), "param": param, "same": param}
    layout, data = _saved(state, {0: "cuda:0", 2: "cuda:1"})
    seen = []

    def to_cpu(tensor, location):
        seen.append((location, tensor.device.type, tuple(tensor.shape)))
        return tensor.cpu()

    back = unflatten(layout, data, Placement.of(to_cpu))
    assert seen == [("cuda:0", "cpu", (3,)), ("cpu", "cpu", (4,)), ("cuda:1", "cpu", (2, 2))]
    assert torch.equal(back["gpu"], torch.ones(3)) and torch.equal(back["host"], torch.arange(4))
    assert isinstance(back["param"], torch.nn.Parameter) and back["same"] is back["param"]
    assert torch.equal(back["param"].detach(), torch.full((2, 2), 7.0))
    to_meta = unflatten(layout, data, Placement.of(lambda tensor, location: tensor.to("meta")))
    assert to_meta["host"].device.type == "meta"
    # None, as for torch.load: back where it was saved (the CPU here; cuda:0 in test_cuda_without_cuda_...)
    host_layout, host_data = _saved({"host": torch.arange(4)})
    back = unflatten(host_layout, host_data, Placement.of(lambda tensor, location: None))
    assert back["host"].device.type == "cpu" and torch.equal(back["host"], torch.arange(4))


def test_a_callable_must_return_the_tensor_it_is_given():
    layout, data = _saved({"w": torch.ones(3)})
    for wrong in (lambda t, loc: "cpu", lambda t, loc: t.double(), lambda t, loc: t[:2]):
        with pytest.raises(InvalidArgument, match="must return the tensor it is given"):
            unflatten(layout, data, Placement.of(wrong))


def test_forms_that_cannot_apply_are_refused_naming_every_form():
    for bad in ("floppy:0", 2.5, {0: "cpu"}, {"cuda:0": "floppy"}, object()):
        with pytest.raises(InvalidArgument, match="map_location"):
            Placement.of(bad)


@no_cuda
def test_cuda_without_cuda_is_a_checkpoint_error_saying_to_load_on_the_cpu():
    for form in ("cuda", "cuda:0", torch.device("cuda", 1), b"cuda"):
        with pytest.raises(InvalidArgument, match=r'CUDA is not available here.*map_location="cpu"') as raised:
            Placement.of(form)
        assert isinstance(raised.value, CheckpointError)
    layout, data = _saved({"w": torch.ones(3)}, {0: "cuda:0"})
    Placement.of({"cuda:0": "cuda:1"})  # a dict checks the devices it is used for, as torch.load does
    for form in ({"cuda:1": "cpu"}, lambda t, loc: None):  # cuda:0 goes back to cuda:0
        with pytest.raises(InvalidArgument, match=r"saved on cuda:0 goes back there.*CUDA is not available"):
            unflatten(layout, data, Placement.of(form))
    with pytest.raises(InvalidArgument, match=r"map_location\['cuda:0'\] = 'cuda:1'.*CUDA is not available"):
        unflatten(layout, data, Placement.of({"cuda:0": "cuda:1"}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_tensor_records_its_device_and_every_form_maps_it():
    state = {"gpu": torch.arange(4.0, device="cuda"), "host": torch.ones(2)}
    flat = flatten(state)
    assert flat.entries[0]["device"] == "cuda:0" and "device" not in flat.entries[1]
    layout, data = _saved({"gpu": state["gpu"].cpu(), "host": state["host"]}, {0: "cuda:0"})
    assert layout == flat.layout()  # what _saved writes by hand is what a save of CUDA tensors records
    back = unflatten(layout, data, Placement.of(lambda tensor, location: None))
    assert back["gpu"].device == torch.device("cuda:0") and back["host"].device.type == "cpu"
    assert unflatten(layout, data, Placement.of({"cuda:0": "cpu"}))["gpu"].device.type == "cpu"
    assert {t.device.type for t in unflatten(layout, data, Placement.of("cuda")).values()} == {"cuda"}
    assert torch.equal(back["gpu"].cpu(), torch.arange(4.0))
