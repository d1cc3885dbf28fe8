"""Chunked causal-LM loss: cross-entropy over the output head without materialising the logits.

A causal LM's logits (batch x sequence x vocabulary, fp32 in the loss) are often the largest
activation of a step once the blocks are checkpointed: SmolLM2's 49k vocabulary makes them
~200 MB per 1k tokens, and the loss keeps the log-softmax and the logits' gradient beside them.
:func:`apply_chunked_loss` computes ``head`` + cross-entropy on ``chunk_tokens`` tokens at a time,
each chunk under activation checkpointing, so only one chunk's logits exist at once, in forward
and in backward.

Under tensor parallel the head's weight is a ``DTensor`` sharded on the vocabulary: each rank
computes the logits of its vocabulary slice, and the cross-entropy runs on those slices
(Megatron-LM's vocabulary-parallel cross-entropy: a max, a sum of exponentials and the target
logits are all-reduced), so no rank ever holds the full logits; with ``chunk_tokens=None``
there is one chunk.
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
    chunk_tokens: int | None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    labeled_only: bool = False,
    per_token: bool = False,
) -> torch.Tensor:
    """Causal-LM loss of ``head(hidden)`` against ``labels``, as transformers' ``ForCausalLMLoss``.

    Labels are shifted left by one (position t predicts token t+1) unless ``shift_labels`` is
    given; the loss is the mean over non-ignored tokens, or the sum divided by
    ``num_items_in_batch`` when given (gradient accumulation over variable-length batches).
    ``labeled_only``: the head runs on the positions with a label only (an ignored position adds
    nothing to the loss or to any gradient, so both are unchanged); on a GPU, selecting them
    waits for the forward once (the count of labels decides the shapes).
    ``per_token``: no reduction: each position's cross-entropy, shaped as the shifted labels
    (0 where ignored), for losses that reduce per sequence (:mod:`hf_scale.parallel.token_logps`).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = shift_labels.reshape(-1).to(flat_hidden.device)
    everywhere = flat_labels
    if labeled_only:
        rows = (flat_labels != ignore_index).nonzero().squeeze(-1)
        flat_hidden, flat_labels = flat_hidden.index_select(0, rows), flat_labels.index_select(0, rows)
    if per_token:
        parts = [
            checkpoint(_chunk_loss, flat_hidden[start:start + chunk_tokens], head.weight, head.bias,
                       flat_labels[start:start + chunk_tokens], ignore_index, True, use_reentrant=False)
            for start in range(0, flat_hidden.shape[0], chunk_tokens)
        ] if chunk_tokens is not None else [_chunk_loss(flat_hidden, head.weight, head.bias, flat_labels,
                                                        ignore_index, True)]
        tokens = torch.cat(parts) if parts else flat_hidden.new_zeros(0, dtype=torch.float32)
        if labeled_only:  # back to every position (0 at the unlabelled ones)
            tokens = tokens.new_zeros(everywhere.shape[0]).index_add(0, rows, tokens)
        return tokens.view(shift_labels.shape)
    if chunk_tokens is None:  # one chunk (a vocabulary-parallel head without chunking)
        total = _chunk_loss(flat_hidden, head.weight, head.bias, flat_labels, ignore_index)
        return _normalise(total, flat_labels, ignore_index, num_items_in_batch)
    if flat_hidden.shape[0] <= chunk_tokens and torch.is_grad_enabled() and not labeled_only:
        import logging

        from ..log import log_rank0

        log_rank0(
            f"loss_chunk_tokens={chunk_tokens} >= the {flat_hidden.shape[0]} tokens of this "
            "forward: one chunk, so the full logits still exist. Use a smaller chunk (e.g. 128).",
            level=logging.WARNING,
            once=True,
        )
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    # one chunk at least: with no labeled position (``labeled_only`` on a batch whose labels are
    # all masked: one data-parallel rank's rows, one microbatch) the loss still comes from the
    # head (0 / 0, as transformers' mean over no label), so its backward runs like every rank's
    for start in range(0, max(flat_hidden.shape[0], 1), chunk_tokens):
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
    return _normalise(total, flat_labels, ignore_index, num_items_in_batch)


