"""LoRA adapters (peft) under every layout: parity with the same peft model in one process,
peft-format checkpoints with rank-distinct values, resume at another layout, bad inputs.

Parity (3 AdamW steps on the adapters, clipping on, against tests.distributed.adapter_checks.
reference_run): losses and gradient norms within 1e-5 relative in fp32; each LoRA tensor's
update within 2e-4 of the reference update's norm (as the full-model parity tests); every base
weight bit for bit unchanged; no frozen weight got a gradient or a place in the optimizer.

A bf16 base with fp32 adapters is compared with the same dtypes in one process. Data parallel
leaves each sample's bf16 matmuls as they were (fsdp: measured 1e-7 on losses, 1.4e-6 on
updates), but tensor parallel sums bf16 partial products across ranks, one more rounding per
row-parallel layer: gradient norms measured 0.6% apart, updates up to 0.19 of their norm (Adam
turns the gradients' rounding noise into full steps, as in the full-model parity tests). Those
cases get 2e-2 and 0.5, test_parity's low-precision tolerances; a step not taken gives 1.

Ranks are spawned once per world size; each test reads one part of the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import adapter_checks
from tests.harness import run_ranks

FP32_RTOL = 1e-5
UPDATE_RTOL = 2e-4
BF16_RTOL = 2e-2
BF16_UPDATE_RTOL = 0.5

# LoRA on the attention of a MoE model, its experts frozen (peft's all-linear would wrap the
# experts' parameters, which ep refuses)
MOE_LORA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
WORLD2 = [
    {"id": "ddp", "config": {"strategy": "ddp"}},
    {"id": "zero1", "config": {"strategy": "zero1"}},
    {"id": "zero2", "config": {"strategy": "zero2"}},
    {"id": "fsdp", "config": {"strategy": "fsdp"}},
    {"id": "fsdp_full_ac", "config": {"strategy": "fsdp", "activation_checkpointing": "full"}},
    {"id": "fsdp_chunked_loss", "config": {"strategy": "fsdp", "loss_chunk_tokens": 24}},
    {"id": "tp2", "config": {"strategy": "zero2", "tp": 2}},
    {"id": "pp2", "config": {"strategy": "ddp", "pp": 2}},
    {"id": "fsdp_bf16_base", "config": {"strategy": "fsdp"}, "base_dtype": "bfloat16"},
    {"id": "tp2_bf16_base", "config": {"strategy": "zero2", "tp": 2}, "base_dtype": "bfloat16"},
    # packed bases under tp: Phi-3's qkv_proj / gate_up_proj, GPT-2's Conv1D c_attn
    {"id": "tp2_phi3_packed", "config": {"strategy": "zero2", "tp": 2}, "arch": "phi3_mha"},
    {"id": "tp2_gpt2_conv1d", "config": {"strategy": "zero2", "tp": 2}, "arch": "gpt2"},
    # frozen experts under expert parallel
    {"id": "ep2_qwen3_moe", "config": {"strategy": "ddp", "ep": 2}, "arch": "qwen3_moe", "lora": MOE_LORA},
]
WORLD4 = [
    {"id": "tp2_fsdp2", "config": {"strategy": "fsdp", "tp": 2}},
    {"id": "hsdp", "config": {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}},
    {"id": "pp2_fsdp2", "config": {"strategy": "fsdp", "pp": 2}},
    {"id": "tp2_fsdp2_bf16_base", "config": {"strategy": "fsdp", "tp": 2}, "base_dtype": "bfloat16"},
    {"id": "ep2_fsdp2_qwen3_moe", "config": {"strategy": "fsdp", "ep": 2}, "arch": "qwen3_moe", "lora": MOE_LORA},
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters2")
    results = run_ranks(adapter_checks.world_checks, 2, WORLD2, str(root), True, timeout=900)
    results[0]["root"] = str(root)
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters4")
    results = run_ranks(adapter_checks.world_checks, 4, WORLD4, str(root), False, timeout=900)
    results[0]["root"] = str(root)
    return results


_REFERENCES: dict = {}


def _reference(base_dtype: str, arch: str = "llama", lora: dict | None = None) -> dict:
    key = (base_dtype, arch, repr(lora))
    if key not in _REFERENCES:
        import torch

        _REFERENCES[key] = adapter_checks.reference_run(getattr(torch, base_dtype), arch, **(lora or {}))
    return _REFERENCES[key]


def check_parity(case: dict, ranks: list[dict]) -> dict:
    """Compare one case's result (every rank's) with the one-process run; returns the worst
    relative errors seen, for the tolerance notes."""
    results = [r["parity"][[c["id"] for c in (WORLD2 if len(ranks) == 2 else WORLD4)].index(case["id"])] for r in ranks]
    for result in results:
        assert "error" not in result, result.get("error")
    result = results[0]
    base_dtype = case.get("base_dtype", "float32")
    ref = _reference(base_dtype, case.get("arch", "llama"), case.get("lora"))
    low = base_dtype != "float32"
    tol, update_tol = (BF16_RTOL, BF16_UPDATE_RTOL) if low else (FP32_RTOL, UPDATE_RTOL)
    for step, (got, want) in enumerate(zip(result["losses"], ref["losses"])):
        assert abs(got - want) <= tol * abs(want), f"step {step}: loss {got} vs one process {want}"
    for step, (got, want) in enumerate(zip(result["norms"], ref["norms"])):
        assert abs(got - want) <= tol * abs(want), f"step {step}: grad norm {got} vs one process {want}"
    params = {}
    for r in results:  # under pp each rank holds its stages' parameters
        params.update(r["params"])
    if "lm_head.weight" in set(params) - set(ref["params"]):  # pp: the tied head is the last stage's own copy
        assert np.array_equal(params.pop("lm_head.weight"), params["model.embed_tokens.weight"])
    assert set(params) == set(ref["params"]), "parameter names differ from the peft model's"
    worst = 0.0
    for name, want in ref["params"].items():
        got, initial = params[name], ref["initial"][name].numpy()
        if "lora_" not in name:
            assert np.array_equal(got, initial), f"frozen base weight {name} changed"
            continue
        want_update = want.numpy() - initial
        assert np.linalg.norm(want_update) > 0, f"{name} did not move in the reference: the case tests nothing"
        rel = float(np.linalg.norm((got - initial) - want_update) / np.linalg.norm(want_update))
        worst = max(worst, rel)
        assert rel <= update_tol, f"{name}: its update differs from one process's by {rel:.2e} of its norm"
    for r in results:
        assert r["frozen_grads"] == [], f"frozen weights got gradients: {r['frozen_grads'][:4]}"
        assert r["frozen_in_optimizer"] == [], f"frozen weights in the optimizer: {r['frozen_in_optimizer'][:4]}"
        assert r["trainable"] > 0
    return {"update": worst}


@pytest.mark.parametrize("case", WORLD2, ids=[c["id"] for c in WORLD2])
def test_adapter_parity_world2(case, world2):
    check_parity(case, world2)


@pytest.mark.parametrize("case", WORLD4, ids=[c["id"] for c in WORLD4])
def test_adapter_parity_world4(case, world4):
    check_parity(case, world4)


def test_parity_check_fails_on_a_stale_adapter():
    """The check itself: a run whose adapters never moved (losses and norms right) fails it."""
    ref = _reference("float32")
    stale = {"losses": ref["losses"], "norms": ref["norms"], "frozen_grads": [], "frozen_in_optimizer": [],
             "trainable": 1, "params": {n: v.numpy() for n, v in ref["initial"].items()}}
    ranks = [{"parity": [stale] + [{}] * (len(WORLD2) - 1)}] * 2
    with pytest.raises(AssertionError, match="its update differs"):
        check_parity(WORLD2[0], ranks)


@pytest.mark.parametrize("layout", ["fsdp", "tp2", "pp2", "ddp", "fsdp_named", "tp2_fsdp2"])
def test_rank_distinct_adapter_round_trip(layout, world2, world4):
    """Every rank's slice of every LoRA tensor holds its own values; saved, zeroed, loaded back:
    every element returns, on every rank (the files hold all ranks' slices, not rank 0's)."""
    ranks = world4 if layout == "tp2_fsdp2" else world2
    for rank, result in enumerate(ranks):
        got = result["round_trip"][layout]
        assert got["lora_tensors"] > 0
        assert got["wrong"] == [], f"rank {rank}: {got['wrong'][:4]} did not come back"
    assert ranks[0]["round_trip"][layout]["files"] == ["adapter_config.json", "adapter_model.safetensors",
                                                       "checksums.sha256"]


@pytest.mark.parametrize("layout", ["fsdp", "tp2", "pp2", "fsdp_named", "tp2_fsdp2"])
def test_peft_reads_the_saved_adapter(layout, world2, world4):
    """peft itself (PeftModel.from_pretrained, one process) reads what the ranks wrote: the only
    reader that shares no code with hf_scale's writer (a 2-D slice at the wrong offset under
    tp2 x fsdp2; an adapter not named "default")."""
    import torch
    from peft import PeftModel

    ranks = world4 if layout == "tp2_fsdp2" else world2
    folder = f"{ranks[0]['root']}/adapter_{layout}"
    model = PeftModel.from_pretrained(adapter_checks.tiny_model("llama", "causal"), folder)
    lora = {n: p for n, p in model.get_base_model().named_parameters() if "lora_" in n}
    holders = ranks if layout == "pp2" else ranks[:1]  # a pipeline rank holds its stage's tensors
    assert len(lora) == sum(r["round_trip"][layout]["lora_tensors"] for r in holders) > 0
    saved_as = ".mine." if layout == "fsdp_named" else ".default."  # peft loads it as "default"
    for name, p in lora.items():
        assert torch.equal(p.detach(), adapter_checks.pattern(name.replace(".default.", saved_as), p.shape)), name


@pytest.mark.parametrize("which", ["resume_fsdp_to_tp", "resume_tp_to_pp"])
def test_resume_at_another_layout(which, world2):
    """Two steps, save_state, resume at another layout (adapters zeroed first, so they must come
    from the files), third step: the losses and adapters of the uninterrupted run."""
    ref = _reference("float32")
    got = world2[0][which]
    assert got["step"] == 2
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=FP32_RTOL)
    params = {}
    for r in world2:
        params.update(r[which]["params"])
    for name, want in ref["params"].items():
        if "lora_" in name:
            update = want.numpy() - ref["initial"][name].numpy()
            rel = np.linalg.norm(params[name] - want.numpy()) / np.linalg.norm(update)
            assert rel <= UPDATE_RTOL, f"{name} after resume: {rel:.2e} of its update off"


def test_bad_inputs_fail_on_every_rank(world2):
    for rank, result in enumerate(world2):
        bad = result["bad"]
        assert bad["other_r"].startswith("HfScaleCheckpointError") and "r=4" in bad["other_r"] and "r=2" in bad["other_r"], bad
        assert bad["modules_to_save_tp"].startswith("HfScalePlanError") and "modules_to_save" in bad["modules_to_save_tp"]
        assert "lm_head" in bad["modules_to_save_tp"] and "tp=1" in bad["modules_to_save_tp"]
        assert bad["not_an_adapter"].startswith("HfScaleCheckpointError") and "not a peft adapter folder" in bad["not_an_adapter"]
        assert bad["lora_experts_ep"].startswith("HfScalePlanError") and "carry peft adapters" in bad["lora_experts_ep"], bad
    assert len({tuple(sorted(r["bad"].items())) for r in world2}) == 1, "ranks raised different errors"
