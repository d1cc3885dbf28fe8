"""Context parallel attention without a mask: this rank's query chunks against the gathered keys
in blocks, merged by their log-sum-exp, with K and V gathered for the forward, freed, and
gathered again for the backward (only this rank's S/cp part is saved).

Causal attention over a sequence split into chunks (``hf_scale.parallel.cp``'s layouts: rank r
holds whole chunks of ``chunk`` tokens at known global chunk indices) needs no mask: the queries
of global chunk ``a`` see every key of chunks ``0 .. a-1`` entirely (one attention call without
a mask, its keys a contiguous slice of the sequence) and chunk ``a``'s own keys causally (one
call with ``is_causal=True`` on a square block). Packed documents (``position_ids`` restarting)
cut a chunk's queries into runs, one per document (:class:`Piece`): a run sees its document's
keys in earlier chunks entirely and its own keys causally, still without a mask (one row of the
batch per call, then). The two partial results of a run are merged as flash / ring attention
merges them, by their log-sum-exp ``L``: ``out = sum_i out_i * exp(L_i - L)``,
``L = logsumexp_i(L_i)``. The backward of each block is the flash backward evaluated with the
MERGED output and log-sum-exp (the probabilities ``exp(scores - L)`` and ``rowsum(dout * out)``
of the whole row), which gives each block's exact share of the gradient; the key / value
gradients of the whole sequence are summed and reduce-scattered to the ranks that own them.

Memory per layer and rank, for backward: this rank's queries, keys, values, output and
log-sum-exp (all S/cp); not the gathered K / V (S) nor a mask (S/cp x S). The cost is a second
all-gather of K and V in the backward; under activation checkpointing the forward recomputed
inside the backward leaves what it gathered for the backward (``stash``), so a checkpointed layer
gathers once in its backward, as the masked path does. Grouped-query heads are not repeated for
the blocks without a mask (the query heads of one key head are laid out as one longer query
sequence); only the diagonal block (at most ``chunk`` keys) is repeated.

The kernels are torch's CPU flash attention ops (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), which return the log-sum-exp; on other devices, and for what the blocks do not
express (sliding windows shorter than the sequence, soft-capping, attention dropout, key and
value head sizes that differ), ``hf_scale.parallel.cp`` keeps its masked attention.

Usage::

    pieces = plan_pieces(chunks[rank], chunk, None)   # or each row's document starts
    out = block_attention(query, key, value, group, chunks, chunk, pieces, scale)  # [batch, heads, S/cp, dim]
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Piece(NamedTuple):
    """A run of this rank's queries inside one chunk and one document: ``rows`` of the batch,
    their ``local`` positions on this rank, the document's keys in earlier chunks (``past``,
    global positions, all visible; None when the document starts here) and the run's own keys
    (``diag``, global positions, causal)."""

    rows: slice
    local: slice
    past: slice | None
    diag: slice


def plan_pieces(held: list[int], chunk: int, starts: list[list[int]] | None) -> list[Piece]:
    """The pieces of a rank holding global chunks ``held`` (local order) of ``chunk`` tokens;
    ``starts``: each row's document starts (global positions, 0 first), or None for one
    document per row (then a piece covers every row at once)."""
    rows = [(slice(None), [0])] if starts is None else [(slice(b, b + 1), s) for b, s in enumerate(starts)]
    out = []
    for row, doc_starts in rows:
        doc_starts = sorted(doc_starts)
        for j, a in enumerate(held):
            lo, hi = a * chunk, (a + 1) * chunk
            cuts = [lo, *(s for s in doc_starts if lo < s < hi), hi]
            for qs, qe in zip(cuts, cuts[1:]):
                first = doc_starts[bisect.bisect_right(doc_starts, qs) - 1]  # the document's first token
                past = slice(first, qs) if first < qs else None
                out.append(Piece(row, slice(j * chunk + qs - lo, j * chunk + qe - lo), past, slice(qs, qe)))
    return out


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                    chunks: list[list[int]], chunk: int, pieces: list[Piece], scale: float,
                    stash: dict | None = None, slot=None) -> torch.Tensor:
    """Causal attention of this rank's ``query`` ``[batch, heads, S/cp, dim]`` over the whole
    sequence, whose keys and values ``[batch, kv_heads, S/cp, dim]`` are split over ``group``,
    tokens attending within their document only. ``chunks[r]``: the global chunk indices rank r
    holds, in its local order; ``chunk``: their length; ``pieces``: :func:`plan_pieces` for this
    rank. ``stash`` / ``slot``: where a forward recomputed inside the backward (activation
    checkpointing: a new autograd node, whose backward is not the one that runs) leaves the K / V
    it gathered for the original node's backward, under the calling layer's ``slot``.
    Returns ``[batch, heads, S/cp, dim]``; differentiable in all three inputs."""
    return _BlockAttention.apply(query, key, value, group, chunks, chunk, pieces, scale, stash, slot)


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the block kernels take these tensors (CPU flash attention: one head size)."""
    return (query.device.type == "cpu" and key.shape[-1] == value.shape[-1] == query.shape[-1]
            and query.shape[1] % key.shape[1] == 0)


