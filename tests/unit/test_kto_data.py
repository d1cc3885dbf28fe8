"""Unpaired (KTO) examples to token ids (hf_scale.data.unpaired) with SmolLM2's real tokenizer:
each example is exactly the pair's side it came from; paired data unpaired as TRL does; the
collator's KL rows written out by hand; bad input refused with one clear error; the
``preference.loss: kto`` recipe section and what it refuses; builtin:unpaired."""

from __future__ import annotations

import pytest
import torch
import yaml

from hf_scale.data.preference import tokenize_preference
from hf_scale.data.unpaired import (
    UnpairedCollator,
    check_labels,
    tokenize_unpaired,
    unpair_preference,
)
from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import DataConfig, load_job
from hf_scale.train.tasks import builtin_dataset
from tests.tiny_models import tiny_tokenizer
from tests.unit.test_preference_data import (  # noqa: F401
    PAIRS,
    check_side,
    conversational,
    dataset,
    prompt_text,
    smol,
)


def unpaired(pairs):
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for side in ("chosen", "rejected") for p in pairs]


def test_plain_examples_label_exactly_the_completion(smol):  # noqa: F811
    rows = unpaired(PAIRS)
    out = tokenize_unpaired(dataset(rows), smol, DataConfig(), 128)
    assert sorted(out.column_names) == ["input_ids", "label", "labels"]
    for got, row in zip(out, rows):
        check_side(smol, got["input_ids"], got["labels"], prompt_text(row["prompt"]), row["completion"])
        assert got["label"] is row["label"]


def test_pairs_are_unpaired_as_trl_does(smol):  # noqa: F811
    """Pairs give their chosen sequences (label True), then their rejected ones (False): the
    same tokens as the pair's sides, in any of the forms, with named columns too."""
    pytest.importorskip("trl")  # the anchor: installed beside the benchmarks, not a test dependency
    from trl.data_utils import unpair_preference_dataset

    ours = unpair_preference(dataset(PAIRS)).to_list()
    assert ours == unpair_preference_dataset(dataset(PAIRS)).to_list() == unpaired(PAIRS)
    for rows, cfg in ((PAIRS, DataConfig()), ([conversational(p) for p in PAIRS], DataConfig()),
                      ([{"q": p["prompt"], "a": p["chosen"], "b": p["rejected"]} for p in PAIRS],
                       DataConfig(prompt_column="q", chosen_column="a", rejected_column="b"))):
        pairs = tokenize_preference(dataset(rows), smol, cfg, 128)
        want = [(r[f"{side}_input_ids"], r[f"{side}_labels"], side == "chosen") for side in ("chosen", "rejected")
                for r in pairs]
        got = [(r["input_ids"], r["labels"], r["label"]) for r in tokenize_unpaired(dataset(rows), smol, cfg, 128)]
        assert got == want


def test_truncation_keeps_a_completion():
    tok = tiny_tokenizer()  # one token per character
    row = {"prompt": "abcdefghijklmnopqrstuvwxyz" * 2, "completion": "0123456789", "label": True}
    out = tokenize_unpaired(dataset([row, {**row, "label": False}]), tok, DataConfig(), 40)[0]
    full = tokenize_unpaired(dataset([row, {**row, "label": False}]), tok, DataConfig(), 1000)[0]
    n = len(full["input_ids"]) - len(out["input_ids"])
    assert len(out["input_ids"]) == 40 and n > 0 and out["input_ids"] == full["input_ids"][n:]
    assert out["labels"] == full["labels"][n:]


def test_collator_builds_the_kl_rows_by_rotation():
    """Row 2i: example i; row 2i+1: example i's prompt, then example i-1's completion (labels
    included; example 0 takes the last's), cut to max_len."""
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "label": True},
            {"input_ids": [8, 9, 10, 11], "labels": [-100, -100, 10, 11], "label": False},
            {"input_ids": [12, 13, 14, 15, 16], "labels": [-100, 13, 14, 15, -100], "label": True}]
    batch = UnpairedCollator(0, max_len=5)(rows)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 0, 0], [5, 13, 14, 15, 16],          # example 0; prompt 0 + completion 2
        [8, 9, 10, 11, 0], [8, 9, 6, 7, 0],            # example 1; prompt 1 + completion 0
        [12, 13, 14, 15, 16], [12, 10, 11, 0, 0]]      # example 2; prompt 2 + completion 1
    assert batch["labels"].tolist() == [
        [-100, 6, 7, -100, -100], [-100, 13, 14, 15, -100],
        [-100, -100, 10, 11, -100], [-100, -100, 6, 7, -100],
        [-100, 13, 14, 15, -100], [-100, 10, 11, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 1, 1, 1, 0], [1, 1, 1, 1, 0],
                                                [1] * 5, [1, 1, 1, 0, 0]]
    assert batch["label"].tolist() == [True, False, True] and batch["label"].dtype == torch.bool
    cut = UnpairedCollator(0, max_len=2)(rows[:2])  # KL row 0: prompt 0 + completion 1, cut to 2
    assert cut["input_ids"][1].tolist() == [5, 10, 0, 0] and cut["labels"][1].tolist() == [-100, 10, -100, -100]


