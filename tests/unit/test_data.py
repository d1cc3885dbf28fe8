"""Data: every file type, builtin tasks, tokenisation (loss on answers only), bad input, batches."""

from __future__ import annotations

import json

import pytest
import torch

from hf_scale.errors import HfScaleCheckpointError, HfScaleConfigError
from hf_scale.train.config import DataConfig
from hf_scale.train.data import (
    check_seq_len,
    label_ids,
    load_splits,
    render_pair,
    tokenize_causal_lm,
    tokenize_classification,
)
from hf_scale.train.loader import PadCollator, ShardedBatches, eval_batches
from tests.tiny_models import tiny_config, tiny_tokenizer

ROWS = [{"prompt": f"What is {i} + 1?", "response": str(i + 1), "text": f"line {i}", "label": ["a", "b"][i % 2]}
        for i in range(12)]


def _write(folder, kind: str):
    path = folder / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "txt":
        path.write_text("".join(r["text"] + "\n" for r in ROWS))
    else:
        import pandas as pd

        frame = pd.DataFrame(ROWS)
        frame.to_csv(path, index=False) if kind == "csv" else frame.to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["json", "jsonl", "csv", "parquet", "txt"])
def test_each_file_type_loads_and_tokenizes(tmp_path, kind):
    path = _write(tmp_path, kind)
    text = kind == "txt"
    cfg = DataConfig(path=str(path), eval_split=None, eval_fraction=0.25, text_column="text" if text else None)
    splits = load_splits(cfg)
    assert len(splits["train"]) == 9 and len(splits["eval"]) == 3
    rows = tokenize_causal_lm(splits["train"], tiny_tokenizer(), cfg, max_len=64)
    assert len(rows) == 9
    first = rows[0]
    if text:  # plain text: every token is a label
        assert first["labels"] == first["input_ids"]
    else:  # pairs: prompt masked, the answer and <|im_end|> are labels
        assert -100 in first["labels"] and first["labels"][-1] == 4


