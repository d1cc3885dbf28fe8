"""``hf-scale finetune`` with ``model.quantize: nf4`` (QLoRA) on a tiny recipe: two fsdp ranks,
the LoRA base weights loaded as NF4 slices, adapter-only output; and the recipe errors."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.harness import run_cli
from tests.tiny_models import tiny_recipe

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The tiny recipe with its model swapped for qlora_checks' wider Llama (whole NF4 groups);
    the tiny tokenizer kept."""
    from tests.distributed import qlora_checks

    root = tmp_path_factory.mktemp("cli_qlora")
    path = tiny_recipe(root, steps=2, peft={"r": 4}, model={"quantize": "nf4"})
    wide = root / "wide"
    qlora_checks.save_base(str(wide))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(wide / name, root / "tiny-llama" / name)
    (root / "tiny-llama" / "generation_config.json").unlink(missing_ok=True)
    return path


def test_qlora_recipe_trains_and_saves_the_adapter(recipe, tmp_path):
    out = tmp_path / "run"
    result = run_cli("finetune", str(recipe), "--train.output_dir", str(out), "--train.sample_generations", "0",
                     timeout=600)
    assert "14 LoRA base weights in NF4 over 2 slice(s) each" in result.stdout, result.stdout[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len([s for s in steps if "step" in s and "loss" in s]) >= 2
    saved = sorted(p.name for p in (out / "model").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved


def test_qlora_recipe_errors(recipe, tmp_path):
    """quantize without peft, an unknown quantize, and a layout NF4 does not take: one clear
    error each, before any training."""
    no_peft = run_cli("finetune", str(recipe), "--peft.r", "null", "--train.output_dir", str(tmp_path / "a"),
                      check=False, timeout=300)
    assert no_peft.returncode != 0 and "peft.enabled: true" in no_peft.stdout, no_peft.stdout[-2000:]
    bad = run_cli("finetune", str(recipe), "--model.quantize", "int3", "--train.output_dir", str(tmp_path / "b"),
                  check=False, timeout=300)
    assert bad.returncode != 0 and "model.quantize" in bad.stdout and "nf4" in bad.stdout, bad.stdout[-2000:]
    tp = run_cli("finetune", str(recipe), "--parallel.strategy", "zero2", "--parallel.tp", "2",
                 "--train.output_dir", str(tmp_path / "c"), check=False, timeout=300)
    assert tp.returncode != 0 and "quantize='nf4' with tp=2" in tp.stdout, tp.stdout[-2000:]
