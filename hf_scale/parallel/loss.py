"""Chunked causal-LM loss: cross-entropy over the output head without materialising the logits.

A causal LM's logits (batch x sequence x vocabulary, fp32 in the loss) are often the largest
activation of a step once the blocks are checkpointed: SmolLM2's 49k vocabulary makes them
~200 MB per 1k tokens, and the loss keeps the log-softmax and the logits' gradient beside them.
:func:`apply_chunked_loss` computes ``head`` + cross-entropy on ``chunk_tokens`` tokens at a time,
each chunk under activation checkpointing, so only one chunk's logits exist at once, in forward
and in backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM loss of ``head(hidden)`` against ``labels``, as transformers' ``ForCausalLMLoss``.

    Labels are shifted left by one (position t predicts token t+1) unless ``shift_labels`` is
    given; the loss is the mean over non-ignored tokens, or the sum divided by
    ``num_items_in_batch`` when given (gradient accumulation over variable-length batches).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(flat_hidden.device)
    if flat_hidden.shape[0] <= chunk_tokens and torch.is_grad_enabled():
        import logging

        from ..log import log_rank0

        log_rank0(
            f"loss_chunk_tokens={chunk_tokens} >= the {flat_hidden.shape[0]} tokens of this "
            "forward: one chunk, so the full logits still exist. Use a smaller chunk (e.g. 128).",
            level=logging.WARNING,
            once=True,
        )
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(
            _chunk_loss,
            flat_hidden[start:end],
            head.weight,
            head.bias,
            flat_labels[start:end],
            ignore_index,
            use_reentrant=False,
        )
    if num_items_in_batch is None:
        num_items_in_batch = (flat_labels != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(hidden, weight, bias, labels, ignore_index):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


# Config attributes of models that transform the head's output before the loss (soft-capping,
# scaling): the loss would silently differ, so those models are refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def apply_chunked_loss(model: nn.Module, head: nn.Linear, chunk_tokens: int) -> None:
    """Make ``model``'s forward compute its loss with :func:`chunked_cross_entropy`.

    Contract: ``model`` is a transformers causal LM whose forward calls ``head`` on the final
    hidden states and passes the result straight to ``model.loss_function`` (true of the HF
    causal LMs without logit soft-capping or scaling). When a forward gets ``labels`` with
    gradients enabled, ``head`` passes the hidden states through, the loss is computed chunk
    by chunk, and the output's ``logits`` is None. Forwards without labels, and under
    ``torch.no_grad()`` (evaluation, ``generate``), are unchanged and return logits.
    """
    config = getattr(model, "config", None)
    transforms = [a for a in _LOGIT_TRANSFORMS if getattr(config, a, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(
            f"{type(model).__name__} transforms its logits before the loss ({transforms}); "
            "chunked loss would compute a different loss. Set loss_chunk_tokens=None."
        )
    if not isinstance(head, nn.Linear) or not hasattr(model, "loss_function"):
        raise ValueError(
            f"chunked loss needs a causal LM with a Linear output head and a loss_function; "
            f"{type(model).__name__} has {type(head).__name__}. Set loss_chunk_tokens=None."
        )
    state = {"active": False}
    head_forward = head.forward
    loss_function = model.loss_function

    def start(module, args, kwargs):
        wanted = kwargs.get("labels") is not None and torch.is_grad_enabled()
        state["active"] = state.get("force", wanted)

    def finish(module, args, kwargs, output):
        if state["active"] and output is not None and hasattr(output, "logits"):
            output["logits"] = None
        state["active"] = False
        return output

    @functools.wraps(head_forward)
    def head_or_passthrough(hidden_states):
        return hidden_states if state["active"] else head_forward(hidden_states)

    @functools.wraps(loss_function)
    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        state["calls"] = state.get("calls", 0) + 1
        if not state["active"]:
            return loss_function(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return chunked_cross_entropy(logits, head, labels, chunk_tokens, ignore_index=ignore_index,
                                     num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)

    handles = [
        model.register_forward_pre_hook(start, with_kwargs=True),
        model.register_forward_hook(finish, with_kwargs=True, always_call=True),
    ]
    head.forward = head_or_passthrough
    model.loss_function = loss
    try:
        _verify(model, head, state)
    except Exception:
        for handle in handles:  # leave the model as it was
            handle.remove()
        del head.forward
        model.loss_function = loss_function
        raise


@torch.no_grad()
def _verify(model: nn.Module, head: nn.Linear, state: dict) -> None:
    if head.weight.is_meta:
        return
    vocab = head.weight.shape[0]
    ids = torch.arange(8, device=head.weight.device).unsqueeze(0) * 7 % vocab
    was_training = model.training
    model.eval()  # no dropout: both forwards must see the same function
    try:
        losses = []
        for force in (False, True):
            state.update(force=force, calls=0)
            losses.append(model(input_ids=ids, labels=ids).loss)
            if state["calls"] != 1:
                raise ValueError(
                    f"{type(model).__name__}'s forward does not compute its loss through "
                    "model.loss_function, so chunked loss cannot apply. Set loss_chunk_tokens=None."
                )
    finally:
        state.pop("force", None)
        state["active"] = False
        model.train(was_training)
    plain, chunked = (float(x) for x in losses)
    if abs(plain - chunked) > 1e-4 * max(1.0, abs(plain)):
        raise ValueError(
            f"{type(model).__name__}: chunked loss {chunked:.6f} != its own loss {plain:.6f} on a "
            "probe batch; its forward changes the logits before the loss. Set loss_chunk_tokens=None."
        )
