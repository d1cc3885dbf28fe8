"""``hf-scale plan --pp``: the stage split the engine would make and the schedule's bubble, without weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from hf_scale.cli import main
from hf_scale.config import ParallelConfig
from hf_scale.layout_preview import bubble_fraction, plan_report
from tests.tiny_models import CAUSAL, save_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# SmolLM2-135M's shapes (the real model is a zoo package; its config stands in here)
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
EMBEDDING = 49152 * 576


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m", "idle"),
    [
        ("1f1b", 2, 1, 2, 1 / 3),  # (p-1)/(m+p-1): warm-up and drain of one stage each
        ("gpipe", 2, 1, 8, 1 / 9),
        ("1f1b", 4, 1, 4, 3 / 7),
        ("interleaved_1f1b", 2, 2, 8, 1 / 17),  # (p-1)/(v*m+p-1)
        ("zero_bubble", 2, 2, 8, 1 / 49),  # (p-1)/(3*v*m+p-1)
        ("zero_bubble", 4, 1, 4, 3 / 15),  # ZB-1P's rate (p-1)/(3m) = 1/4 of the busy time
        ("zbv", 2, 2, 8, 0.0),
    ],
)
def test_bubble_fraction_of_each_schedule(schedule, p, v, m, idle):
    fraction, formula = bubble_fraction(schedule, p, v, m)
    assert fraction == pytest.approx(idle, rel=1e-12) and formula


def test_bubble_over_busy_time_is_the_published_rate():
    """idle / (1 - idle) is the bubble rate the papers give: (p-1)/m for 1F1B, (p-1)/(3m) for ZB-1P."""
    for p, m in [(2, 2), (4, 8), (8, 32)]:
        one, _ = bubble_fraction("1f1b", p, 1, m)
        zb, _ = bubble_fraction("zero_bubble", p, 1, m)
        assert one / (1 - one) == pytest.approx((p - 1) / m)
        assert zb / (1 - zb) == pytest.approx((p - 1) / (3 * m))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    LlamaConfig(**SMOLLM2).save_pretrained(folder)
    return folder / "config.json"


def test_stage_split_of_smollm2_covers_every_block_once_and_is_balanced(smollm2):
    config = LlamaConfig.from_pretrained(smollm2.parent)
    report = plan_report(config, ParallelConfig(pp=2), 2)
    pp = report["pp"]
    blocks = [b for st in pp["stages"] for b in st["blocks"]]
    assert blocks == list(range(30))  # contiguous, in order, each once
    assert [st["rank"] for st in pp["stages"]] == [0, 1]
    # the tied embedding is held by the first stage, the head's copy by the last
    assert sum(st["params"] for st in pp["stages"]) == report["parameters"] + EMBEDDING
    assert sum(st["compute"] for st in pp["stages"]) == pytest.approx(1.0)
    assert pp["balance"] <= 1.2
    assert len(pp["stages"][0]["blocks"]) > len(pp["stages"][1]["blocks"])  # the head weighs on the last stage
    assert report["params_per_rank"] == max(pp["rank_params"]) < report["parameters"]
    assert (pp["microbatches"], pp["bubble"]) == (2, pytest.approx(1 / 3))
    # a V (zbv) puts stage 0 and stage 3 on rank 0; fsdp over 2 more ranks halves each rank's share
    v = plan_report(config, ParallelConfig(pp=2, pp_schedule="zbv", pp_microbatches=8), 4)
    assert [st["rank"] for st in v["pp"]["stages"]] == [0, 1, 1, 0]
    assert v["params_per_rank"] == max(v["pp"]["rank_params"]) // 2
    assert v["pp"]["rank_params"][0] == v["pp"]["stages"][0]["params"] + v["pp"]["stages"][3]["params"]


def test_plan_command_prints_the_stages_and_the_bubble(smollm2, capsys):
    assert main(["plan", str(smollm2), "--pp", "2", "--pp-microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "mesh: fsdp over 2 rank(s) on 1 node(s): pp=2 x dp_replicate=1 x dp_shard=1 x tp=1" in out
    assert "pipeline parallel over 2 ranks: 2 stages (1 per rank), schedule 1f1b, 8 microbatches per batch" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [r[:3] for r in rows] == [["0", "0", "0-18"], ["1", "1", "19-29"]]
    assert "bubble: 11.1% of a step idle (p=2, v=1, m=8: (p-1)/(m+p-1))" in out
    assert main(["plan", str(smollm2), "--pp", "2", "--pp-schedule", "interleaved_1f1b", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 stages (2 per rank), schedule interleaved_1f1b, 4 microbatches" in out and "dp_shard=2" in out
    assert "bubble: 11.1% of a step idle (p=2, v=2, m=4: (p-1)/(v*m+p-1))" in out


def test_plan_of_a_recipe_takes_pp_flags_and_overrides(tmp_path, capsys):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL)
    recipe = str(CONFIGS / "quickstart.yaml")
    capsys.readouterr()
    assert main(["plan", recipe, "--model.name_or_path", folder, "--parallel.pp", "2"]) == 0
    assert "pp=2 x dp_replicate=1 x dp_shard=1" in capsys.readouterr().out
    assert main(["plan", recipe, "--model.name_or_path", folder, "--pp", "2", "--pp-schedule", "gpipe"]) == 0
    assert "schedule gpipe" in capsys.readouterr().out
    # the tiny Llama has 2 blocks: 4 stages cannot be cut, and the engine's error says so
    assert main(["plan", folder, "--pp", "2", "--pp-schedule", "zero_bubble"]) == 2  # 2 stages per rank
    assert "= 4 stages, but LlamaForCausalLM has 2 blocks" in capsys.readouterr().err
    assert main(["plan", folder, "--pp", "3"]) == 2
    assert "= 3 stages, but LlamaForCausalLM has 2 blocks" in capsys.readouterr().err
    assert main(["plan", folder, "--pp", "2", "--pp-schedule", "bogus"]) == 2
    assert "pp_schedule='bogus' is not one of 'gpipe', '1f1b'" in capsys.readouterr().err


def test_the_benchmarks_arithmetic_idles_as_long():
    """scripts/pipeline_ideal.py computes each schedule's ideal step on its own: from the papers'
    formulas with stage times, and by replaying the schedule's own action order (torch's
    ``pipeline_order`` for the multi-stage ones). With equal stages and equal forward /
    input-backward / weight-backward passes a rank idles the fraction hf-scale plan prints
    (the replay of torch's zbv order is left out: it keeps some bubble at few microbatches
    where the paper's ZB-V has none)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from pipeline_ideal import action_orders, ideal_step, simulate

    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]:
        for m in (2, 4, 8):
            ones = [1.0] * (2 * v)
            busy = m * 3 * v  # each rank's forward + input and weight backward of its v stages
            want = bubble_fraction(schedule, 2, v, m)[0]
            assert 1 - busy / ideal_step(schedule, m, 2, ones, ones, ones) == pytest.approx(want), (schedule, m)
            if schedule != "zbv":
                replayed = simulate(action_orders(schedule, m, 2), ones, ones, ones)
                assert 1 - busy / replayed == pytest.approx(want), (schedule, m)
