"""The labeled-only loss (``loss_labeled_only``: the output head and cross-entropy on the labeled
positions only) under fsdp (2 data-parallel ranks, each its own rows), fsdp with chunks, tp=2
and pp=2 against one process of plain transformers on the same global batch, on batches whose
prompts are masked (a prefix of a different length per row) and right-padded (-100): the
same losses, gradients after the first step and parameter updates after 2 AdamW steps, and
the head runs on the label tokens only. Also with chunks where a data-parallel rank's rows or
a pipeline microbatch hold no label token at all (their backward raised: the rank left its
collectives). One 2-rank process group runs every case (tests/distributed/labeled_only_checks.py).

Tolerances are test_parity.py's: fp32 losses within 1e-5 relative, each gradient within 1e-5
of its norm (measured: under 5e-7), updates within 2e-4 of the reference update's norm.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import labeled_only_checks as checks
from tests.distributed.test_parity import FP32_RTOL, NOISE_GRAD, UPDATE_RTOL, update_errors
from tests.harness import run_ranks
from tests.tiny_models import slice_batch

CASES = [
    {"id": "fsdp", "config": {"strategy": "fsdp"}},
    {"id": "fsdp-chunked", "config": {"strategy": "fsdp", "loss_chunk_tokens": 5}},
    {"id": "tp2", "config": {"tp": 2}},
    {"id": "pp2", "config": {"pp": 2, "pp_schedule": "1f1b"}},
    # rows 0-3 hold no label token: data-parallel rank 0's slice, the pipeline's first microbatch
    {"id": "fsdp-chunked-unlabeled-rank", "config": {"strategy": "fsdp", "loss_chunk_tokens": 5}, "unlabeled_rows": 4},
    {"id": "pp2-chunked-unlabeled-microbatch", "config": {"pp": 2, "pp_schedule": "1f1b", "loss_chunk_tokens": 5},
     "unlabeled_rows": 4},
]


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(checks.world_checks, 2, CASES, timeout=300)
    return {case["id"]: [ranks[r][i] for r in range(2)] for i, case in enumerate(CASES)}


_REFERENCES: dict = {}


def _reference(unlabeled_rows: int) -> dict:
    if unlabeled_rows not in _REFERENCES:
        _REFERENCES[unlabeled_rows] = checks.reference_run(unlabeled_rows=unlabeled_rows)
    return _REFERENCES[unlabeled_rows]


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_labeled_only_matches_one_process_on_masked_prompts(case, results):
    ranks, reference = results[case["id"]], _reference(case.get("unlabeled_rows", 0))
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
    held = set()
    for rank, result in enumerate(ranks):
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= FP32_RTOL * abs(want), f"rank {rank} step {step}: loss {got} vs {want}"
        for name, grad in result["grads"].items():
            assert grad is not None, f"rank {rank}: {name} got no gradient"
            rel = _relative(grad, reference["grads"][name].numpy())
            assert rel <= FP32_RTOL, f"rank {rank} {name}: its gradient differs by {rel:.2e} of its norm"
        sub = {key: {n: reference[key][n] for n in result["params"]} for key in ("params", "initial", "grad_max")}
        noise = NOISE_GRAD * max(reference["norms"])
        for name, rel in update_errors(sub, result["params"], noise).items():
            assert rel <= UPDATE_RTOL, f"rank {rank} {name}: its update differs by {rel:.2e} of its norm"
        held |= set(result["params"])
    assert set(reference["params"]) - set(reference["tie_targets"]) <= held, "a parameter is held by no rank"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_the_head_runs_on_the_label_tokens_only(case, results):
    """The last step's positions through the head on each rank: its slice's label tokens (the
    whole batch's under tp, on the pipeline's last stage under pp, none on its first stage);
    twice with chunks, each chunk's head recomputed in backward. (The first step of a pipeline
    also runs torch's shape inference on one microbatch.)"""
    chunked = "loss_chunk_tokens" in case["config"]
    for rank, result in enumerate(results[case["id"]]):
        want = result["label_tokens"][-1] * (2 if chunked else 1)
        if "pp" in case["config"] and result["pp_rank"] == 0:
            want = 0
        assert result["head_rows"][-1] == want, f"rank {rank}: the head ran on {result['head_rows']} positions"


def test_data_parallel_ranks_train_on_rows_of_different_label_counts(results):
    """Under fsdp the two ranks hold different rows (23 and 44 label tokens), so each rank's
    loss is weighted by its share of the label tokens, not averaged."""
    ranks = results["fsdp"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert [r["label_tokens"][0] for r in ranks] == [23, 44]
    assert ranks[0]["raw_losses"] != ranks[1]["raw_losses"]


def test_the_batches_make_the_prompt_mask_and_the_token_weighting_matter():
    """One process: the gradient with the prompts unmasked, and the gradient of the mean of the
    two halves' mean losses (a data-parallel or microbatch weighting that averaged means),
    differ from the batch's by far more than the tolerance (measured: 0.58 and 0.31 of its
    norm; at random init the loss itself hardly moves, 6e-4 relative unmasked)."""
    model = checks.pp_model(checks.ARCH)
    batch = checks.batches()[0]
    unmasked = dict(batch, labels=torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100))
    halves = [slice_batch(batch, i, 2) for i in range(2)]
    grads = []
    for loss_of in (lambda: model(**batch).loss, lambda: model(**unmasked).loss,
                    lambda: sum(model(**h).loss for h in halves) / 2):
        model.zero_grad()
        loss_of().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for other in grads[1:]:
        assert float((grads[0] - other).norm() / grads[0].norm()) > 100 * FP32_RTOL
