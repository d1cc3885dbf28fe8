"""``hf-scale finetune`` with ``preference.loss``: DPO with the RPO term on the tiny Llama under
fsdp on 2 processes, 2 accumulated micro-batches of 2 pairs per rank, the reference precomputed
by the run itself before its first step, against one process on the same 8 pairs per step
(the loader's world-1 batches, ``preference_step`` on the plain model, plain AdamW): the logged
loss, gradient norm and TRL's metrics agree to 1e-5, and the saved weights' updates to 1e-3 of
their norm (tests/integration/cli_reference.py's bounds). That holds only if the loop weights
micro-batches by pairs (and the RPO term by chosen tokens) over the accumulation and the
data-parallel ranks, and the reference is the policy before the first step. Evaluation reports
the preference loss and reward accuracy on the held-out pairs, before and after.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tests.harness import finish_command, start_command
from tests.integration.cli_reference import LOSS_RTOL, UPDATE_RTOL, logged_steps
from tests.tiny_models import tiny_recipe

STEPS = 3
PREFERENCE = {"loss": "sigmoid", "beta": 0.5, "rpo_alpha": 0.5}


def one_process(recipe, pairs_per_step: int, reference_model: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_scale.data.preference import PairCollator
    from hf_scale.parallel.preference import preference_step
    from hf_scale.parallel.preference_reference import reference_logps
    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits
    from hf_scale.train.loader import ShardedBatches
    from hf_scale.train.preference import pair_datasets

    job = load_job(recipe)
    torch.manual_seed(job.train.seed)
    tokenizer = AutoTokenizer.from_pretrained(job.model.name_or_path)
    train, _ = pair_datasets(job, tokenizer, load_splits(job.data))
    model = AutoModelForCausalLM.from_pretrained(job.model.name_or_path, dtype=torch.float32)
    collate = PairCollator(tokenizer.pad_token_id)
    scorer = model if reference_model is None else AutoModelForCausalLM.from_pretrained(reference_model, dtype=torch.float32)
    ref = reference_logps(scorer, train, collate, 4)
    train = train.add_column("ref_chosen_logps", ref[:, 0].tolist()).add_column("ref_rejected_logps", ref[:, 1].tolist())
    batches = iter(ShardedBatches(train, pairs_per_step, 0, 1, collate, seed=job.data.seed))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.train.lr, betas=tuple(job.train.betas), weight_decay=0.0)
    knobs = job.preference.knobs()
    out = {"losses": [], "norms": [], "accuracies": [], "margins": []}
    for _ in range(STEPS):
        result = preference_step(model, next(batches), knobs)
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(float(result.loss))
        out["accuracies"].append(float(result.sums["rewards/accuracies"]) / result.pairs)
        out["margins"].append(float(result.sums["rewards/margins"]) / result.pairs)
    out.update(initial=initial, final={n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    recipe = tiny_recipe(tmp_path_factory.mktemp("cli-dpo"), steps=STEPS, data={"path": "builtin:preference"},
                         preference=PREFERENCE, train={"batch_size": 2, "grad_accum": 2, "scheduler": "constant",
                                                       "max_grad_norm": None, "weight_decay": 0.0})
    out = recipe.parent / "runs" / "fsdp"
    run = start_command([sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), "--train.output_dir", str(out)])
    reference = one_process(recipe, pairs_per_step=8)  # while the run starts its processes
    return out, finish_command(run, timeout=900).stdout, reference


def test_steps_match_one_process(dpo_run):
    out, log, ref = dpo_run
    _check_steps(out, ref)
    assert "global batch 8 (2 x 2 data-parallel ranks x 2 accumulation)" in log, log[-3000:]
    assert "reference log-probs of 48 training pairs precomputed with the policy before its first step" in log


def test_a_held_reference_model_is_the_reference(dpo_run, tmp_path):
    """``preference.reference: model`` with another model's weights, under zero2: a frozen copy
    sharded beside the policy (fsdp units), scored per micro-batch. The run must be one process
    whose reference log-probs are that other model's (not the policy's starting point: the
    first step's margins and loss differ from the precomputed run's)."""
    from tests.tiny_models import save_tiny_checkpoint

    out, _, precomputed = dpo_run
    recipe = out.parent.parent / "tiny.yaml"
    other = save_tiny_checkpoint(tmp_path / "sft", seed=1, initializer_range=0.2)  # far from the policy
    held, one = tmp_path / "held", tmp_path / "precomputed-other"
    cli = [sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), "--preference.reference_model", other]
    # both runs at once, and the one-process reference computed here meanwhile (most of a run is
    # process starts and imports)
    runs = [start_command([*cli, "--parallel.strategy", "zero2", "--preference.reference", "model",
                           "--train.output_dir", str(held)]),
            # the same reference precomputed in one pass (one process, the same 8 pairs per step)
            start_command([*cli, "--nproc-per-node", "1", "--train.batch_size", "4", "--preference.reference",
                           "precompute", "--train.output_dir", str(one)])]
    ref = one_process(recipe, pairs_per_step=8, reference_model=other)
    log, one_log = (finish_command(run, timeout=900).stdout for run in runs)
    assert f"reference: {other} held frozen beside the policy (one no-grad forward per micro-batch, sharded" in log
    assert "precomputed" not in log
    assert abs(ref["losses"][0] - precomputed["losses"][0]) > 0.1  # the other reference shows
    _check_steps(held, ref)
    summary = json.loads((held / "summary.json").read_text())
    assert summary["before"]["eval_rewards/margins"] != 0.0  # the policy is not its reference
    assert f"reference log-probs of 48 training pairs precomputed with the reference model {other}" in one_log
    _check_steps(one, ref)


def _check_steps(out, ref) -> None:
    steps = logged_steps(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in steps], ref["losses"], rtol=LOSS_RTOL, err_msg="loss")
    np.testing.assert_allclose([r["grad_norm"] for r in steps], ref["norms"], rtol=LOSS_RTOL, err_msg="grad_norm")
    np.testing.assert_allclose([r["rewards/accuracies"] for r in steps], ref["accuracies"], atol=1e-6)
    np.testing.assert_allclose([r["rewards/margins"] for r in steps], ref["margins"], rtol=1e-4, atol=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert all(key in r for r in steps), key


def test_saved_weights_match_one_process(dpo_run):
    from transformers import AutoModelForCausalLM

    out, _, ref = dpo_run
    got = dict(AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).named_parameters())
    for name, want in ref["final"].items():
        want_update = want - ref["initial"][name]
        rel = float((got[name].detach() - ref["initial"][name] - want_update).norm() / want_update.norm().clamp_min(1e-12))
        assert rel <= UPDATE_RTOL, f"{name}: update off by {rel:.2e}"


def test_evaluation_reports_the_preference_loss_and_reward_accuracy(dpo_run):
    out, log, _ = dpo_run
    summary = json.loads((out / "summary.json").read_text())
    for when in ("before", "after"):
        scores = summary[when]
        assert scores["eval_examples"] == 10 and 0.0 <= scores["eval_rewards/accuracies"] <= 1.0
        assert np.isfinite(scores["eval_loss"])
    # before the first step the policy is the reference: every reward is 0, the loss log 2 + RPO's NLL
    assert summary["before"]["eval_rewards/margins"] == 0.0
    assert "eval_rewards/accuracies:" in log
