"""Mesh degrees and the torchrun environment: every bad layout fails before any collective."""

import pytest
import torch

from hf_scale import HfScaleConfigError, ParallelConfig
from hf_scale.distributed import read_env
from hf_scale.mesh import ParallelDims


@pytest.mark.parametrize(
    "config, world, nodes, expected",
    [
        (dict(strategy="fsdp"), 8, 1, (1, 8)),
        (dict(strategy="zero2"), 4, 1, (1, 4)),
        (dict(strategy="ddp"), 4, 1, (4, 1)),
        (dict(strategy="zero1"), 2, 1, (2, 1)),
        (dict(strategy="hsdp"), 16, 2, (2, 8)),  # replicate across nodes, shard within
        (dict(strategy="hsdp", dp_replicate=2), 4, 1, (2, 2)),
        (dict(strategy="hsdp", dp_shard=2), 8, 1, (4, 2)),
        (dict(strategy="fsdp", dp_replicate=2, dp_shard=2), 4, 1, (2, 2)),
    ],
)
def test_resolve_degrees(config, world, nodes, expected):
    dims = ParallelDims.resolve(ParallelConfig(**config), world, nodes)
    assert (dims.dp_replicate, dims.dp_shard) == expected
    assert dims.dp_degree == world and dims.tp == dims.pp == 1


def test_degrees_that_do_not_multiply_to_world_size_print_every_degree():
    with pytest.raises(HfScaleConfigError, match=r"pp=1 x dp_replicate=2 x dp_shard=3 x tp=1 = 6 ranks, but WORLD_SIZE=4"):
        ParallelDims.resolve(ParallelConfig(strategy="hsdp", dp_replicate=2, dp_shard=3), 4)


def test_world_not_divisible():
    with pytest.raises(HfScaleConfigError, match="dp_replicate=4 does not divide the 6 data-parallel ranks"):
        ParallelDims.resolve(ParallelConfig(strategy="hsdp", dp_replicate=4), 6)


def test_hsdp_on_one_node_needs_dp_replicate():
    with pytest.raises(HfScaleConfigError, match="hsdp' needs dp_replicate >= 2"):
        ParallelDims.resolve(ParallelConfig(strategy="hsdp"), 4, 1)


