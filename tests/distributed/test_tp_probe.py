"""The check of a guessed tensor-parallel plan (hf_scale/parallel/tp_check.py): one forward of a
sharded copy on a probe batch against the unsharded copy, block by block. A wrong plan that
keeps every shape consistent runs without error and is told apart by the numbers alone:

* Llama's ``up_proj`` as ``packed_colwise:2`` beside a ``colwise`` ``gate_proj``: each rank
  multiplies its gate features by other features' up projections (the first block's output
  differs by 5.6e-3);
* GPT-NeoX's fused ``query_key_value`` read as ``[q; k; v]`` (``packed_colwise:3``, the first
  guess inferred for a fused projection of 3 x hidden) where it is laid out head by head
  (``colwise``): 4.0e-2.

Both are refused: a plan with no other guess with ``HfScalePlanError`` naming the block that
differed and by how much, an inferred guess by trying the next one; the correct plans pass.
One 2-rank process group runs every case (``tp_checks.probe_outcome``).
"""

from __future__ import annotations

import re

import pytest

from hf_scale.parallel.tp_check import ATOL
from tests.distributed import tp_checks
from tests.harness import run_ranks
from tests.tiny_models import tiny_model

UP_PACKED = {"model.layers.*.mlp.up_proj": "packed_colwise:2"}
QKV = "gpt_neox.layers.*.attention.query_key_value"
CASES = {  # name -> (arch, how the plan is marked, changes to the plan inferred from the modules)
    "llama": ("llama", "inferred", {}),
    "llama_declared": ("llama", "declared", {}),
    "llama_up_packed": ("llama", "declared", UP_PACKED),
    "llama_up_packed_inferred": ("llama", "inferred", UP_PACKED),
    "gpt_neox": ("gpt_neox", "inferred", {}),  # its first guess is [q; k; v]
    "gpt_neox_declared": ("gpt_neox", "declared", {QKV: "colwise"}),
    "gpt_neox_qkv_packed": ("gpt_neox", "declared", {QKV: "packed_colwise:3"}),
}
DIFFERS = re.compile(r"on a probe batch, the output of (\S+) \((\w+)\) differs by up to ([0-9.e+-]+)\.")


@pytest.fixture(scope="module")
def outcomes():
    extra = {name: ("probe_outcome", args, {}) for name, args in CASES.items()}
    ranks = run_ranks(tp_checks.world_checks, 2, [], [], extra, timeout=300)
    for name in CASES:
        assert ranks[0][name] == ranks[1][name], f"{name}: the ranks disagree"
    return ranks[0]


def _inferred(arch: str) -> dict:
    from hf_scale.model_plans import resolve_plan
    from hf_scale.model_plans.from_hf import with_inferred_tp

    model = tiny_model(arch, "causal")
    return dict(with_inferred_tp(model, resolve_plan(model), 0).tp_plan)


@pytest.mark.parametrize("name, block, cls", [("llama_up_packed", "model.layers.0", "LlamaDecoderLayer"),
                                              ("gpt_neox_qkv_packed", "gpt_neox.layers.0", "GPTNeoXLayer")])
def test_a_shape_consistent_wrong_plan_is_refused_naming_the_block(outcomes, name, block, cls):
    error = outcomes[name].get("error", f"no error: {outcomes[name]}")
    assert error.startswith("HfScalePlanError: "), error
    found = DIFFERS.search(error)
    assert found, f"not refused by the numbers: {error}"
    assert found.group(1, 2) == (block, cls), error
    assert float(found.group(3)) > 100 * ATOL, error  # a wrong result, far above the comparison's noise


@pytest.mark.parametrize("name", ["llama", "llama_declared", "gpt_neox_declared"])
def test_the_correct_plan_passes_the_probe_unchanged(outcomes, name):
    arch, _, changes = CASES[name]
    got = outcomes[name]
    assert "error" not in got, got["error"]
    assert got["source"]["tp_plan"].endswith(", checked"), got["source"]
    assert got["tp_plan"] == {**_inferred(arch), **changes}


def test_a_wrong_inferred_guess_gives_way_to_the_next(outcomes):
    """Llama's inferred plan with ``up_proj`` packed is refused; the next guess inferred from
    the modules (the MLPs alone, every attention whole) holds and is used."""
    got = outcomes["llama_up_packed_inferred"]
    assert "error" not in got, got["error"]
    assert got["source"]["tp_plan"] == "inferred, checked"
    assert got["source"]["tp_whole"].startswith("every attention"), got["source"]
    assert got["tp_plan"] == {k: v for k, v in _inferred("llama").items() if ".mlp." in k}
    assert got["tp_plan"]["model.layers.*.mlp.up_proj"] == "colwise"


def test_gpt_neox_first_guess_is_refused_and_head_by_head_is_used(outcomes):
    """GPT-NeoX's fused projection of 3 x hidden features: the first guess, ``[q; k; v]``, runs
    (the shapes agree) but differs, so the second, head by head, is checked and used."""
    assert _inferred("gpt_neox")[QKV] == "packed_colwise:3"
    got = outcomes["gpt_neox"]
    assert "error" not in got, got["error"]
    assert got["source"]["tp_plan"] == "inferred, checked"
    assert got["tp_plan"] == {**_inferred("gpt_neox"), QKV: "colwise"}