class _Gathered:
    """The whole sequence's keys and values in global order, gathered from the group's ranks."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, group, chunks: list[list[int]], chunk: int):
        self.dim = key.shape[-1]
        kv = torch.cat([key, value], dim=-1).contiguous()  # [batch, kv_heads, S/cp, 2 dim]: one collective
        gathered = funcol.wait_tensor(funcol.all_gather_single(kv, 0, group))  # [cp * batch, ...]
        self.order = _order(chunks)
        cp, per = len(chunks), len(chunks[0])
        b, h, _, d2 = kv.shape
        by_rank = gathered.view(cp, b, h, per, chunk, d2).permute(1, 2, 0, 3, 4, 5)
        ranks, local = self.order
        self.kv = by_rank[:, :, ranks, local].reshape(b, h, cp * per * chunk, d2)  # global order, one copy

    @property
    def key(self) -> torch.Tensor:
        return self.kv[..., : self.dim]

    @property
    def value(self) -> torch.Tensor:
        return self.kv[..., self.dim:]


def _order(chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each global chunk in order: the rank that holds it and its place on that rank."""
    where = {c: (r, j) for r, held in enumerate(chunks) for j, c in enumerate(held)}
    ranks, local = zip(*(where[c] for c in range(len(where))))
    return torch.tensor(ranks), torch.tensor(local)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, heads, n, ...]`` -> ``[batch, kv_heads, groups * n, ...]``: the query heads that
    share a key head as one longer query sequence (heads ordered as ``repeat_interleave``)."""
    b, h, n = t.shape[:3]
    return t.reshape(b, kv_heads, (h // kv_heads) * n, *t.shape[3:])


def _ungrouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, kv_heads, gn = t.shape[:3]
    return t.reshape(b, heads, gn * kv_heads // heads, *t.shape[3:])


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, chunks, chunk, pieces, scale, stash, slot):
        gathered = _Gathered(key, value, group, chunks, chunk)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
        for p in pieces:
            q = query[p.rows, :, p.local]
            k, v = (t[p.rows, :, p.diag] for t in (gathered.key, gathered.value))
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            o, m = _FORWARD(q, k, v, 0.0, True, scale=scale)  # the diagonal block, causal
            if p.past is not None:  # the document's keys in earlier chunks, entirely visible: no mask
                past, past_m = _FORWARD(_grouped(q, kv_heads), gathered.key[p.rows, :, p.past],
                                        gathered.value[p.rows, :, p.past], 0.0, False, scale=scale)
                past, past_m = _ungrouped(past, heads), _ungrouped(past_m, heads)
                merged = torch.logaddexp(m, past_m)  # fp32, as the kernels return it; the sum in fp32 too
                o = (o.float() * (m - merged).exp().unsqueeze(-1)
                     + past.float() * (past_m - merged).exp().unsqueeze(-1)).to(o.dtype)
                m = merged
            out[p.rows, :, p.local] = o
            lse[p.rows, :, p.local] = m
        # a forward recomputed inside the backward (activation checkpointing) leaves what it
        # gathered for the original node's backward, which runs right after: no third gather
        if stash is not None and torch._C._current_graph_task_id() != -1:
            stash[slot] = gathered
        ctx.stash, ctx.slot = stash, slot
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.chunks, ctx.chunk, ctx.pieces, ctx.scale = group, chunks, chunk, pieces, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        chunks, chunk, scale, group = ctx.chunks, ctx.chunk, ctx.scale, ctx.group
        kept = ctx.stash.pop(ctx.slot, None) if ctx.stash is not None else None
        gathered = kept if kept is not None else _Gathered(key, value, group, chunks, chunk)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        acc = torch.promote_types(key.dtype, torch.float32)
        grad_kv = torch.zeros(gathered.kv.shape, dtype=acc, device=key.device)  # the whole sequence's
        grad_q = torch.zeros(query.shape, dtype=acc, device=query.device)
        dim = key.shape[-1]
        for p in ctx.pieces:
            q, g, o, m = (t[p.rows, :, p.local] for t in (query, grad_out, out, lse))
            k, v = (t[p.rows, :, p.diag] for t in (gathered.key, gathered.value))
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            dq, dk, dv = _BACKWARD(g, q, k, v, o, m, 0.0, True, scale=scale)
            if groups > 1:
                dk, dv = (t.unflatten(1, (kv_heads, groups)).sum(2) for t in (dk, dv))
            grad_q[p.rows, :, p.local] += dq
            grad_kv[p.rows, :, p.diag, :dim] += dk
            grad_kv[p.rows, :, p.diag, dim:] += dv
            if p.past is not None:
                dq, dk, dv = _BACKWARD(
                    _grouped(g, kv_heads), _grouped(q, kv_heads), gathered.key[p.rows, :, p.past],
                    gathered.value[p.rows, :, p.past], _grouped(o, kv_heads), _grouped(m, kv_heads),
                    0.0, False, scale=scale)
                grad_q[p.rows, :, p.local] += _ungrouped(dq, heads)
                grad_kv[p.rows, :, p.past, :dim] += dk
                grad_kv[p.rows, :, p.past, dim:] += dv
        del gathered, kept
        # back to the gathered layout (rank, then its chunks), summed onto the rank that owns each
        cp, per = len(chunks), len(chunks[0])
        b, h, _, d2 = grad_kv.shape
        ranks, local = _order(chunks)
        by_rank = torch.empty(b, h, cp, per, chunk, d2, dtype=key.dtype, device=key.device)
        by_rank[:, :, ranks, local] = grad_kv.view(b, h, cp * per, chunk, d2).to(key.dtype)
        del grad_kv
        by_rank = by_rank.permute(2, 0, 1, 3, 4, 5).reshape(cp * b, h, per * chunk, d2)
        mine = funcol.wait_tensor(funcol.reduce_scatter_single(by_rank, "sum", 0, group))
        return (grad_q.to(query.dtype), mine[..., :dim], mine[..., dim:], None, None, None, None, None, None,
                None)
