"""Examples in, token ids out: load a dataset with ``datasets`` and tokenise it for the task.

Sources (``data.path``): a generated task (``builtin:arithmetic``), local files (json, jsonl,
csv, parquet, txt: a file, a folder or a glob) or a Hub dataset name. Tokenisation runs with
``Dataset.map`` (cached on disk for file datasets, ``num_proc`` workers), on rank 0 first so
the other ranks read its cache.

Causal LM examples are conversations (a ``messages`` column), prompt/response pairs, or plain
text (``data.format``; ``auto`` reads it from the columns). Conversations and pairs go through
one renderer, :func:`hf_scale.data.chat.tokenize_conversation`: the chat template (a plain
format when the tokenizer has none), the loss on the assistant turns and their end-of-turn
tokens only. Plain text has the loss on every token. Any of them can be packed
(``data.packing``, :mod:`hf_scale.data.packing`): whole examples in rows best-fit-decreasing,
documents kept apart by ``position_ids``; plain text may also be ``wrapped`` into full rows.
Classification examples are text (or text pairs) with a label.

Usage::

    splits = load_splits(job.data)                     # {"train": Dataset, "eval": Dataset|None}
    train = tokenize_causal_lm(splits["train"], tokenizer, job.data, max_len)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..data.chat import normalize_messages, resolve_chat_template, tokenize_conversation
from ..errors import HfScaleConfigError
from ..log import log_rank0
from ..ranks import rank0_first  # tokenise on rank 0 first; the others read its cache
from .config import DataConfig
from .data_files import is_local, load_data_files
from .tasks import PREFIX, builtin_dataset


def load_splits(cfg: DataConfig) -> dict:
    """``{"train": Dataset, "eval": Dataset or None}`` from the configured source."""
    if cfg.path.startswith(PREFIX):
        splits = builtin_dataset(cfg.path, seed=cfg.seed + 1234)
    elif is_local(cfg.path):
        splits = load_data_files(cfg.path, "data.path")
    else:
        splits = _load_hub(cfg)
    if cfg.train_split not in splits:
        raise HfScaleConfigError(
            f"data.train_split={cfg.train_split!r} is not a split of {cfg.path!r}; it has "
            f"{', '.join(splits)}."
        )
    train = splits[cfg.train_split]
    if cfg.eval_path:
        evaluation = load_data_files(cfg.eval_path, "data.eval_path")["train"]
    elif cfg.eval_split and cfg.eval_split in splits:
        evaluation = splits[cfg.eval_split]
    elif cfg.eval_fraction > 0:
        parts = train.train_test_split(test_size=cfg.eval_fraction, seed=cfg.seed)
        train, evaluation = parts["train"], parts["test"]
    else:
        evaluation = None
        log_rank0(f"no evaluation split ({cfg.eval_split!r} absent): set data.eval_path or data.eval_fraction to evaluate.")
    train = _first(train, cfg.max_train_samples)
    evaluation = _first(evaluation, cfg.max_eval_samples)
    return {"train": train, "eval": evaluation}


def _first(ds, n):
    return ds if ds is None or n is None else ds.select(range(min(n, len(ds))))


def _load_hub(cfg: DataConfig):
    from datasets import load_dataset

    try:
        return load_dataset(cfg.path, cfg.name)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; say which dataset failed
        raise HfScaleConfigError(
            f"could not load the Hub dataset {cfg.path!r} (subset {cfg.name!r}): "
            f"{type(e).__name__}: {str(e)[:300]}. Local files work too: data.path: train.jsonl."
        ) from None


def require_columns(ds, columns: dict[str, str | None]) -> None:
    """Fail naming the config key and the missing column, and list the dataset's columns.

    ``columns`` maps config keys to column names: ``{"data.label_column": "label"}``.
    """
    _require(ds.column_names, columns)


def _require(names, columns: dict[str, str | None]) -> None:
    for key, col in columns.items():
        if col is not None and col not in names:
            raise HfScaleConfigError(
                f"{key}={col!r}: the dataset has no column {col!r}; its columns are "
                f"{', '.join(names)}. Set {key} to one of them."
            )


def check_seq_len(max_seq_len: int, model_config) -> None:
    """``max_seq_len`` must fit the model's positions."""
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit is not None and max_seq_len > limit:
        raise HfScaleConfigError(
            f"data.max_seq_len={max_seq_len} is above the model's limit of {limit} positions "
            f"(config.max_position_embeddings): set data.max_seq_len <= {limit}."
        )


