"""On a CPU mesh hf_scale's fsdp issues its all-gathers asynchronously and prefetches one unit
ahead (hf_scale/parallel/fsdp.py ``overlap_on_host``): FSDP2's defaults block the host that
computes there. Other device types keep FSDP2's defaults. One process (a gloo group of one
rank, so ``fully_shard`` builds real units); the counts at world 2, beside loss parity:
tests/distributed/test_parity.py."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hf_scale.parallel.fsdp import apply_fsdp, overlap_on_host


@pytest.fixture(scope="module")
def mesh(one_process_group):
    return init_device_mesh("cpu", (1,))


def _async(model: nn.Module) -> list[bool]:
    return [group.unshard_async_op for unit in model.modules() if isinstance(unit, FSDPModule)
            for group in unit._get_fsdp_state()._fsdp_param_groups]


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def test_only_a_cpu_mesh_gets_async_all_gathers(mesh):
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert overlap_on_host(model, "cuda") is False and _async(model) == [False, False]
    assert overlap_on_host(model, "cpu") is True and _async(model) == [True, True]


@pytest.mark.parametrize("prefetch, ahead", [(None, 1), (2, 2)])
def test_apply_fsdp_on_cpu_prefetches_asynchronously(mesh, prefetch, ahead):
    model = _model()
    apply_fsdp(model, mesh, [model[0], model[1]], prefetch=prefetch)
    assert _async(model) == [True, True, True]
    forward = model._get_fsdp_state()._states_to_forward_prefetch
    assert len(forward) == ahead  # the root issues the first unit's all-gather (and the next) ahead
    backward = model[1]._get_fsdp_state()._states_to_backward_prefetch
    assert len(backward) == 1  # the unit before it
