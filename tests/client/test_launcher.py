"""Rank and world size: the arguments, then each launcher's variables, then torch.distributed (ckpt.launcher)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from ckpt.launcher import LAUNCHER_VARIABLES, rank_and_world_size
from ckpt_core.errors import InvalidArgument

EVERY_VARIABLE = [name for pair in LAUNCHER_VARIABLES for name in pair]


@pytest.fixture
def environment(monkeypatch):
    """Start from no launcher variable at all (the test runner's own may be set)."""
    for name in EVERY_VARIABLE:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("launcher", "variables"),
    [
        ("torchrun", {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}),
        ("srun", {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}),
        ("Open MPI mpirun", {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16"}),
        ("MPICH / Intel MPI mpiexec", {"PMI_RANK": "5", "PMI_SIZE": "16"}),
    ],
)
def test_each_launchers_variables_give_rank_and_world_size(environment, launcher, variables):
    for name, value in variables.items():
        environment.setenv(name, value)
    assert rank_and_world_size() == (5, 16), launcher


def test_the_first_launcher_in_order_wins_and_a_half_named_one_is_skipped(environment):
    environment.setenv("SLURM_PROCID", "3")
    environment.setenv("SLURM_NTASKS", "4")
    environment.setenv("OMPI_COMM_WORLD_RANK", "1")
    environment.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert rank_and_world_size() == (3, 4)  # srun inside mpirun's allocation? Slurm's come first
    environment.setenv("RANK", "7")  # torchrun under srun: torchrun's global rank, not the node's task
    environment.setenv("WORLD_SIZE", "32")
    assert rank_and_world_size() == (7, 32)
    environment.delenv("WORLD_SIZE")  # RANK alone names no world: skipped
    assert rank_and_world_size() == (3, 4)


def test_arguments_beat_the_environment_one_by_one(environment):
    environment.setenv("RANK", "2")
    environment.setenv("WORLD_SIZE", "8")
    assert rank_and_world_size(1, 4) == (1, 4)
    assert rank_and_world_size(rank=6) == (6, 8)
    assert rank_and_world_size(world_size=3) == (2, 3)


def test_no_launcher_is_one_process(environment):
    assert rank_and_world_size() == (0, 1)


def test_a_variable_that_is_no_integer_is_named(environment):
    environment.setenv("SLURM_PROCID", "zero")
    environment.setenv("SLURM_NTASKS", "4")
    with pytest.raises(InvalidArgument, match="SLURM_PROCID='zero' is not an integer"):
        rank_and_world_size()


@pytest.fixture
def process_group(tmp_path):
    """Yield an initialised gloo group of one process (rank 0 of 1)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_initialised_process_group_is_used_when_no_variable_names_a_rank(environment, process_group):
    assert rank_and_world_size() == (0, 1)
    assert rank_and_world_size(world_size=1) == (0, 1)


def test_variables_that_disagree_with_the_process_group_are_refused(environment, process_group):
    # srun with one task per node, each spawning its ranks itself: Slurm's number is the node's.
    environment.setenv("SLURM_PROCID", "3")
    environment.setenv("SLURM_NTASKS", "4")
    with pytest.raises(InvalidArgument, match=r"SLURM_PROCID and SLURM_NTASKS say rank 3 of 4, but torch\.distributed"):
        rank_and_world_size()
    assert rank_and_world_size(0, 1) == (0, 1)  # said explicitly: taken as is
