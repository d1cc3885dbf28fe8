"""``train_step`` / ``eval_step``: one training API for every layout, pipeline or not.

Without pipeline parallel a step is the plain ``model(**batch).loss`` and its backward; under
pipeline parallel the model's forward cannot run alone on a stage, and the step goes through
the schedule (:class:`hf_scale.parallel.pp_schedule.Pipeline`). The fine-tuning loop and user
scripts call these and never branch on the layout. ``parallelize`` also binds them as
``model.train_step(batch)`` and ``model.eval_step(batch)``.

Usage::

    loss = model.train_step(batch)         # gradients accumulate into .grad; loss is detached
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HfScaleConfigError
from ..parallel_state import get_state


def train_step(model: nn.Module, batch: dict, loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one batch; the gradients are those of ``loss_scale * loss``.

    Returns the (unscaled, detached, fp32) loss of the batch: under pipeline parallel the
    same on every rank of the pipeline; otherwise the loss of this rank's batch.
    """
    pipeline = _pipeline(model)
    if pipeline is not None:
        return pipeline.train_step(batch, loss_scale)
    loss = _loss(model(**batch), batch)
    (loss * loss_scale).backward()
    return loss.detach().float()


def eval_step(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss of one batch, without gradients (the model's train/eval mode is left as is)."""
    pipeline = _pipeline(model)
    if pipeline is not None:
        return pipeline.eval_step(batch)
    with torch.no_grad():
        return _loss(model(**batch), batch).float()


def _pipeline(model: nn.Module):
    state = get_state(model)
    return None if state is None else state.pipeline


def _loss(output, batch: dict) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None:
        raise HfScaleConfigError(
            f"the model returned no loss for a batch with keys {sorted(batch)}: train_step and "
            "eval_step need 'labels' in the batch."
        )
    full = getattr(loss, "full_tensor", None)  # a tensor-parallel loss may be a DTensor
    return full() if full else loss
