"""``hf-scale plan --gpus``'s candidate table and ``parallelize(model, "auto")``'s choice."""

import pytest

from hf_scale.config import ParallelConfig
from hf_scale.errors import HfScaleConfigError
from hf_scale.layout_search.auto import auto_config, is_auto
from hf_scale.layout_search.ranking import format_candidates, plan_candidates
from tests.tiny_models import CAUSAL, tiny_config, tiny_model


def test_candidates_table_and_recommendation():
    facts, best, ranked, budget, work = plan_candidates(tiny_config("llama"), 4, "1GiB", 16, 2)
    text = format_candidates(facts, best, ranked, budget, work)
    assert text.splitlines()[2].startswith(" *  1 ")  # the recommendation is the first row
    assert f"recommended: {best.layout.describe()}" in text
    assert "rejected:" in text and "does not split into the pipeline" in text
    assert "4 rank(s) of 1.0 GiB" in text


def test_auto_config_is_a_valid_parallel_config():
    model = tiny_model("llama", CAUSAL)
    config, best = auto_config(model, world_size=2, budget=2**30, device_type="cuda", seq=16)
    assert isinstance(config, ParallelConfig) and best.fits
    assert config.strategy == best.layout.strategy and config.mixed_precision is None  # not asked for
    fixed, _ = auto_config(model, world_size=2, budget=2**30, device_type="cuda", seq=16,
                           fixed={"strategy": "auto", "activation_checkpointing": "full", "mixed_precision": "bf16"})
    assert fixed.activation_checkpointing == "full" and fixed.mixed_precision == "bf16"
    assert next(model.parameters()).device.type == "cpu"  # the real model was not touched


def test_auto_refuses_degrees_that_contradict_the_world_size():
    with pytest.raises(HfScaleConfigError, match="does not divide the world size 2"):
        auto_config(tiny_model("llama", CAUSAL), world_size=2, budget=2**30, device_type="cuda", seq=16,
                    fixed={"strategy": "auto", "tp": 3})


def test_is_auto():
    assert is_auto("auto") and is_auto({"strategy": "auto", "tp": 2})
    assert not is_auto({"strategy": "fsdp"}) and not is_auto(None) and not is_auto(ParallelConfig())


def test_parallelize_auto_in_one_process_applies_what_the_budget_forces(tmp_path, monkeypatch):
    """``parallelize(model, "auto")`` without torchrun: with a budget between the estimates of no
    checkpointing and of full checkpointing, the planner must choose checkpointing, and the model
    then runs checkpointed blocks (a stand-in calibration for this machine)."""
    import hf_scale
    from hf_scale.layout_search import Layout, Workload, estimate_memory, model_facts
    from hf_scale.layout_search import auto as auto_module
    from hf_scale.layout_search.choose import MARGIN
    from tests.harness import stand_in_calibration

    monkeypatch.setenv("XDG_CACHE_HOME", stand_in_calibration(tmp_path)["XDG_CACHE_HOME"])
    model = tiny_model("llama", CAUSAL)
    facts, work = model_facts(model), Workload(seq=auto_module._seq(model, None), batch=1, device="cpu")
    plain = estimate_memory(facts, Layout(), work).device_total
    full = estimate_memory(facts, Layout(ac="full"), work).device_total
    assert full < plain
    monkeypatch.setattr(auto_module, "_device_memory", lambda *args: int((plain + full) / 2 / (1 - MARGIN)))
    model = hf_scale.parallelize(model, "auto")
    state = hf_scale.get_state(model)
    assert state.config.activation_checkpointing is not None and state.config.strategy == "fsdp"
    checkpointed = [m for m in model.modules() if getattr(m, "_hf_scale_checkpointed", False)]
    assert len(checkpointed) == model.config.num_hidden_layers  # every block runs checkpointed


