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


def test_qlora_recipe_errors(recipe):
    """quantize without peft, and an unknown quantize: one clear error each from the recipe,
    before anything launches (the layouts NF4 does not take are refused on every rank:
    tests/distributed/test_qlora.py)."""
    from hf_scale.errors import HfScaleConfigError
    from hf_scale.train.config import load_job

    with pytest.raises(HfScaleConfigError, match=r"set peft\.r \(e\.g\. 16"):
        load_job(recipe, ["--peft.r", "null"])
    with pytest.raises(HfScaleConfigError, match=r"model\.quantize.*nf4"):
        load_job(recipe, ["--model.quantize", "int3"])
