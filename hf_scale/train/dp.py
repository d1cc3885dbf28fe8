"""This rank's data-parallel coordinate, read once from the parallelized model.

Ranks of one tensor-parallel group hold different slices of the same model and must see the
same batch; only the data-parallel ranks see different data. So the loader, the loss
weighting, evaluation and the metrics shard and reduce over the data-parallel rank, degree and
group that :func:`hf_scale.get_state` reports, never ``RANK`` / ``WORLD_SIZE``: with tp = 2 on
4 ranks there are 2 different batches per step, not 4, and each token is counted once.

Usage::

    dp = DataParallel.of(model)
    batches = ShardedBatches(dataset, batch_size, dp.rank, dp.degree, collate)
    dp.all_reduce(token_counts)            # summed over the ranks that saw different data
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..parallel_state import get_state


@dataclass(frozen=True)
class DataParallel:
    """``rank`` of ``degree`` data-parallel ranks and their process ``group`` (None when there
    is one: nothing to reduce)."""

    rank: int = 0
    degree: int = 1
    group: Any = None

    @classmethod
    def of(cls, model) -> "DataParallel":
        """The coordinate of a model returned by :func:`hf_scale.parallelize` (one process
        for a model that was not parallelized)."""
        state = get_state(model)
        if state is None or state.dp_degree == 1:
            return cls()
        return cls(state.dp_rank, state.dp_degree, state.dp_group)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` in place over the data-parallel ranks (a no-op with one)."""
        if self.degree > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor


def pipeline_degree(model) -> int:
    """How many pipeline ranks split this model (1 without pipeline parallel).

    Under pipeline parallel a rank holds some stages only: it trains and evaluates through
    ``model.train_step`` / ``model.eval_step`` (losses), and cannot produce logits or generate
    alone, so evaluation skips the metrics that need them and sample generations are skipped.
    """
    state = get_state(model)
    return 1 if state is None else int(getattr(state, "pp_degree", 1) or 1)


def context_degree(model) -> int:
    """How many context-parallel ranks split each sequence (1 without cp).

    Under cp a rank holds its own positions' logits only (the loss is the whole sequence's), and
    ``generate`` is refused: evaluation reports the loss only and sample generations are skipped,
    as under pipeline parallel."""
    state = get_state(model)
    return 1 if state is None else int(getattr(state, "cp_degree", 1) or 1)
