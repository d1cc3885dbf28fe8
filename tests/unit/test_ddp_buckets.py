"""``apply_ddp``: the gradients are views into DDP's all-reduce buckets (``gradient_as_bucket_view``),
not a second copy beside them, also after ``zero_grad(set_to_none=True)`` (the reducer makes the
views again); the planner counts them once (``MemoryEstimate.bucket_grads``)."""

from __future__ import annotations

import torch

from hf_scale.parallel.ddp import apply_ddp
from tests.tiny_models import tiny_batch, tiny_model


def _grad_storages(model) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}


def test_gradients_are_views_into_the_buckets(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_model("llama", "causal")
    apply_ddp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), bucket_cap_mb=1000)
    params = sum(1 for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second backward after set_to_none: views again
        model(**tiny_batch("causal", 2)).loss.backward()
        assert params > 10 and len(_grad_storages(model)) == 1  # one bucket holds every gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
