"""Unpaired preference examples (KTO) to token ids: a prompt, one completion and a label (True:
desirable, False: undesirable), rendered with the chat template exactly as preference pairs are
(:mod:`hf_scale.data.preference`), the loss on the completion only.

A row holds ``prompt``, ``completion`` and ``label`` (the columns ``data.prompt_column``,
``data.response_column``, ``data.label_column``), in TRL's two forms:

- plain: two strings and a bool. The prompt is one user turn, the completion one assistant turn
  (``data.system_prompt`` is put first, as in SFT).
- conversational: ``prompt`` a list of messages, ``completion`` a list holding the assistant
  message(s) that follow it.

Paired data (``prompt``, ``chosen``, ``rejected``, no completion column) are unpaired first as
TRL's ``unpair_preference_dataset`` does: each pair gives its chosen completion with label True
and its rejected one with label False (:func:`unpair_preference`).

Labels and truncation follow the pairs' rules (one sequence instead of two): the prompt keeps its
end, never below ``max_len // 2`` tokens, the completion its start, so no example loses its
completion. Refused before training, one error naming the row and the fix: a missing or empty
prompt / completion, a missing label or one that is not a bool, mixed forms. A training set with
one kind of label only is refused by :func:`check_labels` (KTO learns from both).

The KL rows (:class:`UnpairedCollator`): KTO's reference point is estimated from mismatched
pairs, each example's prompt with the previous example's completion in the same batch (the
first takes the last's), as TRL's ``KL_completion_ids``; they are built per batch, so they are
in the batch whatever the sampler's order.

Usage::

    rows = tokenize_unpaired(ds, tokenizer, job.data, max_len=512)
    batch = UnpairedCollator(tokenizer.pad_token_id, max_len=512)([rows[0], rows[1]])
    batch["input_ids"].shape   # [4, S]: example 0, its KL row, example 1, its KL row
"""

from __future__ import annotations

from ..errors import HfScaleConfigError
from .chat import IGNORE, resolve_chat_template, tokenize_conversation
from .preference import _prompt_len, _require_answer, check_completion_only, truncate_pair

COLUMNS = ("input_ids", "labels", "label")


def unpair_preference(ds):
    """TRL's ``unpair_preference_dataset``: ``prompt``, ``completion``, ``label`` rows from
    ``prompt``, ``chosen``, ``rejected`` pairs (chosen: True, rejected: False; per block of
    1000 pairs the chosen rows, then the rejected ones), other columns dropped."""

    def unpair(batch):
        n = len(batch["chosen"])
        return {"prompt": batch["prompt"] + batch["prompt"], "completion": batch["chosen"] + batch["rejected"],
                "label": [True] * n + [False] * n}

    return ds.map(unpair, batched=True, remove_columns=ds.column_names, desc="unpairing preference pairs")


def unpaired_columns(ds, cfg) -> tuple[object, dict[str, str]]:
    """(the dataset, unpaired if it held pairs; ``{config key: column}`` of its prompt, completion
    and label). Refuses a missing column, naming the key to set."""
    names = list(ds.column_names)
    prompt = cfg.prompt_column or "prompt"
    completion = cfg.response_column or "completion"
    if completion not in names and cfg.chosen_column in names and cfg.rejected_column in names:
        if prompt not in names:
            raise HfScaleConfigError(
                f"kto unpairs preference pairs into examples, and needs their prompt column {prompt!r} "
                "(data.prompt_column) to do it; these pairs have none (implicit prompts): give a prompt column.")
        ds = ds.rename_columns({c: t for c, t in ((prompt, "prompt"), (cfg.chosen_column, "chosen"),
                                                  (cfg.rejected_column, "rejected")) if c != t})
        ds, names, prompt, completion = unpair_preference(ds), ["prompt", "completion", "label"], "prompt", "completion"
    columns = {"data.prompt_column": prompt, "data.response_column": completion, "data.label_column": cfg.label_column}
    for key, col in columns.items():
        if col not in names:
            raise HfScaleConfigError(
                f"{key}={col!r}: the kto data have no column {col!r}; their columns are {', '.join(names)}. KTO "
                f"rows need a prompt, a completion and a label (True: desirable, False: undesirable): set {key} "
                "to yours, or give prompt / chosen / rejected pairs (unpaired as TRL does).")
    return ds, columns


