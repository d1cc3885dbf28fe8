"""Context parallel (``Layout.cp``) in the planner: memory, exchange bytes and attention work.

What :mod:`hf_scale.parallel.cp` does to one rank, read from its code:

- the rank runs ``S/cp`` of each sequence's ``S`` tokens (``S`` padded to a multiple of the
  layout's granule: ``2 cp`` for ``head_tail``, ``cp`` for ``contiguous``), and FSDP shards over
  ``dp_shard x cp`` (DDP averages over ``dp_replicate x cp``): everything but attention is that of
  the layout with ``cp`` folded into the data-parallel degree and ``S/cp``-token sequences
  (:func:`flat_layout`, :func:`local_work`), the activations falling as ``1/cp``;
- attention adds, per layer (:func:`attention_bytes`), by the path the layer takes:

  * ``allgather`` in blocks without a mask (``cp_attention="auto"`` on the CPU, plain causal
    layers): it keeps this rank's ``S/cp`` queries, keys, values, output and log-sum-exp (what
    one process keeps for ``S/cp`` tokens: nothing more); while it runs, the gathered K / V of
    the whole sequence and, in backward, their fp32 gradient and the reduce-scatter's input;
  * ``allgather`` on other devices, plain causal layers (:mod:`hf_scale.parallel.cp_prefix`):
    each query chunk against the prefix of keys it may see, lower-right causal, no mask: it keeps
    each chunk's prefix of K / V repeated for grouped-query heads (the fused kernel's; ``(2 cp +
    1) / (2 cp)`` of the sequence on every ``head_tail`` rank, ``S`` on the last ``contiguous``
    one) where one process keeps ``S/cp`` of the key-value heads; while it runs, the gathered K /
    V in gather and in global order (in backward their gradient and the reduce-scatter's input);
  * ``allgather`` under a mask (sliding windows shorter than the sequence, soft-capping): it keeps the
    gathered K / V repeated for grouped-query heads (``S`` tokens, every head) and the fused
    kernel's additive mask (``S/cp x S`` in the compute dtype), where one process keeps ``S/cp``
    of the key-value heads; the boolean mask (``S/cp x S`` bytes per window kind) lives through
    the step; backward makes the gradients of the repeated K / V and of the gathered ones;
  * ``alltoall``: queries, keys and values of ``heads/cp`` heads over ``S`` tokens (the same bytes
    as every head over ``S/cp``), the key-value heads repeated up to the query heads for the fused
    kernel; while it runs, the exchange's buffers (q, k, v and the output, out and back).

- the exchange per layer (:func:`exchange_bytes`, bytes this rank receives): ``allgather``:
  forward ``(cp-1)/cp`` of the whole sequence's K / V, the backward their gradients' reduce-scatter
  (the same bytes), the block path gathering them again in backward (not under full checkpointing,
  where the recomputed forward's gather is kept for it); ``alltoall``: ``(cp-1)/cp`` of q, k / v
  and the output, out in forward and back in backward (three all-to-alls each). A recomputed
  forward (full checkpointing) exchanges again.
- the attention work: causal attention of ``S`` tokens costs ``S^2/2`` per head; a rank holding
  chunks ``a`` does ``sum (a + 1/2)`` of the ``sum over all chunks``: the same on every rank under
  ``head_tail``, ``(2 cp - 1) / cp`` of the mean on the last rank under ``contiguous``
  (:func:`attention_share`).

cp stays inside a node (the chooser tries degrees up to the ranks per node): its exchange is on
the critical path, every layer.

Checked by tests/unit/test_planner_cp.py (each term, and a simulated cp layout: its peak and the
collectives it issues) and, at Llama-3-8B scale, ``scripts/simulate_published.py --parts cp``
(docs/benchmarks.md, section simulate-cp).

Usage::

    flat, local = flat_layout(layout), local_work(work, layout)
    extra = attention_bytes(facts, layout, work)        # per layer: kept, while running, held
    exchange_bytes(facts, layout, work)                  # {"forward": ..., "backward": ..., "collectives": ...}
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from .profile import DTYPE_BYTES

# Layout and Workload (``.estimate``) appear in annotations only: estimate imports this module, not back.


def granule(layout: Layout) -> int:
    """What a sequence is padded to a multiple of (:func:`hf_scale.parallel.cp.granule`)."""
    return 2 * layout.cp if layout.cp_layout == "head_tail" else layout.cp


def padded(seq: int, layout: Layout) -> int:
    return -(-seq // granule(layout)) * granule(layout)


def flat_layout(layout: Layout) -> Layout:
    """``layout`` with cp folded into the data-parallel degree FSDP shards (DDP averages) over."""
    if layout.strategy in ("ddp", "zero1"):
        return replace(layout, cp=1, dp_replicate=layout.dp_replicate * layout.cp)
    return replace(layout, cp=1, dp_shard=layout.dp_shard * layout.cp)


def local_work(work: Workload, layout: Layout) -> Workload:
    """``work`` as one rank of the cp group runs it: ``S/cp`` tokens per sequence."""
    return replace(work, seq=padded(work.seq, layout) // layout.cp)


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # the shortest sliding window (None: none)
    kinds: int  # mask kinds a forward builds (full, and one per window)
    softcap: bool


def attention_shape(facts) -> Shape:
    from ..parallel.cp_alltoall import heads_of

    config = facts.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv = heads_of(config)
    dim = getattr(text, "head_dim", None) or facts.hidden // heads
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is not None and "sliding_attention" not in types:
        window = None
    kinds = len(set(types)) if types else 1
    softcap = bool(getattr(text, "attn_logit_softcapping", None))
    return Shape(heads, kv, dim, window, kinds, softcap)


def allgather_path(facts, layout: Layout, work: Workload) -> str:
    """The path the allgather exchange's layers take (:func:`hf_scale.parallel.cp.cp_attention`; the
    planner's rows are unpacked): ``masked`` for a window shorter than the sequence or soft-capping,
    else ``blocks`` on the CPU and ``prefix`` (each query chunk against its keys' prefix,
    lower-right causal, :mod:`hf_scale.parallel.cp_prefix`) elsewhere."""
    shape = attention_shape(facts)
    seq = padded(work.seq, layout)
    if shape.softcap or (shape.window is not None and shape.window < seq):
        return "masked"
    return "blocks" if work.device == "cpu" else "prefix"


def prefix_keys(layout: Layout, seq: int) -> int:
    """The keys the busiest rank's query chunks attend to on the prefix path, summed over its
    chunks (chunk ``a`` sees ``(a + 1) chunk`` keys): ``(2 cp + 1) / (2 cp)`` of the sequence on
    every rank under ``head_tail``, the whole sequence on the last rank under ``contiguous``."""
    from ..parallel.cp import chunks_held

    held = chunks_held(layout.cp, layout.cp_layout)
    chunk = seq // (layout.cp * len(held[0]))
    return max(sum(a + 1 for a in chunks) for chunks in held) * chunk


class AttentionBytes(NamedTuple):
    """Per rank: what one layer keeps for backward beyond one process's ``S/cp``-token profile
    (``kept``), what exists only while a layer runs (``running``: forward and backward, the larger),
    and what lives through the whole step (``held``: the boolean masks)."""

    kept: int
    running: int
    held: int


def attention_bytes(facts, layout: Layout, work: Workload) -> AttentionBytes:
    """The attention terms of one micro-batch (module doc) under ``layout.cp``."""
    if layout.cp == 1:
        return AttentionBytes(0, 0, 0)
    h, kv, dh, _, kinds, _ = attention_shape(facts)
    d = DTYPE_BYTES[layout.precision]
    b = layout.micro_batch
    seq = padded(work.seq, layout)
    local = seq // layout.cp
    if layout.cp_exchange == "alltoall":
        kv_sent = max(kv, layout.cp)  # key-value heads fewer than cp are repeated up to cp
        kept = b * 2 * (h - kv) * local * dh * d  # k, v repeated to the query heads for the fused kernel
        buffers = b * (2 * h + 2 * kv_sent) * local * dh * d  # q, k / v, the output
        return AttentionBytes(kept, 2 * buffers, 0)
    gathered = b * seq * kv * 2 * dh * d  # the whole sequence's K and V
    path = allgather_path(facts, layout, work)
    if path == "prefix":
        return _prefix_bytes(h, kv, dh, d, b, seq, local, prefix_keys(layout, seq))
    if path == "blocks":
        # blocks: the gathered K / V while a layer runs; in backward their fp32 gradient and the
        # reduce-scatter's input in the compute dtype beside them
        return AttentionBytes(0, gathered + b * seq * kv * 2 * dh * 4 + gathered, 0)
    repeated = b * seq * h * 2 * dh * d  # K / V repeated for grouped-query heads
    bias = local * seq * d  # the fused kernel's additive mask (one row of the batch: no packed documents)
    kept = repeated + bias - b * 2 * local * kv * dh * d  # one process keeps S/cp of the key-value heads
    # forward: the boolean mask inverted while the additive one is made from it (SDPA's conversion);
    # backward: the gradients of the repeated K / V and of the gathered ones
    return AttentionBytes(kept, max(local * seq, repeated + gathered), kinds * local * seq)


def _prefix_bytes(h: int, kv: int, dh: int, d: int, b: int, seq: int, local: int, keys: int) -> AttentionBytes:
    """The prefix path's terms (:func:`attention_bytes`): each chunk's SDPA keeps the keys and
    values of its prefix (``keys`` over the rank's chunks), repeated to the query heads for the
    fused kernel (the simulation's; without grouped heads the gathered K / V themselves), where one
    process keeps ``S/cp`` of the key-value heads. While it runs: the gathered K / V twice (in
    gather order and in global order; in backward their gradient and the reduce-scatter's input).
    The repeated prefixes' gradients exist in attention's backward only, after the MLP's gradients
    (the block's backward workspace, :func:`.estimate.activation_bytes`) are freed."""
    gathered = b * seq * kv * 2 * dh * d
    kept_kv = b * keys * h * 2 * dh * d if h != kv else gathered
    kept = kept_kv - b * 2 * local * kv * dh * d
    return AttentionBytes(kept, 2 * gathered, 0)


def exchange_bytes(facts, layout: Layout, work: Workload) -> dict[str, float]:
    """Bytes one rank receives per layer and micro-batch (module doc): ``forward``, ``backward``
    (a full checkpoint's recomputed forward included), and the ``collectives`` they take."""
    if layout.cp == 1:
        return {"forward": 0.0, "backward": 0.0, "collectives": 0}
    h, kv, dh = attention_shape(facts)[:3]
    d = DTYPE_BYTES[layout.precision]
    b, cp = layout.micro_batch, layout.cp
    seq = padded(work.seq, layout)
    off = (cp - 1) / cp
    recompute = layout.ac == "full"
    if layout.cp_exchange == "alltoall":
        one = b * (2 * h + 2 * max(kv, cp)) * (seq // cp) * dh * d * off  # q, k / v, out
        return {"forward": one, "backward": one * (2 if recompute else 1), "collectives": 3 * (3 if recompute else 2)}
    kv_bytes = b * seq * kv * 2 * dh * d * off
    # backward: the gradients' reduce-scatter, and one more gather: the recomputed forward's, or the
    # block path's own (it keeps no gathered K / V)
    again = 1 if recompute or allgather_path(facts, layout, work) == "blocks" else 0
    return {"forward": kv_bytes, "backward": kv_bytes * (1 + again), "collectives": 2 + again}


def attention_share(cp: int, cp_layout: str) -> float:
    """The busiest rank's share of the causal attention work of a sequence (module doc)."""
    from ..parallel.cp import chunks_held

    held = chunks_held(cp, cp_layout)
    work = [sum(a + 0.5 for a in chunks) for chunks in held]
    return max(work) / sum(work)
