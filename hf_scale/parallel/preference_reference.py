"""The reference's log-probabilities, precomputed in one pass over the pairs (TRL's
``precompute_ref_log_probs``), under the training layout itself.

Before the first optimizer step the policy IS the reference: one forward per batch, in eval mode
and without gradients, under whatever layout the model has (fsdp, zero2, ddp, tp, pp), gives the
summed completion log-probs of every chosen and rejected sequence. Each data-parallel rank
computes its share of the rows; the small per-row floats are all-gathered over the
data-parallel group, so every rank ends with all of them (to add to the dataset as
``ref_chosen_logps`` / ``ref_rejected_logps``). No second model, no full copy of the weights:
TRL's version of this crashes under FSDP2 (trl#6470); here the sharded model computes them.

The reference can also be another model held beside the policy: :func:`frozen_reference_logps`
gives one batch's values from it, step by step (``preference.reference: model``).

Usage::

    ref = reference_logps(model, rows, PairCollator(pad_id), batch_size=8, rank=dp.rank, world=dp.degree,
                          group=dp.group)                  # [len(rows), 2]: chosen, rejected
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .optim import reshard_fsdp
from .preference import sequence_logps


def reference_logps(model: nn.Module, rows: Sequence, collate: Callable, batch_size: int, *, rank: int = 0,
                    world: int = 1, group=None, device: torch.device | None = None) -> torch.Tensor:
    """``[len(rows), 2]`` (chosen, rejected) summed completion log-probs of every pair under
    ``model`` now, in eval mode without gradients (the mode is restored after). ``rows``: pair
    rows ``collate`` turns into an interleaved batch (:class:`hf_scale.data.preference.PairCollator`);
    ``rank`` / ``world`` / ``group``: the data-parallel rank, degree and group (every rank of a
    tensor-parallel group or pipeline passes the same ones and runs the same batches)."""
    n = len(rows)
    share = math.ceil(n / world) if n else 0
    mine = [min(i, n - 1) for i in range(rank * share, (rank + 1) * share)]  # the last rank repeats a row
    device = device or _device(model)
    out = torch.zeros(share, 2, dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, share, batch_size):
            index = mine[start:start + batch_size]
            full = index + [index[-1]] * (batch_size - len(index))  # every batch one shape (pp schedules)
            batch = collate([rows[i] for i in full])
            batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
            logps = sequence_logps(model, batch).float().to(device)
            out[start:start + len(index)] = logps.view(-1, 2)[: len(index)]
    finally:
        model.train(was_training)
        reshard_fsdp(model)
    if world > 1:
        every = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(every, out, group=group)
        out = torch.cat(every)
    return out[:n].cpu()


def frozen_reference_logps(reference: nn.Module, batch: dict) -> torch.Tensor:
    """``[rows]`` summed completion log-probs of an interleaved pair batch under a frozen
    ``reference`` model held beside the policy (``preference.reference: model``), as fp32 on
    the batch's device: what the batch's ``ref_logps`` would hold had they been precomputed.
    Its FSDP units are resharded after the forward (a forward without backward leaves the root
    gathered), so between forwards the reference holds only its shards."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    try:
        return sequence_logps(reference, inputs).float().to(batch["input_ids"].device)
    finally:
        reshard_fsdp(reference)


def _device(model: nn.Module) -> torch.device:
    from ..parallel_state import get_state

    state = get_state(model)
    if state is not None:
        return state.env.device
    return next(model.parameters()).device
