"""Gradient clipping and weight-decay groups under pipeline parallel equal one process's.

pp=2 (2 ranks), pp=2 x fsdp2 and pp=2 x tp2 (4 ranks) and pp=2 under zbv (2 ranks, the embedding
and the head's copy on one rank), the tiny Llama with its head tied to the embedding:
the norm ``hf_scale.clip_grad_norm_(model)`` returns is one process's on every rank (both
stages' gradients, reduced over the pp group after the dp / tp reduction, the tied weight counted
once although both its copies hold the summed gradient); clipping scales every gradient, the
head's copy included, by one process's factor; ``build_optimizer`` on a pruned stage puts each
held parameter in the group one process puts it in.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_scale.parallel.optim import parameter_groups
from tests.distributed import pp_optim_checks
from tests.harness import run_ranks
from tests.tiny_models import CAUSAL, tiny_batch

TIE = ("lm_head.weight", "model.embed_tokens.weight")


# (parallel config, world size, blocks): loop placement over 2 and 4 ranks, and the V of zbv
# (rank 0 holds the first and the last stage: the embedding and the head's own copy)
LAYOUTS = {"pp2": ({"pp": 2}, 2, 2), "pp2xfsdp2": ({"pp": 2, "strategy": "fsdp"}, 4, 2),
           "pp2xtp2": ({"pp": 2, "tp": 2}, 4, 2), "pp2-zbv": ({"pp": 2, "pp_schedule": "zbv"}, 2, 4)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    return LAYOUTS[request.param]


@pytest.fixture(scope="module")
def reference(layout) -> dict:
    model = pp_optim_checks.tiny_llama(layout[2])
    batch = tiny_batch(CAUSAL, 4)
    batch["labels"][0, :5] = -100
    loss = model(**batch).loss
    loss.backward()
    params = dict(model.named_parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    grads = {n: p.grad.clone() for n, p in params.items()}
    grads[TIE[0]] = grads[TIE[1]]  # one tensor, two names
    decay = {id(p) for g in parameter_groups(model, 0.1) if g["weight_decay"] for p in g["params"]}
    names = dict(model.named_parameters(remove_duplicate=False))
    return {"loss": float(loss.detach()), "norm": norm, "grads": grads,
            "decay": {n for n, p in names.items() if id(p) in decay}}


@pytest.fixture(scope="module")
def ranks(layout) -> list[dict]:
    config, world, layers = layout
    return run_ranks(pp_optim_checks.worker, world, config, layers, timeout=600)


def test_the_norm_covers_every_stage_and_the_tied_weight_once(ranks, reference):
    for r in ranks:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["whole"] == pytest.approx(reference["norm"], rel=1e-5), r
    by_stage = {r["pp_rank"]: r for r in ranks if r["dp_rank"] == 0}  # one replica (tp ranks agree)
    assert sorted(by_stage) == [0, 1]
    # each stage alone: the sum of their squares counts the tied weight twice
    tie = float(reference["grads"][TIE[1]].norm())
    squares = sum(r["stage"] ** 2 for r in by_stage.values())
    assert squares == pytest.approx(reference["norm"] ** 2 + tie**2, rel=1e-4)
    assert tie**2 > 1e-3 * reference["norm"] ** 2  # the tied weight is not negligible here


def test_clipping_scales_every_gradient_by_one_process_factor(ranks, reference):
    scale = (reference["norm"] / 2) / (reference["norm"] + 1e-6)
    held = set()
    for r in ranks:
        for name, grad in r["grads"].items():
            held.add(name)
            want = reference["grads"][name].numpy() * scale
            np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7 * math.sqrt(want.size), err_msg=name)
    assert held >= set(reference["grads"]), set(reference["grads"]) - held  # every weight, both tie ends


def test_weight_decay_groups_on_a_stage_are_one_process_groups(ranks, reference):
    for r in ranks:
        decay, no_decay = set(r["groups"]["decay"]), set(r["groups"]["no_decay"])
        assert decay == {n for n in decay | no_decay if n in reference["decay"]}, r["pp_rank"]
        assert decay and no_decay and not decay & no_decay
    holders = [r for r in ranks if TIE[0] in r["groups"]["decay"] + r["groups"]["no_decay"]]
    assert holders and all(TIE[0] in r["groups"]["decay"] for r in holders)  # decays as the embedding does
