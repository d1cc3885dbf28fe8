"""Pipeline plans transformers does not declare (``base_model_pp_plan``), in its format.

An entry maps base-model module names, in forward order, to ``(inputs, outputs)``. The entry
whose module is the block ``ModuleList`` splits it: entries before it run on the first stage
only, entries after it on the last stage only (see :mod:`hf_scale.model_plans.pp`). Modules a plan
leaves out (rotary embeddings, buffers only) run on every stage. Names may be dotted (OPT's
blocks are ``decoder.layers`` of its base model).
"""

from __future__ import annotations

from .base import extend_plan

extend_plan(
    "gpt2",
    pp_plan={
        "wte": (["input_ids"], ["inputs_embeds"]),
        "wpe": (["position_ids"], ["position_embeds"]),
        "drop": (["hidden_states"], ["hidden_states"]),
        "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "ln_f": (["hidden_states"], ["hidden_states"]),
    },
)
extend_plan(
    "opt",
    pp_plan={
        "decoder.embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "decoder.embed_positions": (["attention_mask", "position_ids"], ["position_embeds"]),
        "decoder.project_in": (["inputs_embeds"], ["inputs_embeds"]),
        "decoder.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "decoder.final_layer_norm": (["hidden_states"], ["hidden_states"]),
        "decoder.project_out": (["hidden_states"], ["hidden_states"]),
    },
)
