"""``hf-scale finetune`` end to end on tiny models: every strategy, resume, errors. Two nodes:
``test_cli_tp`` (two agents on an ``--rdzv-endpoint``) and ``test_slurm`` (hsdp, 2 nodes x 2 workers).

Each run is the real command in a subprocess (it starts torchrun itself). Parity: a run on N
ranks with batch B per rank must log the losses and gradient norms, and end with the weights, of
plain transformers + AdamW in one process with batch N x B (same data order, same token-weighted
loss): see ``cli_reference``. hf_scale's own one-process run is held to the same reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import (
    ROOT,
    finish_command,
    run_commands,
    stand_in_calibration,
    start_command,
)
from tests.integration.cli_reference import check_against_reference, logged_steps, plain_reference
from tests.tiny_models import SEQCLS, save_tiny_checkpoint, tiny_recipe

STEPS = 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return tiny_recipe(tmp_path_factory.mktemp("cli"), steps=STEPS)


def losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in logged_steps(out_dir)}


@pytest.fixture(scope="module")
def reference(recipe) -> dict:
    """Plain transformers + torch AdamW, one process, the global batch (2 x 4) at once."""
    return plain_reference(recipe, batch_size=8)


@pytest.fixture(scope="module")
def packed_recipe(tmp_path_factory) -> Path:
    return tiny_recipe(tmp_path_factory.mktemp("packed"), steps=STEPS, sharp=True, data={"packing": "bfd", "max_seq_len": 128})


PACKED = {"fsdp": [], "zero2": ["--data.padding_free", "true"]}


@pytest.fixture(scope="module")
def packed_runs(packed_recipe) -> dict:
    """Both packed runs at once (most of a run is process starts): strategy -> (folder, command)."""
    outs = {s: packed_recipe.parent / "runs" / f"packed-{s}" for s in PACKED}
    return runs_of(packed_recipe, {s: ["--parallel.strategy", s, "--train.output_dir", str(outs[s]), *extra]
                                   for s, extra in PACKED.items()}, outs)


@pytest.mark.parametrize("strategy", list(PACKED), ids=["fsdp-rows", "zero2-padding_free"])
def test_packed_runs_train_like_plain_transformers(packed_recipe, packed_runs, strategy):
    """Packed rows (and their padding-free flattening, which changes no token's loss) against
    plain transformers on the same rows: documents kept apart by position_ids, no mask."""
    out, log = finished(packed_runs[strategy])
    assert "packed documents attended one at a time" in log  # parallel.packed_attention, on for packed data
    check_against_reference(out, plain_reference(packed_recipe, batch_size=8))


def test_one_process_trains_like_plain_transformers(recipe, reference, runs):
    """One process with the whole batch; with ``--train.report_to tensorboard`` the event files
    TensorBoard reads hold every logged loss at its step, as metrics.jsonl has them, and the
    evaluations before and after."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, log = finished(runs["one"])
    assert "launching: torchrun" not in log
    check_against_reference(out, reference)
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(logged) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[s] for s in sorted(logged)], [losses(out)[s] for s in sorted(logged)], rtol=1e-5)
    assert sorted(e.step for e in events.Scalars("eval/loss")) == [0, STEPS]


STRATEGIES = ["fsdp", "zero2", "zero1", "ddp"]
# The fsdp run checkpoints every 2 steps: test_every_strategy checks its training (checkpointing
# changes none of it) and test_resume_mid_epoch resumes from its step-2 checkpoint, one launch for both.
CHECKPOINTING = ("--checkpoint.every_steps", "2", "--checkpoint.keep_last", "3")


def runs_of(recipe: Path, overrides: dict[str, list[str]], outs: dict[str, Path]) -> dict:
    """``hf-scale finetune recipe *overrides[name]`` for each name, two at a time (most of a run
    is process starts): name -> (its output folder, its finished command, unchecked)."""
    argvs = [[sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), *args] for args in overrides.values()]
    return {name: (outs[name], done) for name, done in zip(overrides, run_commands(argvs))}


def finished(run: tuple[Path, subprocess.CompletedProcess]) -> tuple[Path, str]:
    """(output folder, log) of a run of :func:`runs_of`; fails the test when it exited non-zero."""
    out, done = run
    assert done.returncode == 0, f"{' '.join(done.args[1:])} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return out, done.stdout


