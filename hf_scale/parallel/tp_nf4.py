"""Tensor parallel for a Linear whose weight is NF4 (a QLoRA base): the base computed on this
rank's local NF4 slice, never through DTensor's dispatch on ``NF4Tensor`` (which gives a silently
wrong backward under tp: the weight transposed).

Each rank's weight is a DTensor on the tp mesh (``Shard(0)`` colwise, ``Shard(1)`` rowwise, so
that the loader reads its block and FSDP shards it) whose local tensor is a plain ``NF4Tensor``
quantized from that slice alone (its own mean block absmax: torchao's ``to_nf4`` of the slice).
The forward swaps the DTensor for its local tensor and computes with plain tensors, with
Megatron's two regions (:mod:`.group_grad`):

- ``colwise``: ``copy_to_group(x) @ W_r^T`` (+ the bias's rows): the local output features; the
  input's gradient, a partial sum per rank, is summed over the tp group in backward;
- ``rowwise``: ``sum_over_group(x_r @ W_r^T)`` (+ the whole bias, once): the input holds this
  rank's features (a colwise layer's local output).

The weight is frozen (no gradient); LoRA's factors keep their own DTensor styles
(:data:`hf_scale.model_plans.adapters.LORA_TP_FACTOR`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .group_grad import copy_to_group, sum_over_group

NF4_TP_STYLES = {"colwise": 0, "rowwise": 1}  # style -> the weight dim split over the tp ranks
_SWAPPED = "_hf_scale_nf4_tp_params"


def apply_nf4_tp(module: nn.Linear, tp_mesh, style: str) -> None:
    """``module`` (an ``nn.Linear`` whose weight is a meta ``NF4Tensor`` of the whole shape)
    split over ``tp_mesh`` by ``style`` (``colwise`` / ``rowwise``), computing on local slices."""
    from ..quantize.nf4 import quantize_rows

    dim = NF4_TP_STYLES[style]
    tp = tp_mesh.size()
    weight = module.weight
    shape = list(weight.shape)
    shape[dim] //= tp
    local = quantize_rows(torch.empty(shape, dtype=weight.dtype, device="meta"), torch.empty((), device="meta"),
                          scaler_block=weight.scaler_block_size)  # place_nf4's: FSDP's shards of this slice hold whole groups
    placed = DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False, shape=weight.shape,
                                stride=weight.stride())
    module.register_parameter("weight", nn.Parameter(placed, requires_grad=False))
    if module.bias is not None:
        bias = distribute_tensor(module.bias, tp_mesh, [Shard(0) if style == "colwise" else Replicate()])
        module.register_parameter("bias", nn.Parameter(bias, requires_grad=module.bias.requires_grad))
    group = tp_mesh.get_group()

    def enter(mod, args):
        swapped = dict(mod._parameters)
        mod.__dict__[_SWAPPED] = swapped
        for name, p in swapped.items():
            if isinstance(p, DTensor):
                mod._parameters[name] = p.to_local() if p.requires_grad else p._local_tensor
        x = args[0]
        if style == "colwise" and torch.is_grad_enabled() and x.requires_grad:
            x = copy_to_group(x, group)
        if style == "rowwise":  # the whole bias is added once, after the partial sums
            mod._parameters["bias"] = None
        return (x, *args[1:])

    def leave(mod, args, output):
        swapped = mod.__dict__.pop(_SWAPPED)
        mod._parameters.update(swapped)
        if style != "rowwise":
            return output
        output = sum_over_group(output, group)
        bias = swapped.get("bias")
        if bias is not None:
            output = output + (bias.to_local() if isinstance(bias, DTensor) else bias)
        return output

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
