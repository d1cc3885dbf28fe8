"""Tensor parallel against one process of plain transformers: tp=2 (2 ranks) and tp=2 x fsdp2
(4 ranks) give the losses, gradient norms and updated parameters of the reference over 3 AdamW
steps with clipping (the rules and tolerances of test_parity.py, reused), the same greedy
tokens, the placements each plan promises and the collectives a forward should cost.

Ranks are spawned once per world size; each test reads one part of the result.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed import tp_checks
from tests.distributed.test_parity import SAME, check_parity
from tests.harness import merge_ranks, run_ranks
from tests.tiny_models import tiny_model

# (arch, head): every architecture with a tp plan, Phi-3 both ways (GQA: gathered qkv;
# phi3_mha: packed qkv), and a vocabulary (129) that tp=2 does not divide.
ARCHS = [
    ("llama", "causal"), ("qwen2", "causal"), ("gpt2", "causal"), ("gpt_neox", "causal"),
    ("opt", "causal"), ("bert", "seqcls"), ("roberta", "seqcls"), ("distilbert", "seqcls"),
    ("t5", "seq2seq"), ("t5", "seqcls"), ("phi3", "causal"), ("phi3_mha", "causal"),
    ("llama_vocab129", "causal"), ("gpt2", "seqcls"),
]
CAUSAL = sorted({a for a, h in ARCHS if h == "causal"})
TP2 = {"tp": 2}
TP2_FSDP2 = {"strategy": "fsdp", "tp": 2}
OPTIONS = {  # extra cases: activation checkpointing with tp
    "full_ac": {"activation_checkpointing": "full"},
    "selective_ac": {"activation_checkpointing": "selective"},
}


def _cases(layout: dict, name: str) -> list[dict]:
    cases = [{"arch": a, "head": h, "config": dict(layout), "id": f"{a}-{h}-{name}"} for a, h in ARCHS]
    for opt_name, opt in OPTIONS.items():
        for arch, head in (("llama", "causal"), ("gpt2", "causal"), ("t5", "seq2seq")):
            cases.append({"arch": arch, "head": head, "config": {**layout, **opt}, "id": f"{arch}-{head}-{name}-{opt_name}"})
    return cases


# tp composed with the other options (docs/tensor-parallel.md's claims): chunked vocabulary-parallel loss, mixed
# precision, zero2 and CPU offload. (hsdp x tp needs 8 ranks for a real 3-D mesh: not run here.)
COMPOSE2 = {"chunked_loss": {"loss_chunk_tokens": 8}, "bf16": {"mixed_precision": "bf16"},
            "labeled_only": {"loss_labeled_only": True}}  # every position labeled: the path (the mask: test_labeled_only.py)
COMPOSE4 = {"zero2": {"strategy": "zero2"}, "cpu_offload": {"cpu_offload": True},
            "chunked_loss": {"loss_chunk_tokens": 8}}


def _composed(layout: dict, name: str, options: dict) -> list[dict]:
    return [{"arch": "llama", "head": "causal", "config": {**layout, **opt}, "id": f"llama-causal-{name}-{key}"}
            for key, opt in options.items()]


# tp2 x fsdp2 composes the same per-architecture plans with FSDP over the other mesh dimension: a
# sample with one architecture per plan source (transformers' plan, a fused Conv1D qkv, a packed
# qkv, the encoder and encoder-decoder registry plans, an uneven vocabulary); tp=2 itself runs on
# every architecture above and in scripts/scan_architectures.py.
WORLD4_ARCHS = [("llama", "causal"), ("gpt2", "causal"), ("phi3_mha", "causal"), ("bert", "seqcls"),
                ("t5", "seq2seq"), ("llama_vocab129", "causal")]
WORLD2 = _cases(TP2, "tp2") + _composed(TP2, "tp2", COMPOSE2)
WORLD4 = ([c for c in _cases(TP2_FSDP2, "tp2xfsdp2") if (c["arch"], c["head"]) in WORLD4_ARCHS]
          + _composed(TP2_FSDP2, "tp2xfsdp2", COMPOSE4))

EXTRA2 = {
    "llama_layout": ("layout_facts", ("llama", "causal", TP2), {}),
    "gpt2_layout": ("layout_facts", ("gpt2", "causal", TP2), {}),
    "phi3_layout": ("layout_facts", ("phi3", "causal", TP2), {}),
    "phi3_mha_layout": ("layout_facts", ("phi3_mha", "causal", TP2), {}),
    "t5_layout": ("layout_facts", ("t5", "seq2seq", TP2), {}),
    "opt_layout": ("layout_facts", ("opt", "causal", TP2), {}),
    "llama_comm": ("comm_facts", ("llama", TP2), {}),
    "gpt2_comm": ("comm_facts", ("gpt2", TP2), {}),
    "zero_grad": ("zero_grad_keeps_zeros", ("llama", TP2), {}),
    "inplace_outputs": ("module_check", ("inplace",), {}),
    "multi_query": ("module_check", ("multi_query",), {}),
    "bad_heads": ("bad_input_error", ("llama", TP2), {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}),
    "bad_pattern": ("bad_input_error", ("llama", TP2), {"plan": {"tp_plan": {"model.layers.*.self_attn.q_projj": "colwise"}}}),
}
EXTRA4 = {f"{arch}_layout": ("layout_facts", (arch, "causal", TP2_FSDP2), {}) for arch in ("llama", "gpt2", "phi3_mha")}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(tp_checks.world_checks, 2, WORLD2, [{"arch": a, "config": TP2} for a in CAUSAL], EXTRA2, timeout=900)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(tp_checks.world_checks, 4, WORLD4, [{"arch": a, "config": TP2_FSDP2} for a in CAUSAL], EXTRA4,
                     timeout=900)


@pytest.fixture(scope="module")
def parity2(world2):
    return merge_ranks([r["parity"] for r in world2], same=SAME)  # every rank's errors, rank 0's figures


@pytest.fixture(scope="module")
def parity4(world4):
    return merge_ranks([r["parity"] for r in world4], same=SAME)


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[c["id"] for c in WORLD2])
def test_tp2_parity(index, parity2):
    check_parity(WORLD2[index], parity2[index])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[c["id"] for c in WORLD4])
def test_tp2_fsdp2_parity(index, parity4):
    check_parity(WORLD4[index], parity4[index])


_GREEDY: dict = {}


def _reference_tokens(arch: str) -> list[list[int]]:
    if arch not in _GREEDY:
        _GREEDY[arch] = tp_checks.greedy_tokens(tiny_model(arch, "causal"))
    return _GREEDY[arch]


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("arch", CAUSAL)
def test_greedy_generate_matches_one_process(arch, world, request):
    results = request.getfixturevalue(world)
    want = _reference_tokens(arch)
    for rank, result in enumerate(results):
        assert result["generate"][CAUSAL.index(arch)] == want, f"rank {rank} generated other tokens"


def test_llama_placements(world2, world4):
    for results in (world2, world4):
        p = results[0]["llama_layout"]["tp_placements"]
        layer = "model.layers.0."
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert p[layer + proj + ".weight"] == "Shard(dim=0)", proj
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert p[layer + proj + ".weight"] == "Shard(dim=1)", proj
        assert p["model.embed_tokens.weight"] == "Shard(dim=0)"  # vocabulary sharded, lm_head tied to it
        assert "lm_head.weight" not in p  # still one parameter
        assert p[layer + "input_layernorm.weight"] == p["model.norm.weight"] == "none"  # whole on each tp rank
    assert world2[0]["llama_layout"]["placements"]["model.norm.weight"] == "plain"
    four = world4[0]["llama_layout"]["placements"]
    assert four["model.layers.0.self_attn.q_proj.weight"].count("Shard") == 2  # (dp_shard, tp): 2-D
    assert four["model.norm.weight"] == "(Shard(dim=0),)"  # fsdp only: a 1-D DTensor


def test_llama_local_shapes_hold_half_the_heads(world2):
    shapes = world2[0]["llama_layout"]["local_shapes"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [16, 32]  # 4 heads x 8 -> 2 heads
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [8, 32]  # 2 kv heads -> 1
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [32, 32]
    assert shapes["model.embed_tokens.weight"] == [64, 32]


def test_gpt2_fused_qkv_is_split_per_part(world2):
    facts = world2[0]["gpt2_layout"]
    p, shapes = facts["placements"], facts["local_shapes"]
    assert p["transformer.h.0.attn.c_attn.weight"] == "(_StridedShard(dim=1, sf=3),)"
    assert p["transformer.h.0.attn.c_attn.bias"] == "(Replicate(),)"  # whole; forward takes its columns
    assert shapes["transformer.h.0.attn.c_attn.weight"] == [32, 48]  # [q_r, k_r, v_r], 16 each
    assert p["transformer.h.0.attn.c_proj.weight"] == "(Shard(dim=0),)"  # Conv1D [in, out]: rowwise on 0
    assert p["transformer.h.0.attn.c_proj.bias"] == "(Replicate(),)"
    assert p["transformer.h.0.mlp.c_fc.weight"] == "(Shard(dim=1),)"
    assert facts["attrs"]["transformer.h.0.attn.split_size"] == 16
    assert facts["attrs"]["transformer.h.0.attn.num_heads"] == 2


def test_phi3_qkv_packed_only_without_gqa(world2):
    gqa, mha = world2[0]["phi3_layout"], world2[0]["phi3_mha_layout"]
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    assert gqa["placements"][qkv] == "(Shard(dim=0),)"  # transformers' plan: gathered output
    assert mha["placements"][qkv] == "(_StridedShard(dim=0, sf=3),)"
    for facts in (gqa, mha):
        assert facts["placements"][gate_up] == "(_StridedShard(dim=0, sf=2),)"
        assert facts["local_shapes"][gate_up] == [64, 32]  # [gate_r; up_r]
    assert mha["attrs"]["model.layers.0.self_attn.num_key_value_heads"] == 2
    assert mha["attrs"]["model.layers.0.self_attn.config.num_attention_heads"] == 2
    assert mha["model_config_heads"] == 4  # the model's own config (saved with it) is untouched
    assert gqa["attrs"]["model.layers.0.self_attn.num_key_value_heads"] == 2  # whole: qkv gathered


def test_t5_relative_bias_sharded_on_heads(world2):
    facts = world2[0]["t5_layout"]
    p = facts["placements"]
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert p[bias] == "(Shard(dim=1),)" and facts["local_shapes"][bias] == [32, 2]
    assert p["decoder.block.0.layer.1.EncDecAttention.q.weight"] == "(Shard(dim=0),)"
    assert p["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == "(Shard(dim=1),)"
    assert facts["attrs"]["decoder.block.1.layer.1.EncDecAttention.n_heads"] == 2


def test_opt_heads_per_rank(world2):
    facts = world2[0]["opt_layout"]
    assert facts["attrs"]["model.decoder.layers.0.self_attn.num_heads"] == 2
    assert facts["placements"]["model.decoder.layers.0.fc2.weight"] == "(Shard(dim=1),)"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_collectives_per_forward(world2, arch):
    """Without sequence parallel: one all-reduce for the vocabulary-sharded embedding, two per
    block (attention output, MLP output). Evaluation gathers the logits once; training never
    does (the loss runs on vocabulary shards: a few scalar-sized all-reduces of its own)."""
    for rank, result in enumerate(world2):
        check_collectives(result[f"{arch}_comm"], rank)


def check_collectives(facts: dict, rank: int) -> None:
    layers = 2
    assert facts["eval"] == {"all_reduce": 1 + 2 * layers, "all_gather_into_tensor": 1}, (rank, facts["eval"])
    assert facts["eval_logits"] == [2, 16, 128], rank
    assert facts["train_logits"] is None, rank
    assert "all_gather_into_tensor" not in facts["train"], (rank, facts["train"])
    assert facts["train"]["all_reduce"] >= 1 + 2 * layers, rank


def test_every_rank_has_the_layout_rank_0_has(world2, world4):
    """The layout tests above read rank 0's facts: every other rank's placements and per-rank
    attributes are the same (and its local shapes, under tp alone: these tp splits are even)."""
    for world, results in (("world2", world2), ("world4", world4)):
        for key in [k for k in results[0] if k.endswith("_layout")]:
            for rank, result in enumerate(results[1:], 1):
                for fact in ("placements", "tp_placements", "attrs", "model_config_heads") + (
                        ("local_shapes",) if world == "world2" else ()):
                    assert result[key][fact] == results[0][key][fact], f"{world} rank {rank}: {key} {fact}"


def test_zero_grad_keeping_gradients_under_tp_alone(world2):
    """tp alone leaves norms plain beside DTensor weights: ``zero_grad(set_to_none=False)``
    zeroes both kinds (torch's own zero_grad batches them into one foreach call and raises)."""
    for result in world2:
        assert result["zero_grad"] == {"kinds": ["DTensor", "Parameter"], "zeros": True, "none": True}


def test_sharded_outputs_may_be_changed_in_place(world2):
    """A sharded layer's output is the caller's to change in place (CTRL scales its embedding
    output with ``*=``, Llama 4 adds the routed experts to its shared expert's with ``add_``):
    torch's ``to_local`` hands out a custom Function's view, which autograd refuses to change."""
    for result in world2:
        assert "error" not in result["inplace_outputs"], result["inplace_outputs"]
        assert result["inplace_outputs"]["loss"] < 1e-4
        assert max(result["inplace_outputs"]["grads"].values()) < 1e-5, result["inplace_outputs"]


def test_fused_projection_keeping_its_key_value_heads_whole(world2):
    """``colwise_replicated_kv``: one k/v head beside split query heads (Falcon, GPTBigCode's
    multi-query attention): the loss and every gradient (the fused weight's, summed over the
    ranks' heads, and the embedding's through it) equal one process's."""
    for result in world2:
        assert "error" not in result["multi_query"], result["multi_query"]
        assert result["multi_query"]["loss"] < 1e-4
        assert max(result["multi_query"]["grads"].values()) < 1e-5, result["multi_query"]


def test_bad_input_fails_on_every_rank_before_any_collective(world2):
    """Both ranks raise (a rank that went on into a collective would hang the spawn)."""
    for result in world2:
        assert result["bad_heads"].startswith("HfScalePlanError") and "num_attention_heads=3" in result["bad_heads"]
        assert "q_projj" in result["bad_pattern"] and "q_proj" in result["bad_pattern"].split("q_projj", 1)[1]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3_mha"])
def test_fsdp_keeps_the_tp_layout(world2, world4, arch):
    """Adding FSDP over the data-parallel ranks leaves every parameter's tp placement as tp
    alone gives it (packed _StridedShard weights included) and shards each one on dp as well."""
    alone, with_fsdp = world2[0][f"{arch}_layout"], world4[0][f"{arch}_layout"]
    assert with_fsdp["tp_placements"] == alone["tp_placements"]
    for name, placements in with_fsdp["placements"].items():
        assert placements != "plain", f"{name} is not sharded by FSDP"
        local, tp_local = math.prod(with_fsdp["local_shapes"][name]), math.prod(alone["local_shapes"][name])
        assert local <= -(-tp_local // 2), f"{name}: {local} elements on a rank, not half of {tp_local}"
