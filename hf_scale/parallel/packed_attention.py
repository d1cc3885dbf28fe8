"""Packed documents attended one at a time: one causal SDPA call per document, not one masked
call over the whole row.

transformers keeps packed documents apart (``position_ids`` restarting at 0, no attention mask,
no cache) with a block-diagonal causal mask over the whole row: SDPA then scores every query
against every key of the row and throws all but the diagonal blocks away, and a masked call
cannot take SDPA's causal kernels. A row of documents of lengths ``n_d`` costs ``(sum n_d)^2``
where its documents need ``sum n_d^2`` (a 512-token row of four documents: ~3x less attention
work; a padding-free batch, one row of every document of the micro-batch: more).

:func:`packed_attention` is transformers' ``sdpa`` attention function, registered in its
``AttentionInterface`` as ``"hf_scale_packed"`` (with sdpa's mask function): where the mask a
layer is handed is exactly causal attention within documents (checked against the mask itself,
once per mask tensor), each document is attended alone with ``is_causal``, through transformers'
own ``sdpa_attention_forward`` (its grouped-query and scaling logic unchanged); every other call
(a padding mask, a cache, a sliding window shorter than a document, an additive mask, ...) goes
to ``sdpa_attention_forward`` as it is. So the results are sdpa's, document by document.

Usage::

    apply_packed_attention(model)   # before the first forward; a no-op unless it uses "sdpa"
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

NAME = "hf_scale_packed"  # the attention function's name in transformers' registry
_STARTS = "_hf_scale_document_starts"  # set on a mask tensor: its rows' document starts, or False


def document_starts(mask: torch.Tensor) -> list[list[int]] | None:
    """Each row's document starts (0 first) when ``mask`` (boolean ``[batch, 1, L, L]``) is
    exactly causal attention within documents, else None. A document starts where a query may
    not see the key just before it; the mask must then equal the block-diagonal causal mask of
    those documents (a sliding window shorter than a document, or a padding mask, does not)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    rows = mask[:, 0]
    length = rows.shape[-1]
    starts = torch.ones(rows.shape[0], length, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = ~rows.diagonal(offset=-1, dim1=-2, dim2=-1)
    doc = starts.cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if not torch.equal((doc[:, :, None] == doc[:, None, :]) & causal, rows):
        return None
    return [torch.nonzero(row).flatten().tolist() for row in starts]


def _starts_of(mask: torch.Tensor) -> list[list[int]] | None:
    """:func:`document_starts`, computed once per mask tensor (every layer, and activation
    checkpointing's recomputation, is handed the same one)."""
    cached = getattr(mask, _STARTS, None)
    if cached is None:
        cached = document_starts(mask) or False
        setattr(mask, _STARTS, cached)
    return cached or None


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (``[batch, heads, seq, dim]`` in, ``[batch, seq, heads,
    dim]`` out): per document under a block-diagonal causal mask, else sdpa unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    starts = None
    if (attention_mask is not None and causal and kwargs.get("position_bias") is None
            and query.shape[2] == key.shape[2] == attention_mask.shape[-1]):
        starts = _starts_of(attention_mask)
    if starts is None or len(starts) not in (1, query.shape[0]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    length = query.shape[2]
    rows = []
    for b, row in enumerate(starts * query.shape[0] if len(starts) == 1 else starts):
        pieces = [sdpa_attention_forward(module, *(t[b:b + 1, :, lo:hi] for t in (query, key, value)), None,
                                         dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
                  for lo, hi in itertools.pairwise([*row, length])]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


def apply_packed_attention(model: nn.Module) -> bool:
    """Switch ``model`` from transformers' ``"sdpa"`` to :func:`packed_attention` (registered
    with sdpa's mask function); True if it did. Models on another attention implementation, or
    that do not take a registered one, keep theirs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError, NotImplementedError):
        return False
    if model.config._attn_implementation == NAME:
        return True
    model.set_attn_implementation("sdpa")
    return False
