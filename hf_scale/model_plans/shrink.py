"""A model's architecture at a tiny size: its config with every width, depth, head count,
vocabulary and expert count shrunk, everything else (module classes, per-layer kinds, flags)
kept. Used to check an inferred tensor-parallel plan on a model that is on the meta device (the
same modules at a size that runs in a moment), and by ``scripts/scan_architectures.py`` to build
every causal LM of transformers small.

Usage::

    small = shrunk_config(model.config, heads=4, kv_heads=2)   # hidden 16 x heads, 2-4 layers
    probe = type(model)._from_config(small)
"""

from __future__ import annotations

import json

VOCAB, RESERVED = 512, 32  # token ids >= VOCAB - RESERVED: special tokens only
HEAD_DIM = 16

HIDDEN = ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "word_embed_proj_dim")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
         "encoder_attention_heads", "num_attention_heads_per_layer")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv")
FIXED = {  # attribute -> tiny value, set where the default config has an int there
    "head_dim": HEAD_DIM, "attention_head_size": HEAD_DIM, "kv_channels": HEAD_DIM, "d_kv": HEAD_DIM,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 64, "ffn_hidden_size": 128, "intermediate_size_mlp": 128,
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "sliding_window": 64, "attention_window_size": 64,
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_expand": 2, "mamba_d_ssm": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "first_k_dense_replace": 1,
    "num_memory_heads": 2, "time_step_rank": 8, "lru_width": 64, "index_n_heads": 4,
    "index_head_dim": 16, "index_topk": 8, "block_size": 8, "rotary_dim": 8, "rotary_emb_dim": 8,
    "attn_layer_period": 2, "attn_layer_offset": 1,  # Jamba: an attention layer among the 2 kept
}
OFF = ("use_mamba_kernels",)  # flags set False: CUDA kernels that the small model does not need
QUIET = ("dropout", "pdrop", "jitter", "layerdrop", "drop_rate", "drop_path")


def _is_subconfig(value) -> bool:
    return isinstance(value, dict) and "model_type" in value


def shrink(d: dict, heads: int = 4, kv_heads: int = 2) -> dict:
    """A config dict shrunk (see module docstring); sub-configs recursively. ``heads`` query
    heads of ``HEAD_DIM`` (the hidden size follows), ``kv_heads`` key/value heads."""
    out = dict(d)
    old_layers = next((d[k] for k in LAYERS if isinstance(d.get(k), int)), None)
    kinds = []
    for key, value in d.items():
        if isinstance(value, list) and old_layers and len(value) == old_layers and old_layers > 1:
            kinds.append(key)
    layers = 2
    for key in kinds:  # keep one layer of each kind (attention / SSM / sliding ...), up to 4
        layers = max(layers, min(4, len({json.dumps(v) for v in d[key]})))
    for key, value in d.items():
        if _is_subconfig(value):
            out[key] = shrink(value, heads, kv_heads)
        elif isinstance(value, bool) and key in OFF:
            out[key] = False
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, float) and any(q in key for q in QUIET):
            out[key] = 0.0
        elif not isinstance(value, int):
            continue
        elif key in HIDDEN:
            out[key] = HEAD_DIM * heads
        elif key in LAYERS:
            out[key] = layers
        elif key in HEADS:
            out[key] = heads
        elif key in KV_HEADS:
            out[key] = kv_heads
        elif key in FIXED:
            out[key] = FIXED[key]
    for key in kinds:  # per-layer lists: the first layer of each kind, then repeat
        values, seen = d[key], []
        picked = [i for i, v in enumerate(values) if not (json.dumps(v) in seen or seen.append(json.dumps(v)))]
        picked = (picked + [i for i in range(len(values)) if i not in picked])[:layers]
        out[key] = [values[i] for i in sorted(picked)]
    if isinstance(out.get("qk_rope_head_dim"), int) and isinstance(out.get("head_dim"), int):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: the rotary part's width
    vocab = out.get("vocab_size") if isinstance(out.get("vocab_size"), int) else VOCAB
    special = vocab - 1
    for key, value in d.items():  # special token ids into the reserved top of the vocabulary
        if key.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= vocab - RESERVED:
            out[key], special = special, special - 1
    return out




def shrunk_config(config, heads: int = 4, kv_heads: int = 2):
    """``config`` (a transformers config) shrunk: a new config of the same class."""
    return type(config).from_dict(shrink(config.to_dict(), heads, kv_heads))
