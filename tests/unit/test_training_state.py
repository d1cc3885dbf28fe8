"""save_state / load_state in one process: round trip, and a state that does not fit."""

import pytest
import torch

import hf_scale
from hf_scale import HfScaleCheckpointError
from tests.tiny_models import tiny_batch, tiny_model


def _trained(steps: int = 2):
    """Two steps, so ``step`` (2) and ``exp_avg_sq`` differ from a fresh optimizer's first."""
    model = hf_scale.parallelize(tiny_model("gpt2", "causal"))
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    for seed in range(steps):
        model(**tiny_batch("causal", 2, seed=seed)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model, optimizer = _trained()
    torch.manual_seed(7)
    hf_scale.save_state(model, optimizer, root=tmp_path, step=1)
    expected_draw = torch.rand(3)
    fresh = hf_scale.parallelize(tiny_model("gpt2", "causal", seed=5))
    fresh_opt = hf_scale.build_optimizer(fresh, lr=5e-4)  # another lr: the saved one must come back
    assert hf_scale.load_state(fresh, fresh_opt, path=tmp_path / "latest") == 1
    assert torch.equal(torch.rand(3), expected_draw)  # RNG as at save time
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(fresh.parameters(), model.parameters()):
        got, want = fresh_opt.state[p], optimizer.state[q]
        assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}
        for key in want:  # the step count too: it sets Adam's bias correction
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in optimizer.param_groups] == [1e-3] * 2


def test_incompatible_optimizer_state_is_explained(tmp_path):
    model, optimizer = _trained()
    hf_scale.save_state(model, optimizer, root=tmp_path, step=1)
    other = hf_scale.parallelize(tiny_model("gpt2", "causal"))
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(HfScaleCheckpointError, match=r"does not fit this optimizer \(SGD\).*Missing key.*momentum_buffer"):
        hf_scale.load_state(other, sgd, path=tmp_path / "latest")


def test_no_checkpoint_to_resume(tmp_path):
    with pytest.raises(HfScaleCheckpointError, match="no complete checkpoint"):
        hf_scale.load_state(*_trained(), path=tmp_path / "latest")
