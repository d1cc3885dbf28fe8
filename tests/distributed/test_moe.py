"""Mixture-of-experts under expert parallel (and tensor parallel, ep x fsdp): parity with one
process for five families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 with a shared expert, GPT-OSS
with expert biases), with the load-balancing loss on and off; transformers#48687's router
gradient case; tokens per expert against the one-process routing; the all-to-alls of a forward;
bad input refused on every rank; ep under pp at world 4, and with tp too at world 8.

Parity (2 AdamW steps, clipping at 1.0, against tests.distributed.moe_checks.reference_run, data
parallel done by hand in one process): losses and gradient norms within 1e-5 relative; the
step-1 gradients of every router, expert and the embedding within 1e-5 of their largest value
(the sum over a token's k experts runs in another order than the model's index_add, tp sums
partial products: rounding only); every parameter's 2-step update within 2e-4 of the reference
update's norm, as the full-model parity tests (Adam turns gradients' rounding noise into full
steps on rows whose gradient is ~0: measured 1.5e-4 absolute on an embedding under ep2 x fsdp2).

Ranks are spawned once per world size; each test reads one part of the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed import moe_checks
from tests.harness import run_ranks

RTOL = 1e-5
UPDATE_RTOL = 2e-4
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")

WORLD2 = [
    *({"id": f"{arch}_ep2{'_aux' if aux else ''}", "arch": arch, "aux": aux, "config": {"ep": 2}}
      for arch in FAMILIES for aux in (False, True)),
    {"id": "qwen3_moe_ep2_full_ac_aux", "arch": "qwen3_moe", "aux": True,
     "config": {"ep": 2, "activation_checkpointing": "full"}},  # the all-to-alls run again in recomputation
    {"id": "mixtral_ep2_zero2", "arch": "mixtral", "aux": False, "config": {"strategy": "zero2", "ep": 2}},
    # dense weights replicated by DDP, every rank its own experts (their gradients divided, not reduced)
    {"id": "qwen3_moe_ep2_ddp_aux", "arch": "qwen3_moe", "aux": True, "config": {"strategy": "ddp", "ep": 2}},
    {"id": "deepseek_v3_ep2_ddp", "arch": "deepseek_v3", "aux": False, "config": {"strategy": "ddp", "ep": 2}},
    # transformers#48687: OLMoE's router lost part of its gradient under ep with batched_mm
    {"id": "router_grad_48687_batched_mm", "arch": "olmoe_48687", "impl": "batched_mm", "config": {"ep": 2}},
]
TP2 = [{"id": f"{arch}_tp2{'_aux' if aux else ''}", "arch": arch, "aux": aux, "config": {"tp": 2}}
       for arch, aux in zip(FAMILIES, (True, False, True, False, True))]
WORLD2 += TP2
# world 4: experts FSDP-sharded over the 2 ranks holding the same ones (efsdp = 2), and ep x tp
WORLD4 = [
    {"id": "qwen3_moe_ep2_fsdp2", "arch": "qwen3_moe", "aux": False, "config": {"ep": 2}},
    {"id": "olmoe_ep2_fsdp2_aux", "arch": "olmoe", "aux": True, "config": {"ep": 2}},
    {"id": "qwen3_moe_ep2_tp2_aux", "arch": "qwen3_moe", "aux": True, "config": {"ep": 2, "tp": 2}},
    {"id": "gpt_oss_ep2_tp2", "arch": "gpt_oss", "aux": False, "config": {"ep": 2, "tp": 2}},
    # ddp with ep < the replicas: dense weights all-reduced by DDP, experts FSDP-sharded over the 2
    # replicas holding the same ones (erep = 2)
    {"id": "qwen3_moe_ep2_ddp4_aux", "arch": "qwen3_moe", "aux": True, "config": {"strategy": "ddp", "ep": 2}},
    {"id": "deepseek_v3_ep2_ddp4", "arch": "deepseek_v3", "aux": False, "config": {"strategy": "ddp", "ep": 2}},
    # recomputation re-runs the experts' FSDP gather and the all-to-alls inside DDP's backward
    {"id": "olmoe_ep2_ddp4_full_ac", "arch": "olmoe", "aux": True,
     "config": {"strategy": "ddp", "ep": 2, "activation_checkpointing": "full"}},
    # hsdp: ep carved out of dp_shard within each replica group, the experts replicated over the groups
    {"id": "mixtral_ep2_hsdp2x2_aux", "arch": "mixtral", "aux": True,
     "config": {"strategy": "hsdp", "dp_replicate": 2, "ep": 2}, "experts_split": 2},
]
# ep x pp at world 4 (pp=2, ep=2 over each stage's 2 data-parallel ranks), 4 layers: the all-to-alls
# inside the schedules' microbatches, the zero-bubble one's split backward included
PIPELINE4 = [
    {"id": "qwen3_moe_ep2_pp2_1f1b", "arch": "qwen3_moe", "layers": 4, "config": {"pp": 2, "ep": 2}},
    {"id": "mixtral_ep2_pp2_zbv", "arch": "mixtral", "layers": 4, "config": {"pp": 2, "ep": 2, "pp_schedule": "zbv"}},
]
# tp x pp x ep at world 8 (pp=2 x dp_shard=2 x tp=2, ep=2 over each stage's dp_shard): each rank
# holds a quarter of its stage's experts (half of them, each split over tp)
PIPELINE8 = [
    {"id": "qwen3_moe_ep2_tp2_pp2_1f1b", "arch": "qwen3_moe", "layers": 4, "config": {"pp": 2, "tp": 2, "ep": 2},
     "experts_split": 4},
    {"id": "mixtral_ep2_tp2_pp2_interleaved", "arch": "mixtral", "layers": 4, "experts_split": 4,
     "config": {"pp": 2, "tp": 2, "ep": 2, "pp_schedule": "interleaved_1f1b"}},
]
ERRORS = [
    {"id": "ep_not_dividing_experts", "arch": "qwen3_moe", "config": {"ep": 2, "dp_shard": 2}, "error": True,
     "num_experts": 3},
    {"id": "ep_on_dense", "arch": "llama", "config": {"ep": 2}, "error": True},
    {"id": "ep_with_zero1", "arch": "qwen3_moe", "config": {"strategy": "zero1", "ep": 2}, "error": True},
    # ddp leaves the experts module out whole: a parameter in it that ep does not split would
    # never be averaged over the ranks
    {"id": "ddp_ep_plain_param", "arch": "qwen3_moe", "config": {"strategy": "ddp", "ep": 2}, "error": True,
     "plain_expert_param": True},
    # the load-balancing loss needs every layer's router logits: no pipeline stage has them all
    {"id": "pp_with_router_loss", "arch": "qwen3_moe", "aux": True, "config": {"pp": 2}, "error": True},
]


# checkpoints: saved under ep (Hub layout: one tensor per expert and projection, as transformers
# writes Qwen3-MoE), loaded and resumed (DCP training state) at other ep degrees and layouts
# (world 2 saves under ep + ddp, and under fsdp with ep = dp_shard, whose experts FSDP leaves whole;
# world 4 under fsdp with ep < dp_shard, whose experts FSDP shards over the ranks holding the same ones)
CHECKPOINT2 = [{"config": {"strategy": "ddp", "ep": 2}, "checkpoint": [{"ep": 2}, {"strategy": "fsdp"}, {"tp": 2}]},
               {"config": {"ep": 2}, "checkpoint": [{"strategy": "ddp", "ep": 2}]}]
CHECKPOINT4 = [{"config": {"ep": 2}, "checkpoint": [{"ep": 4}, {"ep": 2, "tp": 2}, {"strategy": "ddp", "ep": 4},
                                                     {"strategy": "ddp", "ep": 2}]}]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe2"))
    return run_ranks(moe_checks.world_checks, 2, WORLD2 + ERRORS + [{**c, "root": root} for c in CHECKPOINT2], timeout=600)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe4"))
    pipeline = [{**PIPELINE4[0], "root": root}, *PIPELINE4[1:]]  # the first also saved, loaded without pp
    return run_ranks(moe_checks.world_checks, 4, WORLD4 + pipeline + [{**c, "root": root} for c in CHECKPOINT4],
                     timeout=600)


@pytest.fixture(scope="module")
def world8():
    return run_ranks(moe_checks.world_checks, 8, PIPELINE8, timeout=600)


_REFERENCES: dict = {}


def reference(case: dict, dp: int) -> dict:
    key = (case["arch"], case.get("aux", False), dp, case.get("impl"))
    if key not in _REFERENCES:
        _REFERENCES[key] = moe_checks.reference_run(case["arch"], case.get("aux", False), dp, case.get("impl"))
    return _REFERENCES[key]


def result(ranks: list[dict], cases: list[dict], case: dict) -> dict:
    index = [c["id"] for c in cases if "error" not in c].index(case["id"])
    got = ranks[0]["parity"][index]
    assert "traceback" not in got, got.get("traceback")
    for rank, other in enumerate(ranks[1:], 1):  # every rank saw the same global losses, made the same
        # collectives and holds as many expert weights (moe_checks sends the other ranks' these only)
        other = other["parity"][index]
        assert "traceback" not in other, f"rank {rank}: {other.get('traceback')}"
        np.testing.assert_allclose(other["losses"], got["losses"], rtol=1e-6, err_msg=f"rank {rank}")
        assert (other["calls"], other["experts_held"]) == (got["calls"], got["experts_held"]), f"rank {rank}"
    return got


def check_parity(got: dict, ref: dict) -> None:
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=RTOL)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        g = g.numpy()
        err = np.abs(got["grads"][name] - g).max() / (np.abs(g).max() + 1e-12)
        assert err < RTOL, f"gradient of {name}: {err:.2e} of its largest value"
    for name, p in ref["params"].items():
        p, update = p.numpy(), (p - ref["initial"][name]).numpy()
        err = np.linalg.norm(got["params"][name] - p) / (np.linalg.norm(update) + 1e-12)
        assert err < UPDATE_RTOL, f"update of {name}: {err:.2e} of its norm"


def dp_degree(case: dict, world: int) -> int:
    return world // case["config"].get("tp", 1)


@pytest.mark.parametrize("case", WORLD2, ids=[c["id"] for c in WORLD2])
def test_world2_parity(world2, case):
    got = result(world2, WORLD2, case)
    ref = reference(case, dp_degree(case, 2))
    check_parity(got, ref)
    check_routing(got, ref)


@pytest.mark.parametrize("case", WORLD4, ids=[c["id"] for c in WORLD4])
def test_world4_parity(world4, case):
    got = result(world4, WORLD4, case)
    ref = reference(case, dp_degree(case, 4))
    check_parity(got, ref)
    check_routing(got, ref)
    # the layouts here split the experts over all 4 ranks (ep x tp, or ep x FSDP over the ranks
    # holding the same ones, under ddp too), but hsdp, which replicates them over its 2 groups
    total = sum(p.numel() for n, p in ref["params"].items() if ".experts." in n and not n.endswith("bias"))
    assert got["experts_held"] * case.get("experts_split", 4) == total, (got["experts_held"], total)


@pytest.mark.parametrize("world, case", [(4, c) for c in PIPELINE4] + [(8, c) for c in PIPELINE8],
                         ids=[c["id"] for c in PIPELINE4 + PIPELINE8])
def test_pipeline_with_ep_parity(request, world, case):
    """Losses and gradient norms of every step, the first step's router / expert / embedding
    gradients and every parameter's 2 AdamW updates (each from the ranks holding its stage)
    against one process (2 data-parallel ranks); each rank holds half its stage's experts (a
    quarter under tp). The first case's model and training state, saved from the pipeline, load
    into fsdp + ep2 exactly."""
    cases = PIPELINE4 if world == 4 else PIPELINE8
    index = cases.index(case)
    ref = moe_checks.reference_run(case["arch"], False, 2, layers=case["layers"])
    seen = set()
    for rank in request.getfixturevalue(f"world{world}"):
        got = rank["pipeline"][index]
        assert "traceback" not in got, got["traceback"]
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL)
        np.testing.assert_allclose(got["norms"], ref["norms"], rtol=RTOL)  # over every stage's gradients
        assert got["grads"] and any(".experts." in n for n in got["grads"])
        for name, g in got["grads"].items():
            want = ref["grads"][name].numpy()
            err = np.abs(np.asarray(g) - want).max() / (np.abs(want).max() + 1e-12)
            assert err < RTOL, f"gradient of {name}: {err:.2e} of its largest value"
        for name, p in got["params"].items():
            update = (ref["params"][name] - ref["initial"][name]).numpy()
            err = np.linalg.norm(np.asarray(p) - ref["params"][name].numpy()) / (np.linalg.norm(update) + 1e-12)
            assert err < UPDATE_RTOL, f"update of {name}: {err:.2e} of its norm"
        seen |= set(got["params"])
        experts = sum(np.size(p) for n, p in got["params"].items() if ".experts." in n and not n.endswith("bias"))
        assert got["experts_held"] * case.get("experts_split", 2) == experts, (got["experts_held"], experts)
        if world == 4 and index == 0:  # saved by every stage (Hub format and DCP state), loaded into fsdp + ep2: exact
            assert got["saved"] == {"weights": 0.0, "resumed": 0.0}, got["saved"]
    assert seen == set(ref["params"])


def check_routing(got: dict, ref: dict) -> None:
    # tokens per expert, summed over the ranks, equal the one-process routing of the same slices
    assert set(got["counts"]) == set(ref["counts"])
    for name, counts in ref["counts"].items():
        np.testing.assert_array_equal(got["counts"][name], counts.numpy(), err_msg=name)


def test_router_gradient_under_ep_48687(world2):
    """transformers#48687 by name: the routers' gradients under ep=2 with batched_mm experts
    equal the one-process ones (there the loss was right and the router gradient wrong)."""
    case = next(c for c in WORLD2 if c["id"] == "router_grad_48687_batched_mm")
    got, ref = result(world2, WORLD2, case), reference(case, 2)
    routers = [n for n in ref["grads"] if ".mlp.gate." in n]
    assert len(routers) == 2
    for name in routers:
        g = ref["grads"][name].numpy()
        assert np.abs(g).max() > 0
        assert np.abs(got["grads"][name] - g).max() <= RTOL * np.abs(g).max(), name


def test_two_token_all_to_alls_per_moe_layer(world2, world4):
    """One forward: per MoE layer, one all-to-all of counts, then the tokens out and back
    (none under tp alone: the experts' slices sum by all-reduce)."""
    for ranks, cases in ((world2, WORLD2), (world4, WORLD4)):
        for case in cases:
            got = result(ranks, cases, case)
            layers = got["moe_layers"] if case["config"].get("ep", 1) > 1 else 0
            assert got["calls"] == {"counts": layers, "tokens": 2 * layers}, case["id"]


def test_bad_input_refused_on_every_rank(world2):
    for rank in world2:
        errors = dict(zip([c["id"] for c in ERRORS], rank["errors"]))
        assert errors["ep_not_dividing_experts"].startswith("HfScalePlanError: ep=2 does not divide the 3 experts")
        assert "Choose ep in [1, 3]" in errors["ep_not_dividing_experts"]
        assert errors["ep_on_dense"].startswith("HfScalePlanError: ep=2 but LlamaForCausalLM")
        assert "no mixture-of-experts layers" in errors["ep_on_dense"]
        assert errors["ep_with_zero1"].startswith("HfScaleConfigError: ep=2 with strategy='zero1'")
        assert "'ddp' with ep" in errors["ep_with_zero1"]
        assert errors["ddp_ep_plain_param"].startswith("HfScaleConfigError: strategy='ddp' with ep=2")
        assert "model.layers.0.mlp.experts.scale" in errors["ddp_ep_plain_param"]
        assert errors["pp_with_router_loss"].startswith("HfScaleConfigError: pipeline parallel with "
                                                        "Qwen3MoeForCausalLM's load-balancing loss")
        assert "output_router_logits = False" in errors["pp_with_router_loss"]


@pytest.mark.parametrize("world, index", [("world2", 0), ("world2", 1), ("world4", 0)])
def test_checkpoint_across_ep_degrees(request, world, index):
    """Saved at ep=2 by every rank: plain transformers loads it with the weights and logits of the
    ep run; hf_scale loads it exactly into other ep degrees, tp and fsdp, and resumes the
    training state there (optimizer state exact, the next loss the same, the scheduler's rate of
    every param group, however the layout groups them); the loaded model's gradients on the next
    batch are the saved model's."""
    import torch
    from transformers import AutoModelForCausalLM

    ranks = request.getfixturevalue(world)
    case = (CHECKPOINT2 if world == "world2" else CHECKPOINT4)[index]
    for rank in ranks:
        assert "traceback" not in rank["checkpoints"][index], rank["checkpoints"][index]["traceback"]
        loads = rank["checkpoints"][index]["loads"]
        assert rank["checkpoints"][index]["config"] == case["config"]
        assert [c["config"] for c in loads] == case["checkpoint"]
        for load in loads:
            assert load["weights"] == 0.0 and load["resumed_weights"] == 0.0, load
            assert load["optimizer"] == 0.0 and load["optimizer_keys"], load
            assert load["next_loss"] == pytest.approx(load["saved_next_loss"], rel=1e-6), load
            assert load["grad_keys"] and load["grads"] <= 1e-5, load  # rounding only (other layouts)
            # the scheduler resumes each group's rate (the no-decay group's decays faster), over the
            # groups this layout makes (split by kind otherwise than when saved)
            assert load["rates"] == rank["checkpoints"][index]["rates"] == [(0.0, 0.25), (0.1, 0.5)], load
            assert load["rates_next"] == [(0.0, round(1 / 7, 9)), (0.1, round(1 / 3, 9))], load
        if index == 0:  # loads into layouts that group the parameters otherwise (fsdp, tp, ...)
            assert any(load["groups"] != rank["checkpoints"][index]["groups"] for load in loads)
    saved = ranks[0]["checkpoints"][index]
    folder = saved["folder"]
    import json
    from pathlib import Path

    files = list(Path(folder).glob("*.safetensors"))
    from safetensors import safe_open

    keys = set()
    for f in files:
        with safe_open(f, "pt") as fh:
            keys |= set(fh.keys())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys  # the Hub layout, per expert
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = model.state_dict()
    for name, value in saved["saved"].items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
    batch = moe_checks.batches(2)[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"][:2]).logits.numpy()
    np.testing.assert_allclose(logits, saved["logits"], atol=1e-5, rtol=0)
    assert json.loads((Path(folder) / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
