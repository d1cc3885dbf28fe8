"""Preference pairs to token ids: a prompt with a chosen and a rejected completion, each rendered
with the chat template exactly as SFT renders a prompt / response pair or a conversation
(:func:`hf_scale.data.chat.tokenize_conversation`), the loss on the completion only.

A row holds ``prompt``, ``chosen`` and ``rejected`` (the columns ``data.prompt_column``,
``data.chosen_column``, ``data.rejected_column``), in one of TRL's forms:

- plain: three strings. The prompt is one user turn, each completion one assistant turn
  (``data.system_prompt`` is put first, as in SFT).
- conversational: ``prompt`` a list of messages (``{"role", "content"}``), ``chosen`` and
  ``rejected`` each a list holding the assistant message(s) that follow it.
- implicit prompt: no prompt column, ``chosen`` and ``rejected`` whole conversations that share
  their opening messages (TRL's ``extract_prompt``): the shared messages are the prompt.

Labels are the ids (HF's unshifted convention: ``labels[t]`` is token ``t``) on the
completion's assistant turns and their end-of-turn tokens (``<|im_end|>``, so the model learns
to stop, as in SFT), ``-100`` on the prompt, the generation prompt (``<|im_start|>assistant\\n``)
and anything after the last end-of-turn token.

Truncation to ``max_len`` (one rule, for both sequences of a pair): the prompt keeps its end,
the completions their start. The prompt (the tokens before the first label) is cut from the
left just enough for the pair's longer completion to fit, but never below ``max_len // 2``
tokens (or its whole length if shorter); each completion is then cut from the right to the room
left. A completion therefore always keeps at least ``max_len - max_len // 2`` tokens, its first
one labelled: no pair is truncated to nothing (TRL's ``keep_start`` instead drops pairs whose
prompt fills ``max_length``), so no step sees a pair without labels (no NaN loss). The count of
truncated pairs is logged once.

Bad rows are refused before training, one error naming the row and the fix: a missing or empty
prompt / chosen / rejected, chosen identical to rejected, a completion without an assistant
turn, an unknown role.

Usage::

    rows = tokenize_preference(ds, tokenizer, job.data, max_len=512)
    batch = PairCollator(tokenizer.pad_token_id)([rows[0], rows[1]])
    batch["input_ids"].shape   # [4, S]: pair 0 chosen, pair 0 rejected, pair 1 chosen, ...
"""

from __future__ import annotations

from ..errors import HfScaleConfigError
from .chat import IGNORE, resolve_chat_template, tokenize_conversation

COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def preference_columns(column_names, cfg) -> dict[str, str | None]:
    """``{config key: column}`` of the prompt, chosen and rejected columns; the prompt's is None
    for the implicit-prompt form (no prompt column, and ``data.prompt_column`` not set). Refuses
    a missing column, naming the key to set."""
    names = list(column_names)
    prompt = cfg.prompt_column or "prompt"
    columns = {"data.prompt_column": prompt if (cfg.prompt_column or prompt in names) else None,
               "data.chosen_column": cfg.chosen_column, "data.rejected_column": cfg.rejected_column}
    for key, col in columns.items():
        if col is not None and col not in names:
            raise HfScaleConfigError(
                f"{key}={col!r}: the preference data have no column {col!r}; their columns are "
                f"{', '.join(names)}. Preference rows need prompt, chosen and rejected columns (set {key} "
                "to yours), or chosen and rejected conversations that share their opening messages.")
    return columns


def check_completion_only(cfg, max_len: int, kind: str) -> None:
    """Refuse what the preference losses (pairs and kto, ``kind``) cannot train on: sequences
    under 2 tokens and ``data.loss_on_prompt`` (they score the completions only)."""
    if max_len < 2:
        raise HfScaleConfigError(f"max_len={max_len}: a {kind} sequence needs >= 2 tokens (data.max_seq_len).")
    if cfg.loss_on_prompt:
        raise HfScaleConfigError(f"data.loss_on_prompt: {kind} training scores the completions, so the loss is on "
                                 "the completions only; set data.loss_on_prompt: false.")


