"""Preference training in ``hf-scale finetune`` (``preference.loss`` set): pair data, the
reference pass, the optimizer step's micro-batches and evaluation on held-out pairs.

The step's loss is, as one process on the whole global batch would compute it, the mean of the
per-pair losses over every pair of the step (all data-parallel ranks, all accumulated
micro-batches; plus the NLL term's mean over all its tokens): the pair and token counts are
summed over the micro-batches and ``dp.group`` first, and each micro-batch adds its share.

Usage (inside :func:`hf_scale.train.loop.run`)::

    train_ds, eval_ds = pair_datasets(job, tokenizer, splits)
    train_ds, eval_ds = add_reference(job, model, train_ds, eval_ds, dp, pad_id)  # before step 1
    reference = load_reference_model(job, model)      # preference.reference: model; else None
    values = preference_step_values(job, model, micro, dp, amp_scale, reference)
"""

from __future__ import annotations

import torch

from ..data.preference import REF_COLUMNS, PairCollator, tokenize_preference
from ..errors import HfScaleConfigError
from ..log import log_rank0
from ..parallel.optim import no_sync
from ..parallel.preference import PairTotals, pair_totals, preference_eval_step, preference_step
from ..parallel.preference_loss import METRICS
from ..parallel.preference_reference import frozen_reference_logps, reference_logps
from .loader import eval_batches
from .step_sums import StepSums


def pair_datasets(job, tokenizer, splits) -> tuple:
    """(train, eval) tokenised pair rows (eval None without a held-out split); kto's unpaired
    rows (:func:`hf_scale.train.kto.kto_datasets`)."""
    if job.preference.loss == "kto":
        from .kto import kto_datasets

        return kto_datasets(job, tokenizer, splits)
    max_len = job.data.max_seq_len
    train = tokenize_preference(splits["train"], tokenizer, job.data, max_len)
    ev = splits["eval"] and tokenize_preference(splits["eval"], tokenizer, job.data, max_len)
    return train, ev


def reference_config(job):
    """The ``ModelConfig`` of the reference's weights: ``preference.reference_model``, or the
    policy's own source. A model whose vocabulary differs from the policy's is refused (the
    log-probs of one token sequence under both must index the same tokens)."""
    from dataclasses import replace

    from .model import read_model_config

    if job.preference.reference_model is None:
        return job.model
    cfg = replace(job.model, name_or_path=job.preference.reference_model)
    theirs = getattr(read_model_config(cfg), "vocab_size", None)
    ours = getattr(read_model_config(job.model), "vocab_size", None)
    if theirs != ours:
        raise HfScaleConfigError(
            f"preference.reference_model={cfg.name_or_path!r} has a vocabulary of {theirs} tokens, the policy "
            f"{job.model.name_or_path!r} {ours}: the reference must score the policy's token ids. Give a model of "
            "the same family (e.g. the SFT checkpoint the policy was trained from)."
        )
    return cfg


def load_reference_model(job, model):
    """The frozen reference held through the run (``preference.reference: model``), in the
    policy's layout (:func:`hf_scale.train.model.load_reference`); None for the other sources."""
    if job.preference.reference_source(job.peft.enabled) != "model":
        return None
    from ..parallel_state import get_state
    from .model import load_reference

    cfg = reference_config(job)
    reference = load_reference(cfg, job.parallel, get_state(model).env.device)
    log_rank0(f"reference: {cfg.name_or_path} held frozen beside the policy (one no-grad forward per micro-batch"
              + (", sharded like the policy)" if job.parallel.strategy not in ("ddp", "zero1") else ", a replica per rank)"))
    return reference


def add_reference(job, model, train_ds, eval_ds, dp, pad_id: int) -> tuple:
    """The datasets with ``ref_chosen_logps`` / ``ref_rejected_logps`` from the policy as loaded
    (before any optimizer step: it is the reference), or from ``preference.reference_model``
    (loaded for this pass and freed after), when ``preference.reference`` resolves to
    ``precompute``; unchanged otherwise (a held reference model, LoRA's adapter reference,
    reference-free losses)."""
    if job.preference.reference_source(job.peft.enabled) != "precompute":
        return train_ds, eval_ds
    scorer = model
    if job.preference.reference_model is not None:
        from ..parallel_state import get_state
        from .model import load_reference

        scorer = load_reference(reference_config(job), job.parallel, get_state(model).env.device)
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
        ref = reference_logps(scorer, ds, collate, job.train.eval_batch_size, rank=dp.rank, world=dp.degree,
                              group=dp.group)
        by = (f"the reference model {job.preference.reference_model}" if scorer is not model
              else "the policy before its first step")
        log_rank0(f"reference log-probs of {len(ds)} {name} pairs precomputed with {by}")
        ds = ds.remove_columns([c for c in REF_COLUMNS if c in ds.column_names])
        ds = ds.add_column(REF_COLUMNS[0], ref[:, 0].tolist()).add_column(REF_COLUMNS[1], ref[:, 1].tolist())
        out.append(ds)
    return tuple(out)


def preference_step_values(job, model, micro: list[dict], dp, amp_scale: float, reference=None) -> dict:
    """Forward and backward of one optimizer step's micro-batches; its loss and TRL's metrics
    (means over the step's pairs, every data-parallel rank's). ``reference``: the frozen model
    whose log-probs each micro-batch compares with (``preference.reference: model``). kto:
    :func:`hf_scale.train.kto.kto_step_values`."""
    knobs = job.preference.knobs()
    if knobs.loss == "kto":
        from .kto import kto_step_values

        return kto_step_values(job, model, micro, dp, amp_scale, reference)
    if reference is not None:
        for batch in micro:
            batch["ref_logps"] = frozen_reference_logps(reference, batch)
    local = [pair_totals(b, knobs) for b in micro]
    counts = torch.tensor([sum(t.pairs for t in local), sum(t.nll_tokens for t in local)], dtype=torch.float64)
    dp.all_reduce(counts)
    totals = PairTotals(float(counts[0]), float(counts[1]))
    step = StepSums()
    for i, batch in enumerate(micro):
        with no_sync(model, enabled=i < len(micro) - 1):
            # gradients are averaged over dp ranks: each rank's share counts dp.degree times
            step.add(preference_step(model, batch, knobs, loss_scale=dp.degree * amp_scale, totals=totals))
    loss, sums = step.reduced(dp)
    pairs = max(totals.pairs, 1.0)
    return {"loss": loss, **{n: v / pairs for n, v in sums.items() if n in METRICS}}


@torch.no_grad()
def evaluate_preference(job, model, eval_ds, collate, dp, device, reference=None) -> dict:
    """The preference loss and TRL's metrics on the held-out pairs (each pair counted once over
    the data-parallel ranks), as ``eval_loss``, ``eval_rewards/accuracies``, ...; ``reference``
    as in :func:`preference_step_values`. kto: :func:`hf_scale.train.kto.evaluate_kto`."""
    knobs = job.preference.knobs()
    if knobs.loss == "kto":
        from .kto import evaluate_kto

        return evaluate_kto(job, model, eval_ds, collate, dp, device, reference)
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    nll_tokens = torch.zeros((), dtype=torch.float64)
    for batch, weight in eval_batches(eval_ds, job.train.eval_batch_size, dp.rank, dp.degree, collate):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch["pair_weight"] = weight
        if reference is not None:
            batch["ref_logps"] = frozen_reference_logps(reference, batch)
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
