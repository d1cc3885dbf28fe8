"""QLoRA (an NF4 base under LoRA) under data-parallel layouts: parity with one process running
the same quantized model, slice-wise quantization equal to torchao's whole-tensor one, stored
bytes, no in-place weight mutation, and the layouts refused.

Parity (fp32 compute, 3 AdamW steps, clipping on) against tests.distributed.qlora_checks.
reference_run, the peft model with its LoRA base weights quantized whole by torchao: losses,
gradient norms and the first step's LoRA gradients within 1e-5 relative; each LoRA factor's
update within 2e-4 of its norm (as test_adapters). Ranks are spawned once per world size.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import qlora_checks
from tests.harness import run_ranks

pytest.importorskip("torchao")

RTOL = 1e-5
UPDATE_RTOL = 2e-4

WORLD2 = [
    {"id": "fsdp", "config": {"strategy": "fsdp"}, "parts": 2},
    {"id": "zero2", "config": {"strategy": "zero2"}, "parts": 2},
    {"id": "ddp", "config": {"strategy": "ddp"}, "parts": 1},
    {"id": "fsdp_full_ac", "config": {"strategy": "fsdp", "activation_checkpointing": "full"}, "parts": 2},
    # FSDP2's CPU offload of the NF4 shards (torchao's pin_memory / _to_copy): a no-op move on this
    # CPU, the offload policy's code path all the same; on a GPU unchecked (no device here)
    {"id": "fsdp_offload", "config": {"strategy": "fsdp", "cpu_offload": True}, "parts": 2},
    # tensor parallel: the base on local NF4 slices (each tp slice quantized alone), LoRA's factors split
    {"id": "tp2", "config": {"strategy": "fsdp", "tp": 2}, "parts": 1, "tp": 2},
    # pipeline: each stage's rank holds (and quantizes) its blocks' NF4 weights; its LoRA gradients
    {"id": "pp2", "config": {"strategy": "fsdp", "pp": 2}, "parts": 1, "pp": 2},
]
WORLD4 = [
    {"id": "hsdp", "config": {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}, "parts": 2},
    {"id": "fsdp4", "config": {"strategy": "fsdp"}, "parts": 4},  # k / v slices: 128 blocks, scaler block 128
    {"id": "tp2_fsdp2", "config": {"strategy": "fsdp", "tp": 2}, "parts": 2, "tp": 2},  # k / v: 128 too
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qlora_base")
    qlora_checks.save_base(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def world2(base, tmp_path_factory):
    return run_ranks(qlora_checks.world_checks, 2, base, WORLD2, str(tmp_path_factory.mktemp("q2")), True,
                     timeout=900)


@pytest.fixture(scope="module")
def world4(base, tmp_path_factory):
    return run_ranks(qlora_checks.world_checks, 4, base, WORLD4, str(tmp_path_factory.mktemp("q4")), timeout=900)


_REFERENCES: dict = {}


def reference(base: str, parts: int, tp: int = 1) -> dict:
    if (parts, tp) not in _REFERENCES:
        _REFERENCES[parts, tp] = qlora_checks.reference_run(base, parts, tp)
    return _REFERENCES[parts, tp]


def _rel(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check_parity(case: dict, ranks: list[dict], base: str) -> None:
    cases = WORLD2 if len(ranks) == 2 else WORLD4
    results = [r["parity"][[c["id"] for c in cases].index(case["id"])] for r in ranks]
    for result in results:
        assert "error" not in result, result.get("error")
    got, ref = results[0], reference(base, case["parts"], case.get("tp", 1))
    if case.get("pp"):  # each stage's rank holds its blocks' adapters: the model's are the union
        assert all(r["losses"] == got["losses"] and r["norms"] == got["norms"] for r in results)
        got = {**got, "grads": {n: g for r in results for n, g in r["grads"].items()},
               "lora": {n: v for r in results for n, v in r["lora"].items()}}
        assert all(len(r["grads"]) < len(ref["grads"]) for r in results)  # split between the stages
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=RTOL)
    assert set(got["grads"]) == set(ref["grads"]) and got["grads"]
    for name, want in ref["grads"].items():
        assert _rel(got["grads"][name], want.numpy()) <= RTOL, f"{name}: first-step gradient differs"
    init = {n: qlora_checks.init_lora(n, v.shape).numpy() for n, v in ref["lora"].items()}
    for name, want in ref["lora"].items():
        update = want.numpy() - init[name]
        assert np.linalg.norm(update) > 0
        assert _rel(got["lora"][name] - init[name], update) <= UPDATE_RTOL, f"{name}: update differs"
    for r in results:
        assert r["frozen_grads"] == [], r["frozen_grads"][:4]
        assert r["no_grad_equal"] or (case.get("pp") and r["no_grad_equal"] is None), "two no_grad forwards differ"
        assert r["nf4"]["requires_grad"] == []
        # what quantization.json records for export --dequantize: each tp-split weight's dim and degree
        want = {n.replace(".base_layer.", "."): [qlora_checks.tp_dim(n), case["tp"]] for n in r["nf4"]["names"]} \
            if case.get("tp") else {}
        assert r["tp_split"] == want


@pytest.mark.parametrize("case", WORLD2, ids=[c["id"] for c in WORLD2])
def test_qlora_parity_world2(case, world2, base):
    check_parity(case, world2, base)


@pytest.mark.parametrize("case", WORLD4, ids=[c["id"] for c in WORLD4])
def test_qlora_parity_world4(case, world4, base):
    check_parity(case, world4, base)


def _world(layout: str, request):
    """(the ranks' results, the cases) of the world size that ran ``layout``."""
    if layout in {c["id"] for c in WORLD4}:
        return request.getfixturevalue("world4"), WORLD4
    return request.getfixturevalue("world2"), WORLD2


def _quantized(base: str, proj: str, tp: int, tp_rank: int, scaler_block: int):
    """torchao's to_nf4 of layer 0's ``proj`` weight (whole, or this tp rank's slice of it)."""
    from safetensors.torch import load_file
    from torchao.quantization import to_nf4

    name = f"model.layers.0.self_attn.{proj}.weight"
    weight = load_file(f"{base}/model.safetensors")[name]
    if tp > 1:
        weight = weight.chunk(tp, dim=qlora_checks.tp_dim(name))[tp_rank].contiguous()
    return to_nf4(weight, 64, scaler_block)


# the scaler block of each projection's slices (written here: 64-element blocks a slice, the largest divisor
# up to 256): q / o 256 everywhere; k (128 x 256) 128 where a rank holds a quarter of it (fsdp4, tp2 x fsdp2)
SCALER_BLOCKS = {"q_proj": lambda quarter: 256, "o_proj": lambda quarter: 256,
                 "k_proj": lambda quarter: 128 if quarter else 256}


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp4", "hsdp", "tp2", "tp2_fsdp2"])
def test_slice_quantization_equals_whole(layout, base, request):
    """Each rank's NF4 inner tensors of q_proj, o_proj and k_proj are torchao's whole-tensor
    quantization (at the weight's scaler block) split as FSDP splits it (dp = 1: ddp, 2: fsdp and
    hsdp's shards, 4: fsdp4); under tp, of the rank's tp slice (q / k's rows, o's columns)
    quantized alone, split by FSDP."""
    ranks, cases = _world(layout, request)
    case = next(c for c in cases if c["id"] == layout)
    parts, tp = case["parts"], case.get("tp", 1)
    for rank, result in enumerate(ranks):
        # mesh (dp_replicate, dp_shard, tp), tp the fast dimension: hsdp's shard is rank % parts
        tp_rank, shard = rank % tp, (rank // tp) % parts
        for proj in ("q_proj", "o_proj", "k_proj"):
            whole = _quantized(base, proj, tp, tp_rank, SCALER_BLOCKS[proj](parts * tp == 4))
            want = whole.split(whole.shape[0] // parts)[shard] if parts > 1 else whole
            held = result["parity"][cases.index(case)]["nf4"][proj]
            for name, value in held.items():
                expected = getattr(want, name).numpy() if name == "quantized_data" else getattr(want, name).float().numpy()
                if proj == "q_proj" or name == "quantized_data":
                    np.testing.assert_array_equal(value, expected, err_msg=f"rank {rank} {proj} {name}")
                else:  # the mean: exact (fp64) rounded to fp32 here, summed in fp32 by torchao (an ulp apart for
                    # o_proj: its factors 2e-7 apart, a scaler may move one int8 step)
                    np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1 if name == "quantized_scalers" else 0,
                                               err_msg=f"rank {rank} {proj} {name}")


@pytest.mark.parametrize("layout,parts", [("fsdp", 2), ("ddp", 1), ("fsdp4", 4), ("tp2", 2), ("tp2_fsdp2", 4)])
def test_frozen_bytes_per_parameter(layout, parts, request):
    """Every LoRA base weight is NF4 on every rank, at 4 + 1/8 + 32 / (64 x its scaler block) bits a
    parameter (the inner tensors counted, not element_size()): 4.127 at 256; at 4 slices (dp, or
    tp x dp) k / v's slices hold 128 blocks (2 of 16,384 elements whole): scaler block 128."""
    ranks, cases = _world(layout, request)
    case = next(c for c in cases if c["id"] == layout)
    for result in ranks:
        nf4 = result["parity"][cases.index(case)]["nf4"]
        assert nf4["kept"] == [] and len(nf4["names"]) == 14
        small = {n for n, b in nf4["scaler_blocks"].items() if b != 256}
        assert small == ({n for n in nf4["names"] if ".k_proj." in n or ".v_proj." in n} if parts == 4 else set())
        assert set(nf4["scaler_blocks"].values()) <= {256, 128}
        at_128 = len(small) * 128 * 256 // parts  # elements of the k / v slices a rank holds, if at 128
        want = (nf4["elements"] - at_128) * (4 + 1 / 8 + 32 / 16384) + at_128 * (4 + 1 / 8 + 32 / 8192)
        assert abs(nf4["bytes"] * 8 - want) < 1e-6, (nf4["bytes"] * 8, want)


def test_adapter_only_checkpoint_resumes(world2, base):
    """save_state under fsdp writes the adapter alone (the NF4 base is re-quantized at load);
    resumed under ddp, the third step gives the uninterrupted run's loss and adapters."""
    ref = reference(base, 2)
    init = {n: qlora_checks.init_lora(n, v.shape).numpy() for n, v in ref["lora"].items()}
    for rank, result in enumerate(world2):  # each rank resumed (under ddp each holds the whole adapter)
        got = result["resume"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["step"] == 2, rank
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL, err_msg=f"rank {rank}")
        assert got["files"] and all("adapter_model" in f for f in got["files"]), (rank, got["files"])
        for name, want in ref["lora"].items():
            update = want.numpy() - init[name]
            assert _rel(got["lora"][name] - init[name], update) <= UPDATE_RTOL, f"rank {rank}: {name} after resume"


def test_refusals_on_every_rank(world2):
    for result in world2:
        bad = result["bad"]
        assert "error" not in bad, bad.get("error")
        for name in ("pp", "zero1"):  # tp under hsdp / ddp: tests/unit/test_nf4.py (check_quantize)
            assert bad[name].startswith("HfScaleConfigError") and "quantize='nf4' with" in bad[name], bad[name]
        assert "pp=2" in bad["pp"] and "zero1" in bad["zero1"]
        assert bad["no_adapter"].startswith("HfScaleConfigError") and "adapter=" in bad["no_adapter"]
        assert bad["unknown"].startswith("HfScaleConfigError") and "'nf4'" in bad["unknown"]
        assert bad["merge"].startswith("HfScaleConfigError") and "export --merge" in bad["merge"], bad["merge"]
    assert len({tuple(sorted(r["bad"].items())) for r in world2}) == 1, "ranks raised different errors"
