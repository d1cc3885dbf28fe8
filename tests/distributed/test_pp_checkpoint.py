"""Checkpoints of pipeline-parallel layouts (issue 13, item 6): each stage writes its own
tensors into Hub-format shards that plain transformers reads bit for bit (the tied head written
once, as its embedding); from_pretrained at pp loads only a rank's stages (the last stage's head
read from the embedding's key); training state that resumes exactly (pp2 x fsdp2) and reshards
(pp2 x fsdp2 -> fsdp4, pp2 -> fsdp2, pp2 -> one process); ``hf-scale export`` of a pp run.

One 4-rank spawn and one 2-rank spawn for the module (tests/distributed/pp_checkpoint_checks.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_scale.distributed import LAUNCHER_VARS
from hf_scale.model_plans import find_tied_parameters
from tests.distributed import pp_checkpoint_checks as checks
from tests.distributed.write_observer import check_written_once
from tests.harness import run_ranks, to_plain
from tests.tiny_models import AUTO, slice_batch, tiny_batch

CAUSAL = AUTO["causal"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Folders saved by plain transformers (one process): the models' initial weights."""
    root = tmp_path_factory.mktemp("plain")
    out = {}
    for arch in (*checks.ARCHS, "llama4"):
        checks.build(arch).save_pretrained(root / arch)
        out[arch] = str(root / arch)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory, plain):
    return run_ranks(checks.world4, 4, str(tmp_path_factory.mktemp("pp4")), plain, timeout=1500)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, plain):
    return run_ranks(checks.world2, 2, str(tmp_path_factory.mktemp("pp2")), plain, timeout=900)


def _ties(arch: str) -> dict[str, str]:
    return dict(find_tied_parameters(checks.build(arch)))


def _merged(per_rank: list[dict]) -> dict:
    """The ranks' name -> value dicts as one (ranks of one stage hold equal values)."""
    out = {}
    for part in per_rank:
        for name, value in part.items():
            if name in out:
                assert np.array_equal(out[name], value), f"{name}: ranks of one stage disagree"
            out[name] = value
    return out


def _tensor_ranges(folder: Path) -> dict[str, list[tuple[int, int, str]]]:
    """file -> [(start, end, tensor)] byte ranges of each tensor's data, from the headers."""
    out = {}
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as fh:
            length = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(length))
        header.pop("__metadata__", None)
        out[path.name] = [(8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1], n)
                          for n, e in header.items()]
    return out


# ------------------------------------------------------------------ save


SAVED = [("world4", "llama"), ("world4", "gpt2"), ("world2", "llama"), ("world2", "llama4")]


