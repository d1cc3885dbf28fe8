"""Mixture-of-experts planning and checks that need no process group: the experts layout from
transformers' ep plan, ``hf-scale plan --ep`` numbers, tp splits of the experts, bad ep input."""

from __future__ import annotations

import pytest

from hf_scale.config import ParallelConfig
from hf_scale.errors import HfScaleConfigError, HfScalePlanError
from hf_scale.mesh import ParallelDims


def _meta_moe(arch: str = "qwen3_moe", **changes):
    from hf_scale.layout_preview import meta_model
    from tests.distributed.moe_checks import moe_config

    config = moe_config(arch, False)
    for k, v in changes.items():
        setattr(config, k, v)
    return meta_model(config)


def test_ep_report_counts_experts_and_all_to_all_volume():
    from hf_scale.layout_preview import ep_report
    from hf_scale.model_plans import resolve_plan

    model = _meta_moe()
    report = ep_report(model, resolve_plan(model), ep=2, dp_shard=4, tokens=1024)
    per_layer = 4 * 64 * 64 + 4 * 64 * 32  # gate_up [E, 2I, H] + down [E, H, I]
    assert report["expert_params"] == 2 * per_layer
    assert report["experts_per_rank"] == 2 and report["source"] == "transformers"
    assert report["expert_params_gathered"] == per_layer // 2  # 1/ep of a layer's experts
    assert report["expert_params_per_rank"] == 2 * per_layer // 2 // 2  # 1/ep, then FSDP over dp_shard / ep
    assert report["all_to_all_bytes_forward"] == 1024 * 64 * 2 * 2 * 4 * 2  # tokens x hidden x k x 2 x fp32 x layers
    assert report["all_to_all_bytes_step"] == 2 * report["all_to_all_bytes_forward"]


def test_plan_report_under_ddp_ep_counts_one_over_ep_of_the_experts():
    """ddp + ep: the dense weights whole on every rank, the experts 1/ep (not the whole model)."""
    from hf_scale.layout_preview import plan_report
    from tests.distributed.moe_checks import moe_config

    config = moe_config("qwen3_moe", False)
    whole, split = (plan_report(config, ParallelConfig(strategy="ddp", ep=ep), 2) for ep in (1, 2))
    experts = split["ep"]["expert_params"]
    assert whole["params_per_rank"] == whole["parameters"]
    assert split["params_per_rank"] == whole["parameters"] - experts // 2
    # ep fewer than the replicas: the experts FSDP-sharded over the 2 replicas holding the same ones
    quarter = plan_report(config, ParallelConfig(strategy="ddp", ep=2), 4)
    assert quarter["ep"]["expert_params_per_rank"] == experts // 4
    assert quarter["params_per_rank"] == whole["parameters"] - experts + experts // 4


def test_plan_report_under_pp_counts_a_stage_s_experts():
    """ep x pp: a pipeline rank holds its own stages' experts (here 2 of 4 MoE layers)."""
    from hf_scale.layout_preview import plan_report
    from tests.distributed.moe_checks import moe_config

    config = moe_config("qwen3_moe", False, layers=4)
    flat, piped = (plan_report(config, ParallelConfig(pp=pp, ep=2), world)["ep"] for pp, world in ((1, 2), (2, 4)))
    assert piped["expert_params_per_rank"] == flat["expert_params_per_rank"] // 2
    assert piped["moe_layers"] == 2 and piped["all_to_all_bytes_step"] == flat["all_to_all_bytes_step"] // 2


def test_plan_cli_prints_the_ep_section(tmp_path, capsys):
    from hf_scale.cli import main
    from tests.distributed.moe_checks import moe_config

    moe_config("qwen3_moe", False).save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path / "config.json"), "--ep", "2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "(ep=2 of dp_shard)" in out
    assert "expert parallel over 2 ranks: 2 of 4 experts per rank in each of 2 MoE layers" in out
    assert "2.0 MiB in forward, 4.0 MiB per step" in out


def test_experts_tp_split_follows_the_experts_contract():
    from hf_scale.model_plans import resolve_plan
    from hf_scale.model_plans.tp import tp_layout

    model = _meta_moe()
    layout = tp_layout(model, resolve_plan(model), 2)  # was: "names a parameter"
    assert layout.experts["model.layers.0.mlp.experts"] == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
    assert not any(".experts" in name for name in layout.styles)
    oss = _meta_moe("gpt_oss")  # [E, in, out], gate and up interleaved, biases
    split = tp_layout(oss, resolve_plan(oss), 2).experts["model.layers.0.mlp.experts"]
    assert split == {"gate_up_proj": (2, 1), "gate_up_proj_bias": (1, 1), "down_proj": (1, 1), "down_proj_bias": (None, 0)}
    odd = _meta_moe(moe_intermediate_size=33)
    with pytest.raises(HfScalePlanError, match=r"tp=2 does not divide model.layers.0.mlp.experts.gate_up_proj"):
        tp_layout(odd, resolve_plan(odd), 2)


