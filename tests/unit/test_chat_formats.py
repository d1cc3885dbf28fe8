"""Conversations in ``hf-scale finetune``: data.format (auto from the columns), TRL's conversational
prompt/completion, errors naming the row and the key, builtin:multiturn, and exact match on a
conversation's last answer."""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset

from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import DataConfig
from hf_scale.train.data import causal_lm_format, load_splits, tokenize_causal_lm
from tests.tiny_models import tiny_tokenizer
from tests.unit.test_chat_data import TOOLS, runs, smollm2_tokenizer

CHAT = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"},
        {"role": "user", "content": "Add 4 to that."}, {"role": "assistant", "content": "7"}]
END = "<|im_end|>"


@pytest.fixture(scope="module")
def smol():
    return smollm2_tokenizer()


def _labelled(rows, cfg=None, tok=None) -> list[list[str]]:
    tok = tok or tiny_tokenizer()
    out = tokenize_causal_lm(Dataset.from_list(rows), tok, cfg or DataConfig(), 128)
    return [runs(row, tok) for row in out]


@pytest.mark.parametrize(("columns", "keys", "want"), [
    (["messages"], {}, ("messages", {"data.messages_column": "messages"})),
    (["conversations", "id"], {}, ("messages", {"data.messages_column": "conversations"})),
    (["dialog"], {"messages_column": "dialog"}, ("messages", {"data.messages_column": "dialog"})),
    (["prompt", "response", "text"], {}, ("prompt_completion", {"data.prompt_column": "prompt",
                                                                "data.response_column": "response"})),
    (["prompt", "completion"], {}, ("prompt_completion", {"data.prompt_column": "prompt",
                                                          "data.response_column": "completion"})),
    (["q", "a"], {"prompt_column": "q", "response_column": "a"},
     ("prompt_completion", {"data.prompt_column": "q", "data.response_column": "a"})),
    (["text", "messages"], {"text_column": "text"}, ("text", {"data.text_column": "text"})),
    (["text", "label"], {}, ("text", {"data.text_column": "text"})),
    (["messages", "text"], {"format": "text"}, ("text", {"data.text_column": "text"})),
    (["prompt", "response"], {"format": "messages"}, ("messages", {"data.messages_column": "messages"})),
])
def test_auto_format_from_the_columns(columns, keys, want):
    fmt = causal_lm_format(columns, DataConfig(**keys))
    assert (fmt.kind, fmt.columns) == want


def test_auto_format_says_what_it_needs():
    with pytest.raises(HfScaleConfigError, match=r"data.format=auto cannot tell the data format from the columns "
                       r"\(question, answer\)"):
        causal_lm_format(["question", "answer"], DataConfig())
    with pytest.raises(HfScaleConfigError, match=r"data.messages_column='messages': the dataset has no column"):
        tokenize_causal_lm(Dataset.from_list([{"prompt": "a", "response": "b"}]), tiny_tokenizer(),
                           DataConfig(format="messages"), 64)
    with pytest.raises(HfScaleConfigError, match="data.format='chat' is not one of 'auto', 'messages'"):
        DataConfig(format="chat")
    with pytest.raises(HfScaleConfigError, match="data.train_on='all' is not one of 'all_assistant', 'last_assistant'"):
        DataConfig(train_on="all")


def test_messages_rows_train_on_the_assistant_turns(smol):
    assert _labelled([{"messages": CHAT}]) == [["3" + END, "7" + END]]
    assert _labelled([{"messages": CHAT}], DataConfig(train_on="last_assistant")) == [["7" + END]]
    think = [*CHAT[:3], {"role": "assistant", "content": "<think>3+4</think>7"}]
    assert _labelled([{"messages": think}], tok=smol) == [["3" + END, "<think>3+4</think>7" + END]]
    assert _labelled([{"messages": think}], DataConfig(train_on_reasoning=False), smol) == [["3" + END, "7" + END]]
    assert _labelled([{"messages": CHAT}], DataConfig(loss_on_prompt=True))[0][0].startswith("<|im_start|>user")
    sharegpt = [{"from": "human", "value": "What is 1 + 2?"}, {"from": "gpt", "value": "3"}]
    assert _labelled([{"conversations": sharegpt}]) == [["3" + END]]


