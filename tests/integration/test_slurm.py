"""``hf-scale finetune`` under SLURM: ``srun`` starts one task per node, and each reads its node
count, node rank and the rendezvous host from SLURM's variables. Simulated on loopback: two
commands with the variables of two nodes, two workers each under hsdp (replicate across the
nodes x shard within each), against the plain reference. Then what is no srun step (an salloc
shell, sbatch's batch script) and is never read as a layout."""

from __future__ import annotations

import sys

import pytest

from hf_scale import HfScaleConfigError
from hf_scale.launch import resolve_launch, under_torchrun
from hf_scale.train.config import LaunchConfig
from tests.harness import finish_command, free_port, start_command
from tests.integration.cli_reference import check_against_reference, plain_reference
from tests.tiny_models import tiny_recipe

# What sbatch --nodes=2 --ntasks-per-node=1 puts in every process of the job (no step's variables).
ALLOCATION = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
BATCH_SCRIPT = {**ALLOCATION, "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def srun_task(rank: int, tasks: int, nodes: int = 2) -> dict[str, str]:
    """What srun adds for task ``rank`` of a step (one task per node when tasks == nodes)."""
    return {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank * nodes // tasks), "SLURM_LOCALID": "0"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return tiny_recipe(tmp_path_factory.mktemp("slurm"), steps=4)


def test_two_slurm_nodes_train_as_one_job(recipe, tmp_path):
    out = tmp_path / "slurm-run"
    slurm = {**ALLOCATION, "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["finetune", str(recipe), "--nproc-per-node", "2", "--parallel.strategy", "hsdp",
            "--train.batch_size", "2", "--train.output_dir", str(out), "--train.sample_generations", "0"]
    nodes = [start_command([sys.executable, "-m", "hf_scale.cli", *args], env={**slurm, **srun_task(i, 2)})
             for i in range(2)]
    logs = [finish_command(node, timeout=300).stdout for node in nodes]
    for i, log in enumerate(logs):
        assert f"--nnodes=2 --max-restarts=0 --node-rank={i} --master-addr=127.0.0.1" in log
    assert any("hsdp over pp=1 x dp_replicate=2 x dp_shard=2" in log for log in logs)  # world 4
    # 2 nodes x 2 workers x batch 2 = the reference's batch of 8: same losses, gradient norms, weights
    check_against_reference(out, plain_reference(recipe, batch_size=8))


def test_salloc_shell_and_batch_script_are_no_srun_step():
    """hf-scale finetune typed in an salloc shell or run by the batch script itself launches on
    this node: the allocation's 2 nodes and SLURM_NODEID=0 are not a 2-node layout."""
    launch = LaunchConfig(nproc_per_node=1)
    for env in (ALLOCATION, BATCH_SCRIPT, {**BATCH_SCRIPT, "SLURM_STEP_ID": "4294967291"}):  # the batch step's id
        assert resolve_launch(launch, env) == launch
    inside = resolve_launch(launch, {**BATCH_SCRIPT, **srun_task(1, 2), "SLURM_STEP_NODELIST": "n[1-2]"})
    assert (inside.nnodes, inside.node_rank, inside.rdzv_endpoint) == (2, 1, "n1:20077")


def test_mpiexec_ranks_inside_an_allocation_are_workers():
    """mpiexec's ranks inherit the batch script's SLURM_NTASKS == SLURM_NNODES: they train; only
    the tasks srun itself gave PMI ranks (one per node) are torchrun agents."""
    ranks = {**BATCH_SCRIPT, "PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert under_torchrun(ranks)
    assert not under_torchrun({**ranks, **srun_task(1, 2)})  # srun --mpi=pmi2, one task per node


def test_several_tasks_per_node_is_refused():
    with pytest.raises(HfScaleConfigError, match=r"srun started 4 tasks on 2 node\(s\).*--ntasks-per-node=1"):
        resolve_launch(LaunchConfig(), {**ALLOCATION, **srun_task(0, 4)})