def _normalise(total, flat_labels, ignore_index, num_items_in_batch):
    if num_items_in_batch is None:
        num_items_in_batch = (flat_labels != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(hidden, weight, bias, labels, ignore_index, per_token=False):
    """The chunk's summed cross-entropy (``per_token``: each position's, 0 where ignored)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):  # tensor parallel: the head's vocabulary is sharded
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
        logits = F.linear(hidden, weight, bias).float()
        tokens = _VocabParallelCrossEntropy.apply(logits.to_local(), labels, ignore_index, *_vocab_slice(weight))
        return tokens if per_token else tokens.sum()
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none" if per_token else "sum")


def _vocab_slice(weight) -> tuple:
    """(process group, first vocabulary row) of this rank's slice of a vocabulary-sharded head."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = weight.device_mesh, weight.placements
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if mesh.ndim != 1 or len(dims) != 1:
        raise ValueError(f"a vocabulary-parallel head needs a 1-D mesh sharding rows; got {placements} on {mesh}")
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return mesh.get_group(), offset[0]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-position cross-entropy ``[N]`` (0 where ignored) of logits sharded on the vocabulary
    (each rank its ``[N, V/tp]``); the callers sum it, or reduce it per sequence.

    Megatron-LM's vocabulary-parallel cross-entropy: the row maxima, then the sums of
    exponentials and the target logits together, are all-reduced over the tp group (two
    all-reduces of ``[N]`` and ``[2, N]`` values),
    and the gradient (softmax less the one-hot target) is computed in forward, in place in the
    one ``[N, V/tp]`` buffer the exponentials were taken in, and kept for backward. Memory at
    its peak: the logits and that buffer, two ``[N, V/tp]`` fp32 tensors (PyTorch's
    ``loss_parallel`` rules, which this replaces, held five: logits, log-softmax and three of
    its backward's).
    """

    @staticmethod
    def forward(ctx, logits, labels, ignore_index, group, vocab_start):
        import torch.distributed as dist

        local_vocab = logits.shape[-1]
        row_max = logits.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        buf = logits.detach() - row_max.unsqueeze(-1)  # shifted logits, then exp, then the gradient
        local = labels - vocab_start
        here = (local >= 0) & (local < local_vocab)
        index = local.clamp(0, local_vocab - 1).unsqueeze(-1)
        target = buf.gather(-1, index).squeeze(-1) * here  # the shifted target logit, on its rank
        stats = torch.stack([target, buf.exp_().sum(dim=-1)])
        dist.all_reduce(stats, group=group)  # [shifted target logit, sum of exponentials] per row
        target, sum_exp = stats
        valid = labels != ignore_index
        loss = (sum_exp.log() - target) * valid
        buf.div_(sum_exp.unsqueeze(-1))
        buf.scatter_add_(-1, index, -here.to(buf.dtype).unsqueeze(-1))
        buf.mul_(valid.unsqueeze(-1))
        ctx.save_for_backward(buf)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.unsqueeze(-1), None, None, None, None


# Config attributes of models that transform the head's output before the loss (soft-capping,
# scaling): the loss would silently differ, so those models are refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_TURN_OFF = "Set loss_chunk_tokens=None and loss_labeled_only=False."  # what every refusal says to do


def apply_chunked_loss(model: nn.Module, head: nn.Linear, chunk_tokens: int | None, *,
                       labeled_only: bool = False) -> None:
    """Make ``model``'s forward compute its loss with :func:`chunked_cross_entropy`
    (``chunk_tokens=None``: in one chunk, for a head that tensor parallel shards, or for
    ``labeled_only``: the head on the labeled positions only).

    Contract: ``model`` is a transformers causal LM whose forward calls ``head`` on the final
    hidden states and passes the result straight to ``model.loss_function`` (true of the HF
    causal LMs without logit soft-capping or scaling). When a forward gets ``labels`` with
    gradients enabled, ``head`` passes the hidden states through, the loss is computed chunk
    by chunk, and the output's ``logits`` is None. Forwards without labels, and under
    ``torch.no_grad()`` (evaluation, ``generate``), are unchanged and return logits.

    Checked without running the model (a probe forward of the whole unsharded model would cost
    minutes and its activations on a 70B model): here, that the config declares no logit
    transform and that the forward's source calls ``loss_function``; then, in every training
    forward at no extra cost, that the loss was computed once and got exactly what the head
    passed through. A model that breaks the contract fails its first training step, clearly.
    """
    config = getattr(model, "config", None)
    transforms = [a for a in _LOGIT_TRANSFORMS if getattr(config, a, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(
            f"{type(model).__name__} transforms its logits before the loss ({transforms}); "
            f"chunked loss would compute a different loss. {_TURN_OFF}"
        )
    if not isinstance(head, nn.Linear) or not hasattr(model, "loss_function"):
        raise ValueError(
            f"chunked loss needs a causal LM with a Linear output head and a loss_function; "
            f"{type(model).__name__} has {type(head).__name__}. {_TURN_OFF}"
        )
    if "loss_function(" not in _forward_source(model):
        raise ValueError(
            f"{type(model).__name__}'s forward does not compute its loss through "
            f"model.loss_function, so chunked loss cannot apply. {_TURN_OFF}"
        )
    state = {"active": False, "per_token": False}  # per_token: token_logps_mode (token_logps.py)
    head_forward = head.forward
    loss_function = model.loss_function

    def start(module, args, kwargs):
        # per-token log-probs (token_logps_mode) go chunked without gradients too, but not through a
        # tensor-parallel head: without gradients it runs on its local shard and gathers its output
        # (tp_local.py), so it returns the gathered logits and the loss takes them whole
        sharded = hasattr(head.weight, "placements")
        wanted = torch.is_grad_enabled() or (state["per_token"] and not sharded)
        state.update(active=kwargs.get("labels") is not None and wanted, calls=0)

    def finish(module, args, kwargs, output):
        active, calls = state["active"], state["calls"]
        state["active"] = False
        if active and calls != 1:
            raise _not_straight(model, f"its forward called model.loss_function {calls} times")
        if active and output is not None and hasattr(output, "logits"):
            output["logits"] = None
        return output

    @functools.wraps(head_forward)
    def head_or_passthrough(hidden_states):
        if not state["active"]:
            return head_forward(hidden_states)
        # Under tensor parallel the head's input hook made it a replicated DTensor; its output
        # hook hands the model the local tensor, which is what the loss will receive.
        to_local = getattr(hidden_states, "to_local", None)
        state["passed"] = to_local() if to_local else hidden_states
        return hidden_states

    @functools.wraps(loss_function)
    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        state["calls"] += 1
        if not state["active"] and state["per_token"]:
            from .token_logps import token_logps

            return token_logps(logits, labels, ignore_index)
        if not state["active"]:
            return loss_function(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        passed = state.pop("passed", None)
        if passed is None or not _unchanged(passed, logits):
            state["active"] = False  # one error, not a second one from the forward hook
            raise _not_straight(model, "its forward changes the head's output before the loss")
        if state["per_token"]:  # the log-probs of the labels, per position (0 where ignored)
            return -chunked_cross_entropy(logits, head, labels, chunk_tokens, ignore_index=ignore_index,
                                          shift_labels=shift_labels, labeled_only=labeled_only, per_token=True)
        return chunked_cross_entropy(logits, head, labels, chunk_tokens, ignore_index=ignore_index,
                                     num_items_in_batch=num_items_in_batch, shift_labels=shift_labels,
                                     labeled_only=labeled_only)

    loss.hf_scale_token_logps = state  # the switch token_logps_mode turns
    model.register_forward_pre_hook(start, with_kwargs=True)
    model.register_forward_hook(finish, with_kwargs=True, always_call=True)
    head.forward = head_or_passthrough
    model.loss_function = loss


def _forward_source(model: nn.Module) -> str:
    import inspect

    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source (compiled, generated): the checks at run time remain
        return "loss_function("


def is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


def _unchanged(passed: torch.Tensor, received: torch.Tensor) -> bool:
    """The loss got the head's input as the head returned it (a dtype cast aside)."""
    if received is passed:
        return True
    if is_fake(received):  # a simulation (FakeTensorMode): no values to compare, the shape only
        return received.shape == passed.shape
    # equal_nan: torch's pipeline shape inference runs a stage on uninitialised inputs
    return received.shape == passed.shape and torch.allclose(
        received, passed.to(received.dtype), rtol=0, atol=0, equal_nan=True
    )


def _not_straight(model: nn.Module, what: str) -> Exception:
    from ..errors import HfScaleConfigError

    return HfScaleConfigError(
        f"chunked loss cannot apply to {type(model).__name__}: {what}, so the chunked loss would "
        f"differ from its own. {_TURN_OFF}"
    )
