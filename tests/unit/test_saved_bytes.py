"""The saved-for-backward counter (hf_scale/parallel/saved_bytes.py) that the context-parallel
memory test and benchmark read: activations counted once per storage, parameters left out."""

from __future__ import annotations

import torch
from torch import nn

from hf_scale.parallel.saved_bytes import SavedBytes


def test_counts_activations_once_and_leaves_parameters_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with SavedBytes(model) as saved:
        loss = model(x).sum()
    # Linear 1 saves x (5x8), tanh its output (5x16), Linear 2 that same output again: once
    assert saved.total == (5 * 8 + 5 * 16) * 4
    loss.backward()
    with SavedBytes(model) as saved:
        y = x.requires_grad_() * 2  # saves nothing but a scalar
    assert saved.total == 0 and y.requires_grad
    with SavedBytes() as everything:  # no model: parameters are counted too
        model(x.detach()).sum()
    assert everything.total > (5 * 8 + 5 * 16) * 4
