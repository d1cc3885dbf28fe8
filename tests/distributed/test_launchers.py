"""Processes started as mpirun starts them (``OMPI_COMM_WORLD_*`` or ``PMI_*``, no ``RANK``)
form one process group through hf_scale and all-reduce across it."""

from __future__ import annotations

import os

import pytest

from tests.harness import mpirun_vars, run_ranks


def pmi_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """MPICH / Intel MPI's variables (hydra's local rank), plus the rendezvous address."""
    return dict(PMI_RANK=str(rank), PMI_SIZE=str(world), MPI_LOCALRANKID=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def group_check() -> dict:
    import torch
    import torch.distributed as dist

    from hf_scale.distributed import init_distributed

    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    env = init_distributed()
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": env.local_rank,
            "sum": total.item()}


@pytest.mark.parametrize("launcher", [mpirun_vars, pmi_vars], ids=["openmpi", "pmi"])
def test_mpi_launched_processes_form_a_group(launcher):
    results = run_ranks(group_check, 2, launcher=launcher, timeout=120)
    assert [(r["rank"], r["world"], r["local_rank"]) for r in results] == [(0, 2, 0), (1, 2, 1)]
    assert all(r["sum"] == 3.0 for r in results)  # 1 + 2: both ranks took part
