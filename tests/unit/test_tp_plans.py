"""Tensor-parallel plans (one process, no process group): what the registry gives each
architecture, that every block Linear gets a style, and the errors for layouts that cannot
work -- all raised by ``tp_layout`` before any mesh or collective exists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers as tf
from torch import nn

import hf_scale
from hf_scale.config import ParallelConfig
from hf_scale.errors import HfScaleConfigError, HfScalePlanError
from hf_scale.mesh import ParallelDims
from hf_scale.model_plans import resolve_plan, wrap_units
from hf_scale.model_plans.tp import tp_layout
from tests.tiny_models import ARCHS, all_cases, tiny_model

TP_CASES = all_cases() + [("phi3_mha", "causal"), ("llama_vocab129", "causal")]


def _layout(arch, head, tp=2, model=None, **plan):
    model = model or tiny_model(arch, head)
    return tp_layout(model, resolve_plan(model, plan or None), tp)


def _linear_like(module):
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


@pytest.mark.parametrize("arch, head", TP_CASES)
def test_every_block_projection_is_sharded(arch, head):
    """No Linear inside a block is left whole by accident: the plan covers each one."""
    model = tiny_model(arch, head)
    layout = tp_layout(model, resolve_plan(model), 2)
    names = {id(m): n for n, m in model.named_modules()}
    for unit in wrap_units(model, resolve_plan(model)):
        for module in unit.modules():
            if _linear_like(module):
                assert layout.styles.get(names[id(module)], "replicate") != "replicate", names[id(module)]
    embedding = names[id(model.get_input_embeddings())]
    assert layout.styles[embedding] == "embedding_rowwise"


def test_gpt2_fused_qkv_is_packed_and_its_sizes_follow():
    layout = _layout("gpt2", "causal")
    assert layout.styles["transformer.h.1.attn.c_attn"] == "packed_colwise:3"
    assert layout.styles["transformer.h.1.attn.c_proj"] == "rowwise"
    assert layout.styles["transformer.h.1.mlp.c_fc"] == "colwise"
    assert layout.styles["transformer.h.1.mlp.c_proj"] == "rowwise"
    assert layout.local_attrs["transformer.h.1.attn"] == ("split_size", "num_heads")
    assert layout.styles["lm_head"] == "colwise_gather_output"  # tied to wte, same vocabulary split
    base = tp_layout(m := tf.GPT2Model(tiny_model("gpt2", "causal").config), resolve_plan(m), 2)
    assert base.styles["h.0.attn.c_attn"] == "packed_colwise:3"  # the base model: no prefix


def test_gpt2_forward_reads_split_size_for_the_fused_split():
    """What the plan rests on: GPT-2 splits c_attn's output with ``self.split_size`` (so the
    local width must be it) and views heads with -1 (num_heads is not read)."""
    import inspect

    from transformers.models.gpt2 import modeling_gpt2

    source = inspect.getsource(modeling_gpt2.GPT2Attention.forward)
    assert ".split(self.split_size, dim=2)" in source and "self.num_heads" not in source


def test_gpt_neox_keeps_transformers_plan_with_interleaved_heads():
    """GPT-NeoX's fused query_key_value output is viewed as (heads, 3 * head_size): each head's
    q, k, v are adjacent rows, so a plain colwise cut gives each rank whole heads."""
    import inspect

    from transformers.models.gpt_neox import modeling_gpt_neox

    layout = _layout("gpt_neox", "causal")
    assert layout.styles["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert resolve_plan(tiny_model("gpt_neox", "causal")).source["tp_plan"] == "transformers"
    assert "(*input_shape, -1, 3 * self.head_size)" in inspect.getsource(modeling_gpt_neox.GPTNeoXAttention.forward)


@pytest.mark.parametrize("arch, attention, attrs", [
    ("opt", "model.decoder.layers.0.self_attn", ("num_heads",)),
    ("distilbert", "distilbert.transformer.layer.0.attention", ("n_heads",)),
    ("bert", "bert.encoder.layer.0.attention.self", ("num_attention_heads", "all_head_size")),
    ("roberta", "roberta.encoder.layer.1.attention.self", ("num_attention_heads", "all_head_size")),
])
def test_registry_head_attributes(arch, attention, attrs):
    head = ARCHS[arch][2][0]
    assert _layout(arch, head).local_attrs[attention] == attrs


def test_encoders_keep_their_wrap_modules():
    """The tp entries extend the encoders' registry entries instead of replacing them."""
    assert resolve_plan(tiny_model("bert", "seqcls")).wrap_modules == ("BertLayer",)
    assert resolve_plan(tiny_model("distilbert", "seqcls")).wrap_modules == ("TransformerBlock",)


