"""``hf-scale finetune`` with context parallel: cp=2 on 2 processes trains like one process.

One run of the real command (it starts torchrun itself) on the tiny Llama with packed data
(``data.packing: bfd``: documents kept apart by ``position_ids``, no mask, which cp needs),
against the plain-transformers reference of :mod:`tests.integration.cli_reference`: the 2 ranks
of the cp group share each batch of 4 packed rows and split every row's sequence, so the run
must log the per-step losses and gradient norms, and save the weights, of one process with batch
4 (fp32, 1e-5 relative). Evaluation gives one process's loss (from ``eval_step``: each rank holds
its own positions' logits) and says why exact match is left out; sample generations of the live
model are skipped with a line saying why (cp refuses generate's cache), and the saved export
answers instead. A second run, padding-free on top (each micro-batch one flattened row) under the
contiguous layout, holds to the same reference.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness import run_commands
from tests.integration.cli_reference import check_against_reference, one_process_eval, plain_reference
from tests.tiny_models import tiny_recipe

STEPS = 3


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """The recipe, the cp=2 runs' output folders and logs (head_tail layout, and contiguous with
    padding-free rows: both at once, most of a run is process starts), the one-process reference."""
    recipe = tiny_recipe(tmp_path_factory.mktemp("cli-cp"), steps=STEPS, sharp=True, data={"packing": "bfd", "max_seq_len": 128})
    out, flat = recipe.parent / "runs" / "cp2", recipe.parent / "runs" / "cp2-flat"
    cli = [sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), "--parallel.cp", "2"]
    logs = [done.stdout for done in run_commands([
        [*cli, "--train.output_dir", str(out)],
        [*cli, "--parallel.cp_layout", "contiguous", "--data.padding_free", "true", "--train.output_dir", str(flat)],
    ], timeout=900, check=True)]
    return recipe, {"head_tail": (out, logs[0]), "flat": (flat, logs[1])}, plain_reference(recipe, batch_size=4)


@pytest.fixture(scope="module")
def cp_run(cp_runs):
    """The recipe, the head_tail run's output folder and log, and the one-process reference."""
    recipe, runs, reference = cp_runs
    return recipe, *runs["head_tail"], reference


def test_cp2_trains_and_saves_like_one_process(cp_run):
    _, out, log, reference = cp_run
    assert "sequences split over cp=2 (head_tail)" in log, log[-3000:]
    assert "global batch 4 (4 x 1 data-parallel ranks x 1 accumulation)" in log, log[-3000:]
    check_against_reference(out, reference)  # losses, gradient norms, and every final weight
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_seen"] == reference["tokens"]  # the group's tokens, counted once


def test_evaluation_under_cp_is_one_process_loss_without_exact_match(cp_run):
    recipe, out, log, _ = cp_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["before"]) == set(summary["after"]) == {"eval_loss", "eval_examples"}
    assert summary["before"]["eval_examples"] == 10  # not once per cp rank
    assert "evaluation under context parallel (cp=2) reports the loss only" in log
    want = one_process_eval(recipe)
    assert abs(summary["before"]["eval_loss"] - want["eval_loss"]) <= 1e-5 * want["eval_loss"], (summary, want)
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]


def test_generations_are_skipped_with_a_reason_and_the_export_answers(cp_run):
    log = cp_run[2]
    assert "sample generations of the trained model skipped: context parallel (cp=2)" in log, log[-3000:]
    assert "reloaded" in log and "greedy answers" in log


def test_cp2_padding_free_trains_like_one_process(cp_runs):
    """Padding-free on top of the packed rows (each micro-batch's 4 rows flattened into one, which
    changes no token's loss), contiguous layout: the same reference as the packed rows."""
    _, runs, reference = cp_runs
    out, log = runs["flat"]
    assert "sequences split over cp=2 (contiguous)" in log, log[-3000:]
    check_against_reference(out, reference)
