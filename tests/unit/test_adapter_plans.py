"""LoRA seen through by the plans (one process, no process group): the tensor-parallel styles of a
LoRA layer's parts, what tp refuses, and the finetune recipe's peft section."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

import hf_scale  # noqa: E402
from hf_scale.errors import HfScaleConfigError, HfScalePlanError  # noqa: E402
from hf_scale.model_plans.adapters import adapter_host, has_adapters  # noqa: E402
from hf_scale.model_plans.tp import tp_layout  # noqa: E402
from hf_scale.train.config import load_job  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


def _lora(**extra):
    return get_peft_model(tiny_model("llama", "causal"), LoraConfig(r=4, target_modules="all-linear", **extra))


def test_lora_follows_its_base_under_tp():
    model = _lora()
    host = adapter_host(model)
    assert host is model.get_base_model() and has_adapters(host)
    styles = tp_layout(host, hf_scale.resolve_plan(host), 2).styles
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert styles[f"{q}.base_layer"] == "colwise" and styles[f"{q}.lora_B.default"] == "colwise"
    assert f"{q}.lora_A.default" not in styles  # whole on every tp rank: its input is replicated
    assert styles[f"{o}.base_layer"] == "rowwise" and styles[f"{o}.lora_A.default"] == "rowwise"
    assert f"{o}.lora_B.default" not in styles  # whole: its input is lora_A's all-reduced output
    assert q not in styles and o not in styles  # the peft wrapper itself is not a Linear


def test_plans_see_through_the_wrapper():
    model = _lora()
    plan = hf_scale.resolve_plan(adapter_host(model))
    assert plan.wrap_modules == ("LlamaDecoderLayer",)
    assert plan.tied_weights == (("lm_head.weight", "model.embed_tokens.weight"),)


@pytest.mark.parametrize("extra, message", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
])
def test_tp_refuses_what_it_cannot_split(extra, message):
    host = adapter_host(_lora(**extra))
    with pytest.raises(HfScalePlanError, match=message) as error:
        tp_layout(host, hf_scale.resolve_plan(host), 2)
    assert "tp=1" in str(error.value)


def _recipe(tmp_path, peft: str, extra: str = "") -> str:
    path = tmp_path / "r.yaml"
    path.write_text(f"model:\n  name_or_path: zoo:smollm2\n{extra}peft:\n{peft}")
    return str(path)


def test_peft_section_builds_the_lora_config(tmp_path):
    job = load_job(_recipe(tmp_path, "  r: 8\n  target_modules: [q_proj, v_proj]\n"))
    assert job.peft.enabled
    assert job.peft.lora_config() == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
                                      "target_modules": ["q_proj", "v_proj"], "modules_to_save": None}
    assert not load_job(_recipe(tmp_path, "  dropout: 0.0\n")).peft.enabled
    assert load_job(_recipe(tmp_path, "  adapter: some/folder\n")).peft.lora_config() == "some/folder"


@pytest.mark.parametrize("peft, extra, message", [
    ("  r: 0\n", "", "positive"),
    ("  r: 8\n  adapter: x\n", "", "set one of the two"),
    ("  alpha: 16\n", "", "peft.r is not"),
    ("  r: 8\n  dropout: 1.5\n", "", "probability"),
    ("  r: 8\n  modules_to_save: [lm_head]\n", "parallel:\n  tp: 3\n", "tensor parallel would have to split"),
    ("  r: 8\n", "  task: sequence_classification\n", "causal_lm"),
])
def test_peft_section_bad_input(tmp_path, peft, extra, message):
    body = extra if extra.startswith("parallel") else ""
    model_extra = extra if not extra.startswith("parallel") else ""
    path = tmp_path / "r.yaml"
    path.write_text(f"model:\n  name_or_path: zoo:smollm2\n{model_extra}{body}peft:\n{peft}")
    with pytest.raises(HfScaleConfigError, match=message):
        load_job(str(path))


def test_injected_adapters_without_the_wrapper():
    """inject_adapter_in_model gives the transformers model itself with LoRA layers: the same
    plan and styles, and parallelize (one process) keeps it a plain model that trains only them."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "down_proj"]),
                                    tiny_model("llama", "causal"))
    assert adapter_host(model) is model and has_adapters(model)
    styles = tp_layout(model, hf_scale.resolve_plan(model), 2).styles
    assert styles["model.layers.1.self_attn.q_proj.lora_B.default"] == "colwise"
    assert styles["model.layers.1.mlp.down_proj.lora_A.default"] == "rowwise"
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model = hf_scale.parallelize(model)
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 8  # 2 layers x 2 targets x (A, B)