@pytest.mark.parametrize("world, arch", SAVED)
def test_each_stage_writes_its_own_tensors_and_transformers_reads_them_bit_for_bit(world, arch, request):
    ranks = request.getfixturevalue(world)
    folder = Path(ranks[0]["save"][arch]["built"])
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded, with an index
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    ties = _ties(arch)
    assert ties and not set(ties) & set(index)  # the tied head is written once, as its embedding
    check_written_once(folder, [r["save"][arch]["writes"] for r in ranks])
    ranges = _tensor_ranges(folder)
    for r in ranks:  # every byte a rank writes lies in a tensor of its own stages: no gather
        mine = set(r["save"][arch]["built_holding"]["names"])
        for file, offset, n in r["save"][arch]["writes"]:
            if n:
                owner = {name for start, end, name in ranges[file] if start <= offset < end}
                assert owner <= mine, (r["save"][arch]["built_holding"]["pp_rank"], owner)
    before = checks.build(arch)
    placed = sorted((file, start, name) for file, spans in ranges.items() for start, _, name in spans)
    assert [name for _, _, name in placed] == [n for n in before.state_dict() if n not in ties]  # the model's order
    loaded = CAUSAL.from_pretrained(folder)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # still tied
    for (name, p), (_, q) in zip(loaded.named_parameters(), before.named_parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------ from_pretrained


@pytest.mark.parametrize("world, arch", SAVED)
def test_from_pretrained_at_pp_materialises_only_its_stages(world, arch, plain, request):
    ranks = request.getfixturevalue(world)
    reference = CAUSAL.from_pretrained(plain[arch])
    want = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    total = sum(p.numel() for p in reference.parameters())
    held: dict[int, set[str]] = {}
    for r in ranks:
        got = r["save"][arch]
        holding = got["holding"]
        assert holding["meta_left"] == []
        assert holding["blocks"] == holding["layout_blocks"] and holding["blocks"]  # its stages' blocks only
        assert holding["numel"] < total  # the other stage's weights are not here, not even on meta
        held.setdefault(holding["pp_rank"], set()).update(holding["names"])
        for name, value in got["loaded"].items():  # the last stage's head read from the embedding's key
            assert np.array_equal(value, want[name].numpy()), name
        with torch.no_grad():
            batch = slice_batch(tiny_batch("causal", 4, seed=7), *got["dp"])
            expected = float(reference(**batch).loss)
        assert got["loss"] == pytest.approx(expected, rel=1e-5)
    assert len(held) == 2 and not held[0] & held[1]  # disjoint stages
    assert held[0] | held[1] == set(want)  # together, every parameter (the head as its own copy)


def test_a_trained_pp_model_saves_what_it_holds(world4, world2):
    for ranks, archs in ((world4, checks.ARCHS), (world2, ("llama", "llama4"))):
        for arch in archs:
            trained = _merged([r["save"][arch]["trained"] for r in ranks])
            ties = _ties(arch)
            for target, source in ties.items():  # the engine keeps the two ends equal
                assert np.array_equal(trained[target], trained[source])
            loaded = CAUSAL.from_pretrained(ranks[0]["save"][arch]["saved"])
            names = dict(loaded.named_parameters(remove_duplicate=False))
            assert set(names) == set(trained)
            for name, p in names.items():
                assert np.array_equal(p.detach().numpy(), trained[name]), name
            untrained = checks.build(arch)  # the step moved the weights: a real test
            assert not torch.equal(untrained.get_input_embeddings().weight, loaded.get_input_embeddings().weight)


# ------------------------------------------------------------------ resume and reshard


def _state(per_rank: list[dict]) -> dict:
    """One run's snapshot, merged over its ranks."""
    return {"params": _merged([r["params"] for r in per_rank]),
            "optim": {n: v for r in per_rank for n, v in r["optim"].items()}}


def _assert_same_state(got: dict, want: dict, ties: dict[str, str]) -> None:
    """Same parameters and optimizer state by name; a tie target missing on one side (one
    process and fsdp keep the head as the embedding) is compared with its source."""
    for kind in ("params", "optim"):
        names = set(got[kind]) | set(want[kind])
        assert names and all(n in got[kind] or ties.get(n) in got[kind] for n in names), kind
        for name in sorted(names):
            a = got[kind].get(name, got[kind].get(ties.get(name)))
            b = want[kind].get(name, want[kind].get(ties.get(name)))
            assert b is not None, name
            if kind == "params":
                assert np.array_equal(a, b), name
            else:
                assert set(a) == set(b), name
                for key in b:
                    assert np.array_equal(a[key], b[key]), f"{name}.{key}"


def test_pp2_fsdp2_resumes_exactly(world4):
    first, same = [r["first"] for r in world4], [r["same"] for r in world4]
    assert same[0]["step"] == checks.TOTAL // 2
    _assert_same_state(_state([r["state"] for r in same]), _state([r["state"] for r in first]), _ties("llama"))
    assert world4[0]["first"]["losses"] + world4[0]["same"]["losses"] == world4[0]["straight_pp2_fsdp2"]  # bit for bit
    for r in world4:  # each stage's optimizer settings restored (the scheduled lr included)
        assert r["same"]["state"]["groups"] == r["first"]["state"]["groups"]


def test_pp2_fsdp2_reshards_into_fsdp4(world4):
    first = _state([r["first"]["state"] for r in world4])
    _assert_same_state(_state([r["fsdp4"]["state"] for r in world4]), first, _ties("llama"))
    got = world4[0]
    np.testing.assert_allclose(got["fsdp4"]["losses"], got["straight_pp2_fsdp2"][2:], rtol=1e-5)
    np.testing.assert_allclose(got["straight_fsdp4"], got["straight_pp2_fsdp2"], rtol=1e-5)


def test_pp2_reshards_into_fsdp2(world2):
    got = world2[0]
    assert got["fsdp2"]["step"] == checks.TOTAL // 2
    _assert_same_state(_state([r["fsdp2"]["state"] for r in world2]), _state([r["first"]["state"] for r in world2]),
                       _ties("gpt2"))
    np.testing.assert_allclose(got["fsdp2"]["losses"], got["straight_pp2"][2:], rtol=1e-5)
    np.testing.assert_allclose(got["straight_fsdp2"], got["straight_pp2"], rtol=1e-5)


def test_pp2_state_into_one_process(world2, monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    got = to_plain(checks.second_half("gpt2", {"strategy": "fsdp"}, world2[0]["root"]))
    want = _state([r["first"]["state"] for r in world2])
    _assert_same_state(_state([got["state"]]), want, _ties("gpt2"))
    assert set(got["state"]["optim"]) == set(want["optim"]) - set(_ties("gpt2"))  # the head's state is the embedding's
    np.testing.assert_allclose(got["losses"], world2[0]["straight_pp2"][2:], rtol=1e-5)


def test_fsdp2_state_into_pp2_gives_the_head_the_embeddings_state(world2):
    got = world2[0]
    assert got["pp2_from_fsdp2"]["step"] == checks.TOTAL // 2
    want = _state([r["first_fsdp2"]["state"] for r in world2])
    assert "lm_head.weight" not in want["optim"]  # fsdp keeps the head as the embedding
    loaded = _state([r["pp2_from_fsdp2"]["state"] for r in world2])
    assert "lm_head.weight" in loaded["optim"]  # the last stage's own head
    _assert_same_state(loaded, want, _ties("gpt2"))
    np.testing.assert_allclose(got["pp2_from_fsdp2"]["losses"], got["straight_fsdp2"][2:], rtol=1e-5)
    for r in world2:  # each stage's optimizer settings restored (the scheduled lr included)
        assert r["pp2_from_fsdp2"]["state"]["groups"] == r["first_fsdp2"]["state"]["groups"]


def test_fsdp2_state_into_zbv_where_one_rank_holds_both_ends_of_the_tie(world2):
    got = world2[0]
    want = _state([r["fsdp2_llama4"]["state"] for r in world2])
    loaded = _state([r["zbv_from_fsdp2"]["state"] for r in world2])
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(world2[0]["zbv_from_fsdp2"]["state"]["optim"])
    _assert_same_state(loaded, want, _ties("llama4"))
    np.testing.assert_allclose(got["zbv_from_fsdp2"]["losses"], got["fsdp2_llama4"]["losses"][2:], rtol=1e-5)


@pytest.mark.parametrize("world", ["world4", "world2"])
def test_the_free_space_check_counts_every_stages_optimizer_state(world, request):
    first = request.getfixturevalue(world)[0]["first"]
    assert first["written"] <= first["estimate"] < 2 * first["written"]


def test_hf_scale_export_of_a_pp2_fsdp2_checkpoint(world4, tmp_path):
    from hf_scale.cli import main

    out = tmp_path / "exported"
    # in this process (hf_scale.cli.main, whose status is the command's): a process start saved; the
    # command as a process, at 1 and 2 ranks: tests/distributed/test_fault_tolerance.py
    assert main(["export", os.path.join(world4[0]["root"], "latest"), str(out)]) == 0
    saved = _state([r["first"]["state"] for r in world4])["params"]
    loaded = CAUSAL.from_pretrained(out)
    for name, p in loaded.named_parameters(remove_duplicate=False):
        assert np.array_equal(p.detach().numpy(), saved[name]), name
