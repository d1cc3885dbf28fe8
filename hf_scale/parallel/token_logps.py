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
chunking), logits -> log-softmax -> gather, and the head runs on the scored positions only when
the caller passes ``logits_to_keep=scored_positions(labels)`` (:func:`keeps_scored_logits` says
whether the model takes it): a preference batch's completions are a few tokens of each row, so
the ``[rows, seq, vocabulary]`` logits (SmolLM2: 49k entries a position, fp32, plus their
log-softmax) shrink to ``[scored, vocabulary]``; the values are the same.

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


def scored_positions(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``[rows, seq]`` bool: the positions whose logits a label is scored against (position t
    predicts ``labels[:, t + 1]``). As ``logits_to_keep``, transformers runs the head on these
    positions only and returns their logits flattened, ``[scored, vocabulary]``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] != ignore_index


def token_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``[rows, seq]`` log-probabilities of the shifted ``labels`` under ``logits`` (fp32), 0
    where ignored: the full-logits path, for layouts that do not chunk the loss. ``logits``
    ``[rows, seq, vocabulary]``, or ``[scored, vocabulary]`` for the :func:`scored_positions`
    of ``labels`` only (in that order: a forward given them as ``logits_to_keep``)."""
    full = getattr(logits, "full_tensor", None)  # a tensor-parallel model that gathers its logits
    logits = (full() if full else logits).float()
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    valid = shift != ignore_index
    if logits.dim() == 2:  # the head ran on the scored positions only
        if logits.shape[0] != int(valid.sum()):
            raise ValueError(f"logits for {logits.shape[0]} positions, but the labels score {int(valid.sum())}: "
                             "pass logits_to_keep=scored_positions(labels) with these labels")
        picked = torch.log_softmax(logits, dim=-1).gather(-1, shift[valid].unsqueeze(-1)).squeeze(-1)
        return picked.new_zeros(valid.shape).masked_scatter(valid, picked)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, shift.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * valid


def enable_token_logps(module: nn.Module) -> dict:
    """The switch of ``module``'s loss function (installed once: the chunked loss has its own;
    transformers' gets a wrapper that computes :func:`token_logps` while the switch is on)."""
    current = module.loss_function
    switch = getattr(current, _SWITCH, None)
    if switch is not None:
        return switch
    switch = {"per_token": False, "scored_logits": True}  # takes logits of the scored positions only

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


def keeps_scored_logits(module: nn.Module) -> bool:
    """Whether ``module(..., logits_to_keep=scored_positions(labels))`` under
    :func:`token_logps_mode` runs its head on the scored positions only and still gives the
    ``[rows, seq]`` log-probs: its forward honours a 2-D ``logits_to_keep`` (transformers'
    ``slice_logits_to_keep``, whose 2-D bool mask keeps the scored positions flattened:
    :func:`_honours_2d_logits_to_keep` tries it) and its loss is transformers' (the chunked loss
    selects its positions itself, ``loss_labeled_only``)."""
    if not hasattr(module, "loss_function"):
        return False
    return bool(enable_token_logps(module).get("scored_logits")) and _honours_2d_logits_to_keep(module)


_PROBED: dict[type, bool] = {}


def _honours_2d_logits_to_keep(module: nn.Module) -> bool:
    """A one-layer copy of ``module``'s class and config built on the meta device (no memory, no
    collectives: every rank decides alone, once per class) runs 4 positions with 2-D
    ``logits_to_keep`` positions ``[[0, 0]]``: True when its logits are ``[1, 2, vocabulary]``
    (transformers' 2-D branch, where the bool mask is too). A forward that ignores it ([1, 4,
    ...]), reads it as one axis' index or fails on the meta device keeps the full logits (the
    same values, more memory)."""
    # the class that defines forward: fully_shard's FSDP<Class> subclass adds hooks, not a forward
    cls = next(c for c in type(module).__mro__ if "forward" in vars(c))
    if cls not in _PROBED:
        _PROBED[cls] = _probe(cls, getattr(module, "config", None))
    return _PROBED[cls]


def _probe(cls: type, config) -> bool:
    import copy

    if config is None:
        return False
    config = copy.deepcopy(config)
    try:
        config.num_hidden_layers = 1
        # with a cache, transformers skips its search for packed documents in position_ids, whose
        # `.all()` cannot run on the meta device: a parallelized model's config has use_cache off
        # (hf_scale.orchestrate.disable_kv_cache), and the probe failed on every one of them
        config.use_cache = True
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:1]
        config._attn_implementation = "sdpa"
        if hasattr(config, "_experts_implementation"):  # grouped_mm refuses fp32 meta tensors
            config._experts_implementation = "batched_mm"
        with torch.device("meta"), torch.no_grad():
            logits = cls(config)(input_ids=torch.zeros(1, 4, dtype=torch.long),
                                 logits_to_keep=torch.zeros(1, 2, dtype=torch.long)).logits
    except Exception:  # noqa: BLE001 - any failure: keep the full logits
        return False
    return tuple(logits.shape[:2]) == (1, 2) and logits.dim() == 3


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
