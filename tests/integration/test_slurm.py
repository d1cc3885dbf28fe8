"""``hf-scale finetune`` under SLURM: ``srun`` starts one task per node, and each reads its node
count, node rank and the rendezvous host from SLURM's variables. Simulated on loopback: two
commands with the variables of two nodes, one worker each, against the plain reference."""

from __future__ import annotations

import sys

import pytest

from tests.harness import finish_command, free_port, start_command
from tests.integration.cli_reference import check_against_reference, plain_reference
from tests.tiny_models import tiny_recipe


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return tiny_recipe(tmp_path_factory.mktemp("slurm"), steps=4)


def test_two_slurm_nodes_train_as_one_job(recipe, tmp_path):
    out = tmp_path / "slurm-run"
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["finetune", str(recipe), "--nproc-per-node", "1", "--parallel.strategy", "hsdp",
            "--train.batch_size", "4", "--train.output_dir", str(out), "--train.sample_generations", "0"]
    nodes = [start_command([sys.executable, "-m", "hf_scale.cli", *args], env={**slurm, "SLURM_NODEID": str(i)})
             for i in range(2)]
    logs = [finish_command(node, timeout=300).stdout for node in nodes]
    for i, log in enumerate(logs):
        assert f"--nnodes=2 --max-restarts=0 --node-rank={i} --master-addr=127.0.0.1" in log
    assert any("hsdp over pp=1 x dp_replicate=2 x dp_shard=1" in log for log in logs)  # world 2
    # 2 nodes x batch 4 = the reference's batch of 8: same losses, gradient norms, weights
    check_against_reference(out, plain_reference(recipe, batch_size=8))
