"""The planner counts preference training's held reference (``preference.reference: model``,
issue 40): its shards (fsdp, zero2) or whole replica (ddp) in every peak, and its rows (a pair is
two sequences). Checked against the simulation, which runs the loop's own reference forward
(``frozen_reference_logps``) on the reference parallelized as ``load_reference`` does: the
simulated peak grows by what the estimate adds, and the estimate stays within +-10% of it.
The published shape (Llama-3-8B on 8 x 80 GB) is ``scripts/simulate_published.py --parts dpo``."""

from __future__ import annotations

import pytest
import torch

from hf_scale.layout_search import Workload, model_facts
from hf_scale.layout_search.estimate import Layout, estimate_memory
from hf_scale.layout_search.simulate import simulate
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 8,
                                reason="a CUDA build of torch with fewer than 8 visible GPUs")

SEQ, ROWS = 32, 4  # two pairs per rank and step, one forward


@pytest.fixture(scope="module")
def config():
    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("layout,held", [(Layout("fsdp", dp_shard=8, micro_batch=ROWS), 8),
                                         (Layout("zero2", dp_shard=8, micro_batch=ROWS), 8),
                                         (Layout("ddp", dp_replicate=8, micro_batch=ROWS), 1)])
def test_the_reference_adds_its_shards_and_the_estimate_follows_the_simulation(config, layout, held, monkeypatch):
    """fp32 reference (4 bytes a parameter): 1/8 of it per rank where the policy is sharded, all of it
    under ddp, in the estimate. Simulated, the reference's tensors are the policy's own again (its
    parameter shards and buffers, as the allocator rounds them: on a tiny model that rounding is a
    third of the bytes), and the peak grows by exactly them: the reference's forward comes before
    the policy's, below its backward peak."""
    from hf_scale.parallel import preference_reference

    calls = []
    loop_own = preference_reference.frozen_reference_logps
    monkeypatch.setattr(preference_reference, "frozen_reference_logps",
                        lambda reference, batch: calls.append(batch["input_ids"].shape) or loop_own(reference, batch))
    without = simulate(config, 8, 0, layout, seq=SEQ, batch=ROWS)
    assert calls == []
    held_ref = simulate(config, 8, 0, layout, seq=SEQ, batch=ROWS, reference=True)
    assert calls == [(ROWS, SEQ)] * 2, calls  # the loop's reference forward, once a micro-batch, two steps
    params = sum(p.numel() for p in model_facts(config).model.parameters())
    assert held_ref.estimate.reference == pytest.approx(4 * params / held, rel=0.01)
    assert held_ref.estimated - without.estimated == held_ref.estimate.reference
    mine = {k: held_ref.peak[k] - without.peak[k] for k in ("params", "buffers", "total")}
    assert mine["params"] == without.peak["params"] and mine["buffers"] == without.peak["buffers"], mine
    assert mine["total"] == mine["params"] + mine["buffers"], mine
    assert 0.9 <= held_ref.ratio <= 1.1, held_ref.format()
    assert held_ref.misplaced == []


def test_the_reference_forward_counts_when_it_is_the_larger_moment(config):
    """The reference's no-grad forward (its gathered units and logits) happens beside the policy's
    weights and optimizer state only: it sets the peak only when it outweighs the policy's own
    backward, never adds to it."""
    facts = model_facts(config)
    layout = Layout("fsdp", dp_shard=8, micro_batch=ROWS)
    plain = estimate_memory(facts, layout, Workload(seq=SEQ, batch=ROWS, device="cuda"))
    held = estimate_memory(facts, layout, Workload(seq=SEQ, batch=ROWS, device="cuda", reference=2))
    assert held.reference > 0 and held.reference_forward > 0
    assert held.device_total == plain.device_total + held.reference  # the policy's backward is larger here
    from dataclasses import replace

    heavy = replace(held, reference_forward=10 * plain.device_total)
    assert heavy.device_total == (heavy.overhead + heavy.params + heavy.optimizer + heavy.reference
                                  + heavy.reference_forward)


def test_a_dpo_recipe_is_planned_with_its_rows_and_its_reference(tmp_path):
    """``hf-scale plan`` of a preference recipe: ``train.batch_size`` pairs are twice as many rows,
    and ``reference: model`` is counted (named in the header) in ``model.dtype``'s bytes."""
    import yaml

    from hf_scale.cli import main
    from hf_scale.train.config import load_job
    from tests.tiny_models import tiny_recipe

    recipe = tiny_recipe(tmp_path)
    job = yaml.safe_load(recipe.read_text())
    job["preference"] = {"loss": "sigmoid", "reference": "model"}
    job["data"]["path"] = "builtin:preference"
    job["train"]["batch_size"] = 3
    for reference in ("model", "precompute"):
        job["preference"]["reference"] = reference
        path = tmp_path / f"{reference}.yaml"
        path.write_text(yaml.safe_dump(job))
        out = _plan(main, [str(path), "--gpus", "8", "--gpu-memory", "80GB", "--strategy", "fsdp"])
        assert "batch 6 per data-parallel rank" in out, out
        assert ("preference reference held beside the policy" in out) == (reference == "model"), out
        assert load_job(str(path), []).planner_rows() == (6, 4 if reference == "model" else 0)
        assert load_job(str(path), ["--model.dtype", "bfloat16"]).planner_rows() == (6, 2 if reference == "model" else 0)


def test_plan_simulate_runs_a_dpo_recipe_with_its_reference(tmp_path):
    """``hf-scale plan RECIPE --simulate`` of a preference recipe with ``reference: model``: one pair
    (2 rows) a step, the reference held and counted in the estimate beside the simulation."""
    import re

    import yaml

    from hf_scale.cli import main
    from tests.tiny_models import tiny_recipe

    recipe = tiny_recipe(tmp_path)
    job = yaml.safe_load(recipe.read_text())
    job["preference"] = {"loss": "sigmoid", "reference": "model"}
    job["data"]["path"] = "builtin:preference"
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(job))
    out = _plan(main, [str(path), "--simulate", "--seq", "16", "--strategy", "fsdp"])
    assert "mb=2" in out, out  # a pair's chosen and rejected rows in one forward
    held = [float(x) for x in re.findall(r"reference ([0-9.]+)", out)]
    assert len(held) == 2 and all(x > 0 for x in held), out  # ranks 0 and 1: the reference's shards
    assert out.count("estimate / simulated") == 2, out


def _plan(main, args: list[str]) -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["plan", *args]) == 0
    return buffer.getvalue()


def test_the_reference_layout_is_the_loaders():
    from hf_scale.config import ParallelConfig
    from hf_scale.train.model import reference_layout

    assert reference_layout(ParallelConfig(strategy="ddp")) is None
    assert reference_layout(ParallelConfig(strategy="zero1")) is None
    assert reference_layout(ParallelConfig(strategy="zero2")).strategy == "fsdp"
    hsdp = reference_layout(ParallelConfig(strategy="hsdp", dp_replicate=2, reshard_after_forward=False))
    assert hsdp.strategy == "hsdp" and hsdp.reshard_after_forward is None