def tokenize_unpaired(ds, tokenizer, cfg, max_len: int):
    """``datasets.Dataset`` of ``input_ids``, ``labels`` (lists of ints) and ``label`` (bool),
    one row per example, in the order of ``ds`` (unpaired first if it held pairs). See the module
    docstring for the forms, the labels and the truncation rule.

    Args:
        ds: a ``datasets.Dataset`` of unpaired rows (or preference pairs).
        tokenizer: a fast tokenizer.
        cfg: the data config (:class:`hf_scale.train.config.DataConfig`, or an object with its
            ``prompt_column``, ``response_column``, ``label_column``, ``chosen_column``,
            ``rejected_column``, ``chat_template``, ``system_prompt``, ``train_on_reasoning``,
            ``loss_on_prompt``, ``num_proc``).
        max_len: the longest sequence, prompt and completion together (>= 2).
    """
    from ..log import log_rank0  # here: hf_scale.log loads torch.distributed
    from ..ranks import rank0_first

    check_completion_only(cfg, max_len, "kto")
    ds, columns = unpaired_columns(ds, cfg)
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    kwargs = dict(tokenizer=tokenizer, cfg=cfg, columns=columns, template=template, max_len=max_len)
    with rank0_first():
        out = ds.map(encode_unpaired, fn_kwargs=kwargs, with_indices=True, remove_columns=ds.column_names,
                     num_proc=cfg.num_proc, desc="tokenizing kto examples")
    if len(out) == 0:
        raise HfScaleConfigError("the kto data are empty: give at least one prompt / completion / label row.")
    truncated = sum(out["truncated"])
    if truncated:
        log_rank0(f"{truncated} of {len(out)} kto examples are longer than data.max_seq_len={max_len}: their prompts "
                  "keep their end and their completions their start (see hf_scale.data.unpaired).")
    return out.remove_columns("truncated")


def encode_unpaired(example, index: int, tokenizer, cfg, columns: dict, template: str, max_len: int) -> dict:
    """One row of :func:`tokenize_unpaired` (plus ``truncated``: whether it was cut)."""
    prompt, completion, label = _example(example, index, columns)
    seq = tokenize_conversation(
        prompt + completion, tokenizer, train_on="all_assistant", train_on_reasoning=cfg.train_on_reasoning,
        system_prompt=cfg.system_prompt, chat_template=template, prompt_turns=len(prompt),
        where=f"row {index} (its prompt and completion)")
    (ids, labels), _, cut = truncate_pair(seq, seq, max_len)
    return {"input_ids": ids, "labels": labels, "label": label, "truncated": cut}


def _example(example, index: int, columns: dict) -> tuple[list, list, bool]:
    label_col = columns["data.label_column"]
    label = example[label_col]
    if label is None:
        raise HfScaleConfigError(f"row {index} has no label (column {label_col!r} is empty): every kto row needs "
                                 "label true (a desirable completion) or false (an undesirable one).")
    if not isinstance(label, bool):
        raise HfScaleConfigError(
            f"row {index}: label {label!r} ({type(label).__name__}, column {label_col!r}) is not a bool: kto labels "
            "are true (desirable) or false (undesirable), as TRL's; convert the column to booleans.")
    values = {}
    for key, side in (("data.prompt_column", "prompt"), ("data.response_column", "completion")):
        col = columns[key]
        value = example[col]
        if value is None or (isinstance(value, str) and not value.strip()) or (
                isinstance(value, (list, tuple)) and not value):
            raise HfScaleConfigError(f"row {index}: the {side} (column {col!r}) is missing or empty; a kto row needs "
                                     "a non-empty prompt and completion. Drop the row or fill it in.")
        values[side] = value
    prompt, completion = values["prompt"], values["completion"]
    if isinstance(prompt, str) != isinstance(completion, str):
        raise HfScaleConfigError(
            f"row {index}: prompt and completion must both be strings or both lists of messages (TRL's "
            f"conversational form); got prompt {type(prompt).__name__}, completion {type(completion).__name__}.")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}], label
    _require_answer(completion, "completion", index)
    return list(prompt), list(completion), label


