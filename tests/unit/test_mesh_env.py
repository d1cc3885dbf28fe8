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
    with pytest.raises(HfScaleConfigError, match="WORLD_SIZE=6 is not divisible by dp_replicate=4"):
        ParallelDims.resolve(ParallelConfig(strategy="hsdp", dp_replicate=4), 6)


def test_hsdp_on_one_node_needs_dp_replicate():
    with pytest.raises(HfScaleConfigError, match="hsdp' needs dp_replicate >= 2"):
        ParallelDims.resolve(ParallelConfig(strategy="hsdp"), 4, 1)


def test_no_torchrun_variables_means_one_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.backend) == (0, 1, "gloo" if not torch.cuda.is_available() else "nccl")


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
