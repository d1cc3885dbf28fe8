"""Batches from a stream of examples: read as training goes, packed on the fly, resumable exactly.

A stream never sits in memory whole: this rank reads its own part of the source (split over the
data-parallel ranks without overlap by the caller, e.g. ``datasets.distributed.
split_dataset_by_node``), encodes each example (tokenises it; None drops it), and groups
``group`` encoded examples: packed best-fit-decreasing into rows (:func:`pack_examples`) or,
unpacked, one row each. Rows are cut into batches of ``batch_size`` and collated.

The position after a batch is ``(epoch, consumed, emitted)``: the source examples read before
the group its last row came from, and the rows of that group yielded so far. Resuming reads the
source again from ``consumed`` (``source(epoch, skip=consumed)``), packs the same group the same
way and drops the ``emitted`` rows: the batches after a resume are the ones an uninterrupted run
yields (a batch whose rows span two groups was yielded whole, so nothing is read twice). A
source that runs out starts its next epoch (``source(epoch + 1, 0)``), so every rank can take
as many steps as the run asks for.

Usage::

    batches = StreamBatches(lambda epoch, skip: my_examples(epoch, skip), encode=tokenize,
                            batch_size=8, collate=PackedCollator(pad_id), pack="bfd", max_len=2048)
    for batch in batches: ...
    state = batches.state_dict()            # saved per rank with the checkpoint
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import HfScaleCheckpointError, HfScaleConfigError
from .packing import pack_examples


class StreamBatches:
    """This rank's training batches from a stream, with a saveable position."""

    def __init__(self, source: Callable[[int, int], Any], encode: Callable[[dict], dict | None], batch_size: int,
                 collate: Callable[[list[dict]], dict], *, pack: str | None = None, max_len: int | None = None,
                 group: int = 1000):
        if pack == "wrapped":
            raise HfScaleConfigError("data.streaming packs whole examples (data.packing: bfd or bfd_split), "
                                     "not wrapped rows: set data.packing: bfd or false.")
        self.source, self.encode, self.batch_size, self.collate = source, encode, batch_size, collate
        self.pack, self.max_len, self.group = pack, max_len, group
        self.epoch, self.consumed, self.emitted = 0, 0, 0

    def __iter__(self) -> Iterator[dict]:
        epoch, start, skip = self.epoch, self.consumed, self.emitted
        pending: list[dict] = []
        while True:
            read, group_start, buffer, rows_this_epoch = start, start, [], 0
            for example in self.source(epoch, start):
                read += 1
                encoded = self.encode(example)
                if encoded is not None:
                    buffer.append(encoded)
                if len(buffer) == self.group:
                    rows_this_epoch += len(buffer)
                    yield from self._emit(self._rows(buffer), epoch, group_start, skip, pending)
                    group_start, buffer, skip = read, [], 0
            if buffer:
                rows_this_epoch += len(buffer)
                yield from self._emit(self._rows(buffer), epoch, group_start, skip, pending)
            if start == 0 and rows_this_epoch == 0:
                raise HfScaleConfigError(
                    "the data stream gave this rank no usable example in a whole pass: check data.path and "
                    "the columns, or start fewer data-parallel ranks than the stream has examples."
                )
            epoch, start, skip = epoch + 1, 0, 0

    def _emit(self, rows: list[dict], epoch: int, group_start: int, skip: int, pending: list[dict]):
        """Yield the batches the group's rows complete; after each, the position is just past its
        last row: (this epoch, the group's first source example, the rows of the group yielded)."""
        for index in range(skip, len(rows)):
            pending.append(rows[index])
            if len(pending) == self.batch_size:
                self.epoch, self.consumed, self.emitted = epoch, group_start, index + 1
                batch = self.collate(pending)
                pending.clear()
                yield batch

    def _rows(self, examples: list[dict]) -> list[dict]:
        if self.pack is None:
            return examples
        packed = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, self.max_len,
                               split=self.pack == "bfd_split")
        return [dict(zip(packed, values)) for values in zip(*packed.values())]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "emitted": self.emitted,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("batch_size", self.batch_size) != self.batch_size:
            raise HfScaleCheckpointError(
                f"the checkpoint's stream position was saved with train.batch_size {state['batch_size']}, "
                f"this run's is {self.batch_size}: keep it to resume at the same example."
            )
        self.epoch, self.consumed, self.emitted = int(state["epoch"]), int(state["consumed"]), int(state["emitted"])
