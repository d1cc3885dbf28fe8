"""Per-position log-probabilities of the labels, computed in the model's own loss path.

Preference losses need, per sequence, the summed log-probability of its completion tokens, not
one mean over the batch. :func:`token_logps_mode` switches a causal LM's ``loss_function`` so
that ``model(input_ids, attention_mask=..., labels=labels).loss`` is ``[rows, seq]``: at
position ``t`` the log-probability of ``labels[:, t + 1]`` (transformers' shift: position t
predicts token t+1), 0 where that label is ignored (``-100``) and in the last column. Reducing
it per row is then the caller's (a ``[rows, seq]`` tensor, no vocabulary dimension).

Because the switch lives in the loss path, what the layout already does to the loss applies:
with :func:`hf_scale.parallel.loss.apply_chunked_loss` (chunked head, labelled positions only,
or a tensor-parallel head's vocabulary-parallel cross-entropy) the per-position values are
computed chunk by chunk and no rank holds the full-vocabulary logits; under pipeline parallel
the last stage's forward returns them per microbatch. Without those (plain layouts, no
chunking), logits -> log-softmax -> gather.

Usage::

    with token_logps_mode(model):
        per_position = model(**batch).loss        # [rows, seq], differentiable
    logps = per_position.sum(-1)                  # labels -100 outside the completion
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

_SWITCH = "hf_scale_token_logps"  # the attribute of a loss function that holds its switch


def token_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``[rows, seq]`` log-probabilities of the shifted ``labels`` under ``logits`` (fp32), 0
    where ignored: the full-logits path, for layouts that do not chunk the loss."""
    full = getattr(logits, "full_tensor", None)  # a tensor-parallel model that gathers its logits
    logits = (full() if full else logits).float()
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    valid = shift != ignore_index
    picked = torch.log_softmax(logits, dim=-1).gather(-1, shift.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * valid


def enable_token_logps(module: nn.Module) -> dict:
    """The switch of ``module``'s loss function (installed once: the chunked loss has its own;
    transformers' gets a wrapper that computes :func:`token_logps` while the switch is on)."""
    current = module.loss_function
    switch = getattr(current, _SWITCH, None)
    if switch is not None:
        return switch
    switch = {"per_token": False}

    @functools.wraps(current)
    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
             **kwargs):
        if switch["per_token"]:
            return token_logps(logits, labels, ignore_index)
        return current(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                       ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)

    setattr(loss, _SWITCH, switch)
    module.loss_function = loss
    return switch


@contextlib.contextmanager
def token_logps_mode(module: nn.Module):
    """Within: ``module(..., labels=labels).loss`` is the ``[rows, seq]`` per-position
    log-probabilities of the labels (see the module docstring). ``module`` is the causal LM
    whose forward calls ``loss_function`` (the transformers model, or a pipeline stage's view)."""
    if not hasattr(module, "loss_function"):
        from ..errors import HfScaleConfigError

        raise HfScaleConfigError(
            f"preference training needs a causal LM whose forward computes its loss through "
            f"loss_function; {type(module).__name__} has none."
        )
    switch = enable_token_logps(module)
    switch["per_token"] = True
    try:
        yield
    finally:
        switch["per_token"] = False
