"""Preference steps (DPO and its kin) on an interleaved pair batch, under every layout.

A batch holds ``2P`` rows: row ``2i`` is pair ``i``'s chosen sequence, row ``2i + 1`` its
rejected one (``input_ids``, ``attention_mask``, ``labels`` with ``-100`` on the prompt and the
padding), and, for losses that compare with a reference, ``ref_logps`` ``[2P]`` in the same
order. Both halves of every pair go through ONE forward. The per-position log-probabilities come
from the model's own loss path (:mod:`hf_scale.parallel.token_logps`), so a chunked or
vocabulary-parallel loss keeps the full logits from existing, and on the other layouts the head
runs on the completions' positions only (``logits_to_keep``); under pipeline parallel the last
stage returns them per microbatch and the loss is computed there (a microbatch must hold whole
pairs: an even number of rows).

The loss of a step is, as one process on the whole global batch would compute it, the mean of
the per-pair losses over all its pairs (plus the NLL term's mean over all its chosen tokens):
pass the global counts as ``totals`` (:func:`pair_totals` summed over micro-batches and
data-parallel ranks); each call then adds its share, and the returned ``sums`` of TRL's metrics
add up over calls and ranks to the step's (divide by the total pairs).

Usage::

    knobs = PreferenceLoss("sigmoid", beta=0.1)
    out = preference_step(model, batch, knobs)        # backward done; out.loss detached
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import HfScaleConfigError
from ..parallel_state import get_state
from .adapter_off import adapter_disabled
from .preference_loss import PreferenceLoss, pair_losses
from .token_logps import keeps_scored_logits, scored_positions, token_logps_mode

IGNORE = -100


@dataclass(frozen=True)
class PairTotals:
    """The normalisers of a step: its pairs, and the tokens its NLL term averages over."""

    pairs: float
    nll_tokens: float = 0.0

    def __add__(self, other: PairTotals) -> PairTotals:
        return PairTotals(self.pairs + other.pairs, self.nll_tokens + other.nll_tokens)


@dataclass
class PreferenceOutput:
    """What a preference step returns: its share of the step loss (detached, fp32) and the sums
    over its pairs of TRL's metrics (fp64; ``nll`` too when the loss has an NLL term)."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    pairs: int = 0


def pair_totals(batch: dict, knobs: PreferenceLoss) -> PairTotals:
    """This batch's pairs and NLL-term tokens (sum them over micro-batches and data-parallel
    ranks for a step's :class:`PairTotals`); pairs weighted 0 (``pair_weight``) do not count."""
    weight = _pair_weight(batch).to(batch["input_ids"].device)
    nll = 0.0
    if knobs.nll_weight:
        nll = float((_nll_mask(batch, knobs)[0::2].sum(-1) * weight).sum())
    return PairTotals(float(weight.sum()), nll)


def _pair_weight(batch: dict) -> torch.Tensor:
    """Per pair 1, or the batch's ``pair_weight`` (0: a padding copy evaluation adds)."""
    weight = batch.get("pair_weight")
    pairs = batch["input_ids"].shape[0] // 2
    return torch.ones(pairs, dtype=torch.float32) if weight is None else weight.float().cpu()


def preference_step(model: nn.Module, batch: dict, knobs: PreferenceLoss, loss_scale: float = 1.0,
                    totals: PairTotals | None = None) -> PreferenceOutput:
    """Forward (chosen and rejected in one) and backward of ``loss_scale`` x this batch's share of
    the step loss; gradients accumulate into ``.grad``. ``totals``: the step's (default: this
    batch's). The reference: ``batch["ref_logps"]``, else, for a peft model, the base with the
    adapter disabled (one no-grad forward); reference-free losses need none."""
    return _run(model, batch, knobs, loss_scale, totals, train=True)


def preference_eval_step(model: nn.Module, batch: dict, knobs: PreferenceLoss,
                         totals: PairTotals | None = None) -> PreferenceOutput:
    """The same loss and metric sums without gradients (train/eval mode left as is)."""
    with torch.no_grad():
        return _run(model, batch, knobs, 1.0, totals, train=False)


