"""Reward models (``model.task: reward``) at world 2 under fsdp, ddp, zero2 and tp=2 against one
process: the losses, gradient norms and parameter updates of 3 AdamW steps through the
fine-tuning loop's step, and held-out pair accuracy and loss before and after.

The pairs are real preference rows (tokenize_preference with the tiny chat tokenizer): masked
prompts, chosen and rejected of different lengths (so right padding decides where each score
is read), each data-parallel rank on its own pairs, micro-batches accumulated in one case,
TRL's centring term in another. The oracle (reward_checks.reference_run) scores each
sequence alone, unpadded, and forms the pairs by hand: a wrong pairing, a score read at a pad,
a wrong weighting of micro-batches or ranks, or a loss that is not TRL's changes its numbers.
Tolerances (fp32): 1e-5 on losses, gradient norms and evaluation losses, as
tests/distributed/test_parity.py; each tensor's update (final minus initial) within 1e-3 of the
reference update's norm, as tests/integration/cli_reference.py: the oracle runs other shapes
(one unpadded sequence at a time), so its sums round differently, and Adam turns an element
whose gradient is rounding noise into a step of up to lr (measured worst tensor: 4.2e-4, layer
0's down_proj, alike under every layout). A wrong or missing step gives about 1.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.distributed.reward_checks import GLOBAL_PAIRS, STEPS, reference_run, run_reward_cases
from tests.harness import merge_ranks, run_ranks

RTOL = 1e-5
UPDATE_RTOL = 1e-3
CENTER = 0.05
CASES = [
    {"id": "fsdp-accum2-center", "config": {"strategy": "fsdp"}, "accum": 2, "center": CENTER},
    {"id": "fsdp", "config": {"strategy": "fsdp"}},
    {"id": "ddp", "config": {"strategy": "ddp"}},
    {"id": "zero2-accum2", "config": {"strategy": "zero2"}, "accum": 2},
    {"id": "tp2", "config": {"tp": 2}},
]


def _rows(n: int, seed: int) -> list[dict]:
    """Preference rows of varied lengths, tokenised as finetune does."""
    from datasets import Dataset

    from hf_scale.data.preference import tokenize_preference
    from hf_scale.train.config import DataConfig
    from tests.tiny_models import tiny_tokenizer

    rng = random.Random(seed)

    def text(lo, hi):
        return "".join(rng.choice("abcdefghij klmnop0123456789") for _ in range(rng.randint(lo, hi))).strip() or "x"

    raw = []
    for _ in range(n):
        chosen, rejected = text(1, 30), text(1, 30)
        raw.append({"prompt": text(3, 25) + "?", "chosen": chosen, "rejected": rejected + ("!" if rejected == chosen else "")})
    return tokenize_preference(Dataset.from_list(raw), tiny_tokenizer(), DataConfig(), 128).to_list()


@pytest.fixture(scope="module")
def data():
    steps_rows = [_rows(GLOBAL_PAIRS, seed=10 + s) for s in range(STEPS)]
    return steps_rows, _rows(5, seed=99)  # 5 held-out pairs: the ranks' last batches are padded with weight 0


@pytest.fixture(scope="module")
def results(data):
    steps_rows, eval_rows = data
    out = run_ranks(run_reward_cases, 2, CASES, steps_rows, eval_rows, timeout=600)
    # every rank's errors; the losses, norms and evaluations are global (rank 0 holds the parameters)
    return dict(zip((c["id"] for c in CASES), merge_ranks(out, same=("losses", "norms"))))


@pytest.fixture(scope="module")
def references(data):
    steps_rows, eval_rows = data
    return {center: reference_run(steps_rows, eval_rows, center) for center in {c.get("center") for c in CASES}}


def test_the_data_exercise_padding_and_masks(data):
    steps_rows, _ = data
    lengths = [(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in steps_rows[0]]
    assert sum(c != r for c, r in lengths) >= 6
    assert all(r["chosen_labels"][0] == -100 for r in steps_rows[0])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_reward_parity_with_one_process(case, results, references):
    got, ref = results[case["id"]], references[case.get("center")]
    assert "error" not in got, got.get("error")
    assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    assert got["norms"] == pytest.approx(ref["norms"], rel=RTOL)
    for name, final in ref["params"].items():
        update = final - ref["initial"][name]
        error = (torch.as_tensor(got["params"][name]) - final).norm() / update.norm().clamp(min=1e-12)
        assert float(error) < UPDATE_RTOL, (name, float(error))
    for when in ("before", "after"):
        assert got[when]["eval_examples"] == ref[when]["eval_examples"] == 5
        assert got[when]["eval_loss"] == pytest.approx(ref[when]["eval_loss"], rel=RTOL)
        assert got[when]["eval_accuracy"] == ref[when]["eval_accuracy"]


def test_training_moves_the_scores(references):
    """The updates compared above are not vacuous: the reference had gradients, and its score
    head moved by more than weight decay alone would move it (AdamW steps of about lr)."""
    ref = references[None]
    assert min(ref["norms"]) > 1e-3
    moved = (ref["params"]["score.weight"] - ref["initial"]["score.weight"]).abs().mean()
    assert float(moved) > 0.5 * 1e-3  # lr 1e-3 per step, 3 steps; decay alone: ~1e-4 x |w|
