"""Context parallel attention without a mask: this rank's query chunks against the gathered keys
in blocks, merged by their log-sum-exp, with K and V gathered for the forward, freed, and
gathered again for the backward (only this rank's S/cp part is saved).

Plain causal attention over a sequence split into chunks (``hf_scale.parallel.cp``'s layouts:
rank r holds whole chunks of ``chunk`` tokens at known global chunk indices) needs no mask: the
queries of global chunk ``a`` see every key of chunks ``0 .. a-1`` entirely (one attention call
without a mask, its keys a contiguous slice of the sequence) and chunk ``a``'s own keys causally
(one call with ``is_causal=True`` on a square block). The two partial results are merged as
flash / ring attention merges them, by their log-sum-exp ``L``:
``out = sum_i out_i * exp(L_i - L)``, ``L = logsumexp_i(L_i)``. The backward of each block is the
flash backward evaluated with the MERGED output and log-sum-exp (the probabilities
``exp(scores - L)`` and ``rowsum(dout * out)`` of the whole row), which gives each block's exact
share of the gradient; the key / value gradients of the whole sequence are summed and
reduce-scattered to the ranks that own them.

Memory per layer and rank, for backward: this rank's queries, keys, values, output and
log-sum-exp (all S/cp); not the gathered K / V (S) nor a mask (S/cp x S). The cost is a second
all-gather of K and V in the backward (no third one under activation checkpointing: a forward
recomputed inside the backward keeps what it gathered). Grouped-query heads are not repeated
for the blocks without a mask (the query heads of one key head are laid out as one longer query
sequence); only the diagonal block (``chunk`` keys) is repeated.

The kernels are torch's CPU flash attention ops (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), which return the log-sum-exp; on other devices, and for what the blocks do not
express (packed documents, sliding windows, soft-capping, attention dropout, key and value head
sizes that differ), ``hf_scale.parallel.cp`` keeps its masked attention.

Usage::

    out = block_attention(query, key, value, group, chunks, chunk, scale)  # [batch, heads, S/cp, dim]
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                    chunks: list[list[int]], chunk: int, scale: float, stash: dict | None = None,
                    slot=None) -> torch.Tensor:
    """Causal attention of this rank's ``query`` ``[batch, heads, S/cp, dim]`` over the whole
    sequence, whose keys and values ``[batch, kv_heads, S/cp, dim]`` are split over ``group``.
    ``chunks[r]``: the global chunk indices rank r holds, in its local order; ``chunk``: their
    length. ``stash`` / ``slot``: where a forward recomputed inside the backward (activation
    checkpointing: a new autograd node, whose backward is not the one that runs) leaves the K / V
    it gathered for the original node's backward, under the calling layer's ``slot``.
    Returns ``[batch, heads, S/cp, dim]``; differentiable in all three inputs."""
    return _BlockAttention.apply(query, key, value, group, chunks, chunk, scale, stash, slot)


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the block kernels take these tensors (CPU flash attention: one head size)."""
    return (query.device.type == "cpu" and key.shape[-1] == value.shape[-1] == query.shape[-1]
            and query.shape[1] % key.shape[1] == 0)


