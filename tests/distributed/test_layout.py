"""What each strategy does to the model, checked on 2 and 4 CPU ranks (one spawn each)."""

import time

import pytest

from tests.distributed import layout_checks
from tests.harness import run_ranks


@pytest.fixture(scope="module")
def world2():
    return run_ranks(layout_checks.world2_checks, 2, timeout=600)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(layout_checks.world4_checks, 4, timeout=600)


def test_fsdp_shards_every_parameter_and_keeps_ties(world2):
    for facts in (r["fsdp"] for r in world2):
        assert facts["placements"] == ["(Shard(dim=0),)"]
        assert facts["local_fraction"] == pytest.approx(0.5, abs=0.01)
        assert facts["tied"] and facts["is_llama"]
        assert facts["block_param_after_forward"] == "DTensor"  # resharded after forward
        assert facts["optimizer"] == "AdamW" and facts["optimizer_states"] == facts["params"]


LLAMA_PLAN = ("llama", ("LlamaDecoderLayer",), (("lm_head.weight", "model.embed_tokens.weight"),))


@pytest.mark.parametrize("strategy, dp", [("fsdp", (1, 2)), ("zero2", (1, 2)), ("zero1", (2, 1)), ("ddp", (2, 1))])
def test_get_state_reports_what_was_asked(world2, strategy, dp):
    """get_state after parallelize: the config asked for, the model's plan, the degrees, a
    5-D mesh (pp, dp_replicate, dp_shard, cp, tp) whose data-parallel part spans both ranks."""
    for rank, facts in enumerate(r[strategy]["state"] for r in world2):
        assert facts["type"] == "ParallelState" and facts["env"] == (rank, 2)
        assert facts["config"]["strategy"] == strategy and facts["plan"] == LLAMA_PLAN
        assert facts["dims"] == (*dp, 2)
        assert facts["mesh"] == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, *dp, 1, 1))
        assert facts["dp_mesh_size"] == 2
    assert all(r["offload"]["state"]["config"]["cpu_offload"] is True for r in world2)


def test_get_state_of_hsdp_at_world4(world4):
    for rank, facts in enumerate(r["hsdp"]["state"] for r in world4):
        assert facts["config"]["strategy"] == "hsdp" and facts["config"]["dp_replicate"] == 2
        assert facts["dims"] == (2, 2, 4) and facts["env"] == (rank, 4)
        assert facts["mesh"] == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 2, 2, 1, 1))
        assert facts["dp_mesh_size"] == 4


def test_weight_decay_groups_hold_sharded_parameters(world2):
    """AdamW groups are chosen by parameter name, which FSDP2 keeps: decay on matrices and
    embeddings, none on the norm weights, each group made of per-parameter DTensors."""
    for r in world2:
        (decay, decay_names, decay_dt), (no_decay, no_decay_names, no_decay_dt) = r["fsdp"]["groups"]
        assert (decay, no_decay) == (0.1, 0.0)
        assert decay_dt and no_decay_dt
        assert all("norm" in n for n in no_decay_names) and len(no_decay_names) == 5  # 2 x 2 layers + final
        assert not any("norm" in n for n in decay_names) and "model.embed_tokens.weight" in decay_names


def test_clip_grad_norm_over_sharded_and_plain_gradients(world2):
    for r in world2:
        facts = r["mixed_clip"]
        assert facts["norm"] == pytest.approx(facts["expected"], rel=1e-6)
        assert facts["clipped_norm"] == pytest.approx(1.0, rel=1e-4)


def test_zero2_keeps_parameters_gathered_until_backward(world2):
    for facts in (r["zero2"] for r in world2):
        assert facts["placements"] == ["(Shard(dim=0),)"]
        assert facts["block_param_after_forward"] == "Parameter"


def test_zero1_shards_only_optimizer_state(world2):
    per_rank = [r["zero1"] for r in world2]
    assert all(f["placements"] == ["plain"] and f["optimizer"] == "ZeroRedundancyOptimizer" for f in per_rank)
    counts = [f["optimizer_states"] for f in per_rank]
    assert all(0 < c < per_rank[0]["params"] for c in counts) and sum(counts) == per_rank[0]["params"]


def test_ddp_replicates_and_keeps_the_model_class(world2):
    for facts in (r["ddp"] for r in world2):
        assert facts["placements"] == ["plain"] and facts["local_fraction"] == 1.0
        assert facts["is_llama"] and facts["tied"] and facts["optimizer"] == "AdamW"


def test_cpu_offload_policy_applied(world2):
    for r in world2:
        assert r["offload"]["offload_policy"] == "CPUOffloadPolicy"
        assert r["fsdp"]["offload_policy"] == "OffloadPolicy"