def test_no_torchrun_variables_means_one_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.backend) == (0, 1, "gloo" if not torch.cuda.is_available() else "nccl")
    # an exported rendezvous address (as batch scripts do) does not make a process a worker
    assert read_env(dict(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")).world_size == 1


FULL = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_full_torchrun_environment_is_read():
    env = read_env(dict(FULL, LOCAL_WORLD_SIZE="2"))
    assert (env.rank, env.world_size, env.local_rank, env.num_nodes) == (1, 2, 1, 1)


@pytest.mark.parametrize(
    "environ, message",
    [
        (dict(RANK="0"), "RANK set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
        ({k: v for k, v in FULL.items() if k != "MASTER_PORT"}, "MASTER_PORT missing"),
        (dict(FULL, RANK="2"), "RANK=2 is outside WORLD_SIZE=2"),
        (dict(FULL, WORLD_SIZE="two"), "not an integer"),
        (dict(FULL, LOCAL_RANK="3", LOCAL_WORLD_SIZE="2"), "LOCAL_RANK=3 is outside LOCAL_WORLD_SIZE=2"),
    ],
)
def test_inconsistent_torchrun_environment(environ, message):
    with pytest.raises(HfScaleConfigError, match=message):
        read_env(environ)


OMPI = dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
            OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")


@pytest.mark.parametrize(
    "environ, expected",
    [
        (OMPI, (3, 4, 1, 2)),
        (dict(PMI_RANK="2", PMI_SIZE="4", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2",  # MPICH / Intel MPI
              MASTER_ADDR="h", MASTER_PORT="1"), (2, 4, 0, 2)),
        (dict(PMI_RANK="1", PMI_SIZE="2", PALS_LOCAL_RANKID="1", MASTER_ADDR="h", MASTER_PORT="1"), (1, 2, 1, 2)),
        (dict(PMI_RANK="1", PMI_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), (1, 2, 1, 2)),  # one node
        (dict(OMPI, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"), (0, 1, 0, 1)),  # torchrun's win
    ],
)
def test_mpirun_environment_is_read(environ, expected):
    env = read_env(environ)
    assert (env.rank, env.world_size, env.local_rank, env.num_nodes) == expected[:3] + (expected[1] // expected[3],)


def test_mpirun_without_a_rendezvous_address_says_which_variables():
    environ = {k: v for k, v in OMPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(HfScaleConfigError, match=r"mpirun \(Open MPI\) set this process's rank, but MASTER_ADDR missing"):
        read_env(environ)
    with pytest.raises(HfScaleConfigError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_env(dict(OMPI, OMPI_COMM_WORLD_RANK="4"))


def test_workers_of_either_launcher_train_and_srun_agents_launch():
    from hf_scale.launch import under_torchrun

    assert under_torchrun(FULL) and under_torchrun(OMPI) and not under_torchrun({})
    # srun's pmi2 plugin sets PMI_* on its one task per node: that task is a torchrun agent
    srun = dict(PMI_RANK="0", PMI_SIZE="2", SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES="2",
                SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0", SLURM_PROCID="0")
    assert not under_torchrun(srun) and under_torchrun(dict(srun, SLURM_STEP_NUM_TASKS="8", PMI_SIZE="8"))


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("localhost", ["localhost"]),
        ("gpu-a[8-10],cpu1", ["gpu-a8", "gpu-a9", "gpu-a10", "cpu1"]),
        ("r[1-2]n[003,005]", ["r1n003", "r1n005", "r2n003", "r2n005"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_slurm_nodelist_is_expanded(nodelist, hosts):
    from hf_scale.launch import expand_nodelist

    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-]", "node[a]", "node[01", ""])
def test_unreadable_slurm_nodelist(nodelist):
    from hf_scale.launch import expand_nodelist

    with pytest.raises(HfScaleConfigError, match="cannot read the SLURM node list"):
        expand_nodelist(nodelist)


SLURM = dict(SLURM_JOB_ID="1234", SLURM_NNODES="4", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu[07-10]",
             SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="2")  # a task of srun


def test_slurm_sets_nodes_node_rank_and_rendezvous():
    from hf_scale.launch import resolve_launch, torchrun_argv
    from hf_scale.train.config import LaunchConfig

    launch = resolve_launch(LaunchConfig(nproc_per_node=1), SLURM)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (4, 2, "gpu07:21234")
    argv = torchrun_argv(launch, ["train.py"])
    assert {"--nnodes=4", "--node-rank=2", "--master-addr=gpu07", "--master-port=21234"} <= set(argv)
    assert resolve_launch(LaunchConfig(), dict(SLURM, MASTER_PORT="29400")).rdzv_endpoint == "gpu07:29400"
    # the recipe's own layout wins; outside SLURM, or on one node, nothing changes
    mine = LaunchConfig(nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert resolve_launch(mine, SLURM) == mine
    assert resolve_launch(LaunchConfig(), {}) == LaunchConfig()
    assert resolve_launch(LaunchConfig(), dict(SLURM, SLURM_NNODES="1", SLURM_STEP_NUM_TASKS="1")) == LaunchConfig()


def test_example_sbatch_script_runs_one_agent_per_node(tmp_path):
    """scripts/slurm_finetune.sbatch under a stand-in ``srun`` that prints what it would run."""
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "srun"
    fake.write_text('#!/bin/bash\necho "srun $*"; echo "MASTER_PORT=$MASTER_PORT"\n')
    fake.chmod(0o755)
    script = Path(__file__).parents[2] / "scripts" / "slurm_finetune.sbatch"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_GPUS_ON_NODE": "4"}
    env.pop("MASTER_PORT", None)
    out = subprocess.run(["bash", str(script), "my.yaml", "--train.max_steps", "5"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "--mpi=none" in out and "MASTER_PORT=29500" in out
    assert "hf-scale finetune my.yaml --launch.nproc_per_node 4 --train.max_steps 5" in out