def tokenize_preference(ds, tokenizer, cfg, max_len: int):
    """``datasets.Dataset`` of ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
    ``rejected_labels`` (lists of ints), one row per pair, in the order of ``ds``; precomputed
    ``ref_chosen_logps`` / ``ref_rejected_logps`` columns are kept. See the module docstring for
    the forms, the labels and the truncation rule.

    Args:
        ds: a ``datasets.Dataset`` of preference rows.
        tokenizer: a fast tokenizer (character offsets find the completion's tokens).
        cfg: the data config, :class:`hf_scale.train.config.DataConfig` or any object with its
            fields that are read here (``prompt_column``, ``chosen_column``, ``rejected_column``,
            ``chat_template``, ``system_prompt``, ``train_on_reasoning``, ``num_proc``).
        max_len: the longest sequence, prompt and completion together (>= 2).
    """
    from ..log import log_rank0  # here: hf_scale.log loads torch.distributed
    from ..ranks import rank0_first

    check_completion_only(cfg, max_len, "preference")
    columns = preference_columns(ds.column_names, cfg)
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    keep = [c for c in REF_COLUMNS if c in ds.column_names]
    kwargs = dict(tokenizer=tokenizer, cfg=cfg, columns=columns, template=template, max_len=max_len)
    with rank0_first():
        out = ds.map(encode_preference, fn_kwargs=kwargs, with_indices=True,
                     remove_columns=[c for c in ds.column_names if c not in keep],
                     num_proc=cfg.num_proc, desc="tokenizing preference pairs")
    if len(out) == 0:
        raise HfScaleConfigError("the preference data are empty: give at least one prompt / chosen / rejected row.")
    truncated = sum(out["truncated"])
    if truncated:
        log_rank0(f"{truncated} of {len(out)} preference pairs are longer than data.max_seq_len={max_len}: their "
                  "prompts keep their end and their completions their start (see hf_scale.data.preference).")
    return out.remove_columns("truncated")


def encode_preference(example, index: int, tokenizer, cfg, columns: dict, template: str,
                      max_len: int) -> dict:
    """One row of :func:`tokenize_preference` (plus ``truncated``: whether it was cut)."""
    prompt, chosen, rejected = pair_messages(example, index, columns)
    seqs = {}
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        where = f"row {index} (the prompt and its {side} completion)"
        seqs[side] = tokenize_conversation(
            prompt + completion, tokenizer, train_on="all_assistant", train_on_reasoning=cfg.train_on_reasoning,
            system_prompt=cfg.system_prompt, chat_template=template, prompt_turns=len(prompt), where=where)
    if seqs["chosen"]["input_ids"] == seqs["rejected"]["input_ids"]:
        raise HfScaleConfigError(f"row {index}: chosen and rejected are identical ({_short(chosen)}), so the pair "
                                 "prefers nothing; drop the row or fix its rejected completion.")
    (c_ids, c_labels), (r_ids, r_labels), cut = truncate_pair(seqs["chosen"], seqs["rejected"], max_len)
    return {"chosen_input_ids": c_ids, "chosen_labels": c_labels, "rejected_input_ids": r_ids,
            "rejected_labels": r_labels, "truncated": cut}


def pair_messages(example, index: int, columns: dict) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) as message lists, from any of the three forms; refuses a
    missing or empty value and mixed forms, naming the row."""
    values = {}
    for key, col in columns.items():
        if col is None:
            continue
        value = example[col]
        side = key.split(".")[1].removesuffix("_column")
        if value is None:
            raise HfScaleConfigError(f"row {index} has no {side} (column {col!r} is empty): every preference row "
                                     "needs a prompt, a chosen and a rejected completion; drop the row or fill it in.")
        if (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, tuple)) and not value):
            raise HfScaleConfigError(f"row {index}: the {side} (column {col!r}) is empty; a preference pair needs a "
                                     "non-empty prompt and two non-empty completions. Drop the row or fill it in.")
        values[side] = value
    chosen, rejected = values["chosen"], values["rejected"]
    if columns["data.prompt_column"] is None:
        return _implicit_prompt(chosen, rejected, index)
    prompt = values["prompt"]
    kinds = {side: isinstance(v, (list, tuple)) for side, v in values.items()}
    if len(set(kinds.values())) > 1:
        raise HfScaleConfigError(
            f"row {index}: prompt, chosen and rejected must all be strings or all be lists of messages (TRL's "
            f"conversational form); got {', '.join(f'{s} {type(v).__name__}' for s, v in values.items())}.")
    if not kinds["prompt"]:
        user = [{"role": "user", "content": prompt}]
        return user, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        _require_answer(completion, side, index)
    return list(prompt), list(chosen), list(rejected)


def _implicit_prompt(chosen, rejected, index: int) -> tuple[list, list, list]:
    """TRL's implicit prompt: the messages ``chosen`` and ``rejected`` open with in common."""
    if not (isinstance(chosen, (list, tuple)) and isinstance(rejected, (list, tuple))):
        raise HfScaleConfigError(
            f"row {index}: without a prompt column, chosen and rejected must be conversations (lists of messages) "
            "that share their opening messages; for plain strings give a prompt column (data.prompt_column).")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise HfScaleConfigError(
            f"row {index}: chosen and rejected share no opening message, so there is no prompt; give a prompt "
            "column, or conversations that begin with the same user turn.")
    prompt, chosen, rejected = list(chosen[:shared]), list(chosen[shared:]), list(rejected[shared:])
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion:
            raise HfScaleConfigError(f"row {index}: the {side} conversation ends where the shared prompt ends, so "
                                     "its completion is empty (or chosen and rejected are identical); drop the row.")
        _require_answer(completion, side, index)
    return prompt, chosen, rejected