@pytest.fixture(scope="module")
def runs(recipe) -> dict:
    """The recipe on 2 processes under each strategy, in one process with the whole batch
    (``--train.report_to tensorboard``), and "resumed": the fsdp run resumed from its step-2
    checkpoint (:func:`prepare_resume`), started as soon as the fsdp run is done: name -> (folder,
    command). Two at a time: the resumed run shares the last round with the one-process run."""
    from concurrent.futures import ThreadPoolExecutor

    outs = {s: recipe.parent / "runs" / s for s in ("one", *STRATEGIES, "resumed")}
    overrides = {s: ["--parallel.strategy", s, *(CHECKPOINTING if s == "fsdp" else ())] for s in STRATEGIES}
    overrides["one"] = ["--nproc-per-node", "1", "--train.batch_size", "8", "--train.report_to", "tensorboard"]

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return finish_command(start_command([sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), *args]),
                              300, check=False)

    def resume(full) -> subprocess.CompletedProcess:
        done = full.result()
        if done.returncode != 0:
            return subprocess.CompletedProcess(done.args, 1, "the fsdp run to resume from failed", "")
        return run(prepare_resume(outs["fsdp"], outs["resumed"]))

    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {s: pool.submit(run, [*args, "--train.output_dir", str(outs[s])]) for s, args in overrides.items()}
        started["resumed"] = pool.submit(resume, started["fsdp"])
        return {name: (outs[name], future.result()) for name, future in started.items()}


