"""KTO cases of the preference launch (tests/distributed/test_preference.py): N ranks, each with
its own examples, through the fine-tuning loop's step (:func:`hf_scale.train.kto.kto_step_values`:
the KL reference point all-reduced over the data-parallel ranks), against one process that
computes the same step from the definition: per micro-batch, the ranks' batches side by side
(each with the KL rows its rank built), one KL point over all their KL rows, the loss the mean
over every example of the step.

The reference is a frozen model of other weights (``ref_scale``) held beside the policy and
loaded by the loop's ``load_reference`` (``held``), or the base with the adapter disabled
(``lora``); either way the KL term is not 0 (the test checks). ``order: no_grad_first`` runs
every micro-batch's no-grad forwards before the first backward (:func:`no_grad_first_values`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import hf_scale
from hf_scale.data.unpaired import UnpairedCollator
from hf_scale.parallel.kto import kl_point, kto_examples, kto_prepare, kto_step
from hf_scale.parallel.preference_loss import PreferenceLoss, kto_means
from hf_scale.parallel.preference_reference import frozen_reference_logps
from hf_scale.train.dp import DataParallel
from hf_scale.train.kto import kto_step_values
from hf_scale.train.step_sums import StepSums
from tests.tiny_models import tiny_model, unpaired_rows

EXAMPLES = 8  # per step, global
PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}


def step_rows(step: int) -> list[dict]:
    return unpaired_rows(EXAMPLES, seed=2 + step)  # seeds where LoRA's KL point is above 0 too


def reference_model(case: dict):
    """The held reference's weights: the starting weights with the (tied) embeddings scaled by
    ``ref_scale`` (sharper: the policy's log-probs of the KL rows are the higher, so the KL
    point is above 0)."""
    model = tiny_model(case.get("arch", "llama"), "causal").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(case["ref_scale"])
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def micro_rows(rows: list[dict], rank: int, world: int, accum: int) -> list[list[dict]]:
    """Rank ``rank``'s examples of a step, split into its ``accum`` micro-batches."""
    per_rank = len(rows) // world
    mine = rows[rank * per_rank:(rank + 1) * per_rank]
    return [mine[i::accum] for i in range(accum)]


def merge(batches: list[dict]) -> dict:
    """Collated batches side by side (padded on the right to the widest), as one batch."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out = {k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1]), value=v) for b in batches])
           for k, v in PAD.items()}
    out["label"] = torch.cat([b["label"] for b in batches])
    return out


def reference_run(case: dict, make_model, world: int = 2) -> dict:
    """One process: each micro-batch the ranks' batches merged, its KL point over all of them."""
    from tests.distributed.preference_checks import BIG_NORM, LR, _trainable

    model = make_model(case)
    reference = None if case.get("lora") else reference_model(case)
    knobs = PreferenceLoss(**case["loss"])
    collate, accum = UnpairedCollator(0), case.get("accum", 1)
    names = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.0)
    out = {"losses": [], "norms": [], "metrics": [], "refs": []}
    for step in range(case.get("steps", 1)):
        shares = [micro_rows(step_rows(step), r, world, accum) for r in range(world)]
        loss, sums = 0.0, {}
        for i in range(accum):
            batch = merge([collate(shares[r][i]) for r in range(world)])
            if reference is not None:
                batch["ref_logps"] = frozen_reference_logps(reference, batch)
            result = kto_step(model, batch, knobs, kl_point(kto_prepare(model, batch, knobs)), totals=EXAMPLES)
            loss += float(result.loss)
            sums = {k: sums.get(k, 0.0) + float(v) for k, v in result.sums.items()}
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in names.items() if p.grad is not None}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(_trainable(model), BIG_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss)
        out["metrics"].append(kto_means(sums, EXAMPLES))
    out["params"] = {n: p.detach().clone() for n, p in names.items()}
    return out


def no_grad_first_values(job, model, micro: list[dict], dp) -> dict:
    """kto_step_values' step in the other order: every micro-batch's no-grad forwards (the base
    with the adapter off, the KL rows) before the first forward with gradients. With peft's
    ``disable_adapter`` as the reference's switch this gave the last block's adapter the first
    micro-batch's gradient only under fsdp (and no start at all under zero2 / ddp):
    :mod:`hf_scale.parallel.adapter_off` says why."""
    knobs = job.preference.knobs()
    examples = torch.tensor([sum(kto_examples(b) for b in micro)], dtype=torch.float64)
    totals = float(dp.all_reduce(examples)[0])
    points = [kl_point(dp.all_reduce(kto_prepare(model, batch, knobs))) for batch in micro]
    step = StepSums()
    for i, (batch, kl) in enumerate(zip(micro, points)):
        with hf_scale.no_sync(model, enabled=i < len(micro) - 1):
            step.add(kto_step(model, batch, knobs, kl, loss_scale=dp.degree, totals=totals))
    loss, sums = step.reduced(dp)
    return {"loss": loss, **kto_means(sums, totals)}


def parallel_run(case: dict, make_model) -> dict:
    """The ranks' run through the fine-tuning loop's KTO step."""
    from tests.distributed.preference_checks import BIG_NORM, LR, _full, _trainable, held_reference

    model = hf_scale.parallelize(make_model(case), case["config"])
    state = hf_scale.get_state(model)
    dp = DataParallel.of(model)
    held = held_reference(case, state.env.device) if case.get("held") else None
    job = SimpleNamespace(preference=SimpleNamespace(knobs=lambda: PreferenceLoss(**case["loss"])))
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.0)
    collate, accum = UnpairedCollator(0), case.get("accum", 1)
    out = {"losses": [], "norms": [], "metrics": [], "refs": None}
    for step in range(case.get("steps", 1)):
        micro = [collate(rows) for rows in micro_rows(step_rows(step), dp.rank, dp.degree, accum)]
        if case.get("order") == "no_grad_first":
            values = no_grad_first_values(job, model, micro, dp)
        else:
            values = kto_step_values(job, model, micro, dp, 1.0, held)
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        out["norms"].append(float(hf_scale.clip_grad_norm_(model, BIG_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(values.pop("loss"))
        out["metrics"].append(values)
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return out
