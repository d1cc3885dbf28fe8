"""Evaluation on the held-out split: loss, and accuracy or exact match, summed over the
data-parallel ranks (the ranks of one tensor-parallel group run the same forwards on the same
examples, so they are counted once).

Exact match (prompt/response data and conversations) asks whether greedy decoding from the
prompt reproduces the answer and its end-of-turn token: the last labelled span of each row, that
is the last trained assistant turn of a conversation, given the conversation before it. That is decided in one teacher-forced forward: greedy
decoding emits the answer exactly when, at every answer position, the most likely next token
given the correct prefix is the answer's next token (the prefixes then coincide at every
step). So it costs one forward per batch instead of a ``generate`` loop, and all ranks stay
in lockstep, which sharded models need.

Usage::

    dp = DataParallel.of(model)
    scores = evaluate(model, eval_ds, collate, task="causal_lm", batch_size=16,
                      rank=dp.rank, world=dp.degree, group=dp.group)
    scores   # {"eval_loss": 1.93, "eval_exact_match": 0.41, "eval_examples": 200}
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.step import eval_step, forward_options
from .dp import context_degree, pipeline_degree
from .loader import eval_batches
from .reward import reward_scores


@torch.no_grad()
def evaluate(model: nn.Module, dataset, collate, *, task: str, batch_size: int, rank: int, world: int,
             device: torch.device, exact_match: bool = True, group=None) -> dict[str, float]:
    """Mean loss and exact match (causal LM) or accuracy (classification; a reward model: the
    share of pairs whose chosen completion scores higher, the loss its mean Bradley-Terry term
    per pair) over ``dataset``.

    ``rank`` / ``world`` are the data-parallel rank and degree and ``group`` their process
    group (None: the default group, right when every rank sees different data). Under pipeline
    parallel no rank has the logits, and under context parallel a rank has its own positions'
    only: the loss then comes from ``hf_scale.eval_step`` and exact match / accuracy are left out
    (the caller says so once).
    """
    was_training = model.training
    model.eval()
    pipelined = pipeline_degree(model) > 1 or context_degree(model) > 1  # the loss only
    # loss sum, loss count (tokens or examples), correct examples, examples
    totals = torch.zeros(4, dtype=torch.float64)
    for batch, weight in eval_batches(dataset, batch_size, rank, world, collate):
        batch = {k: v.to(device) for k, v in batch.items()}
        if pipelined:
            totals += _pipeline_scores(model, batch, weight.to(device))
            continue
        labels = batch.pop("labels")
        logits = model(**batch, **forward_options(batch)).logits.float()
        if task == "causal_lm":
            scores = _causal_scores(logits, labels, weight.to(device), batch.get("position_ids"))
        elif task == "reward":  # pairs, chosen and rejected interleaved; weights are per pair
            scores = reward_scores(logits, labels, weight.to(device))
        else:
            scores = _classification_scores(logits, labels, weight.to(device))
        totals += scores.cpu().double()
    if world > 1:
        dist.all_reduce(totals, group=group)
    model.train(was_training)
    loss_sum, count, correct, examples = totals.tolist()
    metric = "eval_exact_match" if task == "causal_lm" else "eval_accuracy"
    out = {"eval_loss": loss_sum / max(count, 1.0)}
    if not pipelined and (task != "causal_lm" or exact_match):
        out[metric] = correct / max(examples, 1.0)
    out["eval_examples"] = int(examples)
    return out


def _pipeline_scores(model: nn.Module, batch: dict, weight: torch.Tensor) -> torch.Tensor:
    """(loss sum, label tokens, 0, examples) of a causal-LM batch from ``eval_step``'s mean
    loss: examples weighted 0 (the copies that even out the ranks) lose their labels first.
    Every rank of the pipeline runs the step, even on a batch with no label left."""
    labels = batch["labels"].masked_fill(weight[:, None] == 0, -100)
    tokens = float((labels[:, 1:] != -100).sum())
    loss = float(eval_step(model, {**batch, "labels": labels}))
    examples = float(_documents(labels, batch.get("position_ids"))[1].sum())
    return torch.tensor([loss * tokens if tokens else 0.0, tokens, 0.0, examples], dtype=torch.float64)


def _documents(labels: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's document as a flat index, which documents hold a label) of a batch.

    Without ``position_ids`` a row is one example; in packed rows a document starts wherever
    the positions restart at 0, and one with no label (the padding at a row's end) is none."""
    rows, width = labels.shape
    if position_ids is None:
        doc = torch.zeros_like(labels)
    else:
        doc = (position_ids == 0).long().cumsum(-1) - 1
    flat = doc.clamp(min=0) + torch.arange(rows, device=labels.device)[:, None] * width
    labelled = torch.zeros(rows * width, dtype=torch.bool, device=labels.device)
    labelled[flat[labels != -100]] = True
    return flat, labelled


def _causal_scores(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(loss sum, label tokens, exact matches, examples); an example is a row, or a document of a
    packed row (``position_ids``), matched when greedy decoding reproduces its every label."""
    labels = labels.masked_fill(weight[:, None] == 0, -100)
    flat, labelled = _documents(labels, position_ids)
    logits, labels, flat = logits[:, :-1], labels[:, 1:], flat[:, 1:]  # position t predicts label t + 1
    mask = labels != -100
    tokens = F.cross_entropy(
        logits.transpose(1, 2), labels.clamp(min=0), reduction="none"
    )  # (batch, seq)
    answer = last_span(mask, flat)
    missed = torch.zeros_like(labelled)
    missed[flat[answer & (logits.argmax(-1) != labels)]] = True
    return torch.stack([
        (tokens * mask).sum(), mask.sum(), (labelled & ~missed).sum(), labelled.sum(),
    ]).float()


def last_span(mask: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The last run of True of each example in ``mask`` (batch, seq): the answer exact match
    scores (a pair has one run; a conversation one per trained assistant turn). An example is a
    row, or in packed rows a document (``documents``: each position's document as a flat index,
    :func:`_documents`; a run never crosses a document's start, whose label is ignored)."""
    rows, width = mask.shape
    position = torch.arange(width, device=mask.device).expand(rows, width)
    starts = mask & ~F.pad(mask, (1, 0))[:, :-1]  # True where a run begins
    if documents is None:
        documents = torch.arange(rows, device=mask.device)[:, None].expand(rows, width)
    last_start = torch.full((int(documents.max()) + 1,), -1, dtype=torch.long, device=mask.device)
    last_start = last_start.scatter_reduce(0, documents[starts], position[starts], reduce="amax")
    return mask & (position >= last_start[documents])


def _classification_scores(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits, labels, reduction="none")
    hit = (logits.argmax(-1) == labels).float()
    return torch.stack([(losses * weight).sum(), weight.sum(), (hit * weight).sum(), weight.sum()]).float()