def test_a_folder_or_glob_of_files(tmp_path):
    _write(tmp_path, "jsonl")
    (tmp_path / "more.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    assert len(load_splits(DataConfig(path=str(tmp_path), eval_split=None))["train"]) == 13
    assert len(load_splits(DataConfig(path=str(tmp_path / "*.jsonl"), eval_split=None))["train"]) == 13
    eval_file = load_splits(DataConfig(path=str(tmp_path / "data.jsonl"), eval_path=str(tmp_path / "more.jsonl")))
    assert len(eval_file["eval"]) == 1


def test_answer_tokens_are_exactly_the_labels():
    tok, cfg = tiny_tokenizer(), DataConfig(system_prompt="Be brief.")
    prompt_text, full_text = render_pair(tok, cfg, "What is 2 + 2?", "4")
    assert full_text == prompt_text + "4<|im_end|>" and "Be brief." in prompt_text
    from datasets import Dataset

    row = tokenize_causal_lm(Dataset.from_list([{"prompt": "What is 2 + 2?", "response": "4"}]), tok, cfg, 128)[0]
    answer = [t for t in row["labels"] if t != -100]
    assert tok.decode(answer) == "4<|im_end|>"
    assert row["input_ids"][-len(answer):] == answer
    plain = DataConfig(chat_template=False)
    assert render_pair(tok, plain, "Q", "A") == ("Q\n", "Q\nA<eos>")


def test_builtin_tasks_are_fixed_and_held_out():
    a, b = load_splits(DataConfig(path="builtin:arithmetic")), load_splits(DataConfig(path="builtin:arithmetic"))
    assert a["train"][:5] == b["train"][:5]
    assert not set(a["train"]["prompt"]) & set(a["eval"]["prompt"])
    for row in a["eval"].select(range(20)):
        assert str(eval(row["prompt"][8:-1])) == row["response"]  # "What is 41 + 60?"
    with pytest.raises(HfScaleConfigError, match="unknown generated task 'nope'"):
        load_splits(DataConfig(path="builtin:nope"))


def test_missing_column_lists_the_columns(tmp_path):
    cfg = DataConfig(path=str(_write(tmp_path, "jsonl")), prompt_column="question", eval_split=None)
    train = load_splits(cfg)["train"]
    with pytest.raises(HfScaleConfigError, match=r"data.prompt_column='question'.*columns are prompt, response, text, label"):
        tokenize_causal_lm(train, tiny_tokenizer(), cfg, 64)
    with pytest.raises(HfScaleConfigError, match="data.label_column='topic'"):
        label_ids(train, DataConfig(label_column="topic"))


def test_empty_after_filtering(tmp_path):
    cfg = DataConfig(path=str(_write(tmp_path, "jsonl")), eval_split=None)
    train = load_splits(cfg)["train"]
    with pytest.raises(HfScaleConfigError, match="empty after filtering .12 examples in, 0 left"):
        tokenize_causal_lm(train, tiny_tokenizer(), cfg, max_len=8)  # prompts alone are longer


def test_sequence_length_above_the_model_limit():
    config = tiny_config("gpt2")  # n_positions 64
    check_seq_len(64, config)
    with pytest.raises(HfScaleConfigError, match="data.max_seq_len=65 is above the model's limit of 64"):
        check_seq_len(65, config)


def test_token_ids_beyond_the_model_vocabulary(tmp_path):
    """A tokenizer larger than the model's vocabulary: refused once the data hold an id the
    embedding has no row for (it failed inside the embedding), accepted while they do not."""
    from hf_scale.train.data import check_vocab

    cfg = DataConfig(path=str(_write(tmp_path, "jsonl")), eval_split=None)
    tokenizer = tiny_tokenizer()
    train = tokenize_causal_lm(load_splits(cfg)["train"], tokenizer, cfg, max_len=64)
    largest = max(max(ids) for ids in train["input_ids"])
    config = tiny_config("llama")
    for vocab in (len(tokenizer), largest + 1):  # no id beyond the embedding
        config.vocab_size = vocab
        check_vocab(tokenizer, config, train, None)
    config.vocab_size = largest
    with pytest.raises(HfScaleConfigError, match=f"data hold token id {largest}, but the model's vocabulary has {largest}"):
        check_vocab(tokenizer, config, train, None)


def test_no_data_files_and_mixed_types(tmp_path):
    with pytest.raises(HfScaleConfigError, match="matches no data file"):
        load_splits(DataConfig(path=str(tmp_path / "*.jsonl")))
    _write(tmp_path, "jsonl"), _write(tmp_path, "csv")
    with pytest.raises(HfScaleConfigError, match="mixes file types"):
        load_splits(DataConfig(path=str(tmp_path)))


@pytest.mark.parametrize("name, text, message", [
    ("cut.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": "c", "resp',
     "cut.jsonl': line 2, column 17: Unterminated string (the file ends inside this line: cut short?)"),
    ("list.jsonl", '{"prompt": "a", "response": "b"}\n[1, 2]\n', "list.jsonl': line 2: a JSON list, not an object"),
    ("cut.json", '[{"prompt": "a", "response": "b"}, {"prompt": "c"',
     "cut.json': line 1, column 50: Expecting ',' delimiter (the file ends early: cut short?)"),
    ("broken.csv", 'prompt,response\na,b\nc,d,e,f\n', "broken.csv': line 3: 4 fields, but the header names 2"),
    ("quote.csv", 'prompt,response\n"a,b\nc,d\n', "quote.csv': line 3: unexpected end of data (a quote opened"),
    ("empty.jsonl", "", "empty.jsonl' is empty"),
    ("blank.csv", "\n \n", "blank.csv' is empty"),
])
def test_unreadable_data_files_name_the_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(HfScaleConfigError, match="^data.path: .*" + _escape(message)):
        load_splits(DataConfig(path=str(tmp_path / name)))


def test_data_paths_that_name_no_file(tmp_path):
    with pytest.raises(HfScaleConfigError, match=_escape(f"data.path='{tmp_path}/nope.jsonl': no such file or folder")):
        load_splits(DataConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(HfScaleConfigError, match="data.path='data/nope.csv': no such file"):  # a file, not a Hub name
        load_splits(DataConfig(path="data/nope.csv"))
    _write(tmp_path, "jsonl")
    (tmp_path / "eval.jsonl").write_text("")
    with pytest.raises(HfScaleConfigError, match="^data.eval_path: the data file .*eval.jsonl' is empty"):
        load_splits(DataConfig(path=str(tmp_path / "data.jsonl"), eval_path=str(tmp_path / "eval.jsonl")))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_classification_labels(tmp_path):
    cfg = DataConfig(path=str(_write(tmp_path, "csv")), text_column="text", eval_split=None)
    train = load_splits(cfg)["train"]
    labels = label_ids(train, cfg)
    assert labels == {"a": 0, "b": 1}
    rows = tokenize_classification(train, tiny_tokenizer(), cfg, 32, labels)
    assert rows[0]["labels"] == 0 and rows[1]["labels"] == 1


def test_wrapped_packing_fills_rows(tmp_path):
    cfg = DataConfig(path=str(_write(tmp_path, "txt")), text_column="text", eval_split=None)
    rows = tokenize_causal_lm(load_splits(cfg)["train"], tiny_tokenizer(), cfg, max_len=16, pack="wrapped")
    assert all(len(r["input_ids"]) == 16 for r in rows) and len(rows) == (10 * 7 + 2 * 8) // 16  # 'line 0'..'line 11' + eos, remainder dropped


# ------------------------------------------------------------------ batches


class _Rows(list):
    """A dataset of rows whose input_ids are their own index."""


def _dataset(n):
    return _Rows({"input_ids": [i], "labels": [i]} for i in range(n))


def _ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_ranks_split_each_global_batch_like_one_big_batch():
    data, collate = _dataset(20), PadCollator(0)
    one = iter(ShardedBatches(data, 8, 0, 1, collate, seed=3))
    ranks = [iter(ShardedBatches(data, 4, r, 2, collate, seed=3)) for r in range(2)]
    wholes = []
    for _ in range(4):  # 2 batches per epoch: crosses epoch boundaries
        whole = _ids(next(one))
        parts = [_ids(next(r)) for r in ranks]
        assert parts[0] + parts[1] == whole and len(set(whole)) == 8
        wholes.append(whole)
    assert wholes[0] != wholes[2]  # each epoch is a new permutation


def test_resume_mid_epoch_continues_at_the_right_sample():
    data, collate = _dataset(40), PadCollator(0)
    run = ShardedBatches(data, 4, 1, 2, collate, seed=7)  # 5 batches per epoch
    stream = iter(run)
    seen = [_ids(next(stream)) for _ in range(3)]
    state = run.state_dict()
    rest = [_ids(next(stream)) for _ in range(4)]  # into the next epoch
    resumed = ShardedBatches(data, 4, 1, 2, collate, seed=7)
    resumed.load_state_dict(state)
    assert [_ids(b) for b, _ in zip(resumed, range(4))] == rest
    assert state == {"epoch": 0, "batch": 3, "global_batch": 8} and seen
    sought = ShardedBatches(data, 4, 1, 2, collate, seed=7)
    sought.seek(3)
    assert [_ids(b) for b, _ in zip(sought, range(4))] == rest
    with pytest.raises(HfScaleCheckpointError, match="global batches of 8 examples, this run's are 12"):
        ShardedBatches(data, 4, 0, 3, collate).load_state_dict(state)


def test_too_little_data_for_one_batch():
    with pytest.raises(HfScaleConfigError, match="do not fill one global batch of 16"):
        ShardedBatches(_dataset(10), 8, 0, 2, PadCollator(0))


def test_eval_batches_count_each_example_once():
    data = _dataset(7)
    seen = []
    for rank in range(2):
        for batch, weight in eval_batches(data, 3, rank, 2, PadCollator(0)):
            seen += [i for i, w in zip(_ids(batch), weight.tolist()) if w]
    assert sorted(seen) == list(range(7))
    rounds = [len(list(eval_batches(data, 3, r, 2, PadCollator(0)))) for r in range(2)]
    assert rounds == [2, 2]


def test_collator_pads_labels_with_ignore_index():
    batch = PadCollator(9)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.equal(PadCollator(0)([{"input_ids": [1], "labels": 2}])["labels"], torch.tensor([2]))
