"""Batches for one data-parallel rank, resumable at the exact sample.

Every epoch is one seeded permutation of the dataset, cut into *global* batches of
``world * batch_size`` examples; rank ``r`` takes the ``r``-th block of ``batch_size`` of each.
``rank`` and ``world`` are the *data-parallel* rank and degree (:class:`~hf_scale.train.dp.DataParallel`):
the ranks of one tensor-parallel group pass the same ``rank`` and get the same batches.
So a run on W ranks sees the same global batches as one process with a W times larger batch,
and the position (epoch, batch) is the same number on every rank: it is saved with the
checkpoint and restored with :meth:`ShardedBatches.load_state_dict`. Incomplete last batches
are dropped in training (every rank must take the same number of steps).

Usage::

    batches = ShardedBatches(dataset, batch_size=8, rank=r, world=w, collate=PadCollator(pad_id))
    for batch in batches:          # continues after the last batch yielded, across epochs
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import torch

from ..errors import HfScaleCheckpointError, HfScaleConfigError


class PadCollator:
    """Pad a list of tokenised examples to the longest one (right padding).

    ``input_ids`` are padded with ``pad_id``, ``labels`` with -100 (ignored by the loss),
    ``attention_mask`` with 0; classification labels (ints) become a 1-D tensor.
    """

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        batch: dict[str, torch.Tensor] = {}
        batch["input_ids"] = self._pad([e["input_ids"] for e in examples], width, self.pad_id)
        batch["attention_mask"] = self._pad(
            [[1] * len(e["input_ids"]) for e in examples], width, 0
        )
        labels = [e["labels"] for e in examples]
        if isinstance(labels[0], list):
            batch["labels"] = self._pad(labels, width, -100)
        else:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch

    @staticmethod
    def _pad(rows: list[list[int]], width: int, value: int) -> torch.Tensor:
        out = torch.full((len(rows), width), value, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        return out


class ShardedBatches:
    """This rank's training batches, epoch after epoch, with a saveable position."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        rank: int,
        world: int,
        collate: Callable[[list[dict]], dict[str, torch.Tensor]],
        *,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.collate, self.seed, self.shuffle = collate, seed, shuffle
        self.global_batch = batch_size * world
        self.batches_per_epoch = len(dataset) // self.global_batch
        if self.batches_per_epoch == 0:
            raise HfScaleConfigError(
                f"{len(dataset)} training examples do not fill one global batch of "
                f"{self.global_batch} (batch_size {batch_size} x {world} data-parallel ranks): "
                "lower train.batch_size or add data."
            )
        self.epoch, self.batch = 0, 0  # the next batch to yield

    def __len__(self) -> int:
        return self.batches_per_epoch

    def indices(self, epoch: int, batch: int) -> list[int]:
        """The dataset rows of this rank's part of global batch ``batch`` in ``epoch``."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.dataset), generator=g)
        else:
            order = torch.arange(len(self.dataset))
        start = batch * self.global_batch + self.rank * self.batch_size
        return order[start : start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            if self.batch >= self.batches_per_epoch:
                self.epoch, self.batch = self.epoch + 1, 0
            rows = self.indices(self.epoch, self.batch)
            self.batch += 1
            yield self.collate([self.dataset[i] for i in rows])

    @property
    def position(self) -> int:
        """Global batches consumed since the start of training."""
        return self.epoch * self.batches_per_epoch + self.batch

    def seek(self, position: int) -> None:
        """Continue after ``position`` global batches (e.g. ``step * grad_accum``)."""
        self.epoch, self.batch = divmod(position, self.batches_per_epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise HfScaleCheckpointError(
                f"the checkpoint's data position counts global batches of {state['global_batch']} "
                f"examples, this run's are {self.global_batch}: keep batch_size x data-parallel "
                "ranks the same to resume at the right sample."
            )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def eval_batches(dataset, batch_size: int, rank: int, world: int, collate) -> Iterator[tuple[dict, torch.Tensor]]:
    """This rank's evaluation batches with a 0/1 weight per example.

    Every rank runs the same number of forwards (sharded models need all ranks in each
    collective): the last batches are filled with copies of example 0 weighted 0, so each
    example counts exactly once over all ranks.
    """
    n = len(dataset)
    per_round = batch_size * world
    rounds = max(1, -(-n // per_round))
    for r in range(rounds):
        rows = range(r * per_round + rank * batch_size, r * per_round + (rank + 1) * batch_size)
        weight = torch.tensor([1.0 if i < n else 0.0 for i in rows])
        yield collate([dataset[i if i < n else 0] for i in rows]), weight
