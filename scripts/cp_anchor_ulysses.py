"""The anchor leg of ``bench_cp.py``: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``)
around SDPA in a plain transformers Llama, trained by torch DDP over the sequence-parallel group.

This is how DeepSpeed's own Ulysses examples use it: each rank holds a contiguous 1/cp of the
sequence (its tokens, their global ``position_ids``); every attention layer's q, K and V go through
DeepSpeed's all-to-all (sequence gathered, heads scattered), SDPA runs causal over the whole
sequence on the rank's heads, and the output comes back the same way. Key-value heads that cp
does not divide are repeated first (as hf_scale's all-to-all exchange does). The loss is each
rank's share of one process's mean over the sequence (labels shifted over the whole sequence
before it is split); DDP sums the ranks' gradients (its mean times cp), so the step is one
process's. DeepSpeed is a benchmark-only anchor: it is not a dependency; ``bench_cp.py
--deepspeed DIR`` puts a folder holding it on this worker's path (see that script's doc).
"""

from __future__ import annotations

NAME = "deepspeed_ulysses"


def build(model, cp: int):
    """Register DeepSpeed's distributed attention as ``model``'s attention implementation and wrap
    ``model`` in DDP over the default group; the wrapped model and a ``step(ids) -> loss`` function
    taking the WHOLE sequence (every rank the same) and training on this rank's part."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm wraps the existing group
    group = dist.group.WORLD
    rank = dist.get_rank()
    kv = model.config.num_key_value_heads
    repeat = cp // kv if kv % cp and cp % kv == 0 else 1
    scale = None

    def local(q, k, v):  # [b, s, h/cp, d], the whole sequence
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    ulysses = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        nonlocal scale
        scale = scaling
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        out = ulysses(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0)
        return out.contiguous(), None  # [b, s/cp, h, d], as transformers' sdpa returns

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)

    def step(ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length % cp:
            raise ValueError(f"the sequence ({length} tokens) does not split into cp={cp} equal parts")
        part = length // cp
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # shifted whole
        mine = slice(rank * part, (rank + 1) * part)
        positions = torch.arange(rank * part, (rank + 1) * part).unsqueeze(0)
        logits = ddp(input_ids=ids[:, mine], position_ids=positions).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, mine].flatten(), ignore_index=-100,
                               reduction="sum") / (length - 1)
        (loss * cp).backward()  # DDP averages over the cp ranks: the sum of the parts
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total

    return ddp, step
