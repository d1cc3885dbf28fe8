"""``hf-scale finetune configs/reward.yaml`` end to end on a tiny Llama (the recipe's shape: SmolLM2
swapped for a tiny model, fewer steps): 2 fsdp ranks x 4 pairs train and evaluate as one process
with 8 pairs does, and the saved model, reloaded with plain transformers, scores the held-out
pairs as the run's final evaluation reported."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.harness import ROOT, run_commands
from tests.integration.cli_reference import logged_steps
from tests.tiny_models import CAUSAL, save_tiny_checkpoint


def test_reward_recipe_trains_like_one_process_and_reloads(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_scale.data.preference import tokenize_preference
    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits
    from tests.distributed.reward_checks import oracle_eval

    model = save_tiny_checkpoint(tmp_path / "tiny-llama", "llama", CAUSAL)  # the score head is new, as for SmolLM2
    recipe = str(ROOT / "configs" / "reward.yaml")
    overrides = ["--model.name_or_path", model, "--data.max_train_samples", "32", "--data.max_eval_samples", "6",
                 "--train.max_steps", "3", "--train.progress", "false", "--train.lr", "3e-3",
                 "--train.warmup_steps", "0", "--train.eval_batch_size", "4"]
    out, one = tmp_path / "two", tmp_path / "one"
    cli = [sys.executable, "-m", "hf_scale.cli", "finetune", recipe, *overrides]
    run_commands([[*cli, "--train.batch_size", "4", "--train.output_dir", str(out)],  # both at once
                  [*cli, "--train.batch_size", "8", "--launch.nproc_per_node", "1", "--train.output_dir", str(one)]],
                 check=True)
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (out, one))
    for when in ("before", "after"):
        got, want = summary[when], reference[when]
        assert set(got) == {"eval_loss", "eval_accuracy", "eval_examples"} and got["eval_examples"] == 6
        assert got["eval_accuracy"] == want["eval_accuracy"], when
        np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5, err_msg=when)
    got, want = ([[r["loss"], r["grad_norm"]] for r in logged_steps(d)] for d in (out, one))
    assert len(got) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]

    saved = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert saved.config.num_labels == 1 and saved.config.pad_token_id == 0
    job = load_job(recipe, overrides + ["--model.name_or_path", model])
    rows = tokenize_preference(load_splits(job.data)["eval"], AutoTokenizer.from_pretrained(out / "model"), job.data,
                               job.data.max_seq_len).to_list()
    reloaded = oracle_eval(saved, rows)
    assert reloaded["eval_accuracy"] == summary["after"]["eval_accuracy"]
    np.testing.assert_allclose(reloaded["eval_loss"], summary["after"]["eval_loss"], rtol=1e-5)
