"""hf_scale.save_pretrained from 2 and 4 ranks: a Hub-format folder that plain transformers
loads, giving the parallel model's logits; every rank writes its part, replicas nothing twice."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.distributed.save_checks import save_cases
from tests.harness import run_ranks
from tests.tiny_models import AUTO, tiny_batch, tiny_model

MODELS = [("llama", "causal"), ("t5", "seq2seq"), ("gpt_neox", "causal")]
WORLD2 = [
    dict(id=f"{a}-{h}-{s}", arch=a, head=h, config={"strategy": s}, shard=6000)
    for a, h in MODELS
    for s in ("fsdp", "zero2", "zero1", "ddp")
] + [dict(id="llama-causal-fsdp-bf16-offload", arch="llama", head="causal",
          config={"strategy": "fsdp", "mixed_precision": "bf16", "cpu_offload": True})]
WORLD4 = [dict(id="llama-causal-hsdp", arch="llama", head="causal", config={"strategy": "hsdp", "dp_replicate": 2}, shard=6000)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for world, cases in ((2, WORLD2), (4, WORLD4)):
        per_rank = run_ranks(save_cases, world, cases, str(root), timeout=600)
        for i, case in enumerate(cases):
            out[case["id"]] = (case, [r[i] for r in per_rank])
    return out


@pytest.mark.parametrize("case_id", [c["id"] for c in WORLD2 + WORLD4])
def test_plain_transformers_loads_the_parallel_save(saved, case_id):
    case, ranks = saved[case_id]
    folder = Path(ranks[0]["folder"])
    model = AUTO[case["head"]].from_pretrained(folder)
    for name, param in model.named_parameters():  # bit-exact weights
        assert torch.equal(param.detach(), torch.from_numpy(ranks[0]["params"][name])), name
    if not case["config"].get("mixed_precision"):  # and the parallel model's own outputs
        with torch.no_grad():
            logits = model(**tiny_batch(case["head"], 2, seed=7)).logits
        torch.testing.assert_close(logits, torch.from_numpy(ranks[0]["logits"]), rtol=1e-5, atol=1e-6)
    # The files are the ones transformers writes, and the checksums are right.
    names = sorted(p.name for p in folder.iterdir())
    assert "config.json" in names and not any(n.startswith(".") for n in names)
    shards = [n for n in names if n.endswith(".safetensors")]
    if len(shards) > 1:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        assert index["metadata"]["total_size"] == total - _tied_bytes(model)
    else:
        assert shards == ["model.safetensors"]
    for line in (folder / "checksums.sha256").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest


def _tied_bytes(model):
    seen, tied = set(), 0
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied += p.numel() * p.element_size()
        seen.add(id(p))
    return tied


@pytest.mark.parametrize("strategy, share", [("fsdp", 0.5), ("zero2", 0.5), ("ddp", None), ("zero1", None)])
def test_each_rank_writes_its_part_and_nothing_twice(saved, strategy, share):
    _, ranks = saved[f"llama-causal-{strategy}"]
    total = sum(p.numel() * p.element_size() for p in tiny_model("llama", "causal").parameters())
    written = [r["bytes_written"] for r in ranks]
    assert sum(written) == total  # every byte once
    if share:  # sharded: each rank writes its own shard
        assert all(w == pytest.approx(share * total, rel=0.05) for w in written)
    else:  # replicated: tensors spread over owners, no rank writes everything
        assert all(0 < w < total for w in written)


def test_hsdp_replica_groups_write_nothing_twice(saved):
    _, ranks = saved["llama-causal-hsdp"]
    total = sum(p.numel() * p.element_size() for p in tiny_model("llama", "causal").parameters())
    written = [r["bytes_written"] for r in ranks]
    assert sum(written) == total and written.count(0) == 2  # one replica group wrote it all


def test_a_full_disk_on_one_rank_fails_every_rank_cleanly(tmp_path):
    from tests.distributed.save_checks import full_disk_on_one_rank

    results = run_ranks(full_disk_on_one_rank, 2, str(tmp_path), timeout=180)
    for r in results:
        assert r["outcome"].startswith("no space left for") and "bytes) free" in r["outcome"]
        assert r["left"] == []  # the partial folder was removed
