"""What a fine-tuning run's model card says: the expert-parallel degree beside the mesh, and a
base model linked (and put in the Hub's ``base_model`` metadata) only when it is a Hub id."""

from __future__ import annotations

from hf_scale.config import ParallelConfig
from hf_scale.hub.card import write_model_card
from hf_scale.train.config import JobConfig, ModelConfig, TrainConfig
from hf_scale.train.finish import card_info

SUMMARY = {"steps": 1, "train_time_s": 1.0, "tokens_seen": 10, "final_loss": 0.5}


def test_card_names_ep_and_links_only_a_hub_base_model(tmp_path):
    local = tmp_path / "tiny_moe"
    local.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    job = JobConfig(model=ModelConfig(name_or_path=str(local)), parallel=ParallelConfig(ep=2),
                    train=TrainConfig(output_dir=str(out)))
    info = card_info(job, SUMMARY, out, world=4)
    assert info["mesh"] == {"dp_shard": 4, "ep": 2}
    assert info["base_model"] is None  # a local folder: no Hub link, no metadata the Hub rejects
    card = write_model_card(out, info).read_text()
    assert "huggingface.co//" not in card and str(local) not in card.split("---")[1]
    assert "| mesh `ep` | 2 |" in card

    hub = JobConfig(model=ModelConfig(name_or_path="HuggingFaceTB/SmolLM2-135M"), train=TrainConfig(output_dir=str(out)))
    info = card_info(hub, SUMMARY, out, world=2)
    assert info["base_model"] == "HuggingFaceTB/SmolLM2-135M" and info["mesh"] == {"dp_shard": 2}
    card = write_model_card(out, info).read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M" in card
    assert "(https://huggingface.co/HuggingFaceTB/SmolLM2-135M)" in card
