"""Preference training in ``hf-scale finetune`` (``preference.loss`` set): pair data, the
reference pass, the optimizer step's micro-batches and evaluation on held-out pairs.

The step's loss is, as one process on the whole global batch would compute it, the mean of the
per-pair losses over every pair of the step (all data-parallel ranks, all accumulated
micro-batches; plus the NLL term's mean over all its tokens): the pair and token counts are
summed over the micro-batches and ``dp.group`` first, and each micro-batch adds its share.

Usage (inside :func:`hf_scale.train.loop.run`)::

    train_ds, eval_ds = pair_datasets(job, tokenizer, splits)
    train_ds, eval_ds = add_reference(job, model, train_ds, eval_ds, dp, pad_id)  # before step 1
    values = preference_step_values(job, model, micro, dp, amp_scale)
"""

from __future__ import annotations

import torch

from ..data.preference import REF_COLUMNS, PairCollator, tokenize_preference
from ..log import log_rank0
from ..parallel.optim import no_sync
from ..parallel.preference import PairTotals, pair_totals, preference_eval_step, preference_step
from ..parallel.preference_loss import METRICS
from ..parallel.preference_reference import reference_logps
from .loader import eval_batches


def pair_datasets(job, tokenizer, splits) -> tuple:
    """(train, eval) tokenised pair rows (eval None without a held-out split)."""
    max_len = job.data.max_seq_len
    train = tokenize_preference(splits["train"], tokenizer, job.data, max_len)
    ev = splits["eval"] and tokenize_preference(splits["eval"], tokenizer, job.data, max_len)
    return train, ev


def add_reference(job, model, train_ds, eval_ds, dp, pad_id: int) -> tuple:
    """The datasets with ``ref_chosen_logps`` / ``ref_rejected_logps`` from the policy as loaded
    (before any optimizer step: it is the reference), when ``preference.reference`` resolves to
    ``precompute``; unchanged otherwise (LoRA's adapter reference, reference-free losses)."""
    if job.preference.reference_source(job.peft.enabled) != "precompute":
        return train_ds, eval_ds
    collate = PairCollator(pad_id)
    out = []
    for name, ds in (("training", train_ds), ("evaluation", eval_ds)):
        if ds is None:
            out.append(None)
            continue
        if all(c in ds.column_names for c in REF_COLUMNS):
            log_rank0(f"{name} pairs carry their reference log-probs already: not recomputed")
            out.append(ds)
            continue
        ref = reference_logps(model, ds, collate, job.train.eval_batch_size, rank=dp.rank, world=dp.degree,
                              group=dp.group)
        log_rank0(f"reference log-probs of {len(ds)} {name} pairs precomputed with the policy before its first step")
        ds = ds.remove_columns([c for c in REF_COLUMNS if c in ds.column_names])
        ds = ds.add_column(REF_COLUMNS[0], ref[:, 0].tolist()).add_column(REF_COLUMNS[1], ref[:, 1].tolist())
        out.append(ds)
    return tuple(out)


def preference_step_values(job, model, micro: list[dict], dp, amp_scale: float) -> dict:
    """Forward and backward of one optimizer step's micro-batches; its loss and TRL's metrics
    (means over the step's pairs, every data-parallel rank's)."""
    knobs = job.preference.knobs()
    local = [pair_totals(b, knobs) for b in micro]
    counts = torch.tensor([sum(t.pairs for t in local), sum(t.nll_tokens for t in local)], dtype=torch.float64)
    dp.all_reduce(counts)
    totals = PairTotals(float(counts[0]), float(counts[1]))
    loss_sum = torch.zeros((), dtype=torch.float64)
    sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro):
        with no_sync(model, enabled=i < len(micro) - 1):
            # gradients are averaged over dp ranks: each rank's share counts dp.degree times
            out = preference_step(model, batch, knobs, loss_scale=dp.degree * amp_scale, totals=totals)
        loss_sum += float(out.loss)
        for k, v in out.sums.items():
            sums[k] = sums.get(k, 0.0) + v.detach().double().cpu()
    names = sorted(sums)
    reduced = torch.stack([loss_sum] + [sums[n] for n in names])
    dp.all_reduce(reduced)
    pairs = max(totals.pairs, 1.0)
    values = {"loss": float(reduced[0])}
    values.update({n: float(v) / pairs for n, v in zip(names, reduced[1:]) if n in METRICS})
    return values


@torch.no_grad()
def evaluate_preference(job, model, eval_ds, collate, dp, device) -> dict:
    """The preference loss and TRL's metrics on the held-out pairs (each pair counted once over
    the data-parallel ranks), as ``eval_loss``, ``eval_rewards/accuracies``, ..."""
    knobs = job.preference.knobs()
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    nll_tokens = torch.zeros((), dtype=torch.float64)
    for batch, weight in eval_batches(eval_ds, job.train.eval_batch_size, dp.rank, dp.degree, collate):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch["pair_weight"] = weight
        nll_tokens += pair_totals(batch, knobs).nll_tokens
        out = preference_eval_step(model, batch, knobs, totals=PairTotals(1.0, 1.0))
        for k, v in out.sums.items():
            sums[k] = sums.get(k, 0.0) + v.detach().double().cpu()
    model.train(was_training)
    names = sorted(sums)
    reduced = torch.stack([nll_tokens] + [sums[n] for n in names])
    dp.all_reduce(reduced)
    nll_tokens, pairs = float(reduced[0]), float(len(eval_ds))
    means = dict(zip(names, (float(v) for v in reduced[1:])))
    loss = means["pair_loss"] / pairs + (knobs.nll_weight * means["nll"] / max(nll_tokens, 1.0) if knobs.nll_weight else 0.0)
    out = {"eval_loss": loss}
    out.update({f"eval_{n}": means[n] / pairs for n in names if n in METRICS})
    out["eval_examples"] = len(eval_ds)  # pairs
    return out
