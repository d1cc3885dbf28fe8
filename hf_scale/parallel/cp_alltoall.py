"""Context parallel's all-to-all exchange (Ulysses): heads for sequence, then ordinary attention.

Under ``cp_exchange="alltoall"`` each attention call of :mod:`hf_scale.parallel.cp` exchanges
this rank's queries, keys and values ``[batch, heads, S/cp, dim]`` (its part of the sequence,
every head) for ``[batch, heads/cp, S, dim]`` (the whole sequence, its share of the heads) with
one all-to-all for the queries and one for the keys and values together, puts the sequence back
in global order (the ``head_tail`` layout deals chunks out of order), attends as one process
would, and sends the output back with a third all-to-all. Each exchange has autograd: its
backward is the opposite exchange of the gradient. No rank ever holds the whole sequence's keys
and values of every head (the all-gather's per-layer peak); what a layer keeps for backward is
``heads/cp x S``, the same bytes as ``heads x S/cp``.

The attention in global order: plain causal layers call SDPA with ``is_causal`` and no mask (one
call per packed document, each document's own keys only), on any device; sliding windows shorter
than the sequence and soft-capping take :mod:`hf_scale.parallel.cp`'s dense mask of global
positions (``S x S`` per layer kind).

Heads are dealt whole: the attention heads and the key-value heads must both be divisible by
cp; key-value heads fewer than cp that divide it are repeated up to cp (each rank one key-value
head, the gradient of the copies summed by autograd). :func:`check_heads` refuses the rest.

Usage::

    check_heads(model.config, cp)                                     # before training, every rank
    q, k, v = to_heads(query, key, value, group, order)               # [batch, heads/cp, S, dim] each
    out = causal(q, k, v, starts, scale, dropout)                     # global order, no mask
    out = to_sequence(out, group, order)                              # [batch, heads, S/cp, dim]
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ..errors import HfScaleConfigError


def heads_of(config) -> tuple[int, int]:
    """The model's attention heads and key-value heads (the text model's, for composite configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv


def check_heads(config, cp: int) -> None:
    """Refuse an all-to-all over ``cp`` ranks that cannot deal whole heads to every rank."""
    heads, kv = heads_of(config)
    if heads is None:
        raise HfScaleConfigError(
            f"cp_exchange='alltoall': {type(config).__name__} has no num_attention_heads to deal out over the cp "
            "ranks. Use cp_exchange='allgather'."
        )
    if heads % cp or (kv % cp and cp % kv):
        raise HfScaleConfigError(
            f"cp_exchange='alltoall' with cp={cp}: the model has {heads} attention heads and {kv} key-value heads; "
            "the all-to-all deals whole heads to the cp ranks, so both must be divisible by cp (key-value heads "
            f"fewer than cp must divide it: they are repeated). Use cp_exchange='allgather', or a cp that divides "
            f"{heads} and {kv}."
        )


class _ToHeads(torch.autograd.Function):
    """``[batch, heads, s, dim]`` split over the sequence -> ``[batch, heads/cp, cp*s, dim]``
    (the ranks' parts concatenated in rank order); the backward is :class:`_ToSequence`."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _ToSequence(torch.autograd.Function):
    """The inverse of :class:`_ToHeads`; its backward is :class:`_ToHeads`' forward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Block r of ``send`` (dim 0, equal blocks) to rank r; block r of the result from rank r."""
    return funcol.wait_tensor(funcol.all_to_all_single(send.contiguous(), None, None, group))


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # [cp: the rank that gets these heads, ...]
    got = _all_to_all(send, group)  # [cp: the rank whose positions these are, b, h/cp, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    b, hl, n, d = x.shape
    send = x.reshape(b, hl, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # [cp: the rank whose positions, ...]
    got = _all_to_all(send, group)  # [cp: the rank whose heads these are, b, h/cp, s, d]
    return got.transpose(0, 1).reshape(b, cp * hl, n // cp, d)


def to_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
             order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's positions of every head -> the whole sequence of this rank's heads, in global
    order (``order``: the gathered positions' permutation to global order, None when they are in
    order already). Two all-to-alls: the queries, then the keys and values together (key-value
    heads fewer than cp repeated to cp first)."""
    cp = dist.get_world_size(group)
    dk = key.shape[-1]
    kv = torch.cat([key, value], dim=-1)
    if kv.shape[1] < cp:
        kv = kv.repeat_interleave(cp // kv.shape[1], dim=1)
    query, kv = _ToHeads.apply(query, group), _ToHeads.apply(kv, group)
    if order is not None:
        query, kv = query.index_select(2, order), kv.index_select(2, order)
    return query, kv[..., :dk], kv[..., dk:]


def to_sequence(out: torch.Tensor, group, gathered: torch.Tensor | None) -> torch.Tensor:
    """The attention's output ``[batch, heads/cp, S, dim]`` in global order -> this rank's
    positions of every head (``gathered``: the global position of each gathered place, None when
    in order): one all-to-all."""
    if gathered is not None:
        out = out.index_select(2, gathered)
    return _ToSequence.apply(out, group)


def causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[list[int]] | None,
           scale: float | None, dropout: float) -> torch.Tensor:
    """Causal attention over the whole sequence in global order without a mask: one SDPA call
    (``is_causal``) for rows of one document, else one per row and packed document (``starts``:
    each row's document starts, 0 first), a document seeing its own keys only."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    if starts is None:
        return attend(query, key, value)
    length = query.shape[2]
    rows = []
    for b, row in enumerate(starts):
        cuts = [*row, length]
        rows.append(torch.cat([attend(*(t[b:b + 1, :, lo:hi] for t in (query, key, value)))
                               for lo, hi in itertools.pairwise(cuts)], dim=2))
    return torch.cat(rows, dim=0)
