"""scripts/bench_parallelize.py's check (f): hf_scale fsdp against torch's fully_shard per round
of alternating legs (issue 42: >= 1.1x tokens/s, peak RSS <= 1.0x, the same last loss, in every
round), computed from the rows the launcher returns."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_parallelize import checks, rounds


def _row(tok_s, peak=2.38, loss=13.05, load=0.0):
    return {"status": "ok", "tok_s": tok_s, "peak": peak, "train_peak": peak, "loss": loss, "other_load": load,
            "is_fsdp": True}


def test_each_round_pairs_the_ith_runs():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80)), ("hf_fsdp", _row(60)), ("torch_fsdp", _row(50))]
    (line,) = rounds(runs)
    assert line.startswith("(f) PASS")
    assert "round 1: 90.0 / 80.0 tok/s = 1.125x" in line and "round 2: 60.0 / 50.0 tok/s = 1.200x" in line


def test_one_round_below_the_target_fails_it():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80)), ("hf_fsdp", _row(84)), ("torch_fsdp", _row(80))]
    assert rounds(runs)[0].startswith("(f) FAIL")


def test_memory_and_loss_are_part_of_it():
    assert rounds([("hf_fsdp", _row(99, peak=2.39)), ("torch_fsdp", _row(80))])[0].startswith("(f) FAIL")
    assert rounds([("hf_fsdp", _row(99, loss=13.1)), ("torch_fsdp", _row(80))])[0].startswith("(f) FAIL")


def test_without_both_legs_no_line():
    assert rounds([("hf_fsdp", _row(90))]) == []
    assert rounds([("hf_fsdp", {"status": "timed out"}), ("torch_fsdp", _row(80))]) == []


def test_checks_include_the_rounds():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80))]
    out = checks(dict(runs), runs)
    assert any(line.startswith("(f) PASS") for line in out)
    assert any(line.startswith("(a) PASS") for line in out)


def test_bounds_line_reads_the_legs_against_the_compute_ceiling():
    from bench_fsdp_bounds import bounds_line

    labels = {"bound_compute": "compute alone", "hf_fsdp": "hf", "torch_fsdp": "torch"}
    runs = [("hf_fsdp", _row(80)), ("torch_fsdp", _row(76)), ("hf_fsdp", _row(84)), ("bound_compute", _row(100)),
            ("bound_collectives", _row(200))]
    (line,) = bounds_line(runs, labels, tokens_per_step=1000)
    assert "compute alone 100.0 tok/s" in line
    assert "collectives alone 5.00 s per step" in line  # 1000 tokens / 200 tok/s
    assert "without overlap 66.7 tok/s (0.667 of the ceiling)" in line  # 1000 / (10 s + 5 s)
    assert "hf: 82.0 tok/s = 0.820 of the ceiling" in line  # the mean of its runs
    assert "1.1x torch fully_shard = 83.6 tok/s = 0.836 of the ceiling (within it)" in line
    (slow,) = bounds_line([("torch_fsdp", _row(95)), ("bound_compute", _row(100))], labels, 1000)
    assert "= 104.5 tok/s = 1.045 of the ceiling (beyond it" in slow
    assert bounds_line([("hf_fsdp", _row(80))], labels, 1000) == []


def test_shard_step_adamw_updates_this_ranks_rows_as_adamw_would():
    import torch

    from bench_fsdp_bounds import ShardStepAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    reference = torch.nn.Linear(4, 5)
    reference.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = ShardStepAdamW(model, world=2, rank=1, lr=0.1, weight_decay=0.0)
    full = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    for _ in range(2):
        x = torch.randn(3, 4)
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        optimizer.step()
        full.step()
        optimizer.zero_grad()
        full.zero_grad()
    for name, param in model.state_dict().items():  # rank 1 of 2 holds rows 3-4 of 5 (torch.chunk)
        assert torch.allclose(param[3:], reference.state_dict()[name][3:], atol=1e-6)
        assert torch.equal(param[:3], before[name][:3])
    assert model.weight.grad is None