def test_t5_plan_covers_both_stacks_and_its_relative_bias():
    layout = _layout("t5", "seq2seq")
    s = layout.styles
    assert s["encoder.block.0.layer.0.SelfAttention.relative_attention_bias"] == "colwise"
    assert s["decoder.block.1.layer.1.EncDecAttention.o"] == "rowwise"
    assert s["decoder.block.1.layer.2.DenseReluDense.wi"] == "colwise"
    assert {s[n] for n in ("shared", "encoder.embed_tokens", "decoder.embed_tokens")} == {"embedding_rowwise"}
    assert layout.local_attrs["decoder.block.0.layer.1.EncDecAttention"] == ("n_heads", "inner_dim")


def test_t5_gated_and_encoder_only_variants():
    config = tf.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=128,
                         feed_forward_proj="gated-gelu")
    gated = tf.T5ForConditionalGeneration(config)
    styles = tp_layout(gated, resolve_plan(gated), 2).styles
    assert styles["encoder.block.0.layer.1.DenseReluDense.wi_0"] == styles["decoder.block.1.layer.2.DenseReluDense.wi_1"] == "colwise"
    encoder = tf.T5EncoderModel(tf.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=128))
    layout = tp_layout(encoder, resolve_plan(encoder), 2)
    assert not any(n.startswith("decoder") for n in layout.styles) and "encoder.block.1.layer.0.SelfAttention" in layout.local_attrs


def test_phi3_packs_qkv_only_when_its_parts_are_equal():
    gqa, mha = _layout("phi3", "causal"), _layout("phi3_mha", "causal")
    assert gqa.styles["model.layers.0.self_attn.qkv_proj"] == "colwise_gather_output"
    assert gqa.styles["model.layers.0.self_attn.o_proj"] == "rowwise_split_input"
    assert "model.layers.0.self_attn" not in gqa.local_attrs
    assert mha.styles["model.layers.0.self_attn.qkv_proj"] == "packed_colwise:3"
    assert mha.styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert mha.local_attrs["model.layers.0.self_attn"] == ("num_key_value_heads", "config.num_attention_heads")
    for layout in (gqa, mha):
        assert layout.styles["model.layers.1.mlp.gate_up_proj"] == "packed_colwise"
        assert layout.styles["model.layers.1.mlp.down_proj"] == "rowwise"


def test_user_plan_extends_and_overrides_the_registry():
    layout = _layout("gpt2", "causal", tp_plan={"transformer.h.*.mlp.c_fc": "replicate", "transformer.h.*.mlp.c_proj": "replicate"})
    assert layout.styles["transformer.h.0.mlp.c_fc"] == "replicate"
    assert layout.styles["transformer.h.0.attn.c_attn"] == "packed_colwise:3"


# ------------------------------------------------------------------ bad input


def _llama(**changes):
    cls, kwargs, _ = ARCHS["llama"]
    return tf.LlamaForCausalLM(cls(**{**kwargs, **changes}))


@pytest.mark.parametrize("changes, named", [
    ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, r"query heads \(num_attention_heads=3\)"),
    ({"num_key_value_heads": 1}, r"key/value heads \(num_key_value_heads=1\)"),
    ({"intermediate_size": 63}, r"MLP intermediate size \(intermediate_size=63\)"),
])
def test_tp_not_dividing_a_size_names_it(changes, named):
    model = _llama(**changes)
    with pytest.raises(HfScalePlanError, match=f"tp=2 does not divide the .*{named}"):
        tp_layout(model, resolve_plan(model), 2)


def test_smollm2_shape_tp3_fits_tp2_does_not():
    """SmolLM2-135M's heads (9 query, 3 key/value): tp=3 is its layout, tp=2 is refused."""
    model = _llama(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96)
    tp_layout(model, resolve_plan(model), 3)
    with pytest.raises(HfScalePlanError, match=r"num_attention_heads=9.*num_key_value_heads=3"):
        tp_layout(model, resolve_plan(model), 2)


def test_pattern_matching_no_module_names_it_and_close_matches():
    with pytest.raises(HfScalePlanError, match=r"'model\.layers\.\*\.self_attn\.q_projj' matches no module.*q_proj"):
        _layout("llama", "causal", tp_plan={"model.layers.*.self_attn.q_projj": "colwise"})