class _Gathered:
    """The whole sequence's keys and values in global order, gathered from the group's ranks."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, group, chunks: list[list[int]], chunk: int):
        self.dim = key.shape[-1]
        kv = torch.cat([key, value], dim=-1).contiguous()  # [batch, kv_heads, S/cp, 2 dim]: one collective
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(kv, 0, group))  # [cp * batch, ...]
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
    def forward(ctx, query, key, value, group, chunks, chunk, scale, stash, slot):
        rank = torch.distributed.get_rank(group)
        gathered = _Gathered(key, value, group, chunks, chunk)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        outs, lses = [], []
        for j, a in enumerate(chunks[rank]):
            q = query[:, :, j * chunk:(j + 1) * chunk]
            k, v = (t[:, :, a * chunk:(a + 1) * chunk] for t in (gathered.key, gathered.value))
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out, lse = _FORWARD(q, k, v, 0.0, True, scale=scale)  # the diagonal block, causal
            if a > 0:  # every earlier chunk, entirely visible: no mask
                past, past_lse = _FORWARD(_grouped(q, kv_heads), gathered.key[:, :, : a * chunk],
                                          gathered.value[:, :, : a * chunk], 0.0, False, scale=scale)
                past, past_lse = _ungrouped(past, heads), _ungrouped(past_lse, heads)
                merged = torch.logaddexp(lse, past_lse)
                out = (out * (lse - merged).exp().unsqueeze(-1).to(out.dtype)
                       + past * (past_lse - merged).exp().unsqueeze(-1).to(out.dtype))
                lse = merged
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        # a forward recomputed inside the backward (activation checkpointing) keeps what it
        # gathered: its backward runs right after, and a third all-gather would buy nothing
        if stash is not None and torch._C._current_graph_task_id() != -1:
            stash[slot] = gathered
        ctx.stash, ctx.slot = stash, slot
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.chunks, ctx.chunk, ctx.scale = group, chunks, chunk, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        chunks, chunk, scale, group = ctx.chunks, ctx.chunk, ctx.scale, ctx.group
        kept = ctx.stash.pop(ctx.slot, None) if ctx.stash is not None else None
        gathered = kept or _Gathered(key, value, group, chunks, chunk)
        rank = torch.distributed.get_rank(group)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        grad_out = grad_out.contiguous()
        acc = torch.promote_types(key.dtype, torch.float32)
        grad_kv = torch.zeros(gathered.kv.shape, dtype=acc, device=key.device)  # the whole sequence's
        dim = key.shape[-1]
        grad_q = []
        for j, a in enumerate(chunks[rank]):
            rows = slice(j * chunk, (j + 1) * chunk)
            q, g, o, m = query[:, :, rows], grad_out[:, :, rows], out[:, :, rows], lse[:, :, rows]
            k, v = (t[:, :, a * chunk:(a + 1) * chunk] for t in (gathered.key, gathered.value))
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            dq, dk, dv = _BACKWARD(g, q, k, v, o, m, 0.0, True, scale=scale)
            if groups > 1:
                dk, dv = (t.unflatten(1, (kv_heads, groups)).sum(2) for t in (dk, dv))
            grad_kv[:, :, a * chunk:(a + 1) * chunk, :dim] += dk
            grad_kv[:, :, a * chunk:(a + 1) * chunk, dim:] += dv
            if a > 0:
                dq_past, dk, dv = _BACKWARD(
                    _grouped(g, kv_heads), _grouped(q, kv_heads), gathered.key[:, :, : a * chunk],
                    gathered.value[:, :, : a * chunk], _grouped(o, kv_heads), _grouped(m, kv_heads),
                    0.0, False, scale=scale)
                dq = dq + _ungrouped(dq_past, heads)
                grad_kv[:, :, : a * chunk, :dim] += dk
                grad_kv[:, :, : a * chunk, dim:] += dv
            grad_q.append(dq)
        del gathered
        # back to the gathered layout (rank, then its chunks), summed onto the rank that owns each
        cp, per = len(chunks), len(chunks[0])
        b, h, _, d2 = grad_kv.shape
        ranks, local = _order(chunks)
        by_rank = torch.empty(b, h, cp, per, chunk, d2, dtype=key.dtype, device=key.device)
        by_rank[:, :, ranks, local] = grad_kv.view(b, h, cp * per, chunk, d2).to(key.dtype)
        by_rank = by_rank.permute(2, 0, 1, 3, 4, 5).reshape(cp * b, h, per * chunk, d2)
        mine = funcol.wait_tensor(funcol.reduce_scatter_tensor(by_rank, "sum", 0, group))
        return torch.cat(grad_q, dim=2), mine[..., :dim], mine[..., dim:], None, None, None, None, None, None