def check_vocab(tokenizer, model_config, *datasets) -> None:
    """Every token id of the tokenized ``datasets`` must have a row in the model's embedding: a
    tokenizer larger than the model's vocabulary failed inside the embedding (an ``IndexError``
    on the first batch holding such a token). The data are scanned only then (rare)."""
    vocab = getattr(model_config, "vocab_size", None)
    if not vocab or len(tokenizer) <= vocab:
        return
    largest = max((max(ids, default=-1) for ds in datasets if ds is not None for ids in ds["input_ids"]), default=-1)
    if largest >= vocab:
        raise HfScaleConfigError(
            f"the tokenizer has {len(tokenizer)} tokens and the data hold token id {largest}, but the "
            f"model's vocabulary has {vocab} (config.vocab_size): the model cannot embed them. Use the "
            "model's own tokenizer, or resize the model's embeddings to the tokenizer "
            "(model.resize_token_embeddings(len(tokenizer))) and save it before fine-tuning."
        )


# ------------------------------------------------------------------ causal LM


@dataclass(frozen=True)
class CausalLMFormat:
    """How causal LM rows are read: ``kind`` (``messages``, ``prompt_completion`` or ``text``)
    and its columns, keyed by the config key that names each (``{"data.messages_column": ...}``)."""

    kind: str
    columns: dict


def causal_lm_format(column_names, cfg: DataConfig) -> CausalLMFormat:
    """``cfg.format``, with ``auto`` resolved from the keys set and the columns (the order is
    :class:`DataConfig`'s docstring's)."""
    cols, kind = set(column_names), cfg.format
    if kind == "auto":
        if cfg.text_column:
            kind = "text"
        elif cfg.prompt_column or cfg.response_column:
            kind = "prompt_completion"
        elif cfg.messages_column or cols & {"messages", "conversations"}:
            kind = "messages"
        elif "prompt" in cols and cols & {"response", "completion"}:
            kind = "prompt_completion"
        elif "text" in cols:
            kind = "text"
        else:
            raise HfScaleConfigError(
                f"data.format=auto cannot tell the data format from the columns ({', '.join(column_names)}): "
                "give a messages (or conversations) column, prompt and response (or completion) columns, or a "
                "text column; or name yours with data.messages_column, data.prompt_column + "
                "data.response_column or data.text_column."
            )
    if kind == "messages":
        column = cfg.messages_column or ("conversations" if "conversations" in cols and "messages" not in cols
                                         else "messages")
        return CausalLMFormat(kind, {"data.messages_column": column})
    if kind == "prompt_completion":
        response = cfg.response_column or ("completion" if "completion" in cols and "response" not in cols
                                           else "response")
        return CausalLMFormat(kind, {"data.prompt_column": cfg.prompt_column or "prompt",
                                     "data.response_column": response})
    return CausalLMFormat("text", {"data.text_column": cfg.text_column or "text"})


