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


def srun_pmi_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """srun --mpi=pmi2 with one task on each of ``world`` nodes: PMI ranks, SLURM's local ids."""
    return dict(PMI_RANK=str(rank), PMI_SIZE=str(world), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(world),
                SLURM_STEP_NUM_NODES=str(world), SLURM_STEP_TASKS_PER_NODE=f"1(x{world})", SLURM_PROCID=str(rank),
                SLURM_NODEID=str(rank), SLURM_LOCALID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def group_check() -> dict:
    import torch
    import torch.distributed as dist

    from hf_scale.distributed import init_distributed

    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    env = init_distributed()
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": env.local_rank,
            "nodes": env.num_nodes, "sum": total.item()}


@pytest.mark.parametrize(
    "launcher, local_ranks, nodes",
    [(mpirun_vars, [0, 1], 1), (pmi_vars, [0, 1], 1), (srun_pmi_vars, [0, 0], 2)],  # srun: 2 nodes
    ids=["openmpi", "pmi", "srun-pmi2"],
)
def test_mpi_launched_processes_form_a_group(launcher, local_ranks, nodes):
    results = run_ranks(group_check, 2, launcher=launcher, timeout=120)
    assert [(r["rank"], r["world"], r["local_rank"]) for r in results] == [(0, 2, local_ranks[0]), (1, 2, local_ranks[1])]
    assert all(r["nodes"] == nodes for r in results)
    assert all(r["sum"] == 3.0 for r in results)  # 1 + 2: both ranks took part
