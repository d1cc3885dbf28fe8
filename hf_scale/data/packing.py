"""Packing: whole examples placed into rows, best-fit-decreasing, documents kept apart.

A packed row holds several tokenised examples (documents) one after the other. What keeps
them apart is ``position_ids`` restarting at 0 at every document: transformers finds the
documents from them (``masking_utils.find_packed_sequence_indices``) when the forward gets
**no attention mask and no cache**, and then no token attends across a boundary and every
document sees the positions it would see alone. The label of each document's first token is
-100, so the last token of one document is never trained to predict the next document.
An architecture that ignores that signal is refused (:func:`packing_refusal`).

``bfd`` places whole examples (TRL's ``packing_strategy="bfd"``); ``bfd_split`` first cuts an
example longer than a row into row-sized pieces, each its own document. Rows are packed in
groups of ``group`` examples (the examples a ``Dataset.map`` batch holds, as TRL does), so
packing never needs the whole dataset in memory.

Usage::

    rows = dataset.map(pack_examples, batched=True, batch_size=1000,
                       fn_kwargs=dict(max_len=2048), remove_columns=dataset.column_names)
    collate = PackedCollator(pad_id)              # [rows, longest] with position_ids, no mask
    collate = PackedCollator(pad_id, flatten=True)  # padding-free: one row per micro-batch
    loss = model(**collate([rows[0], rows[1]]), use_cache=False).loss  # hf_scale.forward_options
"""

from __future__ import annotations

import bisect
from typing import Any

IGNORE = -100
STRATEGIES = ("bfd", "bfd_split", "wrapped")


def bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: the indices of ``lengths`` in bins of at most ``capacity`` tokens.

    Longest first, each into the fullest bin that still has room (a new bin when none has);
    an item longer than ``capacity`` is refused (cut it first). Bins come out in the order
    they were opened, their items longest first.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted: bisect finds the best fit
    for i in order:
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"an example of {size} tokens does not fit a row of {capacity}")
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - size, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= size
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def split_long(input_ids: list[list[int]], labels: list[list[int]], max_len: int):
    """Every example longer than ``max_len`` cut into pieces of at most ``max_len`` tokens, each
    a document of its own (its first label ignored when packed, like any document's)."""
    ids_out, labels_out = [], []
    for ids, lab in zip(input_ids, labels):
        for start in range(0, max(len(ids), 1), max_len):
            ids_out.append(ids[start : start + max_len])
            labels_out.append(lab[start : start + max_len])
    return ids_out, labels_out