def tokenize_causal_lm(ds, tokenizer, cfg: DataConfig, max_len: int, *, pack: str | None = None):
    """``input_ids`` / ``labels`` rows; for conversations and pairs the labels are -100 outside
    the trained assistant turns (:mod:`hf_scale.data.chat`) unless ``loss_on_prompt``.

    ``pack``: ``bfd`` / ``bfd_split`` (rows of whole examples with ``position_ids``), ``wrapped``
    (plain text concatenated into full rows) or None (one example per row)."""
    from ..data.packing import pack_examples, wrap_examples

    fn, kwargs = causal_encoder(ds.column_names, tokenizer, cfg, max_len, pack)
    with rank0_first():
        out = ds.map(fn, fn_kwargs=kwargs, with_indices=True, remove_columns=ds.column_names,
                     num_proc=cfg.num_proc, desc="tokenizing")
        out = out.filter(has_labels, num_proc=cfg.num_proc)
        _require_rows(out, len(ds))
        if pack == "wrapped":
            out = out.map(wrap_examples, fn_kwargs=dict(max_len=max_len), batched=True, num_proc=cfg.num_proc,
                          desc="packing (wrapped)")
        elif pack is not None:
            out = out.map(pack_examples, fn_kwargs=dict(max_len=max_len, split=pack == "bfd_split"), batched=True,
                          batch_size=cfg.pack_group, remove_columns=out.column_names, num_proc=cfg.num_proc,
                          desc=f"packing ({pack})")
    return out


def has_labels(example) -> bool:
    """An example that trains something: a label after the first token (which predicts nothing)."""
    return any(x != -100 for x in example["labels"][1:])


def causal_encoder(columns, tokenizer, cfg: DataConfig, max_len: int, pack: str | None = None):
    """``(fn, kwargs)``: ``fn(example, index, **kwargs)`` tokenises one example of a dataset with
    these ``columns`` in the configured format (:func:`causal_lm_format`), truncated to ``max_len``
    (not under ``bfd_split``, which cuts long examples into documents instead). Refuses missing
    columns, and ``wrapped`` packing of anything but plain text."""
    limit = None if pack == "bfd_split" else max_len
    fmt = causal_lm_format(columns, cfg)
    _require(columns, fmt.columns)
    if fmt.kind == "text":
        return _text_example, dict(tokenizer=tokenizer, column=fmt.columns["data.text_column"], max_len=limit)
    if pack == "wrapped":
        raise HfScaleConfigError(
            "data.packing: wrapped concatenates examples into rows that cut them apart and let each "
            "attend to the ones before it: for plain pre-training text only (data.text_column). For "
            "conversations and prompt / response data use data.packing: bfd (whole examples, kept apart)."
        )
    if cfg.chat_template is True and not getattr(tokenizer, "chat_template", None):
        log_rank0("the tokenizer has no chat template: conversations are rendered in the plain format (turns "
                  "on their own lines, each answer followed by EOS); data.chat_template can name a template",
                  once=True)
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    return _chat_example, dict(tokenizer=tokenizer, cfg=cfg, fmt=fmt, template=template, max_len=limit,
                               tools="tools" in columns)


def stream_encoder(tokenizer, cfg: DataConfig, max_len: int, pack: str | None = None):
    """``encode(example) -> tokens or None`` for a stream: the columns are checked on the first
    example, examples left with no label are dropped (None)."""
    chosen: list = []
    seen = [0]

    def encode(example):
        if not chosen:
            chosen.append(causal_encoder(list(example), tokenizer, cfg, max_len, pack))
        fn, kwargs = chosen[0]
        out = fn(example, seen[0], **kwargs)
        seen[0] += 1
        return out if has_labels(out) else None

    return encode


def _require_rows(out, before: int) -> None:
    dropped = before - len(out)
    if dropped and len(out):
        log_rank0(f"dropped {dropped} of {before} examples left with no label tokens after truncation "
                  "(e.g. empty lines, or prompts longer than data.max_seq_len)")
    if len(out) == 0:
        raise HfScaleConfigError(
            f"the dataset is empty after filtering ({before} examples in, 0 left): every example "
            "lost its labels, e.g. prompts longer than data.max_seq_len truncate away the "
            "response. Raise data.max_seq_len or check the columns."
        )


