"""Crash safety: a save killed midway leaves the previous checkpoint usable, and a job whose
rank is SIGKILLed restarts under torchrun, resumes, and ends with the uninterrupted loss."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_scale.checkpoint.training_state import complete_checkpoints, resolve_checkpoint
from tests.harness import finish_command, free_port, start_command

SCRIPT = Path(__file__).with_name("elastic_train.py")


def _torchrun(root: Path, *extra: str) -> None:
    # The c10d rendezvous multi-node jobs use. Restarted workers reuse torchrun's store: without
    # hf_scale's per-attempt store prefix (distributed._attempt_store) they read the dead
    # workers' addresses and fail in gloo's connectFullMesh.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT), str(root), *extra]
    finish_command(start_command(cmd), timeout=600)  # own process group: a timeout kills every worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    clean, killed = tmp_path_factory.mktemp("clean"), tmp_path_factory.mktemp("killed")
    _torchrun(clean)
    _torchrun(killed, "--kill-at", "6")
    return clean, killed


def test_sigkilled_rank_restarts_resumes_and_matches(runs):
    clean, killed = (json.loads((r / "result.json").read_text()) for r in runs)
    assert clean["attempts"] == 1 and killed["attempts"] == 2
    assert killed["loss"] == clean["loss"]


def test_checkpoints_after_restart(runs):
    _, killed = runs
    assert [p.name for p in complete_checkpoints(killed / "ckpt")] == ["step_00000006", "step_00000008"]


def test_partial_save_is_ignored_with_a_warning(tmp_path):
    """Kill a one-process save midway; `latest` still resolves to the previous checkpoint."""
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import hf_scale
from hf_scale.checkpoint import safetensors_io
from tests.distributed.resume_checks import _setup, _train
model, optimizer, scheduler, loader = _setup({{"strategy": "fsdp"}}, seed=0)
_train(model, optimizer, scheduler, loader, 1)
hf_scale.save_state(model, optimizer, scheduler=scheduler, root={str(tmp_path)!r}, step=1)
original = safetensors_io._write_my_bytes
def die(*a, **k):
    original(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
safetensors_io._write_my_bytes = die
hf_scale.save_state(model, optimizer, scheduler=scheduler, root={str(tmp_path)!r}, step=2)
"""
    proc = finish_command(start_command([sys.executable, "-c", code]), timeout=300, check=False)
    assert proc.returncode == -9, proc.stdout[-3000:]
    assert (tmp_path / ".step_00000002.partial").exists()
    with pytest.warns(UserWarning, match="ignoring .step_00000002.partial"):
        assert resolve_checkpoint(tmp_path / "latest").name == "step_00000001"


@pytest.mark.parametrize("nproc", [1, 2])
def test_export_a_training_checkpoint_to_a_hub_folder(runs, tmp_path, nproc):
    import torch
    from transformers import AutoModelForCausalLM

    _, killed = runs
    out = tmp_path / "export"
    script = Path(__file__).parents[2] / "scripts" / "export_checkpoint.py"
    cmd = [sys.executable, str(script), str(killed / "ckpt" / "latest"), str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), *cmd[1:]]
    finish_command(start_command(cmd), timeout=300)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (killed / "ckpt" / "step_00000008" / "model").iterdir())
    exported = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(killed / "ckpt" / "step_00000008" / "model")
    for (name, p), q in zip(exported.named_parameters(), original.parameters()):
        assert torch.equal(p, q), name