GOOD = {"prompt": "Fine?", "completion": "Yes", "label": True}


@pytest.mark.parametrize("rows, words", [
    ([GOOD, {"prompt": "Hi?", "completion": "Yo", "label": None}], "row 1 has no label"),
    ([{**GOOD, "label": 1}, {**GOOD, "label": 0}], "row 0: label 1 \\(int, column 'label'\\) is not a bool"),
    ([{**GOOD, "label": "true"}], "row 0: label 'true' \\(str"),
    ([GOOD, {"prompt": "Hi?", "completion": " ", "label": True}], "row 1: the completion \\(column 'completion'\\)"),
    ([GOOD, {"prompt": None, "completion": "Yo", "label": True}], "row 1: the prompt"),
])
def test_bad_rows_refused_by_row(rows, words):
    with pytest.raises(HfScaleConfigError, match=words):
        tokenize_unpaired(dataset(rows), tiny_tokenizer(), DataConfig(), 64)


def test_bad_data_refused():
    tok = tiny_tokenizer()
    with pytest.raises(HfScaleConfigError, match="data.label_column='label': the kto data have no column"):
        tokenize_unpaired(dataset([{"prompt": "Hi?", "completion": "Yo"}]), tok, DataConfig(), 64)
    with pytest.raises(HfScaleConfigError, match="row 0: prompt and completion must both be strings or both lists"):
        tokenize_unpaired(dataset([{"prompt": "Hi?", "completion": [{"role": "assistant", "content": "Yo"}],
                                    "label": True}]), tok, DataConfig(), 64)
    with pytest.raises(HfScaleConfigError, match="data.loss_on_prompt"):
        tokenize_unpaired(dataset(unpaired(PAIRS)), tok, DataConfig(loss_on_prompt=True), 64)
    with pytest.raises(HfScaleConfigError, match="all desirable"):
        check_labels([True, True, True])
    with pytest.raises(HfScaleConfigError, match="all undesirable"):
        check_labels([False])
    assert check_labels([True, False, True, False]) is None
    advice = check_labels([True] * 9 + [False])  # 9 : 1 with weights 1 and 1
    assert "desirable_weight in [0.11, 0.15]" in advice and "undesirable_weight in [6.77, 9.0]" in advice
    assert check_labels([True] * 9 + [False], undesirable_weight=8.0) is None
    with pytest.raises(HfScaleConfigError, match="needs >= 2"):
        UnpairedCollator(0)([{"input_ids": [1, 2], "labels": [-100, 2], "label": True}])


def test_builtin_unpaired_is_the_pairs_unpaired():
    pairs, rows = builtin_dataset("builtin:preference"), builtin_dataset("builtin:unpaired")
    for split in ("train", "test"):
        want = sorted((p["prompt"], p[side], side == "chosen") for p in pairs[split] for side in ("chosen", "rejected"))
        assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows[split]) == want
        head = rows[split]["label"][:64]  # shuffled: a recipe's first rows hold both labels
        assert 16 < sum(head) < 48


# ------------------------------------------------------------------ the recipe section


def _recipe(tmp_path, **sections):
    job = {"data": {"path": "builtin:unpaired"}, "preference": {"loss": "kto", "beta": 0.2}}
    for name, values in sections.items():
        job.setdefault(name, {}).update(values)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_kto_section(tmp_path):
    job = load_job(_recipe(tmp_path, preference={"desirable_weight": 1.33}))
    knobs = job.preference.knobs()
    assert (knobs.loss, knobs.beta, knobs.desirable_weight, knobs.undesirable_weight) == ("kto", 0.2, 1.33, 1.0)
    assert job.preference.reference_source(lora=False) == "model"  # the KL rows cannot be precomputed
    assert job.preference.reference_source(lora=True) == "adapter"


@pytest.mark.parametrize("sections, words", [
    ({"preference": {"reference": "precompute"}}, "cannot be computed before training"),
    ({"parallel": {"pp": 2}}, "parallel.pp=2"),
    ({"train": {"batch_size": 1}}, "train.batch_size=1"),
    ({"train": {"eval_batch_size": 1}}, "train.eval_batch_size=1"),
    ({"preference": {"rpo_alpha": 1.0}}, "nor kto"),
    ({"preference": {"loss": "sigmoid", "undesirable_weight": 2.0}}, "weighs kto's unpaired examples"),
])
def test_kto_refused_with_one_clear_error(tmp_path, sections, words):
    with pytest.raises(HfScaleConfigError, match=words):
        load_job(_recipe(tmp_path, **sections))
