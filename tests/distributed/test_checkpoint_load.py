"""hf_scale.from_pretrained on 2 and 4 ranks: each rank reads only its slices, into any layout;
a bad checkpoint that one rank alone reads is refused on every rank (issue 26, item 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_scale
from tests.distributed.save_checks import load_cases, refusal_cases
from tests.harness import run_ranks
from tests.tiny_models import tiny_batch, tiny_model

WORLD2 = [
    {"strategy": "fsdp"},
    {"strategy": "zero2", "activation_checkpointing": "full"},
    {"strategy": "zero1"},
    {"strategy": "ddp"},
    {"strategy": "fsdp", "mixed_precision": "bf16", "cpu_offload": True},
]
WORLD4 = [{"strategy": "hsdp", "dp_replicate": 2}, {"strategy": "fsdp"}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = tiny_model("llama", "causal", seed=11)
    folder = hf_scale.save_pretrained(model, tmp_path_factory.mktemp("ref") / "llama", max_shard_size=6000)
    with torch.no_grad():
        logits = model(**tiny_batch("causal", 2, seed=7)).logits
    return folder, model, logits


@pytest.fixture(scope="module")
def loaded(reference):
    folder = str(reference[0])
    return {2: run_ranks(load_cases, 2, folder, WORLD2, timeout=600), 4: run_ranks(load_cases, 4, folder, WORLD4, timeout=600)}


CASES = [(2, i) for i in range(len(WORLD2))] + [(4, i) for i in range(len(WORLD4))]


@pytest.mark.parametrize("world, index", CASES, ids=[f"world{w}-{(WORLD2 if w == 2 else WORLD4)[i]}" for w, i in CASES])
def test_loads_exact_weights_into_the_layout(reference, loaded, world, index):
    _, model, logits = reference
    config = (WORLD2 if world == 2 else WORLD4)[index]
    ranks = [r[index] for r in loaded[world]]
    for name, param in model.named_parameters():
        assert np.array_equal(ranks[0]["params"][name], param.detach().numpy()), name
    sharded = config["strategy"] in ("fsdp", "zero2", "hsdp")
    shard_size = 2 if config["strategy"] == "hsdp" else world
    for r in ranks:
        assert r["share"] == pytest.approx(1 / shard_size if sharded else 1.0, rel=0.05)
        assert r["class"].endswith("LlamaForCausalLM")
        if not config.get("mixed_precision"):
            torch.testing.assert_close(torch.from_numpy(r["logits"]), logits, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ a defect one rank reads


def _shard_of(folder: Path, prefix: str) -> Path:
    """A shard holding tensors under ``prefix`` only (under pp=2 of 2 blocks: one stage's)."""
    by_file: dict[str, list[str]] = {}
    for name, file in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    return folder / next(f for f, names in sorted(by_file.items()) if all(n.startswith(prefix) for n in names))


def _truncate(shard: Path) -> None:
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 64)


def _rewrite(shard: Path, change) -> None:
    """Each tensor of ``shard`` through ``change`` (the index still maps the same names to it)."""
    from safetensors.torch import load_file, save_file

    save_file({k: change(v) for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})


def _flip_a_byte(shard: Path) -> None:
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))


# (id, layout, rank with the defect, that rank's own copy (else one folder for all), the defect,
#  verify_checksums, what its message says)
REFUSALS = [
    ("pp2-truncated-shard-of-stage0", {"pp": 2}, 0, False,
     lambda f: _truncate(_shard_of(f, "model.layers.0.")), False, "truncated"),
    ("pp2-checksum-of-a-stage1-shard", {"pp": 2}, None, False,
     lambda f: _flip_a_byte(_shard_of(f, "model.layers.1.")), True, "do not match checksums.sha256"),
    ("tp2-shape-on-rank1", {"tp": 2}, 1, True,
     lambda f: _rewrite(_shard_of(f, "model.layers.0.mlp.up"), lambda t: t[:-2].clone()), False,
     "has shape [62, 32], the model expects [64, 32]"),
    ("fsdp-integer-dtype-on-rank0", {"strategy": "fsdp"}, 0, True,
     lambda f: _rewrite(_shard_of(f, "model.layers.1.mlp.down"), lambda t: t.to(torch.int32)), False,
     "is I32, the model's is torch.float32"),
    ("ddp-truncated-on-rank1", {"strategy": "ddp"}, 1, True,
     lambda f: _truncate(_shard_of(f, "model.layers.1.self_attn.o")), False, "truncated"),
    ("pp2-missing-shard-on-rank1", {"pp": 2}, 1, True,
     lambda f: _shard_of(f, "model.layers.1.self_attn.o").unlink(), False, "is missing"),
]


def test_a_defect_one_rank_reads_is_refused_on_every_rank(reference, tmp_path):
    """Pipeline stages read different shards; a rank may read its own copy (a disk per node).
    Whichever check fails on one rank (size, shape, dtype, index, checksums), every rank raises
    HfScaleCheckpointError with that message, and all stay in step: a good load follows."""
    good, cases = Path(reference[0]), []
    for name, config, bad_rank, own_copy, defect, verify, _ in REFUSALS:
        bad = shutil.copytree(good, tmp_path / name)
        defect(bad)
        folders = [str(bad) if own_copy is False or r == bad_rank else str(good) for r in range(2)]
        cases.append({"config": config, "folders": folders, "verify": verify})
    cases.append({"config": {"pp": 2}, "folders": [str(good)] * 2, "verify": True})
    ranks = run_ranks(refusal_cases, 2, cases, timeout=300)
    wrong = {}
    for i, (name, _, bad_rank, _, _, _, says) in enumerate(REFUSALS):
        got = [r[i] for r in ranks]
        first = got[bad_rank or 0]["message"]
        relayed = f"rank {bad_rank} failed: HfScaleCheckpointError: {first}"
        want = [first if bad_rank in (None, r) else relayed for r in range(2)]
        if says not in first or [g["kind"] for g in got] != ["HfScaleCheckpointError"] * 2 or [g["message"] for g in got] != want:
            wrong[name] = got
    assert not wrong, wrong
    assert [r[-1]["kind"] for r in ranks] == [None, None], [r[-1] for r in ranks]
