"""Context parallel's all-gather attention without an ``S/cp x S`` mask, on any device: each of
this rank's query chunks attends to the prefix of the gathered keys it may see, causally aligned
to the prefix's end (lower-right).

A rank holds whole chunks of ``chunk`` tokens at known global chunk indices (``head_tail``: two,
``contiguous``: one; :func:`hf_scale.parallel.cp.chunks_held`). The queries of global chunk
``a`` see the keys ``0 .. (a + 1) chunk - 1`` causally: query ``i`` of the chunk (global position
``a chunk + i``) sees key ``j`` when ``j <= i + a chunk``, the causal triangle aligned to the
lower right of a ``chunk x (a + 1) chunk`` block (``torch.nn.attention.bias.causal_lower_right``).
So each chunk is one SDPA call on a contiguous slice of the gathered K / V, without a mask
tensor: on CUDA torch dispatches that bias to flash attention (``is_causal`` there means lower
right) or to the memory-efficient kernel (its lower-right mask type), neither of which makes the
``chunk x prefix`` scores; what a layer keeps for backward is linear in the sequence (the
gathered K / V, this rank's queries, output and log-sum-exp). A chunk whose prefix is itself
(global chunk 0) is plain ``is_causal``.

Where it applies (:func:`hf_scale.parallel.cp.cp_attention`, ``cp_attention="auto"``): plain
causal layers (no sliding window shorter than the sequence, no soft-capping) of unpacked rows,
off the CPU; the CPU has its own mask-free path (:mod:`hf_scale.parallel.cp_blocks`, which also
keeps packed documents apart without a mask). Packed documents, sliding windows and
soft-capping keep the masked path (a document boundary or a window inside a chunk's prefix is
not a lower-right triangle). On a CPU tensor (tests, a layer the blocks do not take) the lower
right triangle is materialised as a boolean ``chunk x prefix`` mask (torch's dispatch of the
bias does so: its CPU kernels have no lower-right mode).

Grouped-query heads: passed as they are (``enable_gqa``) to flash attention (fp16 / bf16), which
takes them; repeated for the fp32 kernels, which do not.

Usage::

    kv = gathered_in_global_order                       # [batch, kv_heads, S, dk + dv]
    out = prefix_attention(query, key, value, held, chunk, scale, dropout)   # [batch, heads, S/cp, dv]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention.bias import CausalBias, CausalVariant

_HALF = (torch.float16, torch.bfloat16)


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, held: list[int], chunk: int,
                     scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's ``query`` ``[batch, heads, len(held) chunk, dim]`` (its
    global chunks ``held``, in local order, of ``chunk`` tokens each) over the whole sequence's
    ``key`` / ``value`` ``[batch, kv_heads, S, dim]`` in GLOBAL order: chunk ``a`` against keys
    ``0 .. (a + 1) chunk``, lower-right causal. Returns ``[batch, heads, len(held) chunk, dv]``."""
    outs = []
    for j, a in enumerate(held):
        end = (a + 1) * chunk
        q = query[:, :, j * chunk:(j + 1) * chunk]
        outs.append(lower_right(q, key[:, :, :end], value[:, :, :end], scale, dropout))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def lower_right(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of the LAST ``query.shape[2]`` positions of a ``key.shape[2]``-token
    sequence (query ``i`` sees keys ``0 .. i + key.shape[2] - query.shape[2]``), by the fused
    kernels' lower-right causal mode where the device has one (module doc)."""
    lq, lk = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and query.dtype not in _HALF and query.device.type != "cpu":
        # the memory-efficient kernel (fp32) takes no grouped heads: torch would fall back to a mask
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    gqa = query.shape[1] != key.shape[1]
    if lq == lk:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=lower_right_bias(lq, lk), dropout_p=dropout,
                                          scale=scale, enable_gqa=gqa)


def lower_right_bias(lq: int, lk: int) -> CausalBias:
    """``torch.nn.attention.bias.causal_lower_right(lq, lk)`` without the uninitialised ``[2, lq,
    lk]`` float32 host tensor its constructor allocates (``torch.Tensor(*sizes)`` underneath: 64
    GiB of address space at 64k queries over 128k keys): the bias is a size-0 meta tensor that
    carries the variant and the lengths, all SDPA's dispatch of it reads. Made outside any fake
    tensor mode (a simulation), which cannot make a tensor subclass."""
    with unset_fake_temporarily():
        bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0, device="meta"))
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, lq, lk
    return bias

