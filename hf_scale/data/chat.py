"""Conversations to token ids and labels: rendered by the tokenizer's chat template, the loss on
the assistant turns only, each turn's end-of-turn token inside the loss (so the model learns
to stop).

A conversation is a list of messages ``{"role": ..., "content": ...}``; roles are ``system``,
``user``, ``assistant`` and ``tool`` (ShareGPT's ``{"from": "human" | "gpt" | "system",
"value": ...}`` is read too). Content is a string or a list of text parts
(``{"type": "text", "text": ...}``). Assistant turns may carry ``tool_calls`` (the template
renders them; they are trained) and ``reasoning_content`` (or ``<think>...</think>`` inside the
content); ``tool`` turns are never trained.

Where the assistant turns are, in characters of the rendered text, comes from one of two places:

- the template's ``{% generation %}`` markers (``apply_chat_template(...,
  return_assistant_tokens_mask=True)``), each marked turn extended by the special token that
  follows it when the template left the end-of-turn token outside the markers. A marker mask
  that is all zeros, all ones, or has not one run per assistant turn is not trusted: the turns
  are then found as below (said once in the log).
- otherwise by rendering prefixes: the text of ``messages[:i]`` with the generation prompt is
  where assistant turn ``i`` starts, the text of ``messages[:i + 1]`` (trailing whitespace
  stripped) where it ends. Each must be a prefix of the whole conversation's text; a template
  that rewrites earlier turns once later ones follow (Qwen3's drops the reasoning of earlier
  assistant turns) is refused for the turns it rewrites, naming what to do.

The whole text is then tokenized once; a token is labelled when its characters overlap a
trained span (``return_offsets_mapping``: a fast tokenizer). Inside a trained span, a
``<think>...</think>`` block (and the whitespace after it) is left out when it is empty
(always) or when ``train_on_reasoning`` is false. Tokens after the last trained one carry no
loss and are dropped, then the row is cut to ``max_len``.

A tokenizer without a chat template (or ``chat_template=False``) uses :data:`PLAIN_TEMPLATE`:
each non-assistant turn's content on its own line, each assistant turn's content followed by
the EOS token (a prompt/response pair renders as ``"prompt\\nresponse<eos>"``), tokenized with
the tokenizer's own special tokens (BOS) as plain text is.

Usage::

    row = tokenize_conversation(
        [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"},
         {"role": "user", "content": "Add 7 to that."}, {"role": "assistant", "content": "49"}],
        tokenizer, train_on="all_assistant", max_len=512)
    row["labels"]   # -100 everywhere but the tokens of "42<|im_end|>" and "49<|im_end|>"
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from ..errors import HfScaleConfigError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
TRAIN_ON = ("all_assistant", "last_assistant")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IGNORE = -100

PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
)

_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r"(.*?)" + re.escape(THINK_CLOSE) + r"\s*", re.DOTALL)


def tokenize_conversation(messages, tokenizer, *, train_on: str = "all_assistant",
                          train_on_reasoning: bool = True, loss_on_prompt: bool = False,
                          system_prompt: str | None = None, chat_template: str | None = None,
                          tools: list | None = None, max_len: int | None = None, prompt_turns: int = 0,
                          where: str = "conversation") -> dict[str, list[int]]:
    """``{"input_ids": [...], "labels": [...]}`` of one conversation, labels ``-100`` outside
    the trained assistant turns.

    Args:
        messages: the conversation (see the module docstring).
        tokenizer: a fast tokenizer.
        train_on: ``all_assistant`` (every assistant turn) or ``last_assistant`` (the last one).
        train_on_reasoning: train on non-empty ``<think>...</think>`` blocks (an empty one never is).
        loss_on_prompt: labels on every token (the conversation is still checked and rendered).
        system_prompt: a system message put first when the conversation has none.
        chat_template: the Jinja template to render with (default: the tokenizer's, else
            :data:`PLAIN_TEMPLATE`); :func:`resolve_chat_template` reads a recipe's setting.
        tools: tool definitions passed to the template (JSON schemas).
        max_len: cut the row to this many tokens.
        prompt_turns: the first ``prompt_turns`` messages are the prompt: their assistant turns
            are never trained (TRL's conversational prompt / completion).
        where: how errors name this conversation (``"row 7 of column 'messages'"``).
    """
    if train_on not in TRAIN_ON:
        raise HfScaleConfigError(f"train_on={train_on!r} is not one of {', '.join(TRAIN_ON)}.")
    template = chat_template or getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE
    if isinstance(messages, str):
        messages = _parse_json(messages, where)
    conversation = normalize_messages(messages, system_prompt=system_prompt, template=template, where=where)
    first_trained = prompt_turns + len(conversation) - len(messages)  # a system prompt may have been put first
    assistant = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    candidates = [i for i in assistant if i >= first_trained]
    if not candidates:
        raise HfScaleConfigError(f"{where}: the completion has no assistant turn, so there is nothing to train on; "
                                 "end it with an assistant message or drop the row.")
    trained = candidates if train_on == "all_assistant" else candidates[-1:]
    render = functools.partial(_render, tokenizer, template, tools, where)
    text = render(conversation).rstrip()
    plain = template == PLAIN_TEMPLATE  # plain text: the tokenizer's own BOS, as for text data
    ids, offsets = _encode(tokenizer, text, add_special_tokens=plain)
    if loss_on_prompt:
        return {"input_ids": ids[:max_len], "labels": list(ids[:max_len])}
    spans = None
    if _has_generation_markers(template):
        spans = _marker_spans(tokenizer, template, tools, conversation, assistant, where)
    if spans is None:
        spans = _prefix_spans(render, conversation, text, trained, where)
    ranges = [r for i in trained for r in _trained_ranges(text, *spans[i], train_on_reasoning)]
    labels = _overlap_labels(ids, offsets, ranges)
    end = max((k + 1 for k, t in enumerate(labels) if t != IGNORE), default=0)
    return {"input_ids": ids[:end][:max_len], "labels": labels[:end][:max_len]}


def normalize_messages(messages, *, system_prompt: str | None = None, template: str | None = None,
                       where: str = "conversation") -> list[dict]:
    """The conversation checked and in the plain form templates read: ``role`` / ``content``
    strings (text parts joined), ``None`` fields dropped (``datasets`` fills absent fields
    with ``None``), ``system_prompt`` first when there is no system message, and
    ``reasoning_content`` folded into the content as ``<think>...</think>`` when ``template``
    does not render that field. Raises :class:`HfScaleConfigError` naming ``where``."""
    if isinstance(messages, str):
        messages = _parse_json(messages, where)
    if not isinstance(messages, (list, tuple)) or not messages:
        what = "empty" if isinstance(messages, (list, tuple)) or messages is None else "not a list of messages"
        raise HfScaleConfigError(f"{where}: the conversation is {what} ({messages!r}); give a list of messages "
                                 "like [{'role': 'user', 'content': ...}, {'role': 'assistant', 'content': ...}] "
                                 "or drop the row.")
    out = [_message(m, j, template, where) for j, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in out):
        raise HfScaleConfigError(f"{where}: the conversation has no assistant turn, so there is nothing to train "
                                 f"on (roles: {', '.join(m['role'] for m in out)}); add the answer or drop the row.")
    if system_prompt is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def resolve_chat_template(tokenizer, chat_template: bool | str = True) -> str:
    """The Jinja template conversations render with: ``True`` the tokenizer's own (else
    :data:`PLAIN_TEMPLATE`), ``False`` :data:`PLAIN_TEMPLATE`, a string a template (it holds
    ``{{`` or ``{%``) or the path of a file holding one."""
    if chat_template is True:
        return getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE
    if chat_template is False or chat_template is None:
        return PLAIN_TEMPLATE
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise HfScaleConfigError(f"chat_template={chat_template!r} is neither a Jinja template (no '{{{{' or "
                                 "'{%') nor a file: give the template, the path of a .jinja file, true (the "
                                 "tokenizer's) or false (the plain format).")
    return path.read_text(encoding="utf-8")


# ------------------------------------------------------------------ messages


def _message(m, j: int, template: str | None, where: str) -> dict:
    if not isinstance(m, dict):
        raise HfScaleConfigError(f"{where}: message {j} is {m!r}, not a mapping with 'role' and 'content'.")
    m = {k: v for k, v in m.items() if v is not None}
    if "role" not in m and "from" in m:  # ShareGPT
        m = {**{k: v for k, v in m.items() if k not in ("from", "value")},
             "role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        m = {k: v for k, v in m.items() if v is not None}
    role = m.get("role")
    if role not in ROLES:
        raise HfScaleConfigError(f"{where}: message {j} has role {role!r}; the roles are {', '.join(ROLES)} "
                                 "(ShareGPT's human / gpt too). Rename the role or drop the message.")
    calls = m.get("tool_calls")
    if calls and role != "assistant":
        raise HfScaleConfigError(f"{where}: message {j} ({role}) has tool_calls; only assistant turns call tools.")
    if calls and template is not None and "tool_calls" not in template:
        raise HfScaleConfigError(f"{where}: message {j} calls tools, but the chat template never renders "
                                 "tool_calls, so the calls would vanish from the text: use a template that "
                                 "renders them (data.chat_template: path/to/template.jinja) or drop the row.")
    content = m.get("content", "" if calls else None)
    m["content"] = _text(content, j, role, where)
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise HfScaleConfigError(f"{where}: message {j}'s reasoning_content is {type(reasoning).__name__}, not a string.")
    if reasoning is not None and template is not None and "reasoning_content" not in template:
        del m["reasoning_content"]
        if reasoning.strip():
            m["content"] = f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{m['content']}"
    return m


def _text(content, j: int, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HfScaleConfigError(f"{where}: message {j} ({role}) has a content part of type {kind!r}; "
                                         "only text parts ({'type': 'text', 'text': ...}) can be trained on.")
        return "".join(parts)
    raise HfScaleConfigError(f"{where}: message {j} ({role}) has content {content!r} ({type(content).__name__}); "
                             "give a string or a list of text parts.")


def _parse_json(value: str, where: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise HfScaleConfigError(f"{where}: the conversation is the string {value[:60]!r}, not a list of "
                                 "messages (nor JSON of one).") from None


# ------------------------------------------------------------------ rendering and spans


def _render(tokenizer, template: str, tools, where: str, conversation: list[dict], *,
            add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError, TypeError, ...; say which row
        raise HfScaleConfigError(f"{where}: the chat template failed on this conversation: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from None


def _encode(tokenizer, text: str, *, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError:
        raise HfScaleConfigError(f"{type(tokenizer).__name__} gives no character offsets: conversations need a "
                                 "fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True)).") from None
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


@functools.lru_cache(maxsize=8)
def _has_generation_markers(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _marker_spans(tokenizer, template: str, tools, conversation: list[dict], assistant: list[int],
                  where: str) -> dict[int, tuple[int, int]] | None:
    """Char spans of the assistant turns from the ``{% generation %}`` markers, each extended by
    the special token right after it when it does not end in one; None when the mask is not one
    run per assistant turn (all zeros, all ones, ...)."""
    try:
        out = tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True,
                                            tokenizer_kwargs={"return_offsets_mapping": True})
    except Exception as e:  # noqa: BLE001
        raise HfScaleConfigError(f"{where}: the chat template failed on this conversation: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from None
    ids, mask, offsets = out["input_ids"], out["assistant_masks"], out["offset_mapping"]
    runs, k = [], 0
    while k < len(mask):
        if mask[k]:
            start = k
            while k < len(mask) and mask[k]:
                k += 1
            runs.append([start, k])
        k += 1
    if not runs or len(runs) != len(assistant) or sum(mask) == len(mask):
        from ..log import log_rank0  # here: hf_scale.log loads torch.distributed

        what = "no token" if not runs else "every token" if sum(mask) == len(mask) else f"{len(runs)} spans"
        log_rank0(f"the chat template's {{% generation %}} markers mark {what} for a conversation with "
                  f"{len(assistant)} assistant turns: the assistant turns are found by rendering prefixes instead",
                  once=True)
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for run in runs:
        if ids[run[1] - 1] not in special and run[1] < len(ids) and ids[run[1]] in special:
            run[1] += 1  # the end-of-turn token the template left outside its markers
    return {i: (offsets[a][0], offsets[b - 1][1]) for i, (a, b) in zip(assistant, runs)}


def _prefix_spans(render, conversation: list[dict], text: str, trained: list[int],
                  where: str) -> dict[int, tuple[int, int]]:
    """Char spans of the ``trained`` assistant turns, from renderings of the prefixes."""
    spans = {}
    for i in trained:
        if i == 0:
            raise HfScaleConfigError(
                f"{where}: the conversation opens with an assistant turn and the chat template has no "
                "{% generation %} markers, so where that turn starts cannot be found: begin with a user or "
                "system turn (data.system_prompt puts one first).")
        head = render(conversation[:i], add_generation_prompt=True)
        upto = render(conversation[: i + 1]).rstrip()
        if not (upto.startswith(head) and text.startswith(upto)):
            n = sum(m["role"] == "assistant" for m in conversation[: i + 1])
            raise HfScaleConfigError(
                f"{where}: the chat template renders the conversation up to assistant turn {n} differently from "
                "the start of the whole conversation: it rewrites earlier turns once later ones follow (as "
                "Qwen3-style templates drop the reasoning of earlier assistant turns), so that turn's tokens "
                "cannot be found. Train on the last assistant turn only (data.train_on: last_assistant), or "
                "use a chat template with {% generation %} markers (data.chat_template: path/to/template.jinja).")
        spans[i] = (len(head), len(upto))
    return spans


def _trained_ranges(text: str, start: int, end: int, train_on_reasoning: bool) -> list[tuple[int, int]]:
    """``[start, end)`` less its ``<think>`` blocks that are empty or, without
    ``train_on_reasoning``, all of them (each with the whitespace after it)."""
    ranges, at = [], start
    for block in _THINK_BLOCK.finditer(text, start, end):
        if train_on_reasoning and block.group(1).strip():
            continue
        if block.start() > at:
            ranges.append((at, block.start()))
        at = block.end()
    if end > at:
        ranges.append((at, end))
    return ranges


def _overlap_labels(ids: list[int], offsets: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[int]:
    """``ids`` where a token's characters overlap one of ``ranges`` (sorted), else -100."""
    labels, r = [], 0
    for token, (a, b) in zip(ids, offsets):
        while r < len(ranges) and ranges[r][1] <= a:
            r += 1
        inside = r < len(ranges) and b > a and a < ranges[r][1] and b > ranges[r][0]
        labels.append(token if inside else IGNORE)
    return labels
