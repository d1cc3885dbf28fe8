"""A preference step's micro-batches add up to the whole batch (hf_scale.train.step_sums.StepSums:
each micro-batch's loss and metric sums in fp64, one all-reduce), in one process: the DPO
family's step (preference_step_values) on two halves against preference_step on the whole."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_scale.parallel.preference import preference_step
from hf_scale.parallel.preference_loss import PreferenceLoss
from hf_scale.train.dp import DataParallel
from hf_scale.train.preference import preference_step_values
from hf_scale.train.step_sums import StepSums
from tests.tiny_models import pair_batch, tiny_model


def test_two_micro_batches_are_the_whole_batch():
    knobs = PreferenceLoss("simpo", beta=0.5, rpo_alpha=0.5)
    job = SimpleNamespace(preference=SimpleNamespace(knobs=lambda: knobs))
    batch = pair_batch(pairs=4)
    whole_model, split_model = tiny_model("llama", "causal"), tiny_model("llama", "causal")
    whole = preference_step(whole_model, batch, knobs)
    micro = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 8))]
    values = preference_step_values(job, split_model, micro, DataParallel(), 1.0)
    assert abs(values["loss"] - float(whole.loss)) < 1e-6
    for name in ("rewards/chosen", "rewards/accuracies", "logps/rejected"):
        assert abs(values[name] - float(whole.sums[name]) / whole.pairs) < 1e-5, name
    for (n, a), b in zip(whole_model.named_parameters(), split_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=n)


class _TwoRanks:
    """A data-parallel group of two ranks holding the same values (the sum doubles them)."""

    def all_reduce(self, tensor):
        tensor.mul_(2)
        return tensor


def test_sums_are_fp64_and_reduced_once():
    step = StepSums()
    for loss in (0.25, 0.5):
        step.add(SimpleNamespace(loss=torch.tensor(loss), sums={"a": torch.tensor(1.0, dtype=torch.float32),
                                                                  "b": torch.tensor(2.0)}))
    assert step.loss.dtype == torch.float64 and all(v.dtype == torch.float64 for v in step.sums.values())
    assert step.reduced(_TwoRanks()) == (1.5, {"a": 4.0, "b": 8.0})
