"""Activation checkpointing on the model's blocks, without renaming any parameter."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# Outputs worth keeping under selective checkpointing: the matmuls and attention kernels.
# Everything between them (norms, activations, residual adds, casts) is recomputed.
_SAVE_OPS = {
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(units: list[nn.Module], mode: str, every: int = 1) -> int:
    """Checkpoint activations of ``units`` (the model's blocks); returns how many.

    ``mode="full"`` recomputes a whole block in backward, for one block in every ``every``.
    ``mode="selective"`` keeps matmul and attention outputs and recomputes the rest, in every
    block. Uses the composable ``torch.distributed._composable.checkpoint`` (non-reentrant,
    RNG state preserved), which registers hooks instead of wrapping modules, so parameter
    names and ``state_dict`` keys do not change. Apply before FSDP.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not 'full' or 'selective'")
    count = 0
    for index, unit in enumerate(units):
        if mode == "full":
            if index % every == 0:
                checkpoint(unit)
                count += 1
        else:
            checkpoint(unit, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))
            count += 1
    return count
