"""Trainable and frozen parameters: what the planner needs to estimate adapter runs (LoRA) and
runs with frozen layers.

A parameter with ``requires_grad=False`` is frozen: it has no gradient and no optimizer state,
the data-parallel reduction skips it, and backward computes no weight gradient for it (the
gradient of its input still flows through it). It is kept in the dtype it is stored in (a
LoRA base is usually loaded in bf16), where the trainable parameters' master copy is fp32.

A peft ``PeftModel`` wraps the transformers model that hf_scale parallelizes
(``peft_model.base_model.model``, adapters injected in place); the planner reads that one,
found as the engine finds it (:func:`hf_scale.model_plans.adapters.adapter_host`). A real (not meta) model with
frozen parameters is copied to the meta device as it is (:func:`meta_copy`): rebuilding it
from its config, as a fully trainable one is, would lose its adapters and its frozen flags.

Usage::

    model = adapter_target(peft_model)            # the transformers model, adapters inside
    frozen = count_frozen(model, wrap_units(model, plan))
    frozen.params, frozen.element_bytes           # e.g. 70e9, 2.0 (a bf16 base)
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from ..model_plans.adapters import adapter_host


@dataclass(frozen=True)
class Frozen:
    """Frozen parameter counts of a model's parts (a tied weight once)."""

    blocks: list[int]  # per block, in the order of the blocks
    root: int  # outside every block (embeddings, final norm, head)
    head: bool  # the output head's weight is frozen
    element_bytes: float  # bytes per frozen parameter as stored (mean over them; 4 when none)
    trainable_tensors: int  # parameter tensors the optimizer steps

    @property
    def params(self) -> int:
        return sum(self.blocks) + self.root


def adapter_target(model: nn.Module) -> nn.Module:
    """The module hf_scale parallelizes: a ``PeftModel``'s transformers model (adapters injected
    in place), or ``model`` itself (the engine's own rule, :func:`adapter_host`)."""
    return adapter_host(model)


def has_frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure on the meta device: the same modules (adapters included), every
    parameter and buffer replaced by a meta tensor of its shape, dtype and ``requires_grad``
    (tied parameters stay one). Nothing of ``model`` is copied or touched but its structure."""
    memo: dict[int, torch.Tensor] = {}
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def block_counts(units: list[nn.Module], frozen_only: bool = False) -> tuple[list[int], set[int]]:
    """Parameters per block (a parameter shared by two blocks counted in the first; only the
    frozen ones with ``frozen_only``), and the ids of every block parameter."""
    seen: set[int] = set()
    blocks = []
    for unit in units:
        count = 0
        for p in unit.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += 0 if frozen_only and p.requires_grad else p.numel()
        blocks.append(count)
    return blocks, seen


def count_frozen(model: nn.Module, units: list[nn.Module]) -> Frozen:
    """Frozen parameters per block (``units``, the plan's blocks), outside them, and their bytes."""
    blocks, seen = block_counts(units, frozen_only=True)
    unique = {id(p): p for p in model.parameters()}.values()
    frozen = [p for p in unique if not p.requires_grad]
    root = sum(p.numel() for p in frozen if id(p) not in seen)
    count = sum(p.numel() for p in frozen)
    stored = sum(p.numel() * p.element_size() for p in frozen)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return Frozen(blocks=blocks, root=root, head=head is not None and not head.weight.requires_grad,
                  element_bytes=stored / count if count else 4.0,
                  trainable_tensors=sum(1 for p in unique if p.requires_grad))