def _text_example(example, index, tokenizer, column, max_len):
    ids = tokenizer(example[column], add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    ids = ids[:max_len]
    return {"input_ids": ids, "labels": list(ids)}


def _chat_example(example, index, tokenizer, cfg: DataConfig, fmt: CausalLMFormat, template: str, max_len: int,
                  tools: bool):
    """A conversation, or a prompt/response pair as one user and one assistant turn."""
    if fmt.kind == "messages":
        column = fmt.columns["data.messages_column"]
        messages, prompt_turns, where = example[column], 0, f"row {index} of column {column!r}"
    else:
        messages, prompt_turns = _pair_messages(example, fmt, index)
        where = f"row {index} (columns {', '.join(repr(c) for c in fmt.columns.values())})"
    definitions = example["tools"] if tools else None
    if isinstance(definitions, str):
        definitions = json.loads(definitions)
    return tokenize_conversation(messages, tokenizer, train_on=cfg.train_on, train_on_reasoning=cfg.train_on_reasoning,
                                 loss_on_prompt=cfg.loss_on_prompt, system_prompt=cfg.system_prompt,
                                 chat_template=template, tools=definitions or None, max_len=max_len,
                                 prompt_turns=prompt_turns, where=where)


def _pair_messages(example, fmt: CausalLMFormat, index: int) -> tuple[list, int]:
    """(messages, prompt turns): strings become one user and one assistant turn; lists of
    messages (TRL's conversational prompt / completion) are joined, the prompt's turns untrained."""
    prompt = example[fmt.columns["data.prompt_column"]]
    response = example[fmt.columns["data.response_column"]]
    if isinstance(prompt, list) and isinstance(response, list):
        return list(prompt) + list(response), len(prompt)
    if isinstance(prompt, list) or isinstance(response, list):
        raise HfScaleConfigError(
            f"row {index}: the prompt and the completion must both be strings or both be lists of messages "
            f"(TRL's conversational form); got {type(prompt).__name__} and {type(response).__name__}."
        )
    return [{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": str(response)}], 0


def render_pair(tokenizer, cfg: DataConfig, prompt: str, response: str) -> tuple[str, str]:
    """(prompt text up to where the answer starts, prompt + answer + end-of-turn), as
    :func:`tokenize_causal_lm` renders a pair: with the chat template the end-of-turn is the
    template's (``<|im_end|>``; trailing whitespace after it is not trained), in the plain
    format the EOS token."""
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    messages = normalize_messages([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                  system_prompt=cfg.system_prompt, template=template)
    prompt_text = tokenizer.apply_chat_template(messages[:-1], chat_template=template, tokenize=False,
                                                add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False).rstrip()
    return prompt_text, full_text


# ------------------------------------------------------------------ classification


def label_ids(ds, cfg: DataConfig) -> dict:
    """``label -> id``: identity for integer labels, sorted names for string labels."""
    require_columns(ds, {"data.label_column": cfg.label_column})
    values = sorted(set(ds[cfg.label_column]))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return {v: v for v in range(max(values) + 1)}
    return {v: i for i, v in enumerate(values)}


def tokenize_classification(ds, tokenizer, cfg: DataConfig, max_len: int, labels: dict):
    """``input_ids`` + integer ``labels`` rows for sequence classification."""
    text = cfg.text_column or "text"
    require_columns(ds, {"data.text_column": text, "data.text_pair_column": cfg.text_pair_column,
                         "data.label_column": cfg.label_column})

    def encode(example):
        pair = example[cfg.text_pair_column] if cfg.text_pair_column else None
        ids = tokenizer(example[text], pair, truncation=True, max_length=max_len)["input_ids"]
        label = example[cfg.label_column]
        if label not in labels:
            raise HfScaleConfigError(f"label {label!r} was not seen in the training split (labels: {list(labels)}).")
        return {"input_ids": ids, "labels": labels[label]}

    with rank0_first():
        out = ds.map(encode, remove_columns=ds.column_names, num_proc=cfg.num_proc, desc="tokenizing")
    _require_rows(out, len(ds))
    return out
