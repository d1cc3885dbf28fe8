"""How many activation bytes a forward keeps for its backward: a ``saved_tensors_hooks`` counter.

Every tensor autograd saves while the counter is active is recorded by its storage (each storage
once, at its full size: a view saved twice, or two views of one buffer, count once); the model's
parameters are left out (they are not activations), and so is anything on the meta device. This
is what context parallel divides by cp, and what activation checkpointing trades for recompute;
temporaries freed inside the forward (a gathered K / V used and dropped, a transient mask) are not
saved and not counted: peak memory is measured apart (RSS, ``torch.cuda.max_memory_allocated``).

Usage::

    with SavedBytes(model) as saved:
        loss = model(**batch).loss
    print(saved.total)          # bytes kept for backward by this rank
    loss.backward()
"""

from __future__ import annotations

import torch
from torch import nn


class SavedBytes:
    """Counts the bytes of the storages autograd saves for backward inside the ``with`` block,
    ``model``'s parameters excluded (see the module docstring)."""

    def __init__(self, model: nn.Module | None = None):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self.seen: dict[int, int] = {}
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.params:
                self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        """Bytes saved for backward so far (each storage once)."""
        return sum(self.seen.values())
