"""scripts/bench_planner.py: its legs cover what issue 14 asks of the calibration run, every leg
is a layout the engine accepts and the planner can estimate, and the ratios and targets it prints."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_planner import (
    LEGS,
    add_round,
    config_of,
    leg_layout,
    peak_module,
    ranking_groups,
    recheck,
    round_orders,
    summary,
    table,
)

from hf_scale.layout_search.estimate import Workload, estimate_memory
from hf_scale.layout_search.profile import model_facts
from hf_scale.mesh import ParallelDims


def test_legs_cover_the_issue():
    layouts = {name: leg_layout(name) for name in LEGS}
    assert len(LEGS) >= 12
    assert {world for _, world, _, _, _ in LEGS.values()} == {1, 2, 4}
    assert {lay.strategy for lay in layouts.values()} >= {"fsdp", "zero2", "zero1", "ddp", "hsdp"}
    assert any(lay.tp > 1 for lay in layouts.values()) and any(lay.pp > 1 for lay in layouts.values())
    assert {lay.ac for lay in layouts.values()} == {None, "selective", "full"}
    assert any(lay.cpu_offload for lay in layouts.values()) and any(lay.loss_chunk_tokens for lay in layouts.values())
    assert {model for model, *_ in LEGS.values()} == {"tiny", "small", "smollm2"}


def test_every_leg_is_a_valid_layout_the_planner_estimates():
    facts = {}
    for name, (model, world, seq, batch, _) in LEGS.items():
        layout = leg_layout(name)
        assert layout.world_size == world, name
        if world > 1:
            ParallelDims.resolve(layout.parallel_config(), world)
        facts.setdefault(model, model_facts(config_of(name)))
        assert estimate_memory(facts[model], layout, Workload(seq=seq, batch=batch)).device_total > 0


def test_table_ratios_and_targets():
    pred = {"tracked": 105.0, "rss": 90.0, "step": 2.0}
    rows = {"tiny_w1": (pred, {"status": "ok", "tracked": 100.0, "rss": 100.0, "step": 1.0}),
            "tiny_ddp_w2": (pred, {"status": "failed: boom"})}
    text = table(rows)
    assert "| tiny_w1 | " in text and "| 1.05 | 0.90 | 2.00 |" in text and "failed: boom" in text
    verdict = summary(rows)
    assert "PASS: tracked within +/-5% on 1 leg(s) (worst +5.0%)" in verdict
    assert "PASS: rss within +/-10% on 1 leg(s) (worst -10.0%)" in verdict
    assert "FAIL: step within +/-25% on 1 leg(s) (worst +100.0%)" in verdict


def test_a_leg_without_tracked_bytes_is_left_out_of_that_target_only():
    """zbv's split backward defeats MemTracker: its leg has RSS and step time, no tracked bytes."""
    pred = {"tracked": 105.0, "rss": 90.0, "step": 1.0}
    split = {"status": "ok", "tracked": None, "rss": 100.0, "step": 1.0}
    rows = {"small_pp2_zbv_w2": (pred, split)}
    assert "| n/a | 0.90 | 1.00 |" in table(rows) and "n/a (split backward)" in table(rows)
    assert "n/a: tracked: no leg measured it" in summary(rows)
    rows["small_pp2_m4_w2"] = (pred, {**split, "tracked": 100.0})
    verdict = summary(rows)
    assert "PASS: tracked within +/-5% on 1 leg(s)" in verdict and "rss within +/-10% on 2 leg(s)" in verdict


def test_ranking_target_per_group_of_comparable_legs():
    """Legs of one model, sequence, batch and world are ranked by tokens/s over the data-parallel
    ranks: tp2 (one data-parallel rank) must be twice as fast per step to match fsdp's tokens."""
    def row(pred_step, meas_step, pred_rss=1.0):
        return ({"tracked": 1.0, "rss": pred_rss, "step": pred_step}, {"status": "ok", "tracked": 1.0, "rss": 1.0,
                                                                        "step": meas_step})

    # predicted: tp2 (0.4 s for half the tokens) beats fsdp (1.0 s); measured: fsdp 1.0 s, tp2 0.9 s
    rows = {"small_fsdp_chunk_w2": row(1.0, 1.0), "small_tp2_w2": row(0.4, 0.9), "tiny_w1": row(1.0, 1.0)}
    verdict = summary(rows)
    assert "FAIL: ranking, small 2x256/dp rank at world 2: ranked first small_tp2_w2 measures 0.56x" in verdict
    assert "world 1" not in verdict  # a leg alone in its group ranks nothing
    rows["small_tp2_w2"] = row(0.6, 0.9)
    assert "PASS: ranking, small 2x256/dp rank at world 2: ranked first small_fsdp_chunk_w2" in summary(rows)


