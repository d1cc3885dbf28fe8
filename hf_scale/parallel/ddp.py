"""DDP (and the model half of ZeRO-1): replicated parameters, gradients all-reduced."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate import replicate

from ..quantize.nf4 import is_nf4


def apply_ddp(model: nn.Module, dp_mesh, *, bucket_cap_mb: int = 25, ignored: list[nn.Module] = ()) -> None:
    """Replicate ``model`` over ``dp_mesh`` with DistributedDataParallel, in place.

    Uses the composable ``replicate`` (DDP's reducer behind module hooks) as torchtitan does,
    so the model keeps its class, attribute names and ``state_dict`` keys: ``model.config``,
    ``model.generate`` and ``save_pretrained`` still work. Gradient sync is toggled with
    ``model.set_requires_gradient_sync(False)`` (see :func:`hf_scale.no_sync`).

    Layout: every parameter is a full plain tensor on every rank; after backward each
    gradient is the mean over the data-parallel ranks. ``ignored`` modules are left alone
    (experts under expert parallel: see :func:`~.fsdp.shard_experts`).
    """
    # The mesh's process group, not the mesh: given a mesh sliced from a larger one, replicate
    # turns every DTensor parameter (the ignored experts too) into a plain attribute after each
    # forward (its DDP + TP workaround), and the experts would lose their parameters.
    # Frozen NF4 weights (QLoRA) are left out too: DDP's initial broadcast would copy_ a plain
    # buffer into each NF4Tensor, which re-quantizes it from dequantized values (a changed
    # weight); every rank loaded the same weights and they never train.
    ignored = list(ignored) + [m for m in model.modules()
                               if any(is_nf4(p) for p in m.parameters(recurse=False))]
    # gradient_as_bucket_view: each gradient a view into DDP's all-reduce bucket, not a second copy
    # of every gradient beside it (4 bytes a trainable fp32 parameter less per rank); the reducer
    # makes the views again after zero_grad(set_to_none=True)
    replicate(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb,
              ignored_modules=ignored or None, gradient_as_bucket_view=True)