def prepare_resume(full: Path, resumed: Path) -> list[str]:
    """The fsdp run as if stopped after step 3 with its last checkpoint at step 2 (mid-epoch: 48
    examples / global batch 8 = 6 steps per epoch), in ``resumed``: that checkpoint and the
    records of the steps before, plus a step 3 it did not checkpoint (replayed after the resume,
    so its record must go). Returns the arguments that resume it."""
    ckpt = resumed / "checkpoints"
    shutil.copytree(full / "checkpoints" / "step_00000002", ckpt / "step_00000002")
    (ckpt / "latest").write_text("step_00000002\n")
    # The interrupted run's records: eval at step 0, steps 1 and 2, and step 3
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()[:4]]
    records[3]["loss"] = 99.0
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return ["--parallel.strategy", "fsdp", *CHECKPOINTING, "--train.output_dir", str(resumed), "--checkpoint.resume", "auto"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_like_plain_transformers(reference, runs, strategy):
    out, log = finished(runs[strategy])
    check_against_reference(out, reference)
    assert f"{strategy} over pp=1 x dp_replicate" in log and "launching: torchrun --nproc-per-node=2" in log
    _check_outputs(out, log)


def test_strategy_auto_chooses_a_layout_and_trains_like_plain_transformers(recipe, reference, capfd, monkeypatch):
    """``--parallel.strategy auto``: rank 0's planner picks the layout for 2 processes and the
    recipe's batches, every rank applies it (with the field given beside it: the head on the
    answer tokens only), and training is the one-process reference's (full logits). ``hf-scale
    plan`` on the same recipe, run in this process (``hf_scale.cli.main``, a process start
    saved), recommends that layout."""
    import re

    from hf_scale.cli import main

    out = recipe.parent / "runs" / "auto"
    env = stand_in_calibration(recipe.parent / "cache")
    argv = [sys.executable, "-m", "hf_scale.cli", "finetune", str(recipe), "--parallel.strategy", "auto",
            "--parallel.loss_labeled_only", "true", "--train.output_dir", str(out)]
    log = finish_command(start_command(argv, env), 300).stdout
    chosen = re.search(r"strategy 'auto' chose (\w+) (\d+)x(\d+)x(\d+)x(\d+) .*\(seq 64 x batch 4 per", log)
    assert chosen, log[-3000:]
    strategy, rep, shard, tp, pp = chosen.groups()
    assert f"{strategy} over pp={pp} x dp_replicate={rep} x dp_shard={shard} x tp={tp}" in log
    # hf-scale plan, asked about the same recipe on the same machine, recommends what the run chose
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capfd.readouterr()
    status = main(["plan", str(recipe), "--parallel.strategy", "auto", "--parallel.loss_labeled_only", "true"])
    said = "".join(capfd.readouterr())
    assert status == 0, said[-3000:]
    recommended = re.search(r"recommended: (.+?) -> parallel:", said)
    assert recommended and f"chose {recommended.group(1)}: " in log, (recommended, log[-3000:])
    check_against_reference(out, reference)
    from huggingface_hub import ModelCard

    assert strategy in ModelCard.load(out / "model" / "README.md").data.tags  # the layout that ran


def _check_outputs(out: Path, log: str) -> None:
    """What a run leaves behind: metrics, summary, a plain-transformers model with its card."""
    import torch
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait", "peak_mem_gb", "elapsed_s"):
        assert key in record, key
    assert record["step"] == 1 and record["lr"] == pytest.approx(3e-3)  # the rate step 1 used (no warmup)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["before"]) == {"eval_loss", "eval_exact_match", "eval_examples"}
    # the eval ran on the trained weights (it moved); that training is right is checked against
    # plain transformers step by step, not by a few steps of a random tiny model improving
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert torch.isfinite(next(model.parameters())).all()
    assert (out / "model" / "loss_curve.png").stat().st_size > 1000
    card = ModelCard.load(out / "model" / "README.md")
    assert "hf-scale" in card.data.tags and "loss_curve.png" in card.text
    assert "reloaded" in log and "greedy answers" in log and "(expected '" in log


def test_resume_mid_epoch_continues_at_the_right_sample(runs):
    full, _ = finished(runs["fsdp"])
    resumed, log = finished(runs["resumed"])  # from the step-2 checkpoint (prepare_resume)
    assert "resumed from" in log and "at step 2 (epoch 0, batch 2)" in log
    before, after = losses(full), losses(resumed)
    assert sorted(after) == [1, 2, 3, 4]  # the metrics file covers the whole run
    np.testing.assert_allclose([after[3], after[4]], [before[3], before[4]], rtol=1e-6)


def test_classification_script(tmp_path):
    """2 ranks x batch 8 evaluate and train as one process with batch 16 does: the same eval
    loss and accuracy before and after, the same training losses and gradient norms."""
    model = save_tiny_checkpoint(tmp_path / "tiny-bert", "bert", SEQCLS)
    out, one = tmp_path / "cls", tmp_path / "cls-one"
    args = [str(ROOT / "configs" / "minilm-classification.yaml"), "--model.name_or_path", model,
            "--train.max_steps", "6", "--train.progress", "false", "--train.lr", "3e-3", "--train.warmup_steps", "0"]
    script = [sys.executable, "scripts/finetune_classification.py", *args]
    run_commands([[*script, "--train.output_dir", str(out)],  # both at once
                  [*script, "--train.output_dir", str(one), "--launch.nproc_per_node", "1", "--train.batch_size", "16"]],
                 check=True)
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (out, one))
    for when in ("before", "after"):
        got, want = summary[when], reference[when]
        assert set(got) == {"eval_loss", "eval_accuracy", "eval_examples"} and got["eval_examples"] == 60
        assert 0.0 <= got["eval_accuracy"] <= 1.0 and np.isfinite(got["eval_loss"])
        assert got["eval_accuracy"] == want["eval_accuracy"], when
        np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5, err_msg=when)
    got, want = ([[r["loss"], r["grad_norm"]] for r in logged_steps(d)] for d in (out, one))
    assert len(got) == 6
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the eval ran on the trained weights (it moved); that training is right is checked against
    # plain transformers step by step, not by a few steps of a random tiny model improving
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(out / "model").config.num_labels == 3


def test_wrong_script_for_the_task_and_bad_input(recipe, tmp_path, capfd):
    """Each found before training, in this process (``hf_scale.cli.main``, whose status is the
    command's, as test_bad_input_sweep runs its one-process cases): a process start each saved.
    The classification script is ``main(["finetune", ...], task="sequence_classification")``
    (test_classification_script runs it as a process)."""
    from hf_scale.cli import main

    one = ["--nproc-per-node", "1"]
    for args, task, words in [
        ([], "sequence_classification", "this script is for 'sequence_classification'"),
        ([*one, "--resume", "latest", "--train.output_dir", str(tmp_path / "none")], None, "no complete checkpoint in"),
        ([*one, "--data.prompt_column", "question", "--train.output_dir", str(tmp_path / "col")], None,
         "its columns are prompt, response"),
    ]:
        capfd.readouterr()
        status = main(["finetune", str(recipe), *args], task=task)
        said = "".join(capfd.readouterr())
        assert status == 2 and words in said, (args, status, said[-3000:])
    # too many processes (--nproc-per-node 64): test_bad_input_sweep's case, exit 2 in one line
