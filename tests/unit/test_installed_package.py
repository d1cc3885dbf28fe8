"""The package as pip installs it: its card template is package data, and a card renders.

Self-contained (imports only hf_scale and its dependencies) so ``make wheel-check`` can copy it
out of the repository and run it against the wheel installed in a fresh venv; there
``HF_SCALE_WHEEL_CHECK=1`` also asserts that the hf_scale imported is the installed one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import os
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

import hf_scale
from hf_scale.hub.card import DEFAULT_TEMPLATE

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}


@pytest.mark.skipif(os.environ.get("HF_SCALE_WHEEL_CHECK") != "1", reason="make wheel-check only")
def test_hf_scale_is_the_installed_wheel():
    where = Path(hf_scale.__file__).resolve()
    assert "site-packages" in where.parts, f"imported {where}, not the installed package"
    assert not (where.parents[1] / "pyproject.toml").exists(), "an editable / source checkout was imported"


def test_card_template_is_package_data():
    shipped = importlib.resources.files("hf_scale.hub") / "templates" / "default.md"
    assert shipped.is_file(), "hf_scale/hub/templates/default.md is not in the installed package"
    assert Path(str(shipped)).resolve() == DEFAULT_TEMPLATE.resolve()


def test_default_card_renders(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    info = {"base_model": "HuggingFaceTB/SmolLM2-135M", "repo_id": "org/tiny", "strategy": "fsdp",
            "world_size": 2, "hyperparameters": {"lr": 2e-5}}
    card = ModelCard.load(hf_scale.write_model_card(tmp_path, info))
    assert card.data.tags == ["hf-scale", "fsdp"] and card.data.pipeline_tag == "text-generation"
    version = importlib.metadata.version("hf-scale")
    for text in ('AutoModelForCausalLM.from_pretrained("org/tiny")', "| world size | 2 processes |",
                 "| lr | `2e-05` |", f"trained with hf_scale {version}."):
        assert text in card.text, text
