"""write_model_card: the card parses with ModelCard.load, carries the run's facts, and the Hub's
YAML validator (the local server's /api/validate-yaml) accepts it."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

import hf_scale
from hf_scale import CardInfo, write_model_card
from hf_scale.errors import HfScaleConfigError
from tests.tiny_models import tiny_model

INFO = CardInfo(
    base_model="HuggingFaceTB/SmolLM2-135M", repo_id="org/tiny-finetune", datasets=["yahma/alpaca-cleaned"],
    license="apache-2.0", language=["en"], tags=["sft"], strategy="hsdp",
    mesh={"dp_replicate": 2, "dp_shard": 4}, world_size=8,
    plan_source={"tp_plan": "inferred, checked", "pp_plan": "transformers"},
    hyperparameters={"lr": 2e-5, "global_batch_size": 64, "mixed_precision": "bf16"},
    training_time_seconds=3725.4, tokens_seen=1048576,
    train_metrics={"loss": 1.23456}, eval_metrics={"loss": 1.5, "perplexity": 4.48},
    loss_curve="loss_curve.png",
)


@pytest.fixture
def folder(tmp_path):
    return hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "out")


def test_card_metadata_and_body(folder):
    (folder / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    card = ModelCard.load(write_model_card(folder, INFO))
    data = card.data
    assert data.base_model == INFO.base_model and data.datasets == INFO.datasets
    assert data.license == "apache-2.0" and data.language == ["en"]
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.tags == ["hf-scale", "hsdp", "sft"]
    for text in (
        'from transformers import AutoModelForCausalLM',
        'AutoModelForCausalLM.from_pretrained("org/tiny-finetune")',
        "| strategy | `hsdp` |", "| mesh `dp_replicate` | 2 |", "| mesh `dp_shard` | 4 |",
        "| world size | 8 processes |", "| tp plan from | inferred, checked |", "| pp plan from | transformers |",
        "| training time | 1h 02m 05s |", "| tokens seen | 1,048,576 |",
        "| lr | `2e-05` |", "| mixed_precision | `bf16` |",
        "| train | loss | 1.235 |", "| eval | perplexity | 4.48 |",
        "![Training loss](loss_curve.png)",
    ):
        assert text in card.text, text


def test_card_without_optional_facts(folder, tmp_path):
    card = ModelCard.load(write_model_card(folder, {"loss_curve": "loss_curve.png"}))  # image absent
    assert "![" not in card.text and "## Results" not in card.text and "Hyperparameters" not in card.text
    assert card.data.tags == ["hf-scale"]
    classifier = hf_scale.save_pretrained(tiny_model("bert", "seqcls"), tmp_path / "cls")
    card = ModelCard.load(write_model_card(classifier, {}))
    assert card.data.pipeline_tag == "text-classification"
    assert "AutoModelForSequenceClassification.from_pretrained(" in card.text


def test_bad_card_info(folder):
    with pytest.raises(HfScaleConfigError, match="unknown config key 'card.base_modle'.*Did you mean 'base_model'"):
        write_model_card(folder, {"base_modle": "gpt2"})
    with pytest.raises(HfScaleConfigError, match="card.world_size: expected int"):
        write_model_card(folder, {"world_size": "eight"})
    with pytest.raises(HfScaleConfigError, match="template .* does not exist"):
        write_model_card(folder, INFO, template=folder / "missing.md")


def test_hub_validator_accepts_the_card_and_rejects_bad_metadata(hub, folder):
    ModelCard.load(write_model_card(folder, INFO)).validate()
    hf_scale.push_to_hub(folder, "org/tiny-finetune", card=INFO)
    assert ModelCard(hub.files("org/tiny-finetune")["README.md"].decode()).data.base_model == INFO.base_model
    start = len(hub.requests)
    with pytest.raises(HfScaleConfigError, match="rejected the metadata.*license"):
        hf_scale.push_to_hub(folder, "org/other", card={"license": "my-own-license"})
    assert [path for _, path in hub.requests[start:]] == ["/api/validate-yaml"]  # before any upload


@pytest.mark.parametrize("name", ["DEFAULT_TEMPLATE", "ADAPTER_TEMPLATE"])
def test_templates_ship_in_the_package_and_model_cards_has_their_copies(name):
    from pathlib import Path

    from hf_scale.hub import card

    template = getattr(card, name)
    package = Path(hf_scale.__file__).resolve().parent
    assert template.is_file() and package in template.resolve().parents
    copy = package.parent / "model_cards" / template.name
    assert copy.read_text() == template.read_text(), (
        f"{copy} differs from {template}, the template hf_scale uses: edit the package's "
        f"template and copy it over (cp {template.relative_to(package.parent)} model_cards/)"
    )


def test_custom_template(folder, tmp_path):
    template = tmp_path / "lab.md"
    template.write_text("---\n{{ card_data }}\n---\n# {{ model_name }}, from the lab\n\nstrategy {{ strategy }}\n")
    card = ModelCard.load(write_model_card(folder, INFO, template=template))
    assert card.text.strip() == "# tiny-finetune, from the lab\n\nstrategy hsdp"
    assert card.data.base_model == INFO.base_model
    template.write_text("{% if strategy %}unclosed")
    with pytest.raises(HfScaleConfigError, match="template=.*Jinja syntax error on line 1"):
        write_model_card(folder, INFO, template=template)


def test_a_recipe_names_the_template_of_its_run_card(folder, tmp_path):
    from hf_scale.train.config import HubConfig, JobConfig, TrainConfig
    from hf_scale.train.finish import finish_run

    template = tmp_path / "lab.md"
    template.write_text("---\n{{ card_data }}\n---\n# {{ model_name }}: {{ hyperparameters.steps }} steps\n")
    job = JobConfig(train=TrainConfig(output_dir=str(tmp_path)), hub=HubConfig(card_template=str(template)))
    summary = {"steps": 7, "train_time_s": 1.0, "tokens_seen": 10, "final_loss": 0.5}
    finish_run(job, folder, summary, None, None, world=1)
    assert ModelCard.load(folder / "README.md").text.strip() == f"# {tmp_path.name}: 7 steps"
