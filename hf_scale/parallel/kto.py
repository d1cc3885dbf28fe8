"""KTO steps (unpaired desirable / undesirable examples) on an interleaved batch, under the
non-pipeline layouts (fsdp, zero2, hsdp, ddp, tp).

A batch holds ``2N`` rows (:class:`hf_scale.data.unpaired.UnpairedCollator`): row ``2i`` is
example ``i`` (its prompt and completion, ``labels`` -100 on the prompt and the padding), row
``2i + 1`` its KL row (example ``i``'s prompt with example ``i - 1``'s completion: TRL's
mismatched pairs, the completions rotated by one within the batch), and ``label`` ``[N]`` (True:
desirable). ``ref_logps`` ``[2N]``, the reference's summed completion log-probs of every row in
the same order, come from the batch (a held reference model scored by the caller) or, for a
peft model, from the base with the adapter disabled (one no-grad forward of all ``2N`` rows).

A step is TRL's ``KTOTrainer._compute_loss``:

1. :func:`kto_prepare` (no gradients): the policy's log-probs of the KL rows (one no-grad
   forward, like TRL's), the reference's if missing, and this rank's ``[sum, count]`` of
   ``policy - reference`` over its KL rows.
2. The caller sums those over the data-parallel ranks (TRL gathers each rank's KL mean and
   averages them: the same for equal micro-batches) and :func:`kl_point` turns the sum into the
   reference point: the mean, detached, clamped at 0.
3. :func:`kto_step`: the forward (with gradients) of the examples' rows only and backward of
   ``loss_scale`` x this micro-batch's share of the step loss, the mean over every example of
   the step (pass the global example count as ``totals``).

Usage::

    knobs = PreferenceLoss("kto", beta=0.1)
    sums = kto_prepare(model, batch, knobs)              # [2]; all-reduce over data-parallel ranks
    out = kto_step(model, batch, knobs, kl=kl_point(sums))
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HfScaleConfigError
from ..parallel_state import get_state
from .preference import (
    PreferenceOutput,
    _host,
    _local,
    _pair_weight,
    _reference,
    sequence_logps,
)
from .preference_loss import PreferenceLoss, kto_losses
from .token_logps import token_logps_mode

ROWS = ("input_ids", "attention_mask", "labels")


def example_rows(batch: dict) -> dict:
    """The examples' rows (``0::2``), cut to their longest sequence."""
    return _rows(batch, 0)


def kl_rows(batch: dict) -> dict:
    """The KL rows (``1::2``: each example's prompt with the previous example's completion)."""
    return _rows(batch, 1)


def _rows(batch: dict, start: int) -> dict:
    rows = {k: batch[k][start::2] for k in ROWS if batch.get(k) is not None}
    mask = rows.get("attention_mask")
    width = int(mask.sum(-1).max()) if mask is not None and mask.numel() else rows["input_ids"].shape[-1]
    return {k: v[:, :width] for k, v in rows.items()}  # right padding: the cut drops padding only


def kto_examples(batch: dict) -> float:
    """This batch's examples (weighted by ``pair_weight``, 0 for padding copies): sum over
    micro-batches and data-parallel ranks for a step's ``totals``."""
    return float(_pair_weight(batch).sum())


def kto_prepare(model: nn.Module, batch: dict, knobs: PreferenceLoss) -> torch.Tensor:
    """No-grad part of a KTO step: sets ``batch["ref_logps"]`` (the base with the adapter
    disabled, unless the batch has them) and ``batch["kl_logps"]`` (the policy's KL rows), and
    returns ``[sum over KL rows of policy - reference, count]`` (fp64, weighted), to sum over
    data-parallel ranks for :func:`kl_point`."""
    _check_batch(model, batch, knobs)
    batch["ref_logps"] = _reference(model, batch, knobs).float()
    with torch.no_grad():
        policy = sequence_logps(model, kl_rows(batch)).float()
    batch["kl_logps"] = policy
    weight = _pair_weight(batch).double().to(policy.device)
    diff = (policy.double() - batch["ref_logps"][1::2].double().to(policy.device)) * weight
    return torch.stack([diff.sum(), weight.sum()]).cpu()


def kl_point(sums: torch.Tensor) -> float:
    """The KL reference point from the ``[sum, count]`` of every data-parallel rank's KL rows:
    their mean, clamped at 0 (TRL's ``kl.clamp(min=0)``; a float, so no gradient reaches it)."""
    return max(float(sums[0]) / max(float(sums[1]), 1.0), 0.0)


def kto_step(model: nn.Module, batch: dict, knobs: PreferenceLoss, kl: float, loss_scale: float = 1.0,
             totals: float | None = None, train: bool = True) -> PreferenceOutput:
    """Forward (the examples' rows, with gradients) and backward of ``loss_scale`` x this batch's
    share of the step loss (``totals``: the step's examples; default this batch's). Call
    :func:`kto_prepare` on the batch first. ``out.sums``: :meth:`KtoTerms.metric_sums`,
    ``example_loss`` (the weighted losses' sum) and ``kl`` (``kl`` x this batch's examples);
    ``out.pairs``: its examples."""
    if batch.get("ref_logps") is None or batch.get("kl_logps") is None:
        raise HfScaleConfigError("kto_step needs kto_prepare(model, batch, knobs) first (the reference's and the "
                                 "KL rows' log-probs).")
    totals = kto_examples(batch) if totals is None else totals
    rows = example_rows(batch)
    with torch.set_grad_enabled(train), token_logps_mode(_host(model)):
        per_position = _local(model(**rows).loss)
    logps = per_position.float().sum(-1)  # token_logps_mode: 0 where the label is -100
    weight = _pair_weight(batch).to(logps.device)
    terms = kto_losses(knobs, logps, batch["ref_logps"][0::2].to(logps.device), batch["label"], kl)
    example_loss = (terms.losses * weight).sum()
    loss = example_loss / max(totals, 1.0)
    if train:
        (loss * loss_scale).backward()
    sums = {**terms.metric_sums(weight), "example_loss": example_loss.detach().double(),
            "kl": torch.tensor(kl * float(weight.sum()), dtype=torch.float64)}
    return PreferenceOutput(loss.detach().float(), sums, rows["input_ids"].shape[0])


def _check_batch(model, batch: dict, knobs: PreferenceLoss) -> None:
    if knobs.loss != "kto":
        raise HfScaleConfigError(f"kto_prepare runs loss 'kto', not {knobs.loss!r} (preference_step runs pairs).")
    missing = [k for k in ("input_ids", "labels", "label") if batch.get(k) is None]
    if missing:
        raise HfScaleConfigError(f"a KTO batch needs {missing}: UnpairedCollator's input_ids, attention_mask, labels "
                                 "(example and KL rows interleaved) and label (True: desirable).")
    rows, examples = batch["input_ids"].shape[0], batch["label"].shape[0]
    if rows != 2 * examples or examples < 2:
        raise HfScaleConfigError(
            f"a KTO batch of {rows} rows and {examples} labels: it needs 2 rows per example (the example, then its "
            "KL row) and at least 2 examples (the KL rows pair each prompt with another example's completion; with "
            "one the KL term is the reward itself, as TRL says), as UnpairedCollator makes.")
    state = get_state(model)
    if state is not None and (state.cp_degree > 1 or state.pipeline is not None):
        raise HfScaleConfigError("kto under context or pipeline parallel (cp > 1, pp > 1) is not supported yet: use "
                                 "fsdp, zero2, hsdp, ddp or tp.")