def sequence_logps(model: nn.Module, batch: dict) -> torch.Tensor:
    """``[rows]`` summed log-probabilities of each row's labelled tokens, without gradients, under
    the model's layout (the same on every rank of a tensor-parallel group or pipeline): the
    reference's log-probs when ``model`` is the reference."""
    rows = batch["input_ids"].shape[0]
    target = _target(batch, _completion_mask(batch), None, None, torch.ones(rows // 2 + rows % 2))
    pipeline = _pipeline(model)
    with torch.no_grad():
        if pipeline is None:
            inputs = _model_inputs(batch, batch["labels"])
            with token_logps_mode(_host(model)):
                per_position = _local(model(**inputs, **_scored_only(model, inputs["labels"])).loss)
            return (per_position.float() * _completion_mask(batch).to(per_position.device)).sum(-1)
        found = torch.zeros(rows, dtype=torch.float32, device=pipeline.device)

        def record(output, target_rows):
            width = output.shape[-1]
            index = target_rows[:, -1].long()
            found.index_copy_(0, index, (output.float() * target_rows[:, :width]).sum(-1))
            return output.sum() * 0.0

        with _last_stage_mode(pipeline):
            pipeline.run_rows(_model_inputs(batch, batch["labels"]), target, record, train=False)
        dist.all_reduce(found, group=pipeline.pp_group)  # found on the last stage's rank only
        return found


# ---------------------------------------------------------------------------- internals
def _run(model, batch, knobs, loss_scale, totals, train) -> PreferenceOutput:
    _check_batch(model, batch, knobs)
    totals = totals or pair_totals(batch, knobs)
    ref = _reference(model, batch, knobs)
    target = _target(batch, _completion_mask(batch), _nll_mask(batch, knobs) if knobs.nll_weight else None, ref,
                     _pair_weight(batch))
    inputs = _model_inputs(batch, _model_labels(batch, knobs))
    pipeline = _pipeline(model)
    if pipeline is None:
        with token_logps_mode(_host(model)):
            per_position = _local(model(**inputs, **_scored_only(model, inputs["labels"])).loss)
        loss, sums = microbatch_loss(knobs, totals, per_position, target.to(per_position.device))
        if train:
            (loss * loss_scale).backward()
        return PreferenceOutput(loss.detach().float(), sums, batch["input_ids"].shape[0] // 2)
    if (batch["input_ids"].shape[0] // pipeline.microbatches) % 2:
        raise HfScaleConfigError(
            f"a pair batch of {batch['input_ids'].shape[0]} rows in pp_microbatches={pipeline.microbatches} "
            "microbatches splits a pair (chosen and rejected must share a microbatch): make the pairs per "
            f"batch a multiple of {pipeline.microbatches}."
        )
    found: list[dict] = []

    def row_loss(output, target_rows):
        loss, sums = microbatch_loss(knobs, totals, output, target_rows)
        found.append(sums)
        return loss

    with _last_stage_mode(pipeline):
        loss = pipeline.run_rows(inputs, target, row_loss, loss_scale, train=train)
    names = sorted(metric_names(knobs))
    mine = found[-pipeline.microbatches:] if pipeline.holds_last else []
    sums = torch.zeros(len(names), dtype=torch.float64, device=pipeline.device)
    for entry in mine:
        sums += torch.stack([entry[n].to(sums.device) for n in names])
    dist.all_reduce(sums, group=pipeline.pp_group)
    return PreferenceOutput(loss, dict(zip(names, sums)), batch["input_ids"].shape[0] // 2)


def metric_names(knobs: PreferenceLoss) -> set[str]:
    """The keys of :attr:`PreferenceOutput.sums`: TRL's metrics, ``pair_loss`` (the per-pair
    losses' sum) and, with an NLL term, ``nll`` (its summed negative log-likelihood)."""
    from .preference_loss import METRICS

    return set(METRICS) | {"pair_loss"} | ({"nll"} if knobs.nll_weight else set())


def microbatch_loss(knobs: PreferenceLoss, totals: PairTotals, per_position: torch.Tensor,
                    target: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The share of the step loss of some whole pairs, from their rows' per-position
    log-probabilities ``[rows, seq]`` and their rows of the target :func:`_target` built."""
    rows, width = per_position.shape
    completion, nll_mask = target[:, :width], target[:, width:2 * width]
    ref, has_ref, weight = target[:, -4], bool(target[0, -3]) if rows else False, target[0::2, -2]
    per_position = per_position.float()
    logps = (per_position * completion).sum(-1)
    counts = completion.sum(-1)
    terms = pair_losses(knobs, logps[0::2], logps[1::2], counts[0::2], counts[1::2],
                        ref[0::2] if has_ref else None, ref[1::2] if has_ref else None)
    pair_loss = (terms.losses * weight).sum()
    loss = pair_loss / max(totals.pairs, 1)
    sums = {**terms.metric_sums(weight), "pair_loss": pair_loss.detach().double()}
    if knobs.nll_weight:
        nll = -((per_position[0::2] * nll_mask[0::2]).sum(-1) * weight).sum()
        loss = loss + knobs.nll_weight * nll / max(totals.nll_tokens, 1)
        sums["nll"] = nll.detach().double()
    return loss, sums


def _shifted(mask: torch.Tensor) -> torch.Tensor:
    """Position t of the per-position log-probs is about token t+1."""
    return F.pad(mask, (0, 1), value=0)[..., 1:]


def _completion_mask(batch: dict) -> torch.Tensor:
    return _shifted((batch["labels"] != IGNORE).float())


def _nll_mask(batch: dict, knobs: PreferenceLoss) -> torch.Tensor:
    """The positions the NLL term counts: the completion's tokens, or (orpo) every attended one."""
    if not knobs.nll_on_prompt:
        return _completion_mask(batch)
    mask = batch.get("attention_mask")
    return _shifted(torch.ones_like(batch["input_ids"], dtype=torch.float32) if mask is None else mask.float())


def _model_labels(batch: dict, knobs: PreferenceLoss) -> torch.Tensor:
    """The labels the model's loss path gets: the completion's, or (orpo) every attended token."""
    if not knobs.nll_on_prompt:
        return batch["labels"]
    mask = batch.get("attention_mask")
    return batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, IGNORE)


def _target(batch, completion, nll_mask, ref, weight) -> torch.Tensor:
    """Per row, what the loss needs beside the log-probs, in one float tensor (a pipeline splits
    it into microbatches with the batch): completion mask | NLL mask | ref log-prob | has-ref
    flag | its pair's weight | row index."""
    rows, _seq = completion.shape
    device = completion.device
    extra = torch.zeros(rows, 4, dtype=torch.float32, device=device)
    if ref is not None:
        extra[:, 0] = ref.to(device=device, dtype=torch.float32)
        extra[:, 1] = 1.0
    extra[:, 2] = weight.to(device).repeat_interleave(2)[:rows]
    extra[:, 3] = torch.arange(rows, device=device, dtype=torch.float32)
    nll_mask = torch.zeros_like(completion) if nll_mask is None else nll_mask.to(device)
    return torch.cat([completion.float(), nll_mask.float(), extra], dim=1)


def _model_inputs(batch: dict, labels: torch.Tensor) -> dict:
    inputs = {"input_ids": batch["input_ids"], "labels": labels}
    if batch.get("attention_mask") is not None:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def _scored_only(model: nn.Module, labels: torch.Tensor) -> dict:
    """``logits_to_keep``: the output head on the positions a label is scored at only (a
    completion's few tokens of each row), not ``[rows, seq, vocabulary]`` logits and their
    log-softmax, when the model takes it (:func:`~.token_logps.keeps_scored_logits`); not
    under tensor parallel (its head's input is a DTensor; a vocabulary-sharded head has the
    vocabulary-parallel loss instead) nor on fake tensors (the planner's simulation: the
    positions are values it does not have)."""
    from .loss import is_fake

    state = get_state(model)
    if (state is not None and state.tp_mesh is not None) or is_fake(labels):
        return {}
    return {"logits_to_keep": scored_positions(labels)} if keeps_scored_logits(_host(model)) else {}


def _reference(model, batch, knobs) -> torch.Tensor | None:
    if not knobs.needs_reference:
        return None
    if batch.get("ref_logps") is not None:
        return batch["ref_logps"]
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):  # the base, adapter off
        with adapter_disabled(model):  # not peft's disable_adapter: it flips requires_grad (see adapter_off)
            return sequence_logps(model, batch)
    raise HfScaleConfigError(
        f"preference loss {knobs.loss!r} needs the reference's log-probs: give the batch 'ref_logps' "
        "(precompute them with hf_scale.parallel.preference_reference.reference_logps before the first "
        "optimizer step), train a LoRA adapter (the reference is the base with the adapter disabled), "
        "or use a reference-free loss (simpo, orpo)."
    )


def _check_batch(model, batch: dict, knobs: PreferenceLoss) -> None:
    missing = [k for k in ("input_ids", "labels") if batch.get(k) is None]
    if missing:
        raise HfScaleConfigError(f"a preference batch needs {missing}: PairCollator's input_ids, attention_mask "
                                 "and labels, chosen and rejected rows interleaved.")
    rows = batch["input_ids"].shape[0]
    if rows % 2:
        raise HfScaleConfigError(f"a preference batch has {rows} rows, an odd number: it needs chosen and "
                                 "rejected rows interleaved (row 2i chosen, 2i+1 rejected), as PairCollator makes.")
    if batch.get("position_ids") is not None and batch.get("attention_mask") is None:
        raise HfScaleConfigError("packed / padding-free preference batches are not supported: pad the pairs "
                                 "(PairCollator) and set data.packing: null, data.padding_free: false.")
    state = get_state(model)
    if state is not None and state.cp_degree > 1:
        raise HfScaleConfigError("preference training under context parallel (cp > 1) is not supported yet: "
                                 "set parallel.cp: 1.")


def _host(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a peft wrapper (its forward calls loss_function)."""
    from ..model_plans.adapters import adapter_host

    return adapter_host(model)


def _pipeline(model: nn.Module):
    state = get_state(model)
    return None if state is None else state.pipeline


@contextlib.contextmanager
def _last_stage_mode(pipeline):
    """Per-position log-probs from the last stage's forward (the stage's model view)."""
    with contextlib.ExitStack() as stack:
        for module in pipeline.stage_modules:
            if getattr(module, "last", False):
                if getattr(module, "own_mean", False):
                    raise HfScaleConfigError(
                        f"{type(module.view).__name__} computes its own loss (not through loss_function): "
                        "preference training under pipeline parallel needs a transformers causal LM."
                    )
                stack.enter_context(token_logps_mode(module.view))
        yield


def _local(value: torch.Tensor) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)
    return full() if full else value
