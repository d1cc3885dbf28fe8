"""Every bad input to ``hf-scale finetune`` ends as one line, exit status 2, no traceback (issue 37),
wherever it is found: by the launcher before torchrun starts, by the workers of a 2-process
torchrun (``hf_scale.torchrun`` says their error once, without torchrun's failure report), or in
one process (``--launch.nproc_per_node 1`` runs in-process).

What a case's output may hold, exactly:

* stderr: one line ``hf-scale finetune: error: ...`` holding the case's words; hf_scale's own
  log lines (``[hf_scale] ...``, the ``[hf_scale] launching: torchrun ...`` line among them);
  progress bars (tqdm's ``[00:00<?, ...]`` / ``[00:00, ...]`` segments, split at ``\\r``). Any
  other line fails the case (a second error line, torchrun's report, a library's warning).
* stdout: nothing but progress bars and ``[hf_scale]`` lines either.
* ``Traceback`` nowhere.
* the ``launching`` line present exactly for the cases found in the workers (so the sweep
  checks where each is found, and that at least 5 are found only after the workers started).

The cases found before launch or in one process run in this process (``hf_scale.cli.main``,
whose status is the command's; a Python warning raised meanwhile counts as a line of output, under
Python's default filters, as a process would print it); those found in the workers each start
``python -m hf_scale.cli``, two at a time (each is mostly process start and imports), on a tiny
Llama with its tokenizer. The workers run the one-process code up to the same errors, so their
output also holds what only a fresh process shows (import-time warnings, once-only log lines). The one users hit first,
``--parallel.tp 2`` on SmolLM2 (configs/quickstart.yaml, 9 heads), is found before launch from the
model's config.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness import ROOT, cli_env
from tests.tiny_models import tiny_recipe

pytestmark = pytest.mark.slow

BEFORE, WORKERS, ONE = "before launch", "in 2 workers", "in one process"
ERROR = "hf-scale finetune: error: "
PROGRESS = re.compile(r"\[\d+:\d\d(:\d\d)?(<|, )")  # tqdm's elapsed-time bracket


def write_bad_inputs(root: Path) -> dict[str, Path]:
    files = {
        "other_columns": ('{"question": "What is 1 + 1?", "answer": "2"}\n' * 8),
        "cut.jsonl": '{"prompt": "What is 1 + 1?", "response": "2"}\n{"prompt": "What is 2 + 2?", "resp',
        "cut.json": '[{"prompt": "What is 1 + 1?", "response": "2"}, {"prompt": "What is',
        "broken.csv": 'prompt,response\n"What is 1 + 1?",2\n"What is 2 + 2?",4,extra,fields\n',
        "empty.jsonl": "",
        "same_pair.jsonl": ('{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}\n'
                            '{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "4"}\n'),
    }
    out = {}
    for name, text in files.items():
        path = root / (name if "." in name else name + ".jsonl")
        path.write_text(text)
        out[name] = path
    (root / "not-a-checkpoint").mkdir()
    (root / "not-a-checkpoint" / "notes.txt").write_text("not a checkpoint")
    return out


def cases(recipe: Path, root: Path, files: dict[str, Path]) -> list[tuple[str, list[str], str, str]]:
    """(name, arguments after ``finetune``, words the error line must hold, where it is found)."""
    r, one = str(recipe), ["--launch.nproc_per_node", "1"]
    return [
        ("unknown config key", [r, "--train.lrr", "1e-4"], "unknown config key 'train.lrr'. Did you mean 'lr'?", BEFORE),
        ("wrong type", [r, "--train.batch_size", "many"], "train.batch_size: expected int, got str 'many'", BEFORE),
        ("missing recipe", [str(root / "nope.yaml")], "nope.yaml' does not exist", BEFORE),
        ("pp and a batch it does not split", [r, "--parallel.pp", "2", "--train.batch_size", "3"],
         "train.batch_size=3 does not split into parallel.pp_microbatches=2", BEFORE),
        ("reward model under pipeline parallel", [r, "--model.task", "reward", "--parallel.pp", "2"],
         "model.task: reward with parallel.pp=2: pipeline parallel runs causal language models only", BEFORE),
        ("peft rank 0", [r, "--peft.r", "0"], "peft.r=0: the LoRA rank must be a positive integer", BEFORE),
        ("tp that does not divide the processes", [r, "--parallel.tp", "3"], "tp=3 does not divide WORLD_SIZE=2", BEFORE),
        ("too many processes", [r, "--launch.nproc_per_node", "64"], "launch.nproc_per_node=64, but this machine has",
         BEFORE),
        ("data with other columns", [r, "--data.path", str(files["other_columns"])],
         "data.format=auto cannot tell the data format from the columns (question, answer)", WORKERS),
        ("preference pair with chosen identical to rejected",
         [r, "--model.task", "reward", "--data.path", str(files["same_pair.jsonl"]), "--data.eval_split", "null"],
         "row 1: chosen and rejected are identical", WORKERS),
        ("truncated JSONL", [r, "--data.path", str(files["cut.jsonl"])],
         f"cannot read the data file '{files['cut.jsonl']}': line 2, column", WORKERS),
        ("model path that does not exist", [r, "--model.name_or_path", str(root / "no-model")],
         f"cannot find model '{root / 'no-model'}'", WORKERS),
        ("--resume latest with no checkpoint", [r, "--resume", "latest"], "no complete checkpoint in", WORKERS),
        ("peft target modules the model lacks", [r, "--peft.r", "4", "--peft.target_modules", "nosuch_proj"],
         "Target modules nosuch_proj not found", WORKERS),
        ("tp 2 on SmolLM2 (9 heads)", ["configs/quickstart.yaml", "--parallel.tp", "2"],
         "tp=2 does not divide the query heads (num_attention_heads=9)", BEFORE),
        ("missing data file", [r, *one, "--data.path", str(root / "nope.jsonl")],
         f"data.path='{root / 'nope.jsonl'}': no such file or folder", ONE),
        ("broken CSV row", [r, *one, "--data.path", str(files["broken.csv"])],
         "broken.csv': line 3: 4 fields, but the header names 2", ONE),
        ("empty data file", [r, *one, "--data.path", str(files["empty.jsonl"])], "empty.jsonl' is empty", ONE),
        ("truncated JSON document", [r, *one, "--data.path", str(files["cut.json"])],
         "cut.json': line 1, column", ONE),
        ("malformed Hub id", [r, *one, "--model.name_or_path", "not a valid id!!"],
         "'not a valid id!!' is neither a folder nor a Hub id", ONE),
        ("max_seq_len above the model's limit", [r, *one, "--data.max_seq_len", "4096"],
         "data.max_seq_len=4096 is above the model's limit of 2048", ONE),
        ("resume from a folder that is not a checkpoint",
         [r, *one, "--checkpoint.resume", str(root / "not-a-checkpoint")], "is not a complete training checkpoint", ONE),
    ]


def run_finetune(args: list[str], out: Path, timeout: float = 240) -> tuple[int, str, str, float]:
    """``python -m hf_scale.cli finetune *args`` with its own output folder; (status, stdout,
    stderr, seconds). Its process group is killed if it outlives ``timeout``."""
    argv = [sys.executable, "-m", "hf_scale.cli", "finetune", *args, "--train.output_dir", str(out)]
    began = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=cli_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout} s)"
    return proc.returncode, stdout, stderr, time.monotonic() - began


def lines(text: str) -> list[str]:
    """The lines of ``text`` that count: not blank, not a progress bar, not an hf_scale log line."""
    kept = []
    for line in re.split(r"[\r\n]", text):
        line = line.strip()
        if line and not PROGRESS.search(line) and not line.startswith("[hf_scale] "):
            kept.append(line)
    return kept


def problems(result: tuple[int, str, str, float], words: str, where: str) -> list[str]:
    """What is wrong with one case's output (nothing when it is one clear line, exit 2)."""
    status, stdout, stderr, _ = result
    found = []
    if status != 2:
        found.append(f"exit status {status}, not 2")
    said = lines(stderr)
    if len(said) != 1 or not said[0].startswith(ERROR) or words not in said[0]:
        found.append(f"stderr's lines are {said}, not one {ERROR!r} line holding {words!r}")
    if lines(stdout):
        found.append(f"stdout holds {lines(stdout)}")
    if "Traceback" in stdout + stderr:
        found.append("a traceback")
    if ("[hf_scale] launching: torchrun" in stderr) != (where == WORKERS):
        found.append(f"expected to be found {where}, but torchrun was{'' if where == WORKERS else ' not'} started")
    return found


