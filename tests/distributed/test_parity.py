"""Parity: N ranks under every strategy give the losses, gradient norms and final parameters of
one process running plain transformers + AdamW on the whole batch (3 AdamW steps, clipping on).

Ranks are spawned once per world size (module fixtures); each test checks one case's result.

Tolerances:
* fp32: losses and gradient norms within 1e-5 relative (only the order of floating-point sums differs).
* bf16 / fp16 against the fp32 reference: the low-precision run computes matmuls with 8
  (bf16) or 11 (fp16) significant bits, i.e. a relative rounding of 2**-9 ~ 2e-3 per product,
  and that error reaches the loss and gradients through a few layers. We allow 2e-2 on losses
  and gradient norms (a handful of roundings). To show the low precision really ran, the
  gradient norms must also *differ* from fp32 by more than fp32 noise (> 1e-5).
* Parameters are compared by their *update* (final minus initial), relative to the reference
  update's norm, never by their value: 3 steps at lr 1e-3 move a tensor by a few percent of its
  norm (T5: under 3.4%), so a value tolerance of 5e-2 passed tensors that never moved. A
  missing step gives an update error of exactly 1, a wrong one about 1 or more. fp32: 2e-4 (the
  worst tensor of the 108 world-2 cases measured 6.5e-5: gpt_neox, fused vs per-tensor AdamW and
  summation order). Low precision: 0.5. Adam normalises updates (m / sqrt(v)), so an element
  whose gradient is small against the rounding changes direction and moves up to lr per step
  differently; that is largest for norm weights, whose gradient elements are few and small.
  Measured worst tensor per model (world 2, 32 low-precision cases): T5 0.33 (bf16, a decoder
  layer_norm weight), T5 fp16 0.17, Llama 0.08. 0.5 sits between that and a step not taken (1).
* Parameter elements whose true gradient is zero (attention key biases, alone or inside a
  fused qkv bias: softmax ignores a constant added to every key) get gradients of pure
  rounding noise (< 1e-6 of the total norm in the reference) and Adam turns noise into steps
  of up to lr in any direction, in any run, single or parallel. For those elements the bound
  is Adam's own, |difference| <= 2 * lr * steps; the rest of the tensor is held to the
  relative tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.training import LR, STEPS, reference_run, run_cases
from tests.harness import merge_ranks, run_ranks
from tests.tiny_models import all_cases

FP32_RTOL = 1e-5
LOW_LOSS_RTOL = 2e-2
UPDATE_RTOL = 2e-4
LOW_UPDATE_RTOL = 0.5
NOISE_GRAD = 1e-6

TWO_ARCHS = [("llama", "causal"), ("t5", "seq2seq")]
OPTIONS = {
    "fp32": {},
    "bf16": {"mixed_precision": "bf16"},
    "full_ac": {"activation_checkpointing": "full"},
    "full_ac_every2": {"activation_checkpointing": "full", "ac_every": 2},
    "selective_ac": {"activation_checkpointing": "selective"},
    "bf16_selective_ac": {"mixed_precision": "bf16", "activation_checkpointing": "selective"},
    "fp16": {"mixed_precision": "fp16"},
    "accum2": {"_accum": 2},
}
SHARDED_ONLY = {
    "cpu_offload": {"cpu_offload": True},
    "bf16_cpu_offload_full_ac": {"mixed_precision": "bf16", "cpu_offload": True, "activation_checkpointing": "full"},
}
FSDP_ONLY = {"no_reshard": {"reshard_after_forward": False}, "blocks_per_unit2": {"blocks_per_unit": 2},
             "prefetch2": {"fsdp_prefetch": 2}}
CAUSAL_ONLY = {  # chunked loss applies to causal LMs (T5 is refused, see the unit tests)
    "chunked_loss": {"loss_chunk_tokens": 24},
    "bf16_full_ac_chunked_loss": {"mixed_precision": "bf16", "activation_checkpointing": "full", "loss_chunk_tokens": 24},
    "labeled_only": {"loss_labeled_only": True},  # every position labeled here: the path (masked prompts: test_labeled_only.py)
}


def _case(arch, head, strategy, option_name, option, **extra):
    config = {k: v for k, v in option.items() if not k.startswith("_")}
    case = dict(arch=arch, head=head, config=dict(strategy=strategy, **config, **extra))
    if "_accum" in option:
        case["accum"] = option["_accum"]
    case["id"] = f"{arch}-{head}-{strategy}-{option_name}"
    return case


# strategy "auto" on cache-off models (what training scripts set), fed packed rows (position_ids
# restarting per document, no attention mask): the planner's meta-device profile met
# transformers' packed-sequence detection there and failed (issue 37).
AUTO_ARCHS = ("llama", "qwen2", "phi3")


def _auto_cases():
    return [dict(arch=a, head="causal", config={"strategy": "auto"}, use_cache=False, packed=True,
                 id=f"{a}-causal-auto-nocache-packed") for a in AUTO_ARCHS]


def _world2_cases():
    cases = [_case(a, h, "fsdp", "fp32", {}) for a, h in all_cases()] + _auto_cases()
    cases += [_case(a, h, "fsdp", "chunked_loss", CAUSAL_ONLY["chunked_loss"]) for a, h in all_cases() if h == "causal" and a != "llama"]
    for arch, head in TWO_ARCHS:
        for strategy in ("ddp", "zero1", "zero2", "fsdp"):
            options = dict(OPTIONS)
            if strategy in ("zero2", "fsdp"):
                options.update(SHARDED_ONLY)
            if strategy == "fsdp":
                options.update(FSDP_ONLY)
            if head == "causal":
                options.update(CAUSAL_ONLY)
            for name, option in options.items():
                if strategy == "fsdp" and name == "fp32" and (arch, head) in all_cases():
                    continue  # already in the every-architecture list
                cases.append(_case(arch, head, strategy, name, option))
    return cases


def _world4_cases():
    options = {k: OPTIONS[k] for k in ("fp32", "bf16", "full_ac", "selective_ac", "accum2")}
    options.update(SHARDED_ONLY)
    options["bf16_full_ac_blocks_per_unit3"] = {"mixed_precision": "bf16", "activation_checkpointing": "full",
                                                "blocks_per_unit": 3}
    return [
        _case(a, h, "hsdp", name, opt, dp_replicate=2, dp_shard=2)
        for a, h in TWO_ARCHS
        for name, opt in dict(options, **(CAUSAL_ONLY if h == "causal" else {})).items()
    ]


WORLD2 = _world2_cases()
WORLD4 = _world4_cases()


SAME = ("losses", "norms", "fsdp_units")  # global (all-reduced) or per-rank figures every rank must share


@pytest.fixture(scope="module")
def world2_results():
    results = run_ranks(run_cases, 2, WORLD2, timeout=900)  # every rank's errors (rank 0 holds the parameters)
    return dict(zip((c["id"] for c in WORLD2), merge_ranks(results, same=SAME)))


@pytest.fixture(scope="module")
def world4_results():
    results = run_ranks(run_cases, 4, WORLD4, timeout=900)  # every rank's errors (rank 0 holds the parameters)
    return dict(zip((c["id"] for c in WORLD4), merge_ranks(results, same=SAME)))


_REFERENCES: dict = {}


def _reference(arch, head, packed=False, use_cache=None):
    key = (arch, head, packed, use_cache)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(arch, head, packed=packed, use_cache=use_cache)
    return _REFERENCES[key]


def check_parity(case: dict, result: dict) -> None:
    assert "error" not in result, result.get("error")
    ref = _reference(case["arch"], case["head"], case.get("packed", False), case.get("use_cache"))
    low_precision = case["config"].get("mixed_precision") is not None
    loss_tol = LOW_LOSS_RTOL if low_precision else FP32_RTOL
    update_tol = LOW_UPDATE_RTOL if low_precision else UPDATE_RTOL
    for step, (got, want) in enumerate(zip(result["losses"], ref["losses"])):
        assert abs(got - want) <= loss_tol * abs(want), f"step {step} loss {got} vs one process {want}"
    for step, (got, want) in enumerate(zip(result["norms"], ref["norms"])):
        assert abs(got - want) <= loss_tol * abs(want), f"step {step} grad norm {got} vs {want}"
    params = result["params"]
    assert set(params) == set(ref["params"]), "parameter names changed"
    noise = NOISE_GRAD * max(ref["norms"])
    for name, rel in update_errors(ref, params, noise).items():
        assert rel <= update_tol, f"parameter {name}: its update differs from one process's by {rel:.2e} of its norm"
    if low_precision:
        norm_diff = max(abs(g - w) / w for g, w in zip(result["norms"], ref["norms"]))
        assert norm_diff > FP32_RTOL, "mixed precision had no effect: gradients equal fp32's"


def update_errors(ref: dict, params: dict, noise: float) -> dict[str, float]:
    """Per tensor: |got update - reference update| / |reference update| (elements whose
    reference gradient is noise left out: they are held to Adam's bound, 2 * lr * steps)."""
    errors = {}
    for name, want in ref["params"].items():
        initial, want, got = ref["initial"][name].numpy(), want.numpy(), params[name]
        zero_grad = ref["grad_max"][name].numpy() < noise
        worst = float(np.abs(got - want)[zero_grad].max(initial=0.0))
        assert worst <= 2 * LR * STEPS, f"{name}: zero-gradient elements moved {worst:.2e} apart"
        want_update = np.where(zero_grad, 0.0, want - initial)
        got_update = np.where(zero_grad, 0.0, got - initial)
        scale = np.linalg.norm(want_update)
        errors[name] = float(np.linalg.norm(got_update - want_update) / scale) if scale else float(np.abs(got_update).max(initial=0.0))
    return errors


@pytest.mark.parametrize("arch, head", TWO_ARCHS)
def test_parity_check_fails_when_parameters_never_move(arch, head):
    """The check itself: a bf16 run whose optimizer never stepped (losses and norms within
    tolerance) must fail, as it did not with a 5e-2 tolerance on the parameter values."""
    ref = _reference(arch, head)
    stale = {"losses": [x * 1.001 for x in ref["losses"]], "norms": [x * 1.001 for x in ref["norms"]],
             "params": {n: p.numpy() for n, p in ref["initial"].items()}}
    with pytest.raises(AssertionError, match="its update differs"):
        check_parity(_case(arch, head, "fsdp", "bf16", OPTIONS["bf16"]), stale)


@pytest.mark.parametrize("case", WORLD2, ids=[c["id"] for c in WORLD2])
def test_parity_world2(case, world2_results):
    check_parity(case, world2_results[case["id"]])


@pytest.mark.parametrize("arch, blocks, grouped", [("llama", 2, 1), ("t5", 4, 2)])
def test_blocks_per_unit_groups_fsdp_units(arch, blocks, grouped, world2_results):
    """blocks_per_unit=2 shards pairs of blocks as one unit (plus the root unit): the parity
    above holds with fewer units, not the same units under another name."""
    head = "causal" if arch == "llama" else "seq2seq"
    assert world2_results[f"{arch}-{head}-fsdp-fp32"]["fsdp_units"] == blocks + 1
    assert world2_results[f"{arch}-{head}-fsdp-blocks_per_unit2"]["fsdp_units"] == grouped + 1


@pytest.mark.parametrize("arch, head", TWO_ARCHS)
def test_fsdp_prefetch_issues_forward_all_gathers_ahead(arch, head, world2_results):
    """On a CPU mesh (these ranks') fsdp prefetches one unit ahead by default, in forward too
    (FSDP2's own default prefetches in backward only), and every prefetch is asynchronous (FSDP2's
    default blocks the host there: nothing would overlap). fsdp_prefetch=2: the parity above holds
    with deeper forward prefetches, and T5's 4 blocks prefetch two units in backward (llama's 2 have
    only one before the last: as many as by default)."""
    default = world2_results[f"{arch}-{head}-fsdp-fp32"]["prefetches"]
    deeper = world2_results[f"{arch}-{head}-fsdp-prefetch2"]["prefetches"]
    assert 0 < default["forward"] < deeper["forward"], (default, deeper)
    for counts in (default, deeper):
        assert counts["async"] == counts["forward"] + counts["backward"], counts
    if arch == "t5":
        assert deeper["backward"] > default["backward"], (default, deeper)
    else:
        assert deeper["backward"] == default["backward"], (default, deeper)


@pytest.mark.parametrize("case", WORLD4, ids=[c["id"] for c in WORLD4])
def test_parity_hsdp_world4(case, world4_results):
    check_parity(case, world4_results[case["id"]])
