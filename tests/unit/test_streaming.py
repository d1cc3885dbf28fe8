"""Streaming (hf_scale.data.streaming, hf_scale.train.streaming_data): batches read, tokenised and
packed as training goes; a resume after any batch continues with exactly the batches an
uninterrupted run yields (across group and epoch boundaries); ranks read disjoint parts."""

from __future__ import annotations

import json
import random

import pytest

from hf_scale.data.streaming import StreamBatches
from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import DataConfig, load_job

EXAMPLES = 23


def _source(epoch: int, skip: int):
    """23 examples of 1-9 tokens in an order that changes with the epoch."""
    order = list(range(EXAMPLES))
    random.Random(epoch).shuffle(order)
    return iter([{"n": i} for i in order[skip:]])


def _encode(example):  # every 5th example has nothing to train: dropped
    n = example["n"]
    return None if n % 5 == 4 else {"input_ids": [n] * (1 + n % 9), "labels": [n] * (1 + n % 9)}


def _collate(rows):
    return [tuple(r["input_ids"]) for r in rows]


def _batches(pack):
    return StreamBatches(_source, _encode, batch_size=3, collate=_collate, pack=pack, max_len=12, group=4)


@pytest.mark.parametrize("pack", [None, "bfd", "bfd_split"])
def test_a_resume_after_any_batch_continues_exactly(pack):
    steps = 30  # several epochs: 19 examples kept per epoch, in groups of 4 (the last of 3)
    whole = []
    for batch in _batches(pack):
        whole.append(batch)
        if len(whole) == steps:
            break
    assert len({tuple(b) for b in whole}) > 10  # the batches differ (a stuck stream repeats one)
    for cut in range(steps):
        first = _batches(pack)
        stream = iter(first)
        for _ in range(cut):
            next(stream)
        resumed = _batches(pack)
        resumed.load_state_dict(first.state_dict() if cut else _batches(pack).state_dict())
        again = iter(resumed)
        assert [next(again) for _ in range(steps - cut)] == whole[cut:], f"resumed after batch {cut}"


def test_every_kept_example_comes_once_per_epoch():
    seen = []
    for batch in StreamBatches(_source, _encode, batch_size=1, collate=_collate, max_len=12, group=4):
        seen.append(batch[0][0])
        if len(seen) == 19:
            break
    assert sorted(seen) == [n for n in range(EXAMPLES) if n % 5 != 4]


def test_a_stream_with_nothing_to_train_is_refused():
    batches = StreamBatches(_source, lambda e: None, batch_size=2, collate=_collate, max_len=12)
    with pytest.raises(HfScaleConfigError, match="no usable example in a whole pass"):
        next(iter(batches))


def test_a_position_saved_with_another_batch_size_is_refused():
    state = _batches(None).state_dict()
    other = StreamBatches(_source, _encode, batch_size=5, collate=_collate, max_len=12)
    with pytest.raises(Exception, match="batch_size 3"):
        other.load_state_dict(state)


@pytest.mark.parametrize("shuffle_buffer", [1, 16])
def test_ranks_read_disjoint_parts_of_a_file(tmp_path, shuffle_buffer):
    from hf_scale.train.streaming_data import stream_source

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(40)))
    cfg = DataConfig(path=str(path), streaming=True, shuffle_buffer=shuffle_buffer, eval_split=None)
    parts = [[e["prompt"] for e in stream_source(cfg, rank, 2)(0, 0)] for rank in range(2)]
    assert not set(parts[0]) & set(parts[1]) and sorted(parts[0] + parts[1]) == sorted(f"q{i}" for i in range(40))
    again = [e["prompt"] for e in stream_source(cfg, 0, 2)(0, 5)]
    assert again == parts[0][5:]  # skipping replays the same order
    assert [e["prompt"] for e in stream_source(cfg, 0, 2)(1, 0)] != parts[0] or shuffle_buffer == 1


@pytest.mark.parametrize("override, message", [
    (["--train.max_steps", "null"], "set train.max_steps"),
    (["--model.task", "sequence_classification"], "set data.streaming: false"),
])
def test_streaming_needs_steps_and_causal_lm(tmp_path, override, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {streaming: true}\ntrain: {max_steps: 5}\n")
    with pytest.raises(HfScaleConfigError, match=message):
        load_job(recipe, override)


def test_streaming_refuses_an_eval_fraction(tmp_path):
    from hf_scale.train.streaming_data import stream_source

    cfg = DataConfig(path="builtin:arithmetic", streaming=True, eval_fraction=0.1)
    with pytest.raises(HfScaleConfigError, match="data.eval_path"):
        stream_source(cfg, 0, 1)
