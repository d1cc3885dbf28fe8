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
    loss = _loss(model(**batch, **forward_options(batch)), batch)
    (loss * loss_scale).backward()
    return loss.detach().float()


def eval_step(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss of one batch, without gradients (the model's train/eval mode is left as is)."""
    pipeline = _pipeline(model)
    if pipeline is not None:
        return pipeline.eval_step(batch)
    with torch.no_grad():
        return _loss(model(**batch, **forward_options(batch)), batch).float()


def is_packed(batch) -> bool:
    """A batch of documents kept apart by ``position_ids`` (no attention mask)."""
    return batch.get("position_ids") is not None and batch.get("attention_mask") is None


def forward_options(batch) -> dict:
    """What a forward of ``batch`` must be called with besides the batch: ``use_cache=False`` for
    packed documents. A model whose config has ``use_cache: true`` (most saved checkpoints) makes
    a cache even in training, and transformers looks for packed documents only without one:
    with it, every document of a row would attend to the ones before it."""
    return {"use_cache": False} if is_packed(batch) else {}


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