def test_architecture_without_tp_plan_gets_one_inferred_from_its_modules():
    config = tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                             vocab_size=128, max_position_embeddings=64)
    plan = resolve_plan(tf.GPTNeoForCausalLM(config))
    assert plan.source["tp_plan"] == "inferred"
    assert dict(plan.tp_plan) == {
        "transformer.h.*.attn.attention.k_proj": "colwise", "transformer.h.*.attn.attention.v_proj": "colwise",
        "transformer.h.*.attn.attention.q_proj": "colwise", "transformer.h.*.attn.attention.out_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    assert dict(plan.tp_local_attrs) == {"transformer.h.*.attn.attention": ("num_heads", "embed_dim")}


def test_fused_qkv_and_block_level_mlp_are_inferred():
    from hf_scale.model_plans.from_hf import with_inferred_tp

    # BLOOM's structure (its registry plan aside: the ALiBi input needs one)
    bloom = tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=128))
    plan = resolve_plan(bloom)
    assert plan.source["tp_plan"] == "registry:bloom"
    inferred = with_inferred_tp(bloom, plan, 0)
    assert inferred.tp_plan["transformer.h.*.self_attention.query_key_value"] == "packed_colwise:3"  # [q; k; v] first
    assert with_inferred_tp(bloom, plan, 1).tp_plan["transformer.h.*.self_attention.query_key_value"] == "colwise"
    assert not any(".self_attention." in k for k in with_inferred_tp(bloom, plan, 2).tp_plan)  # MLPs alone
    assert with_inferred_tp(bloom, plan, 3) is None
    xglm = tf.XGLMForCausalLM(tf.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, vocab_size=128))
    assert {k: v for k, v in resolve_plan(xglm).tp_plan.items() if "fc" in k} == {
        "model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}


def test_architecture_without_attention_says_why_no_plan_is_inferred():
    model = tf.MambaForCausalLM(tf.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4))
    with pytest.raises(HfScalePlanError, match=r"has no tensor-parallel plan.*none is inferred.*MambaBlock.*"
                                               r"plan=\{'tp_plan'.*register_plan"):
        tp_layout(model, resolve_plan(model), 2)


def test_unknown_style_is_refused():
    with pytest.raises(HfScalePlanError, match=r"style 'colwise_sharded'"):
        _layout("llama", "causal", tp_plan={"model.layers.*.mlp.up_proj": "colwise_sharded"})


@pytest.mark.parametrize("tp, world", [(4, 2), (2, 3)])
def test_tp_larger_than_or_not_dividing_the_world(tp, world):
    with pytest.raises(HfScaleConfigError, match=f"tp={tp} does not divide WORLD_SIZE={world}"):
        ParallelDims.resolve(ParallelConfig(tp=tp), world)


def test_tp_in_one_process_says_how_to_launch():
    with pytest.raises(HfScaleConfigError, match=r"tp=2 needs 2 processes.*torchrun --nproc_per_node 2"):
        hf_scale.parallelize(tiny_model("llama", "causal"), {"tp": 2})


def test_ddp_and_zero1_with_tp_are_refused_with_the_alternative():
    for strategy in ("ddp", "zero1"):
        with pytest.raises(HfScaleConfigError, match=rf"strategy='{strategy}' with tp=2.*zero2"):
            ParallelConfig(strategy=strategy, tp=2)


def test_cpu_offload_with_tp_over_every_rank_is_refused():
    with pytest.raises(HfScaleConfigError, match=r"cpu_offload=True.*tp=2 uses all 2 processes"):
        ParallelDims.resolve(ParallelConfig(tp=2, cpu_offload=True), 2)
    assert ParallelDims.resolve(ParallelConfig(tp=2, cpu_offload=True), 4).dp_shard == 2


def test_a_head_that_does_not_gather_its_vocabulary_is_refused():
    with pytest.raises(HfScalePlanError, match=r"output head 'lm_head'.*'colwise'.*colwise_gather_output"):
        _layout("llama", "causal", tp_plan={"lm_head": "colwise"})


def test_a_none_style_drops_a_declared_entry():
    layout = _layout("llama", "causal", tp_plan={"model.layers.*.mlp.up_proj": None, "model.layers.*.mlp.gate_proj": None,
                                                 "model.layers.*.mlp.down_proj": None})
    assert not any(".mlp." in name for name in layout.styles)
    assert layout.styles["model.layers.0.self_attn.q_proj"] == "colwise"