def test_system_prompt_and_plain_format_for_conversations():
    tok = tiny_tokenizer()
    row = tokenize_causal_lm(Dataset.from_list([{"messages": CHAT}]), tok, DataConfig(system_prompt="Be brief."), 128)[0]
    assert tok.decode(row["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    plain = tokenize_causal_lm(Dataset.from_list([{"messages": CHAT}]), tok, DataConfig(chat_template=False), 128)[0]
    assert tok.decode(plain["input_ids"]) == "What is 1 + 2?\n3<eos>Add 4 to that.\n7<eos>"
    assert runs(plain, tok) == ["3<eos>", "7<eos>"]


def test_trl_conversational_prompt_completion_trains_the_completion_only():
    row = {"prompt": CHAT[:3], "completion": CHAT[3:]}
    assert _labelled([row]) == [["7" + END]]  # the prompt's assistant turn is context
    row = {"prompt": CHAT[:2], "completion": CHAT[2:]}  # the completion opens with a user turn
    assert _labelled([row], DataConfig(system_prompt="Be brief.")) == [["7" + END]]  # the system turn shifts none
    with pytest.raises(HfScaleConfigError, match="row 0: the prompt and the completion must both be strings or both"):
        _labelled([{"prompt": "What is 1 + 2?", "completion": CHAT[1:2]}])
    with pytest.raises(HfScaleConfigError, match="row 0 .*: the completion has no assistant turn"):
        _labelled([{"prompt": CHAT[:2], "completion": [{"role": "user", "content": "hm"}]}])


def test_string_pairs_are_one_user_and_one_assistant_turn():
    assert _labelled([{"prompt": "What is 1 + 2?", "completion": "3"}]) == [["3" + END]]
    assert _labelled([{"q": "What is 1 + 2?", "a": 3}], DataConfig(prompt_column="q", response_column="a")) == [["3" + END]]


def test_a_bad_row_is_named():
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}]
    with pytest.raises(HfScaleConfigError, match="row 1 of column 'messages': message 1 has role 'robot'"):
        _labelled(rows)


def test_tool_calls_through_datasets(smol):
    """Arrow gives every message every field (None where absent): the calls still render and train."""
    call = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    chat = [{"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    got = _labelled([{"messages": chat}, {"messages": CHAT}], DataConfig(chat_template=TOOLS), smol)[0]
    assert got == ['<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>' + END, "3" + END]


# ------------------------------------------------------------------ builtin:multiturn


_FOLLOW = [(r"add (\d+)", lambda x, k: x + k), (r"subtract (\d+)", lambda x, k: x - k),
           (r"double", lambda x, k: 2 * x), (r"multiply .* by (\d+)", lambda x, k: x * k)]


def test_multiturn_task_is_fixed_held_out_and_each_answer_follows_from_the_last():
    a, b = load_splits(DataConfig(path="builtin:multiturn")), load_splits(DataConfig(path="builtin:multiturn"))
    assert a["train"][:20] == b["train"][:20]
    assert not {repr(m) for m in a["train"]["messages"]} & {repr(m) for m in a["eval"]["messages"]}
    turns, chars = set(), []
    for messages in a["train"].select(range(400))["messages"]:
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        turns.add(len(messages) // 2)
        chars.append(sum(len(m["content"]) for m in messages))
        x, op, y = re.search(r"What is (\d+) ([+-]) (\d+)\?", messages[0]["content"]).groups()
        value = int(x) + int(y) if op == "+" else int(x) - int(y)
        assert messages[1]["content"] == str(value)
        for question, answer in zip(messages[2::2], messages[3::2]):
            found = [(m, step) for pattern, step in _FOLLOW if (m := re.search(pattern, question["content"].lower()))]
            assert len(found) == 1, question
            m, step = found[0]
            value = step(value, int(m.group(1)) if m.groups() else 0)
            assert answer["content"] == str(value) and value >= 0
    assert turns == {1, 2, 3, 4} and max(chars) > 10 * min(chars)


# ------------------------------------------------------------------ exact match on the last answer


def test_exact_match_scores_the_last_labelled_span():
    from hf_scale.train.evaluate import _causal_scores

    labels = torch.tensor([[-100, 5, 6, -100, -100, 7, 8]] * 3)
    logits = torch.zeros(3, 7, 10)
    logits[:, torch.arange(6), labels[0, 1:].clamp(min=0)] = 1.0  # position t predicts label t + 1
    logits[1, 0, 9] = 2.0  # row 1 misses the first answer: still a hit on the last
    logits[2, 4, 9] = 2.0  # row 2 misses the last answer
    scores = _causal_scores(logits, labels, torch.ones(3))
    assert scores[2].item() == 2.0 and scores[3].item() == 3.0


def test_sample_prompts_stop_where_the_last_answer_starts():
    from hf_scale.train.finish import held_out_prompts

    tok = tiny_tokenizer()
    rows = tokenize_causal_lm(Dataset.from_list([{"messages": CHAT}]), tok, DataConfig(), 128)
    (prompt,) = held_out_prompts(rows, tok, 1)
    assert tok.decode(prompt["ids"][0]).endswith("Add 4 to that.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt["expected"] == "7" and prompt["question"] == "Add 4 to that."
