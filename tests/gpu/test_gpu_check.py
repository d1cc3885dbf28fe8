"""The CUDA path (issue 11, item 4): ``scripts/gpu_check.py`` on a real GPU (the ``gpu`` mark,
skipped without one), and the script's own logic on the CPU with a tiny model so it cannot rot."""

from __future__ import annotations

import pytest

from tests.harness import ROOT, run_cli

SCRIPT = str(ROOT / "scripts" / "gpu_check.py")


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_on_one_gpu_matches_transformers_and_round_trips():
    out = run_cli("--steps", "3", script=SCRIPT, timeout=900).stdout
    assert "all checks passed" in out, out


def test_gpu_check_logic_on_cpu_with_a_tiny_model():
    out = run_cli("--device", "cpu", "--model", "tiny", "--steps", "1", script=SCRIPT, timeout=600).stdout
    assert "all checks passed" in out, out
    assert out.count("hf_scale bf16") == 4  # every leg ran
