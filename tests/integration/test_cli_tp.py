"""``hf-scale finetune`` with tensor parallel: tp=2 x fsdp=2 on 4 processes trains like one process.

One run of the real command (it starts torchrun itself; two torchrun agents of 2 processes on a
loopback rendezvous, as ``test_cli``'s two-node run, since the launcher starts at most one
process per core on one node) against the plain-transformers
reference of :mod:`tests.integration.cli_reference`: 2 data-parallel ranks x batch 4 must log
the per-step losses and gradient norms, and save the weights, of one process with batch 8
(fp32, 1e-5 relative). That holds only if the two ranks of each tp group see the same batch
(data sharded by the data-parallel rank), the loss is weighted by the data-parallel degree and
the vocabulary-parallel loss and clipping are right. Counting checks: tokens and evaluation
examples are counted once (not once per tp rank), the evaluation before training equals one
process's, and every rank generates the same greedy tokens, which the reloaded export repeats.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.harness import finish_command, free_port, start_command
from tests.integration.cli_reference import (
    check_against_reference,
    one_process_eval,
    plain_reference,
)
from tests.tiny_models import tiny_recipe

STEPS = 3


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """The recipe, the tp2 x fsdp2 run's output folder and log, and the one-process reference."""
    recipe = tiny_recipe(tmp_path_factory.mktemp("cli-tp"), steps=STEPS)
    out, port = recipe.parent / "runs" / "tp2-fsdp2", free_port()
    args = ["finetune", str(recipe), "--parallel.tp", "2", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--train.output_dir", str(out)]
    nodes = [start_command([sys.executable, "-m", "hf_scale.cli", *args]) for _ in range(2)]
    log = "\n".join(finish_command(node, timeout=900).stdout for node in nodes)
    return recipe, out, log, plain_reference(recipe, batch_size=8)


def test_tp2_x_fsdp2_trains_like_one_process(tp_run):
    recipe, out, log, reference = tp_run
    assert "fsdp over pp=1 x dp_replicate=1 x dp_shard=2 x tp=2" in log, log[-3000:]
    assert "global batch 8 (4 x 2 data-parallel ranks x 1 accumulation)" in log
    check_against_reference(out, reference)  # losses, gradient norms, final weights


def test_tokens_and_eval_examples_count_once(tp_run):
    recipe, out, log, reference = tp_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_seen"] == reference["tokens"]  # one process's tokens, not twice them
    assert summary["before"]["eval_examples"] == summary["after"]["eval_examples"] == 10
    want = one_process_eval(recipe)
    np.testing.assert_allclose(summary["before"]["eval_loss"], want["eval_loss"], rtol=1e-5)
    assert summary["before"]["eval_exact_match"] == want["eval_exact_match"]


def test_every_rank_generates_the_same_tokens_and_the_export_repeats_them(tp_run):
    log = tp_run[2]
    assert "greedy answers of the trained model (same tokens on all 4 ranks)" in log, log[-3000:]
    assert "reloaded" in log and "the export gives the trained model's answers" in log, log[-3000:]

