"""Tensor-parallel plans for architectures whose transformers config declares none (or one we
improve on), as registry data: module patterns relative to the base model -> style, in the
vocabulary of :mod:`hf_scale.parallel.tp`, plus the integer attributes each sharded attention
module's forward reads as a per-rank count (``tp_local_attrs``, divided by tp after sharding).

What each entry rests on (read in transformers' modeling code, v5):

* GPT-2: ``c_attn`` is one Conv1D ``[q; k; v]`` whose forward does ``.split(self.split_size)``
  then ``view(..., -1, head_dim)``: cutting the fused matrix in two would hand rank 0 all of q
  and half of k. ``packed_colwise:3`` gives rank r ``[q_r; k_r; v_r]`` and ``split_size``
  becomes the local width. ``num_heads`` is not read in forward; divided so it tells the truth.
* GPT-NeoX (declared by transformers, kept): ``query_key_value`` output is viewed as
  ``(..., heads, 3 * head_size)`` -- interleaved per head -- so a plain ``colwise`` cut falls
  on head boundaries and each rank gets whole ``[q_h, k_h, v_h]`` groups. No attribute needed.
* OPT: q/k/v are viewed with ``self.num_heads`` (divided); fc1/fc2 the MLP.
* BERT / RoBERTa / DistilBERT: q/k/v viewed with ``-1`` heads of ``attention_head_size``; the
  head counts are divided for consistency only. Pooler and classifier heads stay whole.
* T5: q/k/v/o per attention (self and cross), ``wi``/``wo`` (``wi_0``/``wi_1`` when the
  activation is gated: a callable of the config). ``relative_attention_bias`` is an Embedding
  ``[buckets, heads]``: ``colwise`` shards its heads, and the bias it returns (computed in block
  0, passed to later blocks) holds the local heads. ``n_heads`` sizes the zero bias of the
  cross-attention, so it is divided. The stacks' ``embed_tokens`` are separate modules tied to
  ``shared``: named so that all three get the same vocabulary sharding.
* Phi-3: ``qkv_proj`` packs ``[q; k; v]``; its forward slices q at
  ``self.config.num_attention_heads * head_dim``, k/v with ``self.num_key_value_heads``.
  With as many kv heads as query heads the three parts are equal: ``packed_colwise:3``, and
  the per-module ``config.num_attention_heads`` and ``num_key_value_heads`` become local (the
  engine gives the module its own config copy for a dotted attribute). With GQA the parts differ;
  transformers' own plan (gather qkv, split the input of o_proj) is kept. ``gate_up_proj``
  ``[gate; up]`` is ``packed_colwise`` either way (its ``chunk(2)`` needs no attribute).
"""

from __future__ import annotations

from .base import extend_plan as _add  # keeps the fields an entry has (the encoders' wrap_modules)