def finetune_here(args: list[str], out: Path, capfd) -> tuple[int, str, str, float]:
    """``hf-scale finetune *args`` in this process (what ``python -m hf_scale.cli`` runs: its
    status is the process's), output read at the file descriptors; for the cases the launcher
    refuses before it starts anything or one process refuses, which cost a process start each
    otherwise. A warning raised meanwhile is a line of stderr, under Python's default filters
    (deprecations and the like hidden), as a process would print it."""
    import warnings

    from hf_scale.cli import main

    began = time.monotonic()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=hidden)
        status = main(["finetune", *args, "--train.output_dir", str(out)])
    stdout, stderr = capfd.readouterr()
    stderr += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return status, stdout, stderr, time.monotonic() - began


def test_every_bad_input_is_one_line_exit_2_and_no_traceback(tmp_path, capfd):
    began = time.monotonic()
    recipe = tiny_recipe(tmp_path)  # a tiny Llama with its tokenizer, 2 processes
    sweep = cases(recipe, tmp_path, write_bad_inputs(tmp_path))
    assert len(sweep) >= 15 and sum(where == WORKERS for *_, where in sweep) >= 5
    results = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {i: pool.submit(run_finetune, args, tmp_path / f"run{i}")
                   for i, (_, args, _, where) in enumerate(sweep) if where == WORKERS}
        for i, (_, args, _, where) in enumerate(sweep):
            if where != WORKERS:
                results[i] = finetune_here(args, tmp_path / f"run{i}", capfd)
        results.update({i: future.result() for i, future in started.items()})
    report, failed = [], []
    for i, (name, _, words, where) in enumerate(sweep):
        found = problems(results[i], words, where)
        report.append(f"{'FAIL' if found else 'ok  '} {results[i][3]:5.1f} s  {where:15} {name}")
        if found:
            failed.append(f"{name}: " + "; ".join(found) + f"\n--- stderr:\n{results[i][2][-3000:]}\n--- stdout:\n"
                          f"{results[i][1][-1000:]}")
    report.append(f"the sweep took {time.monotonic() - began:.0f} s")
    with capfd.disabled():
        print("\n" + "\n".join(report))
    assert not failed, "\n".join(report) + "\n\n" + "\n\n".join(failed)