def _require_answer(completion, side: str, index: int) -> None:
    """A conversational completion opens with an assistant message that says something."""
    first = completion[0]
    content = first.get("content") if isinstance(first, dict) else None
    if isinstance(first, dict) and first.get("role") == "assistant" and not first.get("tool_calls") and (
            content is None or (isinstance(content, str) and not content.strip()) or content == []):
        raise HfScaleConfigError(f"row {index}: the {side} completion's assistant message is empty; a preference "
                                 "pair needs two non-empty completions. Drop the row or fill it in.")


def _short(messages) -> str:
    text = repr(messages)
    return text if len(text) <= 80 else text[:77] + "..."


def truncate_pair(chosen: dict, rejected: dict, max_len: int):
    """``((chosen ids, labels), (rejected ids, labels), cut)`` within ``max_len`` tokens each, by
    the module's rule: each prompt (the tokens before its first label) keeps its end, cut from
    the left just enough for the pair's longer completion to fit but never below
    ``max_len // 2`` tokens; each completion keeps its start, cut to the room left."""
    prompt = {k: _prompt_len(s["labels"]) for k, s in (("c", chosen), ("r", rejected))}
    longest = max(len(chosen["input_ids"]) - prompt["c"], len(rejected["input_ids"]) - prompt["r"])
    out, cut = [], False
    for key, seq in (("c", chosen), ("r", rejected)):
        ids, labels, p = seq["input_ids"], seq["labels"], prompt[key]
        kept_prompt = min(p, max(max_len - longest, max_len // 2))
        start, end = p - kept_prompt, p + (max_len - kept_prompt)
        cut = cut or start > 0 or end < len(ids)
        out.append((list(ids[start:end]), list(labels[start:end])))
    return out[0], out[1], cut


def _prompt_len(labels) -> int:
    return next(k for k, t in enumerate(labels) if t != IGNORE)


class PairCollator:
    """Preference rows to one batch for a single forward of chosen and rejected together.

    ``collator(rows)`` gives ``input_ids``, ``attention_mask`` and ``labels``, LongTensors of
    shape ``[2B, S]``, padded on the right (``pad_id``, 0, -100) to the batch's longest sequence,
    the rows interleaved: row ``2i`` is pair ``i``'s chosen, row ``2i + 1`` its rejected, so a
    split into micro-batches of an even size keeps pairs together. Rows that carry
    ``ref_chosen_logps`` and ``ref_rejected_logps`` add ``ref_logps`` (FloatTensor ``[2B]``,
    interleaved the same way).

    Usage::

        loader = DataLoader(rows, batch_size=4, collate_fn=PairCollator(tokenizer.pad_token_id))
    """

    def __init__(self, pad_id: int):
        if pad_id is None:
            raise HfScaleConfigError("PairCollator needs a pad token id: set tokenizer.pad_token (e.g. to the EOS "
                                     "token) before batching preference pairs.")
        self.pad_id = int(pad_id)

    def __call__(self, rows) -> dict:
        import torch

        seqs = [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for row in rows for side in ("chosen", "rejected")]
        width = max(len(ids) for ids, _ in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(seqs):
            input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            labels[i, : len(lab)] = torch.as_tensor(lab, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if rows and all(c in row and row[c] is not None for row in rows for c in REF_COLUMNS):
            batch["ref_logps"] = torch.tensor([float(row[c]) for row in rows for c in REF_COLUMNS],
                                              dtype=torch.float32)
        return batch
