"""The fine-tuning application under context parallel, without processes: recipes that cp
cannot split fail when loaded, with what to do (pack the data); evaluation on a model carrying
a fake parallel state with ``cp_degree=2`` takes the loss-only path (each cp rank holds its own
positions' logits) and gives the logits path's loss. The loop at world 2:
tests/distributed/test_cp_finetune.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset

from hf_scale.data.packing import PackedCollator
from hf_scale.errors import HfScaleConfigError
from hf_scale.parallel_state import STATE_ATTR
from hf_scale.train.config import DataConfig, load_job
from hf_scale.train.data import tokenize_causal_lm
from hf_scale.train.dp import context_degree
from hf_scale.train.evaluate import evaluate
from tests.tiny_models import CAUSAL, tiny_model, tiny_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("recipe, overrides, message", [
    ("quickstart.yaml", ["--data.packing", "false"], r"on padded rows: .* Pack the data \(data.packing: bfd"),
    ("minilm-classification.yaml", [], "model.task='sequence_classification': context parallel splits the "
                                       "per-token loss of causal LMs only. Drop parallel.cp"),
])
def test_recipes_cp_cannot_split_fail_when_loaded(recipe, overrides, message):
    with pytest.raises(HfScaleConfigError, match=message):
        load_job(CONFIGS / recipe, ["--parallel.cp", "2", *overrides])


@pytest.mark.parametrize("overrides", [["--data.packing", "bfd"], ["--data.packing", "false", "--data.padding_free", "true"]])
def test_packed_recipes_load_under_cp(overrides):
    job = load_job(CONFIGS / "quickstart.yaml", ["--parallel.cp", "2", *overrides])
    assert job.parallel.cp == 2 and job.data.keeps_documents_apart


def test_evaluation_under_cp_reports_the_loss_of_the_logits_path():
    tok = tiny_tokenizer()
    pairs = [{"prompt": f"{i} plus {i}", "response": f"{2 * i}"} for i in range(7)]
    rows = tokenize_causal_lm(Dataset.from_list(pairs), tok, DataConfig(), 32)
    model = tiny_model("llama", CAUSAL)
    collate = PackedCollator(0)
    plain = evaluate(model, rows, collate, task="causal_lm", batch_size=2, rank=0, world=1, device="cpu")
    setattr(model, STATE_ATTR, SimpleNamespace(cp_degree=2, pipeline=None))
    assert context_degree(model) == 2
    split = evaluate(model, rows, collate, task="causal_lm", batch_size=2, rank=0, world=1, device="cpu")
    assert "eval_exact_match" in plain and set(split) == {"eval_loss", "eval_examples"}
    assert split["eval_examples"] == plain["eval_examples"] == 7
    assert split["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)
