"""The fine-tuning application under pipeline parallel, without processes.

A one-process tiny model carrying a fake parallel state with ``pp_degree=2`` (and no pipeline,
so ``eval_step`` is the plain loss) takes evaluation's pipeline path: its loss must equal the
logits path's on the same data, padded rounds included, and exact match is left out. Recipes
that cannot run under pp fail when loaded, before any model is. The loop's one code path,
``train_step(batch, loss_scale=...)``, carries fp16's loss scale.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset

from hf_scale.errors import HfScaleConfigError
from hf_scale.parallel_state import STATE_ATTR
from hf_scale.train.config import DataConfig, load_job
from hf_scale.train.data import tokenize_causal_lm
from hf_scale.train.dp import pipeline_degree
from hf_scale.train.evaluate import evaluate
from hf_scale.train.loader import PadCollator
from tests.tiny_models import CAUSAL, tiny_model, tiny_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_evaluation_on_the_pipeline_path_gives_the_logits_paths_loss():
    tok = tiny_tokenizer()
    pairs = [{"prompt": f"{i} plus {i}", "response": f"{2 * i}"} for i in range(7)]
    rows = tokenize_causal_lm(Dataset.from_list(pairs), tok, DataConfig(), 32)
    model = tiny_model("llama", CAUSAL)
    collate = PadCollator(0)
    # 7 examples in batches of 2: the last batch is padded with a copy weighted 0, whose tokens
    # must not count
    plain = evaluate(model, rows, collate, task="causal_lm", batch_size=2, rank=0, world=1, device="cpu")
    setattr(model, STATE_ATTR, SimpleNamespace(pp_degree=2, pipeline=None))
    assert pipeline_degree(model) == 2
    piped = evaluate(model, rows, collate, task="causal_lm", batch_size=2, rank=0, world=1, device="cpu")
    assert "eval_exact_match" in plain and set(piped) == {"eval_loss", "eval_examples"}
    assert piped["eval_examples"] == plain["eval_examples"] == 7
    assert piped["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--parallel.mixed_precision", "fp16"],
         "mixed_precision='fp16' with pp=2: each stage would scale its own loss"),
        (["--parallel.cpu_offload", "true"], "cpu_offload=True with pp=2 is not supported yet"),
        (["--train.eval_batch_size", "50"],
         "train.eval_batch_size=50 does not split into parallel.pp_microbatches=4 equal microbatches"),
        (["--parallel.pp_microbatches", "null", "--parallel.pp_schedule", "interleaved_1f1b", "--train.batch_size", "6"],
         "train.batch_size=6 does not split into parallel.pp_microbatches=4 (by default pp x stages per rank = 4)"),
    ],
)
def test_recipes_that_cannot_run_under_pp_fail_when_loaded(overrides, message):
    with pytest.raises(HfScaleConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(CONFIGS / "quickstart-pp2.yaml", overrides)


def test_the_quickstarts_run_under_pp():
    job = load_job(CONFIGS / "quickstart-pp2.yaml")
    assert (job.parallel.pp, job.parallel.pp_microbatches, job.launch.nproc_per_node) == (2, 4, 2)
    job = load_job(CONFIGS / "quickstart.yaml", ["--parallel.pp", "2"])  # the command line in docs/cli.md
    assert job.parallel.pp == 2 and job.train.batch_size % 2 == job.train.eval_batch_size % 2 == 0


def test_the_fp16_loss_scale_goes_into_train_steps_loss_scale():
    """With the GradScaler on, the step scales the loss by its scale through ``train_step`` and
    unscales before clipping: the same norm and update as without it."""
    import torch

    from hf_scale.train.config import JobConfig, ModelConfig, TrainConfig
    from hf_scale.train.dp import DataParallel
    from hf_scale.train.loop import _train_step
    from tests.tiny_models import tiny_batch

    job = JobConfig(model=ModelConfig(task="causal_lm"), train=TrainConfig(max_grad_norm=None))
    batch = tiny_batch(CAUSAL, 4)

    def step(scaler):
        model = tiny_model("llama", CAUSAL)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        values = _train_step(job, model, optimizer, scaler, iter([dict(batch)]), torch.device("cpu"), DataParallel())
        return values, model.model.norm.weight.detach().clone()

    (plain, plain_w), (scaled, scaled_w) = step(torch.amp.GradScaler("cpu", enabled=False)), step(
        torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert scaled["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert scaled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    torch.testing.assert_close(scaled_w, plain_w)
