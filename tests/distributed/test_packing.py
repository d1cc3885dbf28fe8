"""Packed rows (documents kept apart by position_ids, no attention mask) under fsdp, tp=2 and
pp=2 at world 2 give the loss and every gradient of one process running the same examples padded
one per row, token-weighted, fp32 at 1e-5: Llama, Qwen3 and Gemma3-text (a sliding window shorter
than the documents). Padding-free rows (each rank's rows flattened into one) under fsdp and tp;
LoRA adapters (their gradients) under fsdp and tp. Every case with ``packed_attention`` (as
hf-scale finetune runs packed data: each document attended alone; sdpa's masked path is
tests/unit/test_packing.py's).
A model that cannot keep documents apart (OPT) is refused: tests/unit/test_packing.py."""

from __future__ import annotations

import pytest

from tests.distributed.packing_checks import run_packed_cases
from tests.harness import run_ranks

ARCHS = ("llama", "qwen3", "gemma3_text")
LAYOUTS = {"fsdp": {"strategy": "fsdp"}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
CASES = [dict(arch=a, config=c, id=f"{a}-{n}") for a in ARCHS for n, c in LAYOUTS.items()]
CASES += [dict(arch=a, config=LAYOUTS[n], flatten=True, id=f"{a}-{n}-padding_free")
          for a in ("llama", "gemma3_text") for n in ("fsdp", "tp2")]
CASES += [dict(arch="llama", config=LAYOUTS[n], lora=True, id=f"llama-{n}-lora") for n in ("fsdp", "tp2")]
RTOL = 1e-5


@pytest.fixture(scope="module")
def results():
    """Each case's results on every rank (a pipeline's stages hold different gradients)."""
    per_rank = run_ranks(run_packed_cases, 2, CASES, timeout=600)
    return {c["id"]: [ranks[i] for ranks in per_rank] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_packed_rows_match_padded_examples_in_one_process(case, results):
    ranks = results[case["id"]]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
    result = ranks[0]
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=RTOL)
    grad_errors = {}  # the worst over the ranks, per parameter
    for r in ranks:
        for name, err in r["grad_errors"].items():
            grad_errors[name] = max(err, grad_errors.get(name, 0.0))
    assert grad_errors, "no gradient was compared"
    assert sum(r["documents_split"] for r in ranks) > 0, "packed_attention never attended documents one at a time"
    worst = max(grad_errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL * 10, f"{worst[0]}: gradient differs by {worst[1]:.2e} of its norm"