def test_ranking_breaks_near_ties_toward_less_memory_as_the_chooser_does():
    """Predicted within 1% of each other is a tie for the chooser (``choose.TIE``), which then
    picks the layout needing less memory: the benchmark checks that pick, not the 0.5% faster one."""
    def row(pred_step, pred_rss, meas_step):
        return ({"tracked": 1.0, "rss": pred_rss, "step": pred_step}, {"status": "ok", "tracked": 1.0, "rss": 1.0,
                                                                        "step": meas_step})

    rows = {"small_zero1_w2": row(0.995, 2.0, 1.2), "small_fsdp_w2": row(1.0, 1.0, 1.0)}
    assert "PASS: ranking, small 2x256/dp rank at world 2: ranked first small_fsdp_w2 measures 1.00x" in summary(rows)
    rows["small_zero1_w2"] = row(0.98, 2.0, 1.2)  # 2% faster predicted: no tie, and measured 0.83x
    assert "FAIL: ranking, small 2x256/dp rank at world 2: ranked first small_zero1_w2 measures 0.83x" in summary(rows)


def test_peak_module_names_where_the_full_checkpointing_peak_is():
    """The estimate's end-of-backward term rests on this: under full checkpointing, the step's
    tracked peak is in the first block's backward (its recomputed MLP), not in the loss."""
    import torch
    import transformers

    import hf_scale

    torch.manual_seed(0)
    model = hf_scale.parallelize(transformers.AutoModelForCausalLM.from_config(config_of("tiny_full_w1")),
                                 hf_scale.ParallelConfig(activation_checkpointing="full"))
    optimizer = hf_scale.build_optimizer(model, lr=1e-5)
    ids = torch.randint(512, (2, 64))

    def step(batch):
        model.train_step({"input_ids": batch, "labels": batch})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(ids)  # the optimizer's state exists from here on, as in the benchmark's measured step
    assert peak_module(model, optimizer, step, ids) == "LlamaForCausalLM.model.layers.0.mlp (Peak-Backward)"


def test_ranking_groups_are_timed_in_rounds_of_alternating_order():
    """A group's legs are timed again after the first pass, reversed then as listed, and each leg's
    step is its rounds' median: no leg always runs first, and one slow launch does not rank it."""
    groups = ranking_groups(["tiny_w1", "small_hsdp_w4", "tiny_full_w1", "small_fsdp_w4", "smollm2_w1"])
    assert groups == {("tiny", 1, 64, 2): ["tiny_w1", "tiny_full_w1"],
                      ("small", 4, 256, 1): ["small_hsdp_w4", "small_fsdp_w4"]}  # smollm2_w1 alone: no rounds
    assert round_orders(["a", "b", "c"], 4) == [["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    assert round_orders(["a", "b"], 1) == []
    meas = {"status": "ok", "step": 1.5, "rounds": [1.5]}
    add_round(meas, 1.0)
    add_round(meas, 1.1)
    assert meas["rounds"] == [1.5, 1.0, 1.1] and meas["step"] == 1.1


def test_ranking_line_gives_each_rounds_tokens_per_second():
    pred = {"tracked": 1.0, "rss": 1.0, "step": 1.0}
    rows = {"small_hsdp_w4": (pred, {"status": "ok", "tracked": 1.0, "rss": 1.0, "step": 1.024, "rounds": [1.024, 2.048, 1.024]}),
            "small_fsdp_w4": ({**pred, "step": 1.1}, {"status": "ok", "tracked": 1.0, "rss": 1.0, "step": 1.024,
                                                      "rounds": [1.024, 1.024, 1.024]})}
    verdict = summary(rows)
    assert "ranked first small_hsdp_w4 measures 1.00x" in verdict
    assert "per round small_hsdp_w4 1,000/500/1,000; small_fsdp_w4 1,000/1,000/1,000" in verdict


def test_recheck_gives_the_step_target_under_the_second_calibration():
    from types import SimpleNamespace

    device = SimpleNamespace(flops_fp32=25e9, intra=SimpleNamespace(bandwidth=1.2e9))
    rows = {"tiny_w1": ({}, {"status": "ok", "step": 1.0}), "tiny_full_w1": ({}, {"status": "ok", "step": 2.0})}
    line = recheck(rows, {"tiny_w1": 1.3, "tiny_full_w1": 1.6}, device)
    assert line == ("recheck: with the calibration taken again after the legs (25.0 GFLOP/s, gloo 1.20 GB/s), "
                    "step within +/-25% on 1 of 2 leg(s) (errors -20.0% to +30.0%)")
