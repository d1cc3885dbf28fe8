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
``Shard(0)`` on the ep mesh; FSDP then shards it over the ranks holding the same experts.

Usage::

    apply_ep(model, ep_mesh, {"model.layers.0.mlp.experts": ("gate_up_proj", "down_proj")})
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def apply_ep(model: nn.Module, ep_mesh, experts: Mapping[str, tuple[str, ...]]) -> None:
    """Shard the expert-indexed parameters of each module in ``experts`` (module name -> its
    parameter names) over ``ep_mesh`` on dim 0, and route its calls through a
    :class:`TokenDispatcher`. The module keeps its class, forward and ``num_experts`` contract:
    ``num_experts`` becomes the local count, so its forward runs on local expert ids."""
    ep = ep_mesh.size()
    for name, params in experts.items():
        module = model.get_submodule(name)
        total = getattr(module, params[0]).shape[0]
        for p in params:
            param = getattr(module, p)
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            module.register_parameter(p, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if hasattr(module, "num_experts"):
            module.num_experts = total // ep
        dispatcher = TokenDispatcher(ep_mesh.get_group(), ep, total // ep)
        module.forward = _expert_parallel_forward(module, module.forward, dispatcher, params)
        module._hf_scale_ep = dispatcher


def _expert_parallel_forward(module: nn.Module, experts_forward, dispatcher: TokenDispatcher, params):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs):
        def local_experts(rows, ids, weights):
            with local_parameters(module, params):
                return experts_forward(rows, ids, weights, *args, **kwargs)

        return dispatcher(hidden_states, top_k_index, top_k_weights, local_experts)

    return forward


@contextlib.contextmanager
def local_parameters(module: nn.Module, names):
    """Within the block, ``module.<name>`` is the local tensor of its DTensor parameter (the
    experts this rank holds; gradients flow back to the DTensor), so the model's forward,
    written for plain tensors, runs unchanged."""
    saved = {}
    for n in names:
        value = module._parameters.get(n)
        if isinstance(value, DTensor):
            saved[n] = value
            module._parameters[n] = value.to_local()
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
        send_counts = torch.bincount(expert_ids, minlength=self.ep * self.num_local).view(self.ep, self.num_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_sizes, recv_sizes = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
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
        per_slot = back[torch.argsort(order)].view(num_tokens, k, -1)
        weighted = per_slot * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(hidden_states.dtype)


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