def pack_examples(batch: dict[str, list], max_len: int, split: bool = False) -> dict[str, list]:
    """A ``Dataset.map(batched=True)`` function: the batch's examples in best-fit-decreasing
    rows of at most ``max_len`` tokens, with ``position_ids`` restarting at 0 per document and
    the label of every document's first token -100. ``split``: cut longer examples first (else
    they must already fit: tokenisation truncates them to ``max_len``)."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    if split:
        input_ids, labels = split_long(input_ids, labels, max_len)
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in bfd_bins([len(x) for x in input_ids], max_len):
        row_ids, row_labels, row_pos = [], [], []
        for i in members:
            row_ids += input_ids[i]
            row_labels += [IGNORE] + list(labels[i][1:])
            row_pos += range(len(input_ids[i]))
        out["input_ids"].append(row_ids)
        out["labels"].append(row_labels)
        out["position_ids"].append(row_pos)
    return out


def wrap_examples(batch: dict[str, list], max_len: int) -> dict[str, list]:
    """``packing: wrapped``: the examples concatenated and cut into rows of exactly ``max_len``
    tokens, the remainder dropped. Documents attend to the ones before them and are cut across
    rows: right for plain pre-training text, wrong for instruction data (which is refused)."""
    ids = [t for row in batch["input_ids"] for t in row]
    labels = [t for row in batch["labels"] for t in row]
    cut = range(0, len(ids) - max_len + 1, max_len)
    return {"input_ids": [ids[i : i + max_len] for i in cut], "labels": [labels[i : i + max_len] for i in cut]}


class PackedCollator:
    """Rows of documents -> a batch with ``position_ids`` and no attention mask.

    Each example is a packed row (with ``position_ids``) or one plain example (one document).
    Rows are right-padded to the longest with ``pad_id``; the padding is a document of its own
    (its positions restart at 0, its labels are -100), so it changes nothing a real token sees.
    Each document's first label is -100. ``flatten``: padding-free, the examples concatenated
    into ONE row (``[1, total tokens]``), no padding at all.

    Run the model on these batches with ``use_cache=False`` (``hf_scale.train_step`` /
    ``eval_step`` do): with a cache, transformers does not look for the documents.
    """

    def __init__(self, pad_id: int, flatten: bool = False):
        self.pad_id, self.flatten = pad_id, flatten

    def __call__(self, examples: list[dict[str, Any]]):
        import torch

        rows = [self._row(e) for e in examples]
        if self.flatten:
            rows = [tuple([t for r in rows for t in r[k]] for k in range(3))]
        width = max(len(ids) for ids, _, _ in rows)
        shape = (len(rows), width)
        batch = {"input_ids": torch.full(shape, self.pad_id, dtype=torch.long),
                 "labels": torch.full(shape, IGNORE, dtype=torch.long),
                 "position_ids": torch.zeros(shape, dtype=torch.long)}
        for i, (ids, labels, positions) in enumerate(rows):
            n = len(ids)
            batch["input_ids"][i, :n] = torch.as_tensor(ids, dtype=torch.long)
            batch["labels"][i, :n] = torch.as_tensor(labels, dtype=torch.long)
            batch["position_ids"][i, :n] = torch.as_tensor(positions, dtype=torch.long)
            batch["position_ids"][i, n:] = torch.arange(width - n)
        return batch

    @staticmethod
    def _row(example: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        ids, labels = list(example["input_ids"]), list(example["labels"])
        positions = example.get("position_ids")
        if positions is None:  # one plain example: one document
            positions = list(range(len(ids)))
            labels = [IGNORE] + labels[1:]
        return ids, labels, list(positions)


def real_tokens(batch) -> int:
    """Tokens of a batch that are not padding: the attention mask's ones, or (packed batches,
    which have none) every position less each row's trailing pad document, which
    :class:`PackedCollator` marks as ``pad`` ids with ignored labels after the last restart."""
    import torch

    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    positions, labels = batch["position_ids"], batch["labels"]
    width = positions.shape[-1]
    last_start = width - 1 - torch.flip((positions == 0).long(), [-1]).argmax(-1)  # the last restart
    cols = torch.arange(width)
    tail = cols[None, :] >= last_start[:, None]
    pad_tail = (tail & (labels != IGNORE)).sum(-1) == 0  # that last document trains nothing: padding
    pad_tail &= last_start > 0  # a row that is one document is no padding
    return int(positions.numel() - ((width - last_start) * pad_tail).sum())


_VERDICTS: dict[tuple, str | None] = {}


def packing_refusal(config, attn_implementation: str | None = None) -> str | None:
    """Why this architecture cannot keep packed documents apart, or None when it can.

    Checked, not listed: the model's class is built at a tiny size from its own config
    (:func:`hf_scale.model_plans.shrink.shrunk_config`, a fixed seed, on the CPU) and a row of
    two documents kept apart by ``position_ids`` must give each document the logits it gets
    alone. Models that build their own mask and ignore the positions (OPT, BLOOM, GPT-OSS in
    transformers 5.24), and recurrent or convolution mixers (which need ``seq_idx`` /
    ``cu_seq_lens`` kernels that do not run here) fail it. One verdict per config class and
    attention implementation (a second of CPU the first time)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..model_plans.shrink import shrunk_config

    attn = attn_implementation or getattr(config, "_attn_implementation", None)  # None: transformers' default
    key = (type(config).__name__, getattr(config, "model_type", None), attn,
           getattr(config, "sliding_window", None) is not None)
    if key in _VERDICTS:
        return _VERDICTS[key]
    small = shrunk_config(config)
    small.use_cache = False
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            chosen = {"attn_implementation": attn} if attn else {}
            model = AutoModelForCausalLM.from_config(small, dtype=torch.float32, **chosen).eval()
            attn = model.config._attn_implementation
            vocab = min(getattr(small, "vocab_size", 512) or 512, 256)
            docs = [torch.randint(4, vocab, (1, n)) for n in (7, 5)]
        with torch.no_grad():
            alone = [model(input_ids=d).logits for d in docs]
            ids = torch.cat(docs, dim=1)
            positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
            packed = model(input_ids=ids, position_ids=positions).logits
        diff = max(float((p - a).abs().max()) for p, a in zip(packed.split([7, 5], dim=1), alone))
        scale = max(float(a.abs().max()) for a in alone)
    except Exception as e:  # noqa: BLE001 - the verdict says what failed
        verdict = (f"a packed row could not be run on a tiny {type(config).__name__} "
                   f"({type(e).__name__}: {str(e)[:200]})")
    else:
        verdict = None if diff <= 1e-4 * max(scale, 1.0) else (
            f"{getattr(config, 'model_type', type(config).__name__)} does not keep packed documents apart: a "
            f"document's logits in a packed row differ from the same document alone by {diff:.2g} "
            f"(attention '{attn}'; its forward ignores the position_ids boundaries)")
    _VERDICTS[key] = verdict
    return verdict


def check_packing(config, attn_implementation: str | None = None) -> None:
    """Refuse packing / padding-free batches for a model that cannot keep documents apart
    (:func:`packing_refusal`), saying what to do instead."""
    from ..errors import HfScaleConfigError

    reason = packing_refusal(config, attn_implementation)
    if reason is not None:
        raise HfScaleConfigError(
            f"data.packing / data.padding_free: {reason}. Train it on padded rows (data.packing: false, "
            "data.padding_free: false), or pack with a model that keeps documents apart."
        )
