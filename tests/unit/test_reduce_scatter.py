"""Where hf_scale's all-to-all reduce-scatter (hf_scale/parallel/reduce_scatter.py) is installed:
on every FSDP unit when the data-parallel backend is gloo, on none for any other backend name
(NCCL keeps its native reduce-scatter), and which reduce ops it accepts. One process (a gloo
group of one rank, so ``fully_shard`` builds real units); the sums over 2 and 4 ranks against
gloo's own reduce-scatter: tests/distributed/test_layout.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from hf_scale.parallel.reduce_scatter import AllToAllReduceScatter, _factor, install_reduce_scatter


@pytest.fixture(scope="module")
def mesh(one_process_group):
    return init_device_mesh("cpu", (1,))


def _sharded(mesh) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _comms(model: nn.Module) -> list[type]:
    return [type(group._reduce_scatter_comm) for unit in model.modules() if isinstance(unit, FSDPModule)
            for group in unit._get_fsdp_state()._fsdp_param_groups]


def test_installed_on_every_unit_for_gloo(mesh):
    model = _sharded(mesh)
    assert install_reduce_scatter(model, dist.get_backend(mesh.get_group())) is True
    assert _comms(model) == [AllToAllReduceScatter, AllToAllReduceScatter]


@pytest.mark.parametrize("backend", ["nccl", "xccl", "fake_accelerator"])
def test_other_backends_keep_their_own(mesh, backend):
    model = _sharded(mesh)
    assert install_reduce_scatter(model, backend) is False
    assert _comms(model) == [DefaultReduceScatter, DefaultReduceScatter]


def test_reduce_ops():
    assert _factor(dist.ReduceOp.SUM) is None
    assert _factor(dist.ReduceOp.AVG) == "avg"
    assert _factor(dist.ReduceOp.PREMUL_SUM(0.25)) == 0.25
    with pytest.raises(ValueError, match="drop set_custom_reduce_scatter"):
        _factor(dist.ReduceOp.MAX)


def test_one_rank_is_the_input_scaled(mesh):
    """A group of one: the output is the input, scaled as the op says (FSDP itself skips the
    collective at one rank; this checks the arithmetic, not the exchange)."""
    data = torch.arange(6, dtype=torch.float32)
    for op, want in ((dist.ReduceOp.SUM, data), (dist.ReduceOp.AVG, data),
                     (dist.ReduceOp.PREMUL_SUM(0.5), data * 0.5)):
        out = torch.empty(6)
        AllToAllReduceScatter()(out, data.clone(), mesh.get_group(), op)
        assert torch.equal(out, want)
    with pytest.raises(ValueError, match="not 1 x the output"):
        AllToAllReduceScatter()(torch.empty(5), data, mesh.get_group(), dist.ReduceOp.SUM)
