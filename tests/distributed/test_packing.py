"""Packed rows (documents kept apart by position_ids, no attention mask) under fsdp, tp=2 and
pp=2 at world 2 give the loss and every gradient of one process running the same examples padded
one per row, token-weighted, fp32 at 1e-5: Llama, Qwen3 and Gemma3-text (a sliding window shorter
than the documents). Padding-free rows (each rank's rows flattened into one) under fsdp and tp;
LoRA adapters (their gradients) under fsdp and tp.
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
    return dict(zip((c["id"] for c in CASES), run_ranks(run_packed_cases, 2, CASES, timeout=600)[0]))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_packed_rows_match_padded_examples_in_one_process(case, results):
    result = results[case["id"]]
    assert "error" not in result, result.get("error")
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=RTOL)
    assert result["grad_errors"], "no gradient was compared"
    worst = max(result["grad_errors"].items(), key=lambda kv: kv[1])
    assert worst[1] <= RTOL * 10, f"{worst[0]}: gradient differs by {worst[1]:.2e} of its norm"
