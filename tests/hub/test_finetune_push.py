"""A fine-tuning run with ``hub.push: true`` ends on the (local) Hub with its card and loss curve."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import ModelCard, snapshot_download
from safetensors.torch import load_file

from hf_scale.cli import main
from tests.hub.conftest import TOKEN
from tests.tiny_models import tiny_recipe


def test_finetune_pushes_model_card_and_curve(hub, tmp_path, caplog):
    recipe = tiny_recipe(tmp_path, steps=3, hub={"push": True, "repo_id": "org/tiny-arith", "license": "apache-2.0"},
                         launch={"nproc_per_node": 1})
    assert main(["finetune", str(recipe)]) == 0
    out = tmp_path / "runs" / "default"
    pulled = Path(snapshot_download("org/tiny-arith", cache_dir=tmp_path / "dl"))
    for name, tensor in load_file(out / "model" / "model.safetensors").items():
        assert torch.equal(load_file(pulled / "model.safetensors")[name], tensor), name
    assert (pulled / "loss_curve.png").read_bytes() == (out / "model" / "loss_curve.png").read_bytes()
    card = ModelCard.load(pulled / "README.md")
    summary = json.loads((out / "summary.json").read_text())
    assert card.data.license == "apache-2.0" and "fsdp" in card.data.tags
    assert "eval_exact_match" in card.text and f"{summary['tokens_seen']:,}" in card.text
    assert "![Training loss](loss_curve.png)" in card.text
    assert "pushed 9 of 9 files" in caplog.text and TOKEN not in caplog.text