def test_auto_keeps_fixed_degrees_and_refuses_contradictions():
    model = tiny_model("llama", CAUSAL)
    kw = dict(world_size=2, budget=2**30, device_type="cuda", seq=16)
    config, best = auto_config(model, fixed=ParallelConfig(strategy="auto", dp_shard=2).fixed_fields(), **kw)
    assert config.dp_shard == 2 and best.layout.dp_shard == 2 and config.strategy in ("fsdp", "zero2")
    # a field only some strategies take: only those are ranked (ddp would refuse it)
    kept, best = auto_config(model, fixed={"reshard_after_forward": False}, **kw)
    assert kept.reshard_after_forward is False and best.layout.strategy in ("fsdp", "zero2", "hsdp")
    piped, best = auto_config(model, fixed={"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2},
                              **{**kw, "batch": 2})
    assert (piped.pp, piped.pp_schedule, best.layout.pp_schedule, best.layout.pp_microbatches) == (2, "gpipe", "gpipe", 2)
    grouped, best = auto_config(model, fixed={"blocks_per_unit": 2}, **kw)
    assert grouped.blocks_per_unit == best.layout.blocks_per_unit == 2 and grouped.sharded
    for fixed, message in [({"dp_replicate": 3}, "dp_replicate=3 = 3 does not divide the world size 2"),
                           ({"dp_replicate": 1, "dp_shard": 1}, "= 1 does not equal the world size 2"),
                           ({"loss_chunk_tokens": 1024}, "matches what was fixed \\(chunks=1024")]:
        with pytest.raises(HfScaleConfigError, match=message):
            auto_config(model, fixed=fixed, **kw)


def test_auto_is_a_strategy_of_parallel_config():
    config = ParallelConfig(strategy="auto", mixed_precision="bf16", tp=2)
    assert config.auto and config.fixed_fields() == {"mixed_precision": "bf16", "tp": 2}
    assert is_auto(config) and not ParallelConfig().auto


def test_plan_text_for_gpus_from_a_config():
    from hf_scale.layout_search.ranking import plan_text

    text = plan_text(tiny_config("llama"), gpus=4, gpu_memory="80GB", seq=16, batch=2)
    assert "4 rank(s) of 74.5 GiB (cuda); seq 16 x batch 2" in text and "recommended:" in text


def test_plan_command_ranks_layouts_for_gpus(tmp_path, capsys):
    from hf_scale.cli import main

    tiny_config("llama").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path / "config.json"), "--gpus", "4", "--gpu-memory", "80 GB", "--seq", "16",
                 "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 rank(s) of 74.5 GiB (cuda); seq 16 x batch 2" in out and "recommended:" in out
    assert main(["plan", str(tmp_path), "--gpus", "4", "--gpu-memory", "eighty"]) == 2
    assert "memory 'eighty' is not a size" in capsys.readouterr().err