def test_bad_ep_input():
    from hf_scale.layout_preview import ep_report, meta_model
    from hf_scale.model_plans import resolve_plan
    from tests.tiny_models import tiny_config

    model = _meta_moe(num_experts=3)
    with pytest.raises(HfScalePlanError, match=r"ep=2 does not divide the 3 experts .* Choose ep in \[1, 3\]"):
        ep_report(model, resolve_plan(model), ep=2)
    dense = meta_model(tiny_config("llama"))
    with pytest.raises(HfScalePlanError, match="ep=2 but LlamaForCausalLM .* has no mixture-of-experts layers"):
        ep_report(dense, resolve_plan(dense), ep=2)
    # ep with pp: carved out of each stage's dp_shard
    assert ParallelDims.resolve(ParallelConfig(ep=2, pp=2), world_size=4).describe() == \
        "pp=2 x dp_replicate=1 x dp_shard=2 x tp=1 (ep=2 of dp_shard)"
    with pytest.raises(HfScaleConfigError, match="ep=2 does not divide dp_shard=1"):
        ParallelDims.resolve(ParallelConfig(ep=2, pp=2), world_size=2)
    with pytest.raises(HfScaleConfigError, match="ep=0"):
        ParallelConfig(ep=0)
    with pytest.raises(HfScaleConfigError, match="ep=4 does not divide dp_shard=2"):
        ParallelDims.resolve(ParallelConfig(ep=4, tp=2), world_size=4)
    assert ParallelDims.resolve(ParallelConfig(ep=2), world_size=4).describe().endswith("(ep=2 of dp_shard)")
    # ddp: ep carved out of the replicas (the rest FSDP-shard the experts they share)
    ddp = ParallelDims.resolve(ParallelConfig(strategy="ddp", ep=4), world_size=4)
    assert (ddp.dp_replicate, ddp.dp_shard) == (4, 1) and ddp.describe().endswith("(ep=4 of dp_replicate)")
    assert ParallelDims.resolve(ParallelConfig(strategy="ddp", ep=2), world_size=4).describe().endswith(
        "(ep=2 of dp_replicate)")
    with pytest.raises(HfScaleConfigError, match="ep=4 does not divide the 6 data-parallel ranks of strategy='ddp'"):
        ParallelDims.resolve(ParallelConfig(strategy="ddp", ep=4), world_size=6)
    # the replicas carry ep only under ddp: fsdp over dp_replicate x dp_shard=1 is refused, not taken for ddp
    with pytest.raises(HfScaleConfigError, match="ep=2 does not divide dp_shard=1 .* set a smaller dp_replicate"):
        ParallelDims.resolve(ParallelConfig(strategy="fsdp", dp_replicate=2, ep=2), world_size=2)
    with pytest.raises(HfScaleConfigError, match="ep=2 with strategy='zero1'"):
        ParallelConfig(strategy="zero1", ep=2)
    # an ep that neither the experts nor the ranks take: the experts' reason first (the degrees'
    # advice, a multiple of 3 processes, would lead to the experts' refusal next)
    from hf_scale.layout_preview import plan_report

    with pytest.raises(HfScalePlanError, match="ep=3 does not divide the 8 experts"):
        plan_report(_meta_moe(num_experts=8).config, ParallelConfig(ep=3), world_size=8)


def test_experts_not_called_with_the_routing_are_left_whole_by_tp_and_refused_by_ep():
    """Llama 4's experts take tokens the model scattered itself (forward(hidden_states)): no
    all-to-all or tp split of transformers' routed contract fits them (the scan met tp's split
    calling them with the routing: a TypeError)."""
    import transformers as tf

    from hf_scale.layout_preview import meta_model
    from hf_scale.model_plans import resolve_plan
    from hf_scale.model_plans.ep import check_ep, experts_layout
    from hf_scale.model_plans.tp import tp_layout

    config = tf.Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                 vocab_size=256)
    model = meta_model(config)
    plan = resolve_plan(model)
    layout = experts_layout(model, plan)
    assert not layout.is_moe and layout.unrouted and all(n.endswith("experts") for n in layout.unrouted)
    with pytest.raises(HfScalePlanError, match="ep=2: the experts of .* not called as transformers' routed experts"):
        check_ep(layout, model, plan, 2)
    styles = tp_layout(model, plan, 2, layout).styles  # the experts' entries dropped, not refused
    assert not any(".experts" in name for name in styles) and any("q_proj" in name for name in styles)
    # transformers' routed experts (Qwen3-MoE) stay the ones ep and tp split
    qwen = _meta_moe()
    assert experts_layout(qwen, resolve_plan(qwen)).is_moe and not experts_layout(qwen, resolve_plan(qwen)).unrouted


def test_routing_options_of_other_stacks_say_what_to_do_instead():
    """DeepSpeed-MoE / Megatron options hf_scale does not have: the unknown-key error says why
    (dropless ep; the model's own routing, set on its config) instead of only listing keys."""
    from hf_scale.config import as_parallel_config, load_yaml
    from hf_scale.train.config import JobConfig

    with pytest.raises(HfScaleConfigError, match="'capacity_factor'. hf_scale's expert parallel drops no token"):
        as_parallel_config({"ep": 2, "capacity_factor": 1.25})
    with pytest.raises(HfScaleConfigError, match="'moe_router_topk'. The routing is the model's own"):
        as_parallel_config({"ep": 2, "moe_router_topk": 2})
    with pytest.raises(HfScaleConfigError, match="Did you mean 'strategy'"):  # other keys: the closest one
        as_parallel_config({"stratgy": "fsdp"})
    with pytest.raises(HfScaleConfigError, match="drops no token"):  # the CLI's override path too
        load_yaml(JobConfig, "configs/quickstart.yaml", ["--parallel.capacity_factor", "1.0"])


def test_ddp_ep_with_fp16_is_refused():
    """GradScaler.unscale_ runs one foreach over every gradient: DTensor experts beside plain dense
    gradients (ddp + ep) make torch raise there, on the first step."""
    with pytest.raises(HfScaleConfigError, match="mixed_precision='fp16'.*Use mixed_precision='bf16'"):
        ParallelConfig(strategy="ddp", ep=2, mixed_precision="fp16")
    ParallelConfig(strategy="ddp", ep=2, mixed_precision="bf16")
