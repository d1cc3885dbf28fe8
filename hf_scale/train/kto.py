"""KTO in ``hf-scale finetune`` (``preference.loss: kto``): unpaired examples, an optimizer
step's micro-batches and evaluation on held-out examples (:mod:`hf_scale.parallel.kto`).

A step's loss is, as one process on the whole global batch would compute it, the mean of the
examples' losses over every example of the step (all data-parallel ranks, all accumulated
micro-batches). Each micro-batch's KL reference point is the mean of ``policy - reference`` over
its KL rows on every data-parallel rank (an all-reduce of two numbers per micro-batch; TRL
averages the ranks' means, the same for equal micro-batches), detached and clamped at 0.

Usage (inside :func:`hf_scale.train.preference.preference_step_values` / ``evaluate_preference``)::

    values = kto_step_values(job, model, micro, dp, amp_scale, reference)
    scores = evaluate_kto(job, model, eval_ds, collate, dp, device, reference)
"""

from __future__ import annotations

import torch

from ..data.unpaired import check_labels, tokenize_unpaired
from ..log import log_rank0
from ..parallel.kto import kl_point, kto_examples, kto_prepare, kto_step
from ..parallel.optim import no_sync
from ..parallel.preference_loss import kto_means
from ..parallel.preference_reference import frozen_reference_logps
from .loader import eval_batches
from .step_sums import StepSums


def kto_datasets(job, tokenizer, splits) -> tuple:
    """(train, eval) tokenised unpaired rows (eval None without a held-out split); the training
    labels checked (both kinds; TRL's advice on the weights when unbalanced)."""
    max_len, pref = job.data.max_seq_len, job.preference
    train = tokenize_unpaired(splits["train"], tokenizer, job.data, max_len)
    advice = check_labels(train["label"], pref.desirable_weight, pref.undesirable_weight)
    if advice:
        log_rank0(advice)
    ev = splits["eval"] and tokenize_unpaired(splits["eval"], tokenizer, job.data, max_len)
    return train, ev


def _prepare(model, batch: dict, knobs, dp, reference) -> float:
    """The batch's KL reference point over the data-parallel ranks."""
    if reference is not None:
        batch["ref_logps"] = frozen_reference_logps(reference, batch)
    return kl_point(dp.all_reduce(kto_prepare(model, batch, knobs)))


def kto_step_values(job, model, micro: list[dict], dp, amp_scale: float, reference=None) -> dict:
    """Forward and backward of one optimizer step's micro-batches; its loss and TRL's KTO
    metrics (rewards/chosen, rewards/rejected, rewards/margins, logps/*, kl: means over the
    step's examples of each kind, every data-parallel rank's)."""
    knobs = job.preference.knobs()
    examples = torch.tensor([sum(kto_examples(b) for b in micro)], dtype=torch.float64)
    dp.all_reduce(examples)
    totals = float(examples[0])
    step = StepSums()
    for i, batch in enumerate(micro):  # TRL's order: each micro-batch's no-grad forwards, then its own
        kl = _prepare(model, batch, knobs, dp, reference)
        with no_sync(model, enabled=i < len(micro) - 1):
            # gradients are averaged over dp ranks: each rank's share counts dp.degree times
            step.add(kto_step(model, batch, knobs, kl, loss_scale=dp.degree * amp_scale, totals=totals))
    loss, sums = step.reduced(dp)
    return {"loss": loss, **kto_means(sums, totals)}


@torch.no_grad()
def evaluate_kto(job, model, eval_ds, collate, dp, device, reference=None) -> dict:
    """The KTO loss and TRL's metrics on the held-out examples (each counted once over the
    data-parallel ranks; each batch's KL reference point over the ranks' KL rows), as
    ``eval_loss``, ``eval_rewards/chosen``, ``eval_kl``, ..."""
    knobs = job.preference.knobs()
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch, weight in eval_batches(eval_ds, job.train.eval_batch_size, dp.rank, dp.degree, collate):
        batch = {k: v.to(device) for k, v in batch.items()}
        batch["pair_weight"] = weight
        kl = _prepare(model, batch, knobs, dp, reference)
        out = kto_step(model, batch, knobs, kl, totals=1.0, train=False)
        for k, v in out.sums.items():
            sums[k] = sums.get(k, 0.0) + v.detach().double().cpu()
    model.train(was_training)
    names = sorted(sums)
    reduced = torch.stack([sums[n] for n in names])
    dp.all_reduce(reduced)
    totals = dict(zip(names, reduced))
    examples = float(len(eval_ds))
    out = {"eval_loss": float(totals["example_loss"]) / examples}
    out.update({f"eval_{k}": v for k, v in kto_means(totals, examples).items()})
    out["eval_examples"] = len(eval_ds)
    return out