def test_plan_for_gpus_keeps_the_degrees_and_strategy_given_on_the_command_line(tmp_path, capsys):
    """``hf-scale plan model --gpus 8 --tp 2 --strategy zero2`` ranks only layouts with tp=2 and
    zero2 (the flags were ignored with --gpus before); a degree that cannot divide the GPUs is an
    error saying so."""
    from hf_scale.cli import main
    from hf_scale.layout_search.ranking import pinned_space, plan_candidates

    config = tiny_config("llama")
    _, best, ranked, *_ = plan_candidates(config, 8, "80GB", 16, 2, **pinned_space({"tp": 2, "strategy": "zero2"}, 8, 1))
    assert ranked and {c.layout.tp for c in ranked} == {2}
    # zero2 wherever there is data parallelism to apply it to (tp2 x pp4 leaves one data rank)
    assert {c.layout.strategy for c in ranked if c.layout.dp_replicate * c.layout.dp_shard > 1} == {"zero2"}
    _, _, free, *_ = plan_candidates(config, 8, "80GB", 16, 2)
    assert len({c.layout.tp for c in free}) > 1  # without the flags the search varies tp
    config.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "8", "--tp", "2", "--strategy", "zero2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "zero2" in out.split("recommended:")[1].splitlines()[0]
    assert main(["plan", str(tmp_path), "--gpus", "8", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err


def test_plan_for_64_gpus_uses_nodes_of_8_and_the_links_given(capsys):
    """``--gpus 64`` is 8 nodes of 8 (not one NVLink domain): tp stays within a node; a slower
    inter-node link given with --inter-gbps changes the step time of the layouts that cross it."""
    from hf_scale.layout_search.cost import H100
    from hf_scale.layout_search.ranking import default_nodes, plan_candidates, with_links

    assert (default_nodes(64, None), default_nodes(8, None), default_nodes(12, None), default_nodes(64, 2)) == (8, 1, 2, 2)
    config = tiny_config("llama")
    _, best, ranked, *_ = plan_candidates(config, 64, "80GB", 64, 8, nodes=8)
    assert all(c.layout.tp <= 8 for c in ranked)
    measured = H100.intra.__class__(1e9, 1e-4, 0.0, gather_bandwidth=5e8, scatter_bandwidth=3e8)
    given = with_links(H100.__class__("cpu", 1e9, 1e9, 1e9, measured, measured), intra_gbps=2)
    assert given.intra.gather == given.intra.scatter == given.intra.bandwidth == 2e9  # one bandwidth for all
    slow = with_links(H100, inter_gbps=0.1, latency_us=50)
    assert slow.inter.bandwidth == 1e8 and slow.intra.latency == pytest.approx(50e-6) and slow.intra.bandwidth == H100.intra.bandwidth
    _, _, slow_ranked, *_ = plan_candidates(config, 64, "80GB", 64, 8, nodes=8, device=slow)
    fast = {c.layout: c.cost.total for c in ranked if c.cost}
    assert any(c.cost and c.cost.total > 2 * fast[c.layout] for c in slow_ranked if c.layout in fast)


def test_from_pretrained_with_auto_plans_on_the_meta_model(tmp_path, monkeypatch):
    """``from_pretrained(path, parallel="auto")``: the planner sees the model built on meta (no
    weights read for it) and the weights then load into the chosen layout."""
    import torch

    import hf_scale
    from tests.harness import stand_in_calibration
    from tests.tiny_models import save_tiny_checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", stand_in_calibration(tmp_path / "cache")["XDG_CACHE_HOME"])
    folder = save_tiny_checkpoint(tmp_path / "tiny", "llama", CAUSAL)
    model = hf_scale.from_pretrained(folder, parallel="auto")
    assert not hf_scale.get_state(model).config.auto
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_plan_of_an_auto_recipe_keeps_the_degrees_given_as_flags(tmp_path, monkeypatch, capsys):
    """``hf-scale plan recipe.yaml --strategy auto --pp 2``: the flags narrow the planner's search
    as they would the recipe's parallel section (every candidate a 2-stage pipeline, its schedule
    and microbatches searched)."""
    from hf_scale.cli import main
    from tests.harness import stand_in_calibration
    from tests.tiny_models import tiny_recipe

    monkeypatch.setenv("XDG_CACHE_HOME", stand_in_calibration(tmp_path / "cache")["XDG_CACHE_HOME"])
    recipe = tiny_recipe(tmp_path)
    assert main(["plan", str(recipe), "--strategy", "auto", "--pp", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith((" *", "    "))
            and " step " in line]
    assert rows and all(" 1x1x1x2 " in row for row in rows), rows
    assert len({row.split("mb=")[1].split("  ")[0] for row in rows}) > 1  # schedules / microbatches vary


def test_plan_of_an_auto_recipe_leaves_out_the_layouts_the_recipe_refuses(tmp_path, monkeypatch, capsys):
    """``hf-scale plan`` ranks what ``hf-scale finetune`` would (``JobConfig.refuses``): under pp
    every batch, the eval batch too, must split into the pipeline's microbatches, so with
    ``eval_batch_size: 6`` only 2-microbatch pipelines remain (4 and 8 do not divide 6), and the
    plan says why the others went."""
    from hf_scale.cli import main
    from hf_scale.config import from_dict
    from hf_scale.train.config import load_job
    from tests.harness import stand_in_calibration
    from tests.tiny_models import tiny_recipe

    monkeypatch.setenv("XDG_CACHE_HOME", stand_in_calibration(tmp_path / "cache")["XDG_CACHE_HOME"])
    recipe = tiny_recipe(tmp_path, parallel={"strategy": "auto", "pp": 2},
                         train={"batch_size": 8, "eval_batch_size": 6})
    assert main(["plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith((" *", "    ")) and " step " in line]
    assert rows and all(" 1x1x1x2 " in row for row in rows), rows
    # 1f1b / gpipe with their default 2 microbatches run; interleaved and zbv default to 4
    assert all(" m=" not in row and " interleaved" not in row and " zbv" not in row for row in rows), rows
    assert "the recipe refuses it: train.eval_batch_size=6 does not split into parallel.pp_microbatches=4" in out
    recommended = out.split("recommended: ")[1].split(" -> parallel: ")[1].split(";")[0]
    fields = dict(kv.split("=") for kv in recommended.split(", "))
    job = load_job(recipe)
    assert fields["pp_schedule"] in ("1f1b", "gpipe") and fields["pp_microbatches"] == "None"  # the default: 2
    chosen = from_dict(ParallelConfig, {"strategy": fields["strategy"], "pp": 2, "pp_schedule": fields["pp_schedule"]})
    assert job.refuses(chosen) is None
