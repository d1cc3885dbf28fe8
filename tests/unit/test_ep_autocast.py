"""The experts' weights under autocast (ddp + ep, or tp / ep without data parallel, with
mixed_precision): the model's grouped matmul is not autocast-enabled, so ``parallel.ep`` hands it
weights cast to autocast's dtype, as autocast does for a Linear, with the gradient flowing to the
fp32 parameter. One process, a one-rank gloo group on the loopback address."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def one_rank_mesh(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))


class Experts(nn.Module):
    """transformers' experts contract, reduced: ``forward(hidden, top_k_index, top_k_weights)``."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.down_proj = nn.Parameter(torch.randn(2, 4, 4))
        self.seen: list[torch.dtype] = []

    def forward(self, hidden, top_k_index, top_k_weights):
        self.seen.append(self.down_proj.dtype)
        weight = self.down_proj[top_k_index[:, 0]]  # [T, 4, 4]
        return torch.bmm(hidden.to(weight.dtype).unsqueeze(1), weight).squeeze(1) * top_k_weights[:, :1]


@pytest.mark.parametrize("autocast", [False, True])
def test_experts_compute_in_autocasts_dtype_and_train_in_fp32(one_rank_mesh, autocast):
    from torch.distributed.tensor import DTensor

    from hf_scale.parallel.ep import apply_experts

    torch.manual_seed(0)
    model = nn.Module()
    model.experts = Experts()
    apply_experts(model, {"experts": ("down_proj",)}, one_rank_mesh, ep=True)
    hidden = torch.randn(6, 4)
    index, weights = torch.tensor([[0, 1], [1, 0]] * 3), torch.ones(6, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model.experts(hidden, index, weights)
    out.float().sum().backward()
    param = model.experts.down_proj
    assert isinstance(param, DTensor) and param.dtype == torch.float32
    assert param.grad is not None and param.grad.dtype == torch.float32 and param.grad.to_local().abs().sum() > 0
    assert model.experts.seen == [torch.bfloat16 if autocast else torch.float32]
