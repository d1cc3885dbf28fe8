"""Megatron's two conjugate regions over a process group, as autograd functions.

- :func:`copy_to_group` (``f``): identity in forward; in backward the gradient, which each rank
  computed for its own part of the work (its heads, its features, its experts' slice), is summed
  over the group.
- :func:`sum_over_group` (``g``): the ranks' partial sums added up in forward; identity in backward.

Used by expert parallel's experts under tp and by the tensor-parallel hooks of modules that are
not sharded themselves (MLA's rope part, a fused multi-query projection, stacked shared experts).
The forward results are not autograd views of the input: a model may change them in place.

Usage::

    x = copy_to_group(x, tp_group)          # before a computation split over the group
    out = sum_over_group(partial, tp_group)  # after it
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.detach()  # same storage and version counter, no view for autograd to guard

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group`` in backward."""
    return _CopyToGroup.apply(x, group)


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (each rank holds a partial sum); its gradient unchanged."""
    return _SumOverGroup.apply(x, group)
