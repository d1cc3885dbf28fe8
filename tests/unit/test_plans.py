"""Plans resolved on the meta device for every covered architecture and task head."""

import pytest
import torch
import transformers as tf
from torch import nn

from hf_scale import HfScalePlanError, ModelPlan, resolve_plan
from hf_scale.model_plans import base as plan_base
from hf_scale.model_plans import fp32_modules, wrap_units
from tests.tiny_models import AUTO, all_cases, tiny_config

EXPECTED_BLOCK = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
    "gemma": "GemmaDecoderLayer", "phi3": "Phi3DecoderLayer", "gpt2": "GPT2Block",
    "gpt_neox": "GPTNeoXLayer", "opt": "OPTDecoderLayer", "bert": "BertLayer",
    "roberta": "RobertaLayer", "distilbert": "TransformerBlock", "t5": "T5Block",
}


def meta_model(arch, head):
    with torch.device("meta"):
        return AUTO[head].from_config(tiny_config(arch))


@pytest.mark.parametrize("arch, head", all_cases(), ids=[f"{a}-{h}" for a, h in all_cases()])
def test_plan_for_every_covered_model(arch, head):
    model = meta_model(arch, head)
    plan = resolve_plan(model)
    assert plan.model_type == model.config.model_type
    assert plan.wrap_modules == (EXPECTED_BLOCK[arch],)
    units = wrap_units(model, plan)
    assert len(units) == (4 if arch == "t5" else 2)  # T5: 2 encoder + 2 decoder blocks
    # Every tie the model really has is recorded, and none crosses a unit boundary.
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    expected_ties = sum(len(names) - 1 for names in shared.values())
    assert len(plan.tied_weights) == expected_ties
    for target, source in plan.tied_weights:
        assert not any(target.startswith(n) or source.startswith(n) for n, m in model.named_modules() if m in units)


def test_fp32_modules_and_sources_for_t5():
    model = meta_model("t5", "seq2seq")
    plan = resolve_plan(model)
    assert plan.keep_fp32_modules == ("wo",) and plan.source["keep_fp32_modules"] == "transformers"
    names = [n for n, m in model.named_modules() if m in fp32_modules(model, plan)]
    assert names and all(n.endswith(".wo") for n in names)
    assert len(names) == 4


def test_tp_and_pp_plans_read_from_transformers():
    plan = resolve_plan(meta_model("llama", "causal"))
    # names from the top model, as transformers' model.tp_plan gives them (head included)
    assert plan.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.tp_plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan.tp_plan["lm_head"] == "colwise_gather_output"
    assert "layers" in plan.pp_plan and plan.source["tp_plan"] == "transformers"
    gpt2 = resolve_plan(meta_model("gpt2", "causal"))  # declared by none: hf_scale's registry
    assert gpt2.tp_plan["transformer.h.*.attn.c_attn"] == "packed_colwise:3"
    assert gpt2.source["tp_plan"] == "registry:gpt2"


def test_registry_entries_fill_what_transformers_lacks():
    assert resolve_plan(meta_model("bert", "seqcls")).source["wrap_modules"] == "registry:bert"
    assert resolve_plan(meta_model("distilbert", "seqcls")).source["wrap_modules"] == "registry:distilbert"


def test_transformers_embeddings_unit_dropped_when_tied(monkeypatch):
    """BERT declares BertEmbeddings no-split; in an MLM it is tied to the decoder."""
    monkeypatch.delitem(plan_base._REGISTRY, "bert")
    with torch.device("meta"):
        model = tf.BertForMaskedLM(tiny_config("bert"))
    plan = resolve_plan(model)
    assert plan.wrap_modules == ("BertLayer",)
    assert ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight") in plan.tied_weights


def test_user_plan_splitting_a_tie_is_refused():
    with torch.device("meta"):
        model = tf.BertForMaskedLM(tiny_config("bert"))
    with pytest.raises(HfScalePlanError, match="tied weights in different FSDP units"):
        resolve_plan(model, {"wrap_modules": ["BertLayer", "BertEmbeddings"]})


def test_user_overrides():
    model = meta_model("llama", "causal")
    plan = resolve_plan(model, {"wrap_modules": "LlamaMLP"})
    assert plan.wrap_modules == ("LlamaMLP",) and plan.source["wrap_modules"] == "user"
    full = ModelPlan(model_type="llama", wrap_modules=("LlamaAttention",))
    assert resolve_plan(model, full).wrap_modules == ("LlamaAttention",)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"wrap_modules": ["NoSuchBlock"]}, r"wraps \['NoSuchBlock'\], which the model does not contain"),
        ({"keep_fp32_modules": ["nope"]}, r"keep_fp32_modules names \['nope'\]"),
        ({"wrap_module": ["LlamaMLP"]}, r"unknown plan field\(s\) \['wrap_module'\]"),
    ],
)
def test_plan_errors(override, message):
    with pytest.raises(HfScalePlanError, match=message):
        resolve_plan(meta_model("llama", "causal"), override)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class _Custom(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks))
        self.head = nn.Linear(4, 2)


def test_generic_fallback_infers_the_block_stack():
    plan = resolve_plan(_Custom(3))
    assert plan.wrap_modules == ("_Block",) and plan.source["wrap_modules"] == "inferred"


def test_no_block_stack_asks_for_a_plan():
    with pytest.raises(HfScalePlanError, match="cannot tell the repeated blocks.*register_plan"):
        resolve_plan(_Custom(1))


def test_register_plan_for_a_new_model_type(monkeypatch):
    monkeypatch.setattr(plan_base, "_REGISTRY", dict(plan_base._REGISTRY))
    plan_base.register_plan("_Custom", wrap_modules=["_Block"], keep_fp32_modules="head")
    plan = resolve_plan(_Custom(1))
    assert plan.wrap_modules == ("_Block",) and plan.keep_fp32_modules == ("head",)
    assert plan.source["wrap_modules"] == "registry:_Custom"


def _tiny_qwen3_5():
    config = tf.Qwen3_5TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                  linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return tf.Qwen3_5ForCausalLM(config)


def test_declared_wrap_classes_the_model_lacks_are_dropped():
    """Qwen3.5's text model declares its vision block beside its decoder layer (issue 26.4): the
    plan keeps the class it has, and one process trains with checkpointed blocks like plain
    transformers (same loss and gradients)."""
    import copy

    import hf_scale

    model = _tiny_qwen3_5()
    assert "Qwen3_5VisionBlock" in model._no_split_modules
    plan = resolve_plan(model)
    assert plan.wrap_modules == ("Qwen3_5DecoderLayer",) and plan.source["wrap_modules"] == "transformers"
    assert len(wrap_units(model, plan)) == 2
    reference = copy.deepcopy(model)
    parallel = hf_scale.parallelize(model, {"activation_checkpointing": "full"})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = parallel(input_ids=ids, labels=ids).loss
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want)
    grads = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_declared_wrap_classes_matching_nothing_are_refused():
    model = meta_model("llama", "causal")
    model._no_split_modules = ["NoSuchBlock", "NorThisOne"]
    with pytest.raises(HfScalePlanError, match=r"wraps \['NoSuchBlock', 'NorThisOne'\], which the model does not"):
        resolve_plan(model)
