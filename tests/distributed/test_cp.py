"""Context parallel (cp=2) against one process running plain transformers and AdamW on the whole
batches: the loss every rank returns, the gradient norm, every gradient of the first step and the
parameters after 3 AdamW steps (clipping on), fp32 at 1e-5 (updates at test_parity's 2e-4).

World 2 (FSDP over the cp ranks): Llama, Qwen3, Mistral (sliding window 5 of 16 tokens),
Gemma3-text (sliding window 4 on one layer), Phi3 and Gemma2 (sliding window and attention
soft-capping), each head_tail and contiguous, plain rows and packed rows (position_ids restarting,
no mask), prompts masked with -100; a length the layout does not divide (padded); activation
checkpointing full and selective; zero2, ddp, chunked and labeled-only loss. World 4: cp=2 x
fsdp dp_shard=2, cp=2 x ddp over 2 replicas (each data-parallel rank its rows, weighted by label
tokens as the loop weighs them). The all-to-all exchange (cp_exchange="alltoall") at world 2 on
Llama rows, Qwen3 and Mistral packed (head_tail), Gemma2 rows (soft-capping), Gemma3-text packed
contiguous under full AC; at world 4 cp=2 x fsdp2 and cp=4 (2 key-value heads repeated to 4).
The all-gather's mask-free path off the CPU (cp_prefix: each query chunk against its keys'
prefix), taken here by refusing the CPU's blocks: Llama head_tail rows (plain, full AC, 14 tokens
padded; packed rows keep the mask), Qwen3 contiguous rows, and at world 4 Llama at cp=4.
Also: one K/V all-gather per attention layer in forward (one reduce-scatter in backward), three
all-to-alls each way and no K/V all-gather under alltoall, and the refusals (heads cp does not
divide under alltoall among them). See tests/distributed/cp_checks.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.cp_checks import CONFIGS, SEQ, reference, run_cp_cases
from tests.distributed.test_parity import UPDATE_RTOL, update_errors
from tests.harness import run_ranks

RTOL = 1e-5
FSDP, DDP = {"strategy": "fsdp", "cp": 2}, {"strategy": "ddp", "cp": 2}
A2A = {**FSDP, "cp_exchange": "alltoall"}


def _case(arch, layout="head_tail", packed=False, config=FSDP, name="", **extra):
    tag = f"{arch}-{layout}-{'packed' if packed else 'rows'}{'-' + name if name else ''}"
    return dict(arch=arch, config={**config, "cp_layout": layout}, packed=packed, id=tag, **extra)


WORLD2 = [_case(a, layout, packed) for a in CONFIGS for layout in ("head_tail", "contiguous") for packed in (False, True)]
WORLD2 += [
    _case("llama", "head_tail", True, name="len14_padded", seq=14),  # 14 tokens: 2 pad to a multiple of 2cp
    _case("gemma3_text", "contiguous", False, name="len13_padded", seq=13),
    _case("llama", "head_tail", True, {**FSDP, "activation_checkpointing": "full"}, "full_ac"),
    _case("mistral", "head_tail", True, {**FSDP, "activation_checkpointing": "selective"}, "selective_ac"),
    _case("llama", "contiguous", False, {**FSDP, "activation_checkpointing": "selective"}, "selective_ac"),
    _case("qwen3", "head_tail", True, {**FSDP, "strategy": "zero2"}, "zero2"),
    _case("llama", "head_tail", True, DDP, "ddp"),
    _case("gemma3_text", "contiguous", True, DDP, "ddp"),
    _case("llama", "head_tail", True, {**FSDP, "loss_chunk_tokens": 8}, "chunked_loss"),
    _case("phi3", "head_tail", True, {**FSDP, "loss_labeled_only": True}, "labeled_only"),
    # the GPU's path on the CPU (the blocks refused): plain causal rows attend to their keys' prefix,
    # lower-right causal (cp_prefix); packed rows and sliding windows keep the mask
    _case("llama", "head_tail", False, name="prefix", no_blocks=True),
    _case("qwen3", "contiguous", False, name="prefix", no_blocks=True),
    _case("llama", "head_tail", False, {**FSDP, "activation_checkpointing": "full"}, "prefix_full_ac", no_blocks=True),
    _case("llama", "head_tail", False, name="prefix_len14_padded", seq=14, no_blocks=True),
    _case("llama", "head_tail", True, name="prefix", no_blocks=True),
    _case("llama", "head_tail", True, {**FSDP, "cp_attention": "masked"}, "masked"),
    _case("qwen3", "contiguous", False, {**FSDP, "cp_attention": "masked"}, "masked"),
    # the all-to-all exchange (heads for sequence): plain causal, packed, sliding window, soft-capping
    _case("llama", "head_tail", False, A2A, "alltoall"),
    _case("qwen3", "head_tail", True, A2A, "alltoall"),
    _case("mistral", "head_tail", True, A2A, "alltoall"),
    _case("gemma2", "head_tail", False, A2A, "alltoall"),
    _case("gemma3_text", "contiguous", True, {**A2A, "activation_checkpointing": "full"}, "alltoall_full_ac"),
]
CP4 = {"strategy": "fsdp", "cp": 4}
WORLD4 = [
    _case("llama", "head_tail", True, name="fsdp2"),
    _case("gemma3_text", "contiguous", False, {**FSDP, "activation_checkpointing": "full"}, "fsdp2_full_ac"),
    _case("qwen3", "head_tail", True, DDP, "ddp2"),
    _case("llama", "head_tail", True, CP4, "cp4"),  # chunks of 2 tokens, documents across 3 ranks
    _case("qwen3", "contiguous", False, CP4, "cp4"),
    _case("gemma3_text", "head_tail", True, {**CP4, "activation_checkpointing": "full"}, "cp4_full_ac"),
    _case("llama", "head_tail", False, {**CP4, "strategy": "ddp"}, "cp4_len13_padded", seq=13),
    _case("llama", "head_tail", False, CP4, "cp4_prefix", no_blocks=True),
    _case("qwen3", "head_tail", True, A2A, "alltoall_fsdp2"),
    _case("llama", "head_tail", True, {**CP4, "cp_exchange": "alltoall"}, "alltoall_cp4"),  # 2 kv heads repeated to 4
]
OTHER4 = [dict(kind="comm", args={"config": CP4}, id="comm_cp4")]
OTHER = [dict(kind="comm", id="comm"), dict(kind="refusals", id="refusals"),
         dict(kind="comm", args={"arch": "gemma3_text", "config": {**FSDP, "activation_checkpointing": "full"}},
              id="comm_full_ac"),
         dict(kind="comm", args={"config": {**FSDP, "cp_attention": "masked"}, "packed": False}, id="comm_masked"),
         dict(kind="comm", args={"arch": "mistral"}, id="comm_mistral"),
         dict(kind="comm", args={"packed": False}, no_blocks=True, id="comm_prefix"),
         # FSDP2's bf16 cast of each unit's inputs rebuilds dataclasses: the layers must still count
         # their attention calls on the forward's one context (it was a dataclass: every call raised)
         dict(kind="comm", args={"config": {**FSDP, "mixed_precision": "bf16"}}, id="comm_bf16"),
         dict(kind="comm", args={"config": A2A}, id="comm_alltoall")]
# which attention each architecture's layers take at 16 tokens: blocks without a mask for plain
# causal layers, the mask for sliding windows shorter than the sequence and soft-capping
KINDS = {"llama": {"masked"}, "qwen3": {"masked"}, "phi3": {"masked"}, "gemma3_text": set(),
         "mistral": {"blocks"}, "gemma2": {"blocks"}}  # the kinds that must NOT be called


@pytest.fixture(scope="module")
def world2():
    cases = WORLD2 + OTHER
    results = run_ranks(run_cp_cases, 2, cases, timeout=600)
    return {c["id"]: [r[i] for r in results] for i, c in enumerate(cases)}


@pytest.fixture(scope="module")
def world4():
    cases = WORLD4 + OTHER4
    results = run_ranks(run_cp_cases, 4, cases, timeout=600)
    return {c["id"]: [r[i] for r in results] for i, c in enumerate(cases)}


_REFERENCES: dict = {}


def check_cp_parity(case: dict, ranks: list[dict]) -> None:
    for r in ranks:
        assert "error" not in r, r.get("error")
    key = (case["arch"], case["packed"], case.get("seq", SEQ))
    ref = _REFERENCES.get(key) or _REFERENCES.setdefault(key, reference(*key))
    got = ranks[0]
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs one process {b}"
    for step, (a, b) in enumerate(zip(got["evaluated"], ref["losses"])):  # no factor cp in evaluation
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: eval_step loss {a} vs one process {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: gradient norm {a} vs one process {b}"
    for name, want in ref["grads"].items():
        want = want.numpy()
        err = float(np.linalg.norm(got["grads"][name] - want) / max(np.linalg.norm(want), 1e-12))
        assert err <= RTOL, f"{name}: first-step gradient differs by {err:.2e} of its norm"
    # an element whose gradient is rounding noise at some step (not only at every step, as in
    # test_parity: 3 steps, not 1) takes an Adam step of up to lr in any direction at that step,
    # in any run: those elements are held to Adam's bound, 2 * lr * steps, by update_errors
    noisy = {**ref, "grad_max": ref["grad_min"]}
    for name, rel in update_errors(noisy, got["params"], 1e-6 * max(ref["norms"])).items():
        assert rel <= UPDATE_RTOL, f"{name}: its update differs from one process's by {rel:.2e} of its norm"
    # every rank of a cp group returned the same loss: the whole rows', not its own part's
    dp_degree = got["dp"][1]
    cp = len(ranks) // dp_degree
    for group in range(dp_degree):
        members = [r for r in ranks if r["dp"][0] == group]
        assert len(members) == cp and all(m["returned"] == members[0]["returned"] for m in members)
    # the attention the layers took: blocks where they apply, unless the config asks for the mask;
    # the prefix path only where the blocks are refused (no_blocks), for plain causal unpacked rows
    never = {"blocks"} if case["config"].get("cp_attention") == "masked" else KINDS[case["arch"]]
    never = {"blocks", "masked"} if case["config"].get("cp_exchange") == "alltoall" else never | {"alltoall"}
    if case.get("no_blocks"):
        never = {"blocks", "alltoall", "prefix" if case["packed"] else "masked"}
    else:
        never = never | {"prefix"}
    for r in ranks:
        assert all(r["calls"][kind] == 0 for kind in never) and sum(r["calls"].values()) > 0, r["calls"]


@pytest.mark.parametrize("case", WORLD2, ids=[c["id"] for c in WORLD2])
def test_cp2_matches_one_process(case, world2):
    check_cp_parity(case, world2[case["id"]])


@pytest.mark.parametrize("case", WORLD4, ids=[c["id"] for c in WORLD4])
def test_cp2_with_two_data_parallel_ranks_matches_one_process(case, world4):
    check_cp_parity(case, world4[case["id"]])


def test_data_parallel_coordinate_leaves_cp_out(world2, world4):
    """Ranks of a cp group share the data-parallel rank (the same batch), as tp ranks do."""
    assert [r["dp"] for r in world2["llama-head_tail-rows"]] == [(0, 1, 1), (0, 1, 1)]
    assert [r["cp"] for r in world2["llama-head_tail-rows"]] == [2, 2]
    assert [r["dp"] for r in world4["llama-head_tail-packed-fsdp2"]] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]
    assert [r["dp"] for r in world4["qwen3-head_tail-packed-ddp2"]] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]


@pytest.mark.parametrize("case", ["comm", "comm_full_ac", "comm_masked", "comm_mistral", "comm_prefix", "comm_cp4",
                                  "comm_bf16"])
def test_one_kv_all_gather_per_attention_layer(case, world2, world4):
    """Forward: one all-gather (K and V together, the whole sequence's bytes) per attention layer
    and one all-reduce (the loss); backward: one reduce-scatter per layer (the K / V gradients,
    the whole sequence's bytes) and one all-reduce. Layers attending in blocks gather K and V
    again in the backward (they saved only their own part); masked layers and the prefix path
    (the GPU's, here with the blocks refused) saved the gathered K / V and do not. Under full activation checkpointing every layer gathers once in the
    backward, as it recomputes (the blocks' backward takes what the recomputation gathered)."""
    results = (world4 if case.endswith("cp4") else world2)[case]
    for counts in results:
        assert "error" not in counts, counts.get("error")
        layers, forward, backward = counts["layers"], counts["forward"], counts["backward"]
        assert "c10d_functional.all_to_all_single" not in {**forward, **backward}, counts
        gather, scatter = "c10d_functional.all_gather_into_tensor", "c10d_functional.reduce_scatter_tensor"
        assert forward.get(gather) == layers, forward
        assert forward.get("c10d.allreduce_") == 1, forward
        assert backward.get(scatter) == layers, backward
        assert backward.get("c10d.allreduce_") == 1, backward
        blocks = {"comm_full_ac": 1, "comm_masked": 0, "comm_mistral": 0, "comm_prefix": 0}.get(case, layers)
        assert counts["blocks"] == blocks, counts
        assert counts["prefix"] == (layers if case == "comm_prefix" else 0), counts  # like the mask: no regather
        regathered = layers if case == "comm_full_ac" else blocks
        assert backward.get(gather) == (regathered or None), backward
        assert counts["forward_bytes"][gather] == layers * counts["kv_bytes"], counts
        assert counts["backward_bytes"][scatter] == layers * counts["kv_bytes"], counts
        assert counts["backward_bytes"].get(gather, 0) == regathered * counts["kv_bytes"], counts


def test_alltoall_exchanges_heads_and_gathers_nothing(world2):
    """The all-to-all exchange, per attention layer: forward one all-to-all of the queries, one of
    K and V together, one of the output, each of this rank's S/cp part (never the whole sequence's
    K / V); the backward the same three, the other way; no K / V all-gather nor reduce-scatter."""
    for counts in world2["comm_alltoall"]:
        assert "error" not in counts, counts.get("error")
        layers, cp = counts["layers"], 2
        a2a = "c10d_functional.all_to_all_single"
        for phase in ("forward", "backward"):
            calls = counts[phase]
            assert calls.get(a2a) == 3 * layers and calls.get("c10d.allreduce_") == 1, calls
            # FSDP's own parameter gathers are c10d._allgather_base_; the K / V exchanges are functional
            assert not {"c10d_functional.all_gather_into_tensor", "c10d_functional.reduce_scatter_tensor"} & set(calls)
            assert counts[f"{phase}_bytes"][a2a] == layers * (2 * counts["q_bytes"] + counts["kv_bytes"]) // cp, counts
        assert counts["alltoall"] == layers and counts["blocks"] == 0, counts


@pytest.mark.parametrize("attempt, message", [
    ("padding_mask", "takes no padding attention mask"),
    ("packed_with_mask", "Drop the attention_mask"),
    ("generate", "without a cache"),
    ("different_batches", "got different batches"),
    ("seqcls", "not a causal LM"),
    ("alltoall_heads", "cp_exchange='alltoall' with cp=2: the model has 3 attention heads and 3 key-value heads"),
])
def test_refusals_on_a_cp_group(attempt, message, world2):
    for result in world2["refusals"]:
        assert "error" not in result, result.get("error")
        assert message in result[attempt], result[attempt]
