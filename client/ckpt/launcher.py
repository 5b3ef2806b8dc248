"""Find this process's rank and world size, from whichever launcher started it.

Checkpointer.__init__ calls rank_and_world_size once, on the caller's thread. The
first source that names both wins, in this order:

1. the arguments (a rank or world size given is taken as is; the other comes from below);
2. torchrun, and what sets the same variables (torch.distributed.launch, Lightning,
   Accelerate, DeepSpeed): RANK, WORLD_SIZE;
3. Slurm's srun: SLURM_PROCID, SLURM_NTASKS;
4. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
5. PMI (MPICH's and Intel MPI's mpiexec, srun --mpi=pmi2): PMI_RANK, PMI_SIZE;
6. an initialised torch.distributed default group;
7. none of these: rank 0 of 1, one process.

A source that names only one of the two is skipped. When torch.distributed is
initialised, it must agree with what the environment says (srun starting one process
per node that spawns its ranks itself would otherwise give every node's ranks the
node's number): a disagreement is an InvalidArgument naming both.
"""

from __future__ import annotations

import os
import sys

from ckpt_core.errors import InvalidArgument

LAUNCHER_VARIABLES = (  # (rank, world size) variables, in the order they are tried
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


def rank_and_world_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Return (rank, world size): the arguments where given, else the launcher's (see the module's docstring)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    found = _from_environment()
    group = _from_torch_distributed()
    if found is not None and group is not None and found[:2] != group:
        raise InvalidArgument(
            f"{found[2]} say rank {found[0]} of {found[1]}, but torch.distributed says rank {group[0]} of "
            f"{group[1]}: pass rank= and world_size= to say which holds"
        )
    detected = found[:2] if found is not None else group or (0, 1)
    return (detected[0] if rank is None else rank, detected[1] if world_size is None else world_size)


def _from_environment() -> tuple[int, int, str] | None:
    for rank_name, size_name in LAUNCHER_VARIABLES:
        rank, size = os.environ.get(rank_name, ""), os.environ.get(size_name, "")
        if rank and size:
            return _integer(rank_name, rank), _integer(size_name, size), f"{rank_name} and {size_name}"
    return None


def _from_torch_distributed() -> tuple[int, int] | None:
    """Return the default group's (rank, world size) if torch.distributed is imported and initialised."""
    torch = sys.modules.get("torch")  # never imported here: a process that has not imported it has no group
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    return distributed.get_rank(), distributed.get_world_size()


def _integer(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={value!r} is not an integer") from None
