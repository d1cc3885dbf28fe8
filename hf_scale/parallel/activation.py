"""Activation checkpointing on the model's blocks, without renaming any parameter."""

from __future__ import annotations

import functools
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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
    block.

    The block's ``forward`` (its body, not its module hooks) runs under non-reentrant
    ``torch.utils.checkpoint`` with RNG state preserved. Keeping the hooks outside matters:
    FSDP's all-gather / cast hooks and transformers' output-capturing hooks then run once per
    forward and are not replayed inside the recomputation (hook-based checkpointing replays
    them, which selective checkpointing rejects and T5 trips over). Unlike
    ``checkpoint_wrapper``, no module is replaced, so parameter names, ``state_dict`` keys and
    attribute paths stay those of transformers. Apply before FSDP.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not 'full' or 'selective'")
    context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls) if mode == "selective" else None
    count = 0
    for index, unit in enumerate(units):
        if mode == "full" and index % every:
            continue
        _checkpoint_forward(unit, context_fn)
        count += 1
    return count


def _checkpoint_forward(module: nn.Module, context_fn) -> None:
    if getattr(module, "_hf_scale_checkpointed", False):
        raise ValueError(f"{type(module).__name__} already has activation checkpointing")
    forward = module.forward
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    module.forward = checkpointed_forward
    module._hf_scale_checkpointed = True
