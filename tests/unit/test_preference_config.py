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
])
def test_refused_with_one_clear_error(tmp_path, sections, words):
    with pytest.raises(HfScaleConfigError, match=words.replace(".", r"\.")):
        load_job(_recipe(tmp_path, **sections))
