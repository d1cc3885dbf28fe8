"""Expert parallel: each rank of the ``ep`` mesh holds ``num_experts / ep`` whole experts, and
every (token, chosen expert) pair travels to its expert's rank and back by all-to-all.

The model's own router, top-k, weight normalisation and load-balancing loss run unchanged,
on this rank's tokens; only the experts module's call is replaced. One MoE layer's forward:

====================== ===================================================================
sort                   the ``T x k`` (token, expert) pairs by expert id: expert-major order,
                       which is rank-major too (rank r holds experts ``[r E/ep, (r+1) E/ep)``)
counts                 ``all_to_all_single`` of the per-expert counts (``ep x E/ep``): each
                       rank learns how many rows it receives, for which local expert
dispatch               ``all_to_all_single`` of the token rows (autograd: its backward is the
                       reverse exchange of the row gradients)
experts                the model's own experts forward on the received rows, with local
                       expert ids and unit weights (its local weights: ``[E/ep, ...]``)
combine                ``all_to_all_single`` of the outputs back to their senders, unsorted,
                       weighted by the router's top-k weights and summed over k, on the sender
====================== ===================================================================

The routing weights are applied on the sender, so the router's gradient is computed where the
router ran, from this rank's tokens (transformers#48687 was a router gradient lost under
expert parallel). Weights: each expert-indexed parameter (dim 0 = expert) becomes a ``DTensor``
``Shard(0)`` on the ep mesh; FSDP then shards it over the ranks holding the same experts (none
when ep is every data-parallel rank: see ``parallel/fsdp.py``).

Usage::

    apply_experts(model, ep_mesh, {"model.layers.0.mlp.experts": ("gate_up_proj", "down_proj")}, ep=True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .group_grad import copy_to_group, sum_over_group


def apply_experts(
    model: nn.Module,
    experts: Mapping[str, tuple[str, ...]],
    mesh,
    ep: bool,
    tp_split: Mapping[str, Mapping[str, tuple[int | None, int]]] | None = None,
) -> None:
    """Distribute each experts module of ``experts`` (module name -> its expert-indexed
    parameter names) over ``mesh``: its ``ep`` dimension splits the experts (dim 0, tokens then
    travel by all-to-all, :class:`TokenDispatcher`), its ``tp`` dimension each expert's
    intermediate size as ``tp_split`` says (``model_plans.ep.experts_tp_split``; a fused
    ``gate_up`` per part). ``mesh``: 1-D ``ep`` or ``tp``, or 2-D ``(ep, tp)``.

    Under tp the module's input (tokens, routing weights) is the same on every tp rank: its
    gradients, partial per rank, are summed in backward; the output, partial sums of each
    rank's slice of the intermediate size, is summed in forward (Megatron's f and g). The
    ``down_proj`` bias is added on the first tp rank only. The module keeps its class and its
    forward, run on local tensors; ``num_experts`` becomes the local count under ep."""
    names = mesh.mesh_dim_names
    ep_size = mesh["ep"].size() if ep else 1
    tp_mesh = mesh["tp"] if tp_split is not None else None
    for name, params in experts.items():
        module = model.get_submodule(name)
        total = getattr(module, params[0]).shape[0]
        split = (tp_split or {}).get(name, {})
        for p in params:
            param = getattr(module, p)
            placements = []
            for dim_name in names:
                if dim_name == "ep":
                    placements.append(Shard(0))
                else:
                    placements.append(_tp_placement(*split[p]))
            sharded = distribute_tensor(param.data, mesh, placements)
            module.register_parameter(p, nn.Parameter(sharded, requires_grad=param.requires_grad))
        once = [p for p in params if split.get(p, (0, 1))[1] == 0]
        dispatcher = None
        if ep:
            if hasattr(module, "num_experts"):
                module.num_experts = total // ep_size
            dispatcher = TokenDispatcher(mesh["ep"].get_group(), ep_size, total // ep_size)
            module._hf_scale_ep = dispatcher
        module.forward = _experts_forward(module, module.forward, params, dispatcher, tp_mesh, once)


def _tp_placement(dim: int | None, parts: int):
    if dim is None:
        return Replicate()
    return _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)


def _experts_forward(module: nn.Module, experts_forward, params, dispatcher, tp_mesh, once):
    tp_group = tp_mesh.get_group() if tp_mesh is not None else None
    first = tp_mesh is None or tp_mesh.get_local_rank() == 0

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs):
        # under autocast (ddp's or one process's mixed precision) the experts compute in its dtype
        # as the Linear layers do: transformers' grouped matmul is not autocast-enabled, and torch
        # 2.13's checks refuse it fp32 on CUDA (FSDP's mixed precision casts its gathered copy itself)
        kind = hidden_states.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None

        def local_experts(rows, ids, weights):
            with local_parameters(module, params, once, first, cast):
                return experts_forward(rows, ids, weights, *args, **kwargs)

        if tp_group is not None:
            hidden_states = copy_to_group(hidden_states, tp_group)
            top_k_weights = copy_to_group(top_k_weights, tp_group)
        if dispatcher is None:
            out = local_experts(hidden_states, top_k_index, top_k_weights)
        else:
            out = dispatcher(hidden_states, top_k_index, top_k_weights, local_experts)
        if tp_group is not None:
            out = sum_over_group(out, tp_group)
        return out

    return forward


@contextlib.contextmanager
def local_parameters(module: nn.Module, names, once=(), first: bool = True, dtype: torch.dtype | None = None):
    """Within the block, ``module.<name>`` is the local tensor of its DTensor parameter (this
    rank's experts, its slice of their intermediate size; gradients flow back to the DTensor),
    so the model's forward, written for plain tensors, runs unchanged. A parameter of ``once``
    (a bias added after a sum over tp ranks) is zero on all but the ``first`` rank in forward;
    each rank's gradient is the whole one (the output's gradient is the same on every tp rank).
    ``dtype``: a floating local tensor is cast to it (differentiably: autocast's weight copy)."""
    saved = {}
    for n in names:
        value = module._parameters.get(n)
        if isinstance(value, DTensor):
            saved[n] = value
            local = value.to_local()
            if dtype is not None and local.is_floating_point() and local.dtype != dtype:
                local = local.to(dtype)
            module._parameters[n] = local if first or n not in once else _ZeroForward.apply(local)
    try:
        yield
    finally:
        module._parameters.update(saved)


class TokenDispatcher:
    """All-to-all token exchange of one experts module over an ep process group (see the module
    docstring for the steps). Called with the module's inputs (``hidden_states [T, H]``,
    ``top_k_index [T, k]`` global expert ids, ``top_k_weights [T, k]``) and the local experts'
    forward; returns ``[T, H]``, the weighted sum of each token's experts' outputs."""

    def __init__(self, group, ep: int, num_local: int):
        self.group, self.ep, self.num_local = group, ep, num_local

    def __call__(self, hidden_states, top_k_index, top_k_weights, local_experts):
        num_tokens, k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        send_rows = hidden_states[order // k]
        recv_counts, send_sizes, recv_sizes = self.exchange_counts(expert_ids)
        rows = _AllToAll.apply(send_rows, recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(self.num_local, device=rows.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=rows.shape[0]).unsqueeze(-1)
        ones = torch.ones(local_ids.shape, dtype=top_k_weights.dtype, device=rows.device)
        if rows.shape[0] == 0:
            # no token for this rank's experts: run them on one zero-weighted row so their weights
            # still get a (zero) gradient, and FSDP's reduction and the reverse exchange still run
            out = local_experts(rows.sum(0, keepdim=True), local_ids.new_zeros(1, 1), ones.new_ones(1, 1))[:0]
        else:
            out = local_experts(rows, local_ids, ones)
        back = _AllToAll.apply(out, send_sizes, recv_sizes, self.group)
        # back to (token, slot) order: a scatter by ``order`` (its backward a gather), no inverse sort
        per_slot = torch.empty_like(back)
        per_slot[order] = back
        per_slot = per_slot.view(num_tokens, k, -1)
        weighted = per_slot * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(hidden_states.dtype)


    def exchange_counts(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The counts step: the rows this rank receives per (sending rank, local expert)
        (``ep x E/ep``), and the rows it sends to / receives from each rank."""
        send_counts = torch.bincount(expert_ids, minlength=self.ep * self.num_local).view(self.ep, self.num_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_sizes, recv_sizes = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        return recv_counts, send_sizes, recv_sizes


class _ZeroForward(torch.autograd.Function):
    """Zeros in forward, the gradient unchanged in backward (see :func:`local_parameters`)."""

    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (``output_sizes`` received from / ``input_sizes`` sent to each
    rank); backward: the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, output_sizes, input_sizes, group):
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        out = x.new_empty((sum(output_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_sizes, input_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes
        out = grad.new_empty((sum(input_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_sizes, output_sizes, group=ctx.group)
        return out, None, None, None


def divide_gradients(module: nn.Module, factor: float) -> None:
    """Divide the gradients of ``module``'s parameters by ``factor`` as they are computed: the
    data-parallel mean of experts that no other rank holds (ep = the data-parallel ranks),
    whose gradients arrive whole through the all-to-all's backward, so no collective is left
    to divide them (FSDP and DDP, which would, leave these parameters alone).

    The hooks are registered at the module's forward, on the parameters it holds then: loading
    a checkpoint (``from_pretrained`` fills meta parameters) replaces the parameter objects, and
    a hook registered now would stay on the replaced ones."""

    def divide(grad: torch.Tensor) -> torch.Tensor:
        return grad / factor

    def hook_parameters(module: nn.Module, args) -> None:
        for p in module.parameters():
            if p.requires_grad and not getattr(p, "_hf_scale_divided", False):
                p.register_hook(divide)
                p._hf_scale_divided = True

    module.register_forward_pre_hook(hook_parameters)


def unsplit_parameters(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters that are plain tensors, not the ``DTensor`` shards the ep
    (or tp) split made: an experts module holding one cannot be left out of data parallel whole
    (nothing would average that parameter's gradient over the ranks)."""
    return [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