_BERT_LAYER = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}
_BERT_ATTRS = {"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}

_add(
    "gpt2",
    tp_plan={
        "h.*.attn.c_attn": "packed_colwise:3",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    tp_local_attrs={"h.*.attn": ("split_size", "num_heads")},
)

_add(
    "opt",
    tp_plan={
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
    tp_local_attrs={"decoder.layers.*.self_attn": ("num_heads",)},
)

_add("bert", tp_plan=_BERT_LAYER, tp_local_attrs=_BERT_ATTRS)
_add("roberta", tp_plan=_BERT_LAYER, tp_local_attrs=_BERT_ATTRS)
_add("roberta-prelayernorm", tp_plan=_BERT_LAYER, tp_local_attrs=_BERT_ATTRS)  # BERT's names, pre-norm

_add(
    "distilbert",
    tp_plan={
        "transformer.layer.*.attention.q_lin": "colwise",
        "transformer.layer.*.attention.k_lin": "colwise",
        "transformer.layer.*.attention.v_lin": "colwise",
        "transformer.layer.*.attention.out_lin": "rowwise",
        "transformer.layer.*.ffn.lin1": "colwise",
        "transformer.layer.*.ffn.lin2": "rowwise",
    },
    tp_local_attrs={"transformer.layer.*.attention": ("n_heads",)},
)


def t5_tp_plan(config) -> dict[str, str]:
    """T5's plan: gated FFNs (T5 v1.1, Flan-T5) have ``wi_0``/``wi_1`` where T5 has ``wi``."""
    plan = {
        "shared": "embedding_rowwise",
        "*.embed_tokens": "embedding_rowwise",
        "*.block.0.layer.0.SelfAttention.relative_attention_bias": "colwise",
    }
    for proj, style in (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise")):
        plan[f"*.block.*.layer.*.*.{proj}"] = style  # SelfAttention and EncDecAttention
    ins = ("wi_0", "wi_1") if getattr(config, "is_gated_act", False) else ("wi",)
    plan.update({f"*.block.*.layer.*.DenseReluDense.{name}": "colwise" for name in ins})
    plan["*.block.*.layer.*.DenseReluDense.wo"] = "rowwise"
    return plan


def t5_tp_local_attrs(config) -> dict[str, tuple[str, ...]]:
    """The attentions' head counts; T5EncoderModel (``is_encoder_decoder=False``) has no decoder."""
    attrs = {"*.block.*.layer.0.SelfAttention": ("n_heads", "inner_dim")}
    if getattr(config, "is_encoder_decoder", True):
        attrs["decoder.block.*.layer.1.EncDecAttention"] = ("n_heads", "inner_dim")
    return attrs


_add("t5", tp_plan=t5_tp_plan, tp_local_attrs=t5_tp_local_attrs)


def phi3_packed_qkv(config) -> bool:
    """Phi-3's fused ``qkv_proj`` splits into equal parts only without GQA."""
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads) == heads


def phi3_tp_plan(config) -> dict[str, str]:
    """Phi-3: packed qkv when its three parts are equal, transformers' gathered qkv otherwise."""
    if phi3_packed_qkv(config):
        attn = {"layers.*.self_attn.qkv_proj": "packed_colwise:3", "layers.*.self_attn.o_proj": "rowwise"}
    else:
        attn = {"layers.*.self_attn.qkv_proj": "colwise_gather_output",
                "layers.*.self_attn.o_proj": "rowwise_split_input"}
    return {**attn, "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"}


def phi3_tp_local_attrs(config) -> dict[str, tuple[str, ...]]:
    """Per-rank counts of the packed layout (none when qkv is gathered whole)."""
    if phi3_packed_qkv(config):
        return {"layers.*.self_attn": ("num_key_value_heads", "config.num_attention_heads")}
    return {}


_add("phi3", tp_plan=phi3_tp_plan, tp_local_attrs=phi3_tp_local_attrs)

# BLOOM: ``query_key_value`` is viewed ``(..., heads, 3, head_dim)`` (interleaved per head:
# ``colwise``); the base model builds the ALiBi biases of all heads, ``alibi`` of shape
# ``[batch x heads, 1, keys]``, and passes it to every attention: ``heads_input`` keeps this rank's.
_add(
    "bloom",
    tp_plan={
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.self_attention": "heads_input:alibi",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    tp_local_attrs={"h.*.self_attention": ("num_heads", "hidden_size", "split_size")},
)

# MPT: ``Wqkv`` is ``[q; k; v]`` (``chunk(3)``); ALiBi biases ``position_bias`` ``[heads, 1, keys]``
# built in the base model for all heads.
_add(
    "mpt",
    tp_plan={
        "blocks.*.attn.Wqkv": "packed_colwise:3",
        "blocks.*.attn.out_proj": "rowwise",
        "blocks.*.attn": "heads_input:position_bias",
        "blocks.*.ffn.up_proj": "colwise",
        "blocks.*.ffn.down_proj": "rowwise",
    },
    tp_local_attrs={"blocks.*.attn": ("n_heads", "hidden_size")},
)
