"""An optimizer step's loss and metric sums over its micro-batches and the data-parallel ranks:
the preference steps' (DPO family: :func:`hf_scale.train.preference.preference_step_values`;
KTO: :func:`hf_scale.train.kto.kto_step_values`) one reduction."""

from __future__ import annotations

import torch


class StepSums:
    """One optimizer step's loss and metric sums (``PreferenceOutput.loss`` / ``.sums``), added
    up over its micro-batches in fp64 on the CPU and summed over the data-parallel ranks in one
    all-reduce (the DPO family's and KTO's steps).

    Usage::

        step = StepSums()
        for batch in micro:
            step.add(preference_step(model, batch, knobs, totals=totals))
        loss, sums = step.reduced(dp)      # floats, every rank's
    """

    def __init__(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64)
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, out) -> None:
        self.loss += float(out.loss)
        for k, v in out.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.detach().double().cpu()

    def reduced(self, dp) -> tuple[float, dict[str, float]]:
        names = sorted(self.sums)
        values = torch.stack([self.loss] + [self.sums[n] for n in names])
        dp.all_reduce(values)
        return float(values[0]), {n: float(v) for n, v in zip(names, values[1:])}
