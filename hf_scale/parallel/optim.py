"""Optimizer, gradient clipping and gradient accumulation for a parallelized model (engine side:
they read the mesh and strategy :func:`hf_scale.parallelize` left on the model).

Parameters keep their names under every strategy (FSDP2 makes each one a ``DTensor``, DDP
leaves it a plain tensor), so parameter groups are chosen by name as HF ``Trainer`` does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch
from torch import nn

from ..parallel_state import get_state

# The same rule as transformers.Trainer.get_decay_parameter_names.
_NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as HF Trainer makes them: no decay on biases and norm weights.

    Frozen parameters (``requires_grad=False``) are left out. Tied parameters appear once.
    """
    from transformers.trainer_pt_utils import (
        get_parameter_names,  # loads Trainer's utilities: only here
    )

    decay_names = set(get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_NAME_PATTERNS))
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if name in decay_names else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def reshard_fsdp(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its sharded parameters.

    A forward without backward (evaluation, a reference pass, a generation) leaves units
    gathered that reshard only in backward: the root always (it keeps its parameters for the
    backward that follows), zero2's units too. While a unit is gathered, ``parameters()`` yields
    its gathered copies; an optimizer built then holds those: it would step copies that are
    thrown away, never zero the sharded gradients (they accumulate over steps), and see the
    wrong norm."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_optimizer(
    model: nn.Module,
    lr: float = 2e-5,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool | None = None,
    **adamw_kwargs,
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters, suited to the strategy it was parallelized with.

    For ``zero1`` this is a ``ZeroRedundancyOptimizer`` wrapping AdamW: each data-parallel
    rank keeps and updates the optimizer state of its part of the parameters only, then
    broadcasts them. Under fsdp / zero2 / hsdp the parameters are already sharded, so plain
    AdamW holds sharded state. ``fused=None`` uses torch's fused AdamW kernel when it supports
    every parameter's device (CUDA, CPU, ...), as HF ``Trainer`` does by default.

    Usage::

        optimizer = hf_scale.build_optimizer(model, lr=2e-5, weight_decay=0.1)
    """
    reshard_fsdp(model)  # the sharded parameters, not the gathered copies a no-grad forward left
    groups = _split_by_kind(parameter_groups(model, weight_decay))
    if fused is None:
        fused = _fused_supported([p for g in groups for p in g["params"]])
    defaults = dict(lr=lr, betas=betas, eps=eps, fused=fused, **adamw_kwargs)
    state = get_state(model)
    if state is not None and state.config.strategy == "zero1" and state.mesh is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            process_group=state.dp_mesh.get_group(),
            **defaults,
        )
    from torch.distributed.tensor import DTensor

    kinds = {p.device_mesh if isinstance(p, DTensor) else None for g in groups for p in g["params"]}
    return (_KindsApartAdamW if len(kinds) > 1 else torch.optim.AdamW)(groups, **defaults)


class _KindsApartAdamW(torch.optim.AdamW):
    """AdamW over groups of different kinds (DTensors of one mesh, plain tensors), whose
    ``zero_grad(set_to_none=False)`` zeroes each group on its own: torch's batches every group's
    gradients by device and dtype into one foreach call, which refuses DTensors beside plain
    tensors (tensor parallel alone leaves norms plain beside sharded weights)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        for group in self.param_groups:  # one kind each (_split_by_kind)
            grads = [p.grad for p in group["params"] if p.grad is not None]
            for g in grads:  # as torch's zero_grad: the gradient leaves any graph
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
            if grads:
                torch._foreach_zero_(grads)
        return None


def _split_by_kind(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor parameters (by mesh) and its plain ones: a foreach or
    fused step over one group cannot mix them (tensor parallel alone leaves norms and biases
    plain beside sharded weights)."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in groups:
        kinds: dict = {}
        for p in group["params"]:
            kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        out.extend({**group, "params": params} for params in kinds.values())
    return out


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """True when torch's fused AdamW kernel takes every parameter (the default here, as in
    HF ``Trainer``'s ``adamw_torch_fused``): about 5x faster than the per-tensor loop on CPU."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)


@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Skip gradient reduction for backward passes inside the block (gradient accumulation).

    Gradients accumulate locally; the first backward outside the block reduces the sum.
    Under FSDP2 this sets ``set_requires_gradient_sync(False)`` (no reduce-scatter and no
    all-reduce), under DDP the reducer is switched off. In one process it does nothing, and
    under pipeline parallel too: there torch's schedule drives each stage's FSDP gradient sync
    itself (one reduce-scatter per ``train_step``, correct but not deferred).
    Divide the loss by the number of micro-batches, as in plain PyTorch.

    Usage::

        for i, micro in enumerate(micro_batches):
            with hf_scale.no_sync(model, enabled=i < len(micro_batches) - 1):
                (model(**micro).loss / len(micro_batches)).backward()
    """
    toggle = getattr(model, "set_requires_gradient_sync", None)
    if not enabled or toggle is None:
        yield
        return
    toggle(False)
    try:
        yield
    finally:
        toggle(True)


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm across all ranks; return that norm (a plain tensor).

    Works when gradients are sharded ``DTensor`` s, plain tensors, or both, on one or several
    meshes (FSDP blocks beside fp32 units, tensor-parallel layers): each group of gradients
    that share a mesh and layout is reduced by DTensor, then the groups' norms are combined.

    Under pipeline parallel pass the model: each rank holds one stage's gradients, so the
    stages' norms are combined over the pp group too (after the dp / tp reduction above), and
    the tied head's copy (``plan.tied_weights`` target, e.g. ``lm_head.weight``, whose
    gradient equals the embedding's after ``train_step``) is clipped but counted once, as one
    process counts the one shared parameter. Every rank gets the same norm and applies the
    same scale.
    """
    parameters, counted, pp_group, device = _clip_targets(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _local_norm([p.grad for p in counted if p.grad is not None], norm_type)
    if pp_group is not None:
        total = _combine_over(total, norm_type, pp_group, device)
    elif not grads:
        return torch.tensor(0.0)
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total


def _clip_targets(parameters) -> tuple[list[torch.Tensor], list[torch.Tensor], object, torch.device | None]:
    """(parameters to clip, those whose gradients the norm counts, the pp process group or
    None, the device its collective uses)."""
    if not isinstance(parameters, nn.Module):
        params = list(parameters)
        return params, params, None, None
    model = parameters
    state = get_state(model)
    named = dict(model.named_parameters())
    if state is None or getattr(state, "pp_degree", 1) <= 1:
        return list(named.values()), list(named.values()), None, None
    # a tie target held as its own Parameter (the head's copy on the last stage, or beside the
    # embedding on one rank) repeats the source's gradient, which the holder of the source counts
    every = dict(model.named_parameters(remove_duplicate=False))
    copies = {id(every[t]) for t, s in state.plan.tied_weights if t in every and every[t] is not every.get(s)}
    counted = [p for p in named.values() if id(p) not in copies]
    return list(named.values()), counted, state.pp_mesh.get_group(), state.env.device


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``grads`` over the ranks that shard them (DTensor meshes), on the CPU."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else (g.device,)
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=None)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float().cpu())
    if not norms:  # a rank with no gradients still joins the pp reduction
        return torch.tensor(0.0)
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _combine_over(norm: torch.Tensor, norm_type: float, group, device) -> torch.Tensor:
    """The norm of the gradients of every rank of ``group`` (the pipeline stages), from each
    rank's ``norm``: a sum of p-th powers (a max for the inf-norm)."""
    import torch.distributed as dist

    if math.isinf(norm_type):
        value = norm.to(device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value.cpu()
    value = norm.double().pow(norm_type).to(device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.cpu().pow(1.0 / norm_type).float()
