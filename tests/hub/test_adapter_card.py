"""The model card of a PEFT adapter folder: the Hub's adapter metadata (parsed back with
huggingface_hub), the LoRA facts and both loading snippets in the body, the loss curve when the
image is there, and when a push writes it (peft's placeholder replaced, a card of its own kept)."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard
from huggingface_hub.repocard import metadata_load

import hf_scale
from hf_scale import write_model_card
from hf_scale.hub.upload import LOSS_CURVE, adapter_card_needed
from tests.hub.conftest import ADAPTER_BASE, save_adapter
from tests.tiny_models import tiny_model

INFO = {"repo_id": "org/tiny-lora", "strategy": "fsdp", "tags": ["sft"], "datasets": ["yahma/alpaca-cleaned"],
        "hyperparameters": {"lora_lr": 2e-4}, "train_metrics": {"train_loss": 0.25}, "loss_curve": LOSS_CURVE}


def test_adapter_card_metadata_and_body(adapter):
    (adapter / LOSS_CURVE).write_bytes(b"\x89PNG\r\n\x1a\n")
    path = write_model_card(adapter, INFO)
    meta = metadata_load(path)
    assert meta == {
        "base_model": ADAPTER_BASE, "datasets": ["yahma/alpaca-cleaned"], "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["hf-scale", "fsdp", f"base_model:adapter:{ADAPTER_BASE}", "lora", "transformers", "sft"],
    }
    text = ModelCard.load(path).text
    for line in (
        f"A LoRA adapter for [{ADAPTER_BASE}](https://huggingface.co/{ADAPTER_BASE})",
        "| method | LoRA (`peft_type: LORA`) |", "| rank `r` | 4 |", "| `lora_alpha` | 8 |",
        "| target modules | `q_proj`, `v_proj` |", "| task | `CAUSAL_LM` |",
        "from peft import PeftModel", "from transformers import AutoModelForCausalLM",
        f'base = AutoModelForCausalLM.from_pretrained("{ADAPTER_BASE}")',
        'model = PeftModel.from_pretrained(base, "org/tiny-lora")',
        f'hf_scale.from_pretrained("{ADAPTER_BASE}", adapter="org/tiny-lora", parallel={{"strategy": "fsdp"}})',
        "| lora_lr | `0.0002` |", "| train | train_loss | 0.25 |",
        f"![Training loss]({LOSS_CURVE})",
    ):
        assert line in text, line


def test_no_loss_curve_without_its_image(adapter):
    text = ModelCard.load(write_model_card(adapter, INFO)).text
    assert "![" not in text and "| rank `r` | 4 |" in text


def test_local_base_and_no_task_type(tmp_path):
    """A base loaded from a folder is named by its path (as for full models); without a
    task_type the head comes from the base class peft recorded (auto_mapping)."""
    base = hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "base")
    folder = save_adapter(tmp_path / "adapter", base_name=str(base), task_type=None)
    assert json.loads((folder / "adapter_config.json").read_text())["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    card = ModelCard.load(write_model_card(folder, {}))
    assert card.data.base_model == str(base) and card.data.pipeline_tag == "text-generation"
    assert f"base_model:adapter:{base}" in card.data.tags
    assert f'AutoModelForCausalLM.from_pretrained("{base}")' in card.text
    assert f'PeftModel.from_pretrained(base, "{folder}")' in card.text  # not pushed: the folder
    assert "| task |" not in card.text


def test_a_card_is_written_over_peft_placeholder_only(adapter, tmp_path):
    assert "[More Information Needed]" in (adapter / "README.md").read_text()  # what peft wrote
    assert adapter_card_needed(adapter)
    write_model_card(adapter, INFO)
    assert not adapter_card_needed(adapter)  # hf_scale's card stays
    (adapter / "README.md").write_text("---\nlibrary_name: peft\n---\n# My adapter, my words\n")
    assert not adapter_card_needed(adapter)
    (adapter / "README.md").unlink()
    assert adapter_card_needed(adapter)
    model = hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "model")
    assert not adapter_card_needed(model)  # a full model gets a card only from card=


def test_loss_curve_name_is_the_one_runs_save():
    from hf_scale.train.metrics import LOSS_CURVE as SAVED

    assert LOSS_CURVE == SAVED
