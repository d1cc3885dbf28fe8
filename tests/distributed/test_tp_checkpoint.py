"""Checkpoints of tensor-parallel layouts (issue 12, item 6): Hub-format saves from tp x fsdp that
plain transformers reads bit for bit, from_pretrained into tp slices, fused q;k;v / gate;up
weights resharded between tp2, tp4, fsdp and one process, and training state that resumes
exactly and reshards (tp2 x fsdp2 -> fsdp4, fsdp2 -> tp2, tp2 -> fsdp2, tp2 x fsdp2 -> 1).

One 4-rank spawn and one 2-rank spawn for the module (tests/distributed/tp_checkpoint_checks.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_scale.distributed import LAUNCHER_VARS
from tests.distributed import tp_checkpoint_checks as checks
from tests.harness import run_ranks, to_plain
from tests.tiny_models import AUTO, tiny_batch, tiny_model


def _world4(root: str, plain: dict) -> dict:
    return {"boxes": checks.box_layouts(), "save": checks.save_and_load(root, plain),
            "resume": checks.resume_world4(root)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Folders saved by plain transformers (one process), the models' initial weights."""
    root = tmp_path_factory.mktemp("plain")
    out = {}
    for arch in ("llama", *checks.FUSED):
        folder = root / arch
        tiny_model(arch, "causal").save_pretrained(folder)
        out[arch] = str(folder)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory, plain):
    root = str(tmp_path_factory.mktemp("tp4"))
    return run_ranks(_world4, 4, root, plain, timeout=1200)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2"))
    return run_ranks(checks.resume_world2, 2, root, timeout=900)


# ------------------------------------------------------------------ boxes


def test_every_box_holds_the_global_values_it_claims(world4):
    for case_index, case in enumerate(world4[0]["boxes"]):
        per_rank = [r["boxes"][case_index] for r in world4]
        for r, got in enumerate(per_rank):
            assert got["ok"] and got["covered"], (case["name"], r, got["placements"], got["boxes"])
        held = sum(math.prod(shape) for got in per_rank for _, shape in got["boxes"])
        assert held == case["numel"] * case["replicas"], case["name"]  # every element once per replica
        if "packed" in case["name"]:  # where torch's single offset is wrong, hence the boxes
            assert not all(got["torch_one_box"] for got in per_rank), case["name"]
        else:
            assert all(got["torch_one_box"] for got in per_rank), case["name"]


# ------------------------------------------------------------------ save / from_pretrained


def test_plain_transformers_reads_a_tp2_fsdp2_save_bit_for_bit(world4):
    folder = Path(world4[0]["save"]["llama_saved"])
    assert len(list(folder.glob("*.safetensors"))) > 1  # a sharded save, with an index
    loaded = AUTO["causal"].from_pretrained(folder)
    before = tiny_model("llama", "causal")  # the model as it was before parallelize
    for (name, p), (_, q) in zip(loaded.named_parameters(), before.named_parameters()):
        assert torch.equal(p, q), name


def test_from_pretrained_at_tp2_gives_one_process_logits(world4, plain):
    model = AUTO["causal"].from_pretrained(plain["llama"])
    with torch.no_grad():
        want = model(**{k: v for k, v in tiny_batch("causal", 2, seed=7).items() if k != "labels"}).logits
    for r in world4:
        got = r["save"]
        assert got["llama_meta_left"] == []
        torch.testing.assert_close(torch.from_numpy(got["llama_logits"]), want, rtol=1e-5, atol=1e-6)
        assert got["llama_share"] < 0.5  # tp2 x fsdp2: a quarter of the sharded weights, whole norms


@pytest.mark.parametrize("arch", checks.FUSED)
def test_fused_weights_saved_at_tp2_load_at_tp1_fsdp_and_tp4(world4, arch):
    result = world4[0]["save"][arch]
    model = AUTO["causal"].from_pretrained(result["folder"])  # tp1: plain transformers
    with torch.no_grad():
        want = model(**{k: v for k, v in tiny_batch("causal", 2, seed=7).items() if k != "labels"}).logits
    for r in world4:
        for layout in ("tp2", "fsdp4", "tp4"):
            torch.testing.assert_close(torch.from_numpy(r["save"][arch][layout]), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, layout=layout: f"{arch} {layout}: {m}")
    again = AUTO["causal"].from_pretrained(result["tp4_folder"])  # saved from tp4's packed slices
    for (name, p), (_, q) in zip(again.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), name
    untrained = tiny_model(arch, "causal")  # the step moved the fused weights: a real test
    fused = [n for n, _ in model.named_parameters() if n.endswith(("c_attn.weight", "query_key_value.weight", "qkv_proj.weight"))]
    assert fused and all(not torch.equal(model.get_parameter(n), untrained.get_parameter(n)) for n in fused)


# ------------------------------------------------------------------ resume and reshard


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got["params"]) == set(want["params"])
    for name, value in want["params"].items():
        assert np.array_equal(np.asarray(got["params"][name]), np.asarray(value)), name
    assert set(got["optim"]) == set(want["optim"]) and want["optim"]
    for name, values in want["optim"].items():
        assert set(got["optim"][name]) == set(values), name
        for key, value in values.items():
            assert np.array_equal(np.asarray(got["optim"][name][key]), np.asarray(value)), f"{name}.{key}"


# Every rank's snapshot: the sharded tensors are assembled whole on each, but a replicated one (a
# norm under tp) is that rank's own copy: a load that restored rank 0's alone must fail.

def test_tp2_fsdp2_resumes_exactly(world4):
    for rank, result in enumerate(world4):
        resume = result["resume"]
        assert resume["same"]["step"] == 2, rank
        _assert_same_state(resume["same"]["state"], resume["first"]["state"])
        assert resume["first"]["losses"] + resume["same"]["losses"] == resume["straight_tp2_fsdp2"], rank  # bit for bit


def test_tp2_fsdp2_reshards_into_fsdp4(world4):
    for rank, result in enumerate(world4):
        resume = result["resume"]
        _assert_same_state(resume["fsdp4"]["state"], resume["first"]["state"])
        np.testing.assert_allclose(resume["fsdp4"]["losses"], resume["straight_tp2_fsdp2"][2:], rtol=1e-5)
        np.testing.assert_allclose(resume["straight_fsdp4"], resume["straight_tp2_fsdp2"], rtol=1e-5)


@pytest.mark.parametrize("loaded, saved, straight", [
    ("tp2_from_fsdp2", "first_fsdp2", "straight_fsdp2"), ("fsdp2_from_tp2", "first_tp2", "straight_tp2")])
def test_state_reshards_between_fsdp2_and_tp2(world2, loaded, saved, straight):
    for rank, result in enumerate(world2):
        got, want = result[loaded], result[saved]
        assert got["step"] == 2, rank
        _assert_same_state(got["state"], want["state"])
        np.testing.assert_allclose(got["losses"], result[straight][2:], rtol=1e-5, err_msg=f"rank {rank}")
        np.testing.assert_allclose(result["straight_tp2"], result["straight_fsdp2"], rtol=1e-5, err_msg=f"rank {rank}")


def test_tp2_fsdp2_state_into_one_process(world4, monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    resume = world4[0]["resume"]
    got = to_plain(checks.second_half({"strategy": "fsdp"}, resume["root"]))
    _assert_same_state(got["state"], resume["first"]["state"])
    np.testing.assert_allclose(got["losses"], resume["straight_tp2_fsdp2"][2:], rtol=1e-5)
    assert os.path.isdir(os.path.join(resume["root"], "step_00000002", "optimizer"))