def test_bf16_computes_low_keeps_fp32_params_grads_and_fp32_modules(world2):
    for facts in (r["precision"] for r in world2):
        assert facts["wi"] == "torch.bfloat16"
        assert (facts["wo_in"], facts["wo_out"]) == ("torch.float32", "torch.float32")  # T5 keeps wo in fp32
        assert facts["param_dtypes"] == ["torch.float32"] and facts["grad_dtypes"] == ["torch.float32"]


def test_no_sync_skips_gradient_communication(world2):
    for fsdp in (r["no_sync_fsdp"] for r in world2):
        assert fsdp["no_sync_reduce_scatter"] == 0 and fsdp["sync_reduce_scatter"] > 0
    for facts in (r["no_sync_ddp"] for r in world2):
        assert facts["no_sync_grads_equal_across_ranks"] is False  # rank-local gradients
        assert facts["sync_grads_equal_across_ranks"] is True


def _check_all_to_all_reduce_scatter(facts: dict) -> None:
    """hf_scale's fsdp on gloo reduce-scatters with all-to-alls (one per unit, no
    reduce_scatter_tensor); putting FSDP's own back gives reduce-scatters and no all-to-all."""
    assert facts["all_to_all_calls"] == {"all_to_all": facts["units"], "reduce_scatter": 0}
    assert facts["native_calls"] == {"all_to_all": 0, "reduce_scatter": facts["units"]}


@pytest.mark.parametrize("case", ["rs_fp32", "rs_bf16", "rs_divide"])
def test_all_to_all_reduce_scatter_gives_torchs_gradients(world2, case):
    """The same gradients as FSDP's own reduce-scatter on an uneven (padded) embedding, in fp32,
    under bf16 mixed precision and with a gradient divide factor (PREMUL_SUM, which gloo lacks:
    its reference sums, then divides): bit for bit at 2 ranks (a + b in either order), the divide
    factor within 1e-6 (x * (1/3) against x / 3)."""
    for r in world2:
        facts = r[case]
        _check_all_to_all_reduce_scatter(facts)
        if case == "rs_divide":
            assert facts["worst"] <= 1e-6
        else:
            assert facts["exact"], facts["worst"]


def test_all_to_all_reduce_scatter_sums_like_gloo(world2, world4):
    """The collective alone on rank-distinct data against gloo's reduce_scatter_tensor (SUM,
    AVG; PREMUL_SUM against the sum times its factor): exact at 2 ranks; at 4 the order of the
    sum differs (fp32 within 1e-6) and bf16 is within two bf16 roundings (2**-7: the sum's, and
    PREMUL_SUM's product's) of the fp32 sum."""
    for r in world2:
        assert all(v == 0.0 for k, v in r["rs_collective"].items() if not k.endswith("_vs_fp32")), r["rs_collective"]
    for r in world4:
        for key, worst in r["rs_collective"].items():
            bound = 2**-7 if "bfloat16" in key else 1e-6
            if "bfloat16" not in key or key.endswith("_vs_fp32"):
                assert worst <= bound, (key, worst)
        facts = r["rs_fp32"]
        _check_all_to_all_reduce_scatter(facts)
        assert facts["worst"] <= 1e-6


def test_bad_layout_fails_on_every_rank_without_hanging(world2):
    for r in world2:
        assert "dp_replicate=3 does not divide the 2 data-parallel ranks" in r["bad_layout"]


def test_generate_works_after_fsdp_and_checkpointing(world2):
    import torch

    from tests.tiny_models import tiny_model

    with torch.no_grad():  # the same model, greedy, in one process
        expected = tiny_model("llama", "causal").eval().generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False
        )[0].tolist()
    assert world2[0]["generate"] == world2[1]["generate"] == expected


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_fp16_trains_with_torch_grad_scaler(world2, strategy):
    for facts in (r[f"fp16_{strategy}"] for r in world2):
        assert facts["scale"] > 0 and facts["losses"][-1] < facts["losses"][0]


def test_hsdp_replicates_across_groups_and_shards_within(world4):
    for r in world4:
        facts = r["hsdp"]
        assert facts["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert facts["local_fraction"] == pytest.approx(0.5, abs=0.01)
        comm = r["no_sync_hsdp"]
        assert comm["no_sync_reduce_scatter"] == comm["no_sync_all_reduce"] == 0
        assert comm["sync_reduce_scatter"] > 0 and comm["sync_all_reduce"] > 0  # shard, then replicas


def test_a_hung_collective_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 5s"):
        run_ranks(layout_checks.hang, 2, timeout=5)
    assert time.monotonic() - start < 45


def test_a_result_that_cannot_be_sent_back_fails_at_once():
    """Not after the timeout as a "hung collective": the rank reports its pickling error."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank \d of 2 failed:(.|\n)*(pickle|Pickl)"):
        run_ranks(layout_checks.unpicklable, 2, timeout=120)
    assert time.monotonic() - start < 100