def check_labels(labels, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> str | None:
    """Refuses training data with one kind of label only; for unbalanced data whose weights lie
    outside the range Eqn (8) of the KTO paper suggests, TRL's advice (to log), else None."""
    labels = [bool(x) for x in labels]
    good = sum(labels)
    bad = len(labels) - good
    if good == 0 or bad == 0:
        kind = "desirable (label true)" if bad == 0 else "undesirable (label false)"
        raise HfScaleConfigError(
            f"the kto training data have {len(labels)} examples, all {kind}: KTO learns from desirable and "
            "undesirable completions together (its KL reference point and losses compare them). Add examples of "
            "the other kind (paired data give both), or train desirable-only data with SFT (preference.loss: null).")
    if good == bad:
        return None
    d_low, d_high = round(bad * undesirable_weight / good, 2), round(bad * undesirable_weight / good * 1.33, 2)
    u_low, u_high = round(good * desirable_weight / bad / 1.33, 2), round(good * desirable_weight / bad, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"{good} desirable and {bad} undesirable kto examples, but the weights are outside the range the KTO "
            f"paper suggests: set EITHER preference.desirable_weight in [{d_low}, {d_high}] OR "
            f"preference.undesirable_weight in [{u_low}, {u_high}] (TRL's advice).")


class UnpairedCollator:
    """Unpaired rows to one KTO batch: each example followed by its KL row.

    ``collator(rows)`` gives ``input_ids``, ``attention_mask`` and ``labels``, LongTensors of
    shape ``[2B, S]`` padded on the right (``pad_id``, 0, -100): row ``2i`` is example ``i``,
    row ``2i + 1`` example ``i``'s prompt followed by example ``i - 1``'s completion (example 0
    takes the last's; TRL's rotation), cut from the right to ``max_len``; and ``label``, a
    BoolTensor ``[B]``. A batch needs at least 2 examples.

    Usage::

        loader = DataLoader(rows, batch_size=8, collate_fn=UnpairedCollator(tokenizer.pad_token_id, 512))
    """

    def __init__(self, pad_id: int, max_len: int | None = None):
        if pad_id is None:
            raise HfScaleConfigError("UnpairedCollator needs a pad token id: set tokenizer.pad_token (e.g. to the EOS "
                                     "token) before batching kto examples.")
        self.pad_id, self.max_len = int(pad_id), max_len

    def __call__(self, rows) -> dict:
        import torch

        rows = list(rows)
        if len(rows) < 2:
            raise HfScaleConfigError(
                f"a kto batch of {len(rows)} example: the KL rows pair each prompt with another example's completion, "
                "so a batch needs >= 2 (with one the KL term is the reward itself, as TRL says). Raise "
                "train.batch_size / train.eval_batch_size.")
        split = [_prompt_len(row["labels"]) for row in rows]
        seqs = []
        for i, (row, p) in enumerate(zip(rows, split)):
            other, q = rows[i - 1], split[i - 1]  # i = 0 takes the last example's completion
            kl_ids = list(row["input_ids"][:p]) + list(other["input_ids"][q:])
            kl_labels = [IGNORE] * p + list(other["labels"][q:])
            end = len(kl_ids) if self.max_len is None else self.max_len
            seqs += [(row["input_ids"], row["labels"]), (kl_ids[:end], kl_labels[:end])]
        width = max(len(ids) for ids, _ in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(seqs):
            input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            labels[i, : len(lab)] = torch.as_tensor(lab, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        label = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "label": label}
