"""The ``preference:`` recipe section: loaded from YAML with CLI overrides, its reference
resolved, and what preference training cannot run with refused before any model loads."""

from __future__ import annotations

import pytest
import yaml

from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import load_job


def _recipe(tmp_path, **sections):
    job = {"data": {"path": "builtin:preference"}, "preference": {"loss": "sigmoid", "beta": 0.2}}
    for name, values in sections.items():
        job.setdefault(name, {}).update(values)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_section_loads_with_overrides(tmp_path):
    job = load_job(_recipe(tmp_path), ["--preference.loss", "ipo", "--preference.beta", "0.5"])
    knobs = job.preference.knobs()
    assert (knobs.loss, knobs.beta) == ("ipo", 0.5)
    assert job.preference.reference_source(lora=False) == "precompute"
    assert job.preference.reference_source(lora=True) == "adapter"
    assert load_job(_recipe(tmp_path, preference={"loss": "orpo"})).preference.reference_source(lora=True) is None
    assert not load_job(_recipe(tmp_path, preference={"loss": None})).preference.enabled


@pytest.mark.parametrize("sections, words", [
    ({"preference": {"loss": "dpo"}}, "not one of"),
    ({"preference": {"reference": "copy"}}, "preference.reference"),
    ({"preference": {"loss": "robust", "label_smoothing": 0.6}}, "label_smoothing"),
    ({"data": {"packing": "bfd"}}, "data.packing"),
    ({"data": {"padding_free": True}}, "data.packing"),
    ({"preference": {"reference": "adapter"}}, "peft.r"),
    ({"model": {"task": "sequence_classification"}}, "model.task"),
    ({"preference": {"reference_model": "other"}}, "reference: model"),  # auto reads no reference model
    ({"preference": {"loss": "simpo", "reference": "model", "reference_model": "other"}}, "needs no reference"),
    ({"preference": {"reference": "model"}, "parallel": {"pp": 2}}, "reference: precompute"),
    ({"preference": {"reference": "model"}, "parallel": {"strategy": "ddp", "ep": 2}}, "experts included"),
    ({"preference": {"reference": "model"}, "model": {"trust_remote_code": True}}, "trust_remote_code"),
])
def test_refused_with_one_clear_error(tmp_path, sections, words):
    with pytest.raises(HfScaleConfigError, match=words.replace(".", r"\.")):
        load_job(_recipe(tmp_path, **sections))


def test_reference_model_is_read_by_model_and_precompute(tmp_path):
    for source in ("model", "precompute"):
        job = load_job(_recipe(tmp_path, preference={"reference": source, "reference_model": "some/sft"}))
        assert job.preference.reference_source(lora=True) == source  # an explicit source wins over LoRA's adapter
        assert job.preference.reference_model == "some/sft"


def test_a_reference_of_another_vocabulary_is_refused(tmp_path):
    from tests.tiny_models import save_tiny_checkpoint

    from hf_scale.train.preference import reference_config

    policy = save_tiny_checkpoint(tmp_path / "policy")
    other = save_tiny_checkpoint(tmp_path / "other", vocab_size=300)
    job = load_job(_recipe(tmp_path, model={"name_or_path": policy},
                           preference={"reference": "model", "reference_model": other}))
    with pytest.raises(HfScaleConfigError, match="vocabulary of 300 tokens"):
        reference_config(job)
    same = load_job(_recipe(tmp_path, model={"name_or_path": policy},
                            preference={"reference": "model", "reference_model": policy}))
    assert reference_config(same).name_or_path == policy


def test_a_replicated_reference_is_a_frozen_plain_model_scoring_like_its_weights(tmp_path):
    """Under ddp / zero1 the reference is the plain model on the device: no wrapper, nothing
    to train, eval mode, and its log-probs are the model's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import pair_rows, save_tiny_checkpoint

    from hf_scale.config import ParallelConfig
    from hf_scale.data.preference import PairCollator
    from hf_scale.parallel.preference import sequence_logps
    from hf_scale.parallel.preference_reference import frozen_reference_logps
    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_reference

    path = save_tiny_checkpoint(tmp_path / "m", seed=3)
    reference = load_reference(ModelConfig(name_or_path=path), ParallelConfig(strategy="ddp"), torch.device("cpu"))
    assert type(reference) is AutoModelForCausalLM.from_pretrained(path).__class__
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    batch = PairCollator(0)(pair_rows(3))
    want = sequence_logps(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch)
    torch.testing.assert_close(frozen_reference_logps(reference, batch), want, rtol=0, atol=0)