def test_a_plan_naming_parameters_as_moe_plans_do_says_how_to_drop_it():
    model = tiny_model("llama", "causal")
    with pytest.raises(HfScalePlanError, match=r"names a parameter of model\.layers\.0\.mlp\.up_proj.*None"):
        _layout("llama", "causal", model=model, tp_plan={"model.layers.*.mlp.up_proj.weight": "colwise"})


def test_every_plan_style_has_an_engine_style():
    """plans.tp lists the styles a plan may name; parallel.tp must build each one (the two
    tables are kept apart: plans never import torch.distributed)."""
    from torch import nn

    from hf_scale.model_plans.tp import _STYLES
    from hf_scale.parallel.tp import HOOK_STYLES, _style

    for style in (*_STYLES, "packed_colwise:3"):
        if style != "replicate" and style not in HOOK_STYLES:  # left alone / hooked by apply_tp itself
            assert _style(nn.Linear(6, 6), style) is not None, style


def test_inferred_plan_leaves_whole_what_it_cannot_pair():
    # BitNet's MLP normalises its whole projected width between up and down: left whole, named
    bitnet = tf.BitNetForCausalLM(tf.BitNetConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    plan = resolve_plan(bitnet)
    assert not any(".mlp." in k for k in plan.tp_plan) and "ffn_sub_norm" in plan.source["tp_whole"]
    # JetMoE: a router of no known role and attention experts: nothing inferred, and why
    jetmoe = tf.JetMoeForCausalLM(tf.JetMoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_key_value_heads=2, kv_channels=8, num_local_experts=2,
                                                  num_experts_per_tok=1, vocab_size=128))
    with pytest.raises(HfScalePlanError, match=r"none is inferred.*router.*experts"):
        tp_layout(jetmoe, resolve_plan(jetmoe), 2)


def _tiny(model_type, **changes):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import scan_architectures as scan

    config = scan.tiny_config(model_type)
    for k, v in changes.items():
        setattr(config, k, v)
    return tf.AutoModelForCausalLM.from_config(config)


