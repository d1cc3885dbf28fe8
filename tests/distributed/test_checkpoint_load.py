"""hf_scale.from_pretrained on 2 and 4 ranks: each rank reads only its slices, into any layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_scale
from tests.distributed.save_checks import load_cases
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