def test_per_head_norms_and_scalar_activations_get_their_gradients_summed():
    # Persimmon's inferred plan: q/k layernorms over head_dim see each rank's heads only
    layout = tp_layout(*(lambda m: (m, resolve_plan(m)))(_tiny("persimmon")), 2)
    assert layout.styles["model.layers.0.self_attn.q_layernorm"] == "replicated_with_grad_allreduce"
    assert "model.layers.0.input_layernorm" not in layout.styles  # the hidden-size norm sees the whole input
    # Apertus: transformers' plan names q/k norms; the xIELU activation's scalars sit between up and down
    apertus = _tiny("apertus")
    styles = tp_layout(apertus, resolve_plan(apertus), 2).styles
    assert styles["model.layers.0.mlp.act_fn"] == "replicated_with_grad_allreduce"
    # multi-head latent attention: q_a_layernorm feeds q_b_proj whole (not a per-head norm)
    minicpm3 = _tiny("minicpm3")
    styles = tp_layout(minicpm3, resolve_plan(minicpm3), 2).styles
    assert styles["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    assert "model.layers.0.self_attn.q_a_layernorm" not in styles
    assert "model.layers.0.self_attn.kv_a_layernorm" not in styles


def test_bare_per_head_parameters_split_with_their_heads():
    model = _tiny("granite_swa")
    layout = tp_layout(model, resolve_plan(model), 2)
    assert layout.params["model.layers.0.self_attn.sinks"] == 0
    assert layout.styles["model.layers.0.self_attn"] == "local_params"
    # stacked shared experts: colwise splits ndim - 2, rowwise the last dim; the module sums its output
    inkling = _tiny("inkling_text")
    layout = tp_layout(inkling, resolve_plan(inkling), 2)
    assert layout.params["model.layers.0.mlp.shared_experts.gate_proj"] == 1
    assert layout.params["model.layers.0.mlp.shared_experts.down_proj"] == 2
    assert layout.styles["model.layers.0.mlp.shared_experts"] == "all_reduce"
    assert layout.styles["lm_head"] == "rowwise_split_input"  # whole logits: allowed for the head
    assert layout.styles["model.embed_tokens"] == "replicate"  # its forward normalises after the lookup


def test_inferred_plans_read_sequential_mlps_and_attention_units():
    ctrl = _tiny("ctrl")
    plan = resolve_plan(ctrl)
    assert plan.tp_plan["transformer.h.*.multi_head_attention.Wq"] == "colwise"
    assert plan.tp_plan["transformer.h.1.ffn.0"] == "colwise" and plan.tp_plan["transformer.h.1.ffn.2"] == "rowwise"
    xlm = _tiny("xlm")
    assert resolve_plan(xlm).tp_plan["transformer.attentions.*.q_lin"] == "colwise"


def test_multi_query_fused_qkv_keeps_its_key_value_heads_whole():
    # Falcon (multi_query): query_key_value is [q (64); k (16); v (16)], one kv head; tp splits q only
    falcon = _tiny("falcon")
    plan = resolve_plan(falcon)
    assert plan.tp_plan["transformer.h.*.self_attention.query_key_value"] == "colwise_replicated_kv:32"
    assert "num_kv_heads" not in plan.tp_local_attrs["transformer.h.*.self_attention"]  # 1: stays whole
    assert "num_heads" in plan.tp_local_attrs["transformer.h.*.self_attention"]
    layout = tp_layout(falcon, plan, 2)
    from hf_scale.model_plans.tp import shard_dim

    qkv = falcon.get_submodule("transformer.h.0.self_attention.query_key_value")
    assert shard_dim(qkv, "weight", layout.styles["transformer.h.0.self_attention.query_key_value"]) is None
    from hf_scale.model_plans.from_hf import with_inferred_tp

    # next candidate: head-by-head interleaving, which divides the kv head counts again
    second = with_inferred_tp(falcon, plan, 1)
    assert second.tp_plan["transformer.h.*.self_attention.query_key_value"] == "colwise"
    # GPTBigCode: 96 = 64 + 2 x 16 features is also 3 x 32: the unequal parts win over packed_colwise:3
    bigcode = _tiny("gpt_bigcode")
    assert resolve_plan(bigcode).tp_plan["transformer.h.*.attn.c_attn"] == "colwise_replicated_kv:32"
    # a width tp does not divide is refused with what the style needs
    with pytest.raises(HfScalePlanError, match=r"first 66 features .*tp=4 divides"):
        tp_layout(falcon, resolve_plan(falcon, {"tp_plan": {"transformer.h.*.self_attention.query_key_value":
                                                            "colwise_replicated_kv:30"}}), 4)


def test_alibi_biases_of_every_head_are_split_with_the_heads():
    # BLOOM / MPT build ALiBi biases for all heads in the base model: their attentions keep this rank's
    bloom, mpt = _tiny("bloom"), _tiny("mpt")
    bloom_styles = tp_layout(bloom, resolve_plan(bloom), 2).styles
    assert bloom_styles["transformer.h.0.self_attention"] == "heads_input:alibi"
    assert bloom_styles["transformer.h.0.self_attention.query_key_value"] == "colwise"  # per-head interleaved
    mpt_styles = tp_layout(mpt, resolve_plan(mpt), 2).styles
    assert mpt_styles["transformer.blocks.0.attn"] == "heads_input:position_bias"
    assert mpt_styles["transformer.blocks.0.attn.Wqkv"] == "packed_colwise:3"
    with pytest.raises(HfScalePlanError, match=r"forward takes no argument 'bias'"):
        tp_layout(mpt, resolve_plan(mpt, {"tp_plan": {"transformer.blocks.*.attn": "heads_input:bias"}}), 2)


def test_inferred_candidates_end_with_the_mlps_alone_and_read_fused_gate_up_by_width():
    from hf_scale.model_plans.from_hf import with_inferred_tp

    # TrOCR's attention reshapes to a width read from its input: the last candidate leaves it whole
    trocr = _tiny("trocr")
    plan = resolve_plan(trocr)
    assert plan.tp_plan["model.decoder.layers.*.self_attn.q_proj"] == "colwise"
    last = with_inferred_tp(trocr, plan, 1)
    assert with_inferred_tp(trocr, plan, 2) is None
    assert dict(last.tp_plan) == {"model.decoder.layers.*.fc1": "colwise", "model.decoder.layers.*.fc2": "rowwise"}
    assert not last.tp_local_attrs  # the attentions keep their head counts
    assert last.source["tp_whole"].startswith("every attention")
    # Moshi's fc1 writes twice what fc2 reads ([gate; up], split by view(..., 2, -1))
    assert resolve_plan(_tiny("moshi")).tp_plan["model.layers.*.mlp.fc1"] == "packed_colwise:2"
