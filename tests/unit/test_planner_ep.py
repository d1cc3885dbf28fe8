"""Expert parallel in the auto-planner (issue 27, item 4): ep layouts only for mixture-of-experts
models and only where the engine accepts them, the experts gathered per layer shrinking to 1/ep,
the all-to-all bytes and seconds from ``ep_report``'s formula, MoE compute counted on the active
experts, and a Qwen3-MoE-shaped model at 16 GPUs ranked with its ep layouts. One process, meta
models only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_scale.layout_search.choose import choose, evaluate
from hf_scale.layout_search.cost import H100, Device, Link, flops_per_token, step_cost
from hf_scale.layout_search.estimate import GiB, Layout, Workload, estimate_memory
from hf_scale.layout_search.experts import all_to_all_bytes, ep_degrees, moe_facts
from hf_scale.layout_search.profile import model_facts
from tests.distributed.moe_checks import moe_config
from tests.tiny_models import tiny_config

LINK = Link(bandwidth=1e9, latency=1e-5, overlap=0.5)
GPU = Device("gpu", flops_fp32=1e12, flops_low=2e12, mem_bandwidth=1e12, intra=LINK, inter=LINK)
WORK = Workload(seq=16, batch=4, device="cuda")
SMALL = dict(acs=(None,), chunks=(None,), offloads=(False,), units=(1,))


def _moe(arch: str = "qwen3_moe", **changes):
    config = moe_config(arch, False)
    for k, v in changes.items():
        setattr(config, k, v)
    return model_facts(config)


@pytest.fixture(scope="module")
def moe():
    return _moe(num_experts=8)  # 8 experts, top-2, 2 MoE layers, hidden 64


@pytest.fixture(scope="module")
def dense():
    return model_facts(tiny_config("llama"))


@pytest.mark.parametrize("arch, key", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts"),
                                       ("deepseek_v3", "n_routed_experts")])
def test_moe_facts_come_from_the_config_and_the_experts_layout(arch, key):
    facts = _moe(arch)
    moe = moe_facts(facts)
    config = facts.model.config
    assert moe.num_experts == getattr(config, key) == 4 and moe.top_k == config.num_experts_per_tok == 2
    assert moe.moe_layers == (1 if arch == "deepseek_v3" else 2)  # DeepSeek-V3's first layer is dense
    assert moe.blocks == ({1} if arch == "deepseek_v3" else {0, 1})
    assert ep_degrees(facts) == (1, 2, 4)


def test_ep_layouts_only_for_moe_models_and_only_valid_ones(moe, dense):
    _, ranked = choose(moe, WORK, 8, 100 * GiB, GPU, tps=(1, 2), **SMALL)  # tp 4 splits no kv head pair
    eps = {c.layout.ep for c in ranked}
    assert eps == {1, 2, 4, 8}
    for c in ranked:
        lay = c.layout
        if lay.ep > 1:  # the engine's conditions: fsdp / zero2 / hsdp with ep | dp_shard (each stage's under
            # pp), or ddp with ep | its replicas and no tp; ep | experts
            assert (lay.strategy in ("fsdp", "zero2", "hsdp") and lay.dp_shard % lay.ep == 0
                    or lay.strategy == "ddp" and lay.tp == 1 and lay.dp_replicate % lay.ep == 0), lay
            # (a pipeline may be refused for its own reasons, with or without ep: too few blocks, a
            # micro-batch that does not split into its microbatches)
            assert 8 % lay.ep == 0 and (c.fits or lay.pp > 1), (lay, c.reason)
            assert f"ep={lay.ep}" in lay.describe() and lay.parallel_config().ep == lay.ep
    assert any(c.layout.ep == 8 and c.layout.dp_shard == 8 for c in ranked)
    assert any(c.layout.ep > 1 and c.layout.strategy == "hsdp" for c in ranked)  # ep within each replica group
    assert any(c.layout.ep > 1 and c.layout.pp > 1 and c.fits for c in ranked)  # ep within each stage
    assert any(c.layout.strategy == "ddp" and 1 < c.layout.ep < c.layout.dp_replicate and c.fits for c in ranked)
    assert not any(c.layout.ep > 1 and c.layout.tp * c.layout.pp > 1 and c.layout.dp_shard < c.layout.ep for c in ranked)

    # a dense model never gets ep, and one forced on it is refused with the engine's message
    assert ep_degrees(dense) == (1,) and moe_facts(dense) is None
    _, ranked = choose(dense, WORK, 8, 100 * GiB, GPU, **SMALL)
    assert {c.layout.ep for c in ranked} == {1}
    forced = evaluate(dense, Layout("fsdp", 1, 4, ep=2), WORK, 100 * GiB, GPU)
    assert "has no mixture-of-experts layers" in forced.reason
    # an ep that divides dp_shard but not the experts: the engine's reason too
    six = _moe(num_experts=6)
    assert ep_degrees(six) == (1, 2, 3, 6)
    assert "ep=4 does not divide the 6 experts" in evaluate(six, Layout("fsdp", 1, 4, ep=4), WORK, 100 * GiB,
                                                            GPU).reason
    _, ranked = choose(six, WORK, 4, 100 * GiB, GPU, **SMALL)
    assert {c.layout.ep for c in ranked} == {1, 2}  # 3 and 6 do not divide dp_shard 1, 2 or 4


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_gathered_experts_shrink_to_one_over_ep_and_state_stays(moe, precision):
    d = 2 if precision else 4
    per_layer = moe_facts(moe).layer_params
    assert per_layer == 8 * (64 * 64 + 64 * 32)  # gate_up [E, 2I, H] + down [E, H, I]
    base = {s: estimate_memory(moe, Layout(s, 1, 8, precision=precision), WORK) for s in ("fsdp", "zero2")}
    for ep in (2, 4, 8):
        for strategy, layers in (("fsdp", 1), ("zero2", 2)):  # fsdp gathers one block at a time, zero2 every one
            mem = estimate_memory(moe, Layout(strategy, 1, 8, precision=precision, ep=ep), WORK)
            ref = base[strategy]
            # at ep = dp_shard in fp32 no other rank holds this rank's experts: FSDP leaves them out, none gathered
            share = 1 if ep == 8 and not precision else 1 - 1 / ep
            # gradient accumulation (batch 4 of micro-batches of 1): no_sync's unsharded fp32 gradients
            # are those of the FSDP units, so none of the experts the rank does not gather (its own whole
            # ones, out of FSDP, have their gradients counted in grads): both MoE layers' in fp32
            accumulated = 2 * per_layer * share * 4
            assert ref.comm_buffers - mem.comm_buffers == pytest.approx(
                layers * per_layer * share * d + accumulated, abs=4)
            # the same weight, gradient and optimizer bytes per rank as fsdp over dp_shard
            assert (mem.params, mem.grads, mem.optimizer) == (ref.params, ref.grads, ref.optimizer)
            # one MoE layer's all-to-all buffers: tokens x top_k x hidden, out and back
            assert mem.activations - ref.activations == 2 * (1 * 16) * 2 * 64 * d


def test_ddp_with_ep_replicates_the_dense_weights_and_holds_one_over_ep_of_the_experts(moe):
    """ddp + ep (at ep = the replicas each rank its own experts): the dense weights, their gradients
    and AdamW state whole on every rank, the experts' 1/ep; no collective for the experts (the
    dense gradients' all-reduce only). With fewer ep the experts are FSDP-sharded over the replicas
    holding the same ones; both are searched."""
    from hf_scale.mesh import ParallelDims

    experts = moe_facts(moe).expert_params
    plain, split = (estimate_memory(moe, Layout("ddp", 4, 1, ep=ep), WORK) for ep in (1, 4))
    away = experts * 3 / 4  # the other 3 ranks' experts
    assert plain.params - split.params == pytest.approx(4 * away, abs=4)
    assert plain.grads - split.grads == pytest.approx(4 * away, abs=4)
    assert plain.optimizer - split.optimizer == pytest.approx(8 * away, abs=8)
    # DDP's buckets hold the dense gradients only: every expert's is out (the others' not held, its own ignored)
    assert plain.comm_buffers - split.comm_buffers == pytest.approx(4 * experts, abs=4)
    # ep fewer than the replicas: the experts FSDP-sharded over
    # the 2 replicas holding the same ones, 1/4 of them held between steps, one layer's share gathered
    half = estimate_memory(moe, Layout("ddp", 4, 1, ep=2), WORK)
    assert (half.params, half.grads, half.optimizer) == (split.params, split.grads, split.optimizer)
    per_layer = moe_facts(moe).layer_params
    assert half.comm_buffers - split.comm_buffers == pytest.approx(2 * 4 * per_layer / 2, abs=4)
    # under autocast a rank copies only the experts it computes with: its 1/ep (gathered whole at ep < replicas)
    for ep in (2, 4):
        low = estimate_memory(moe, Layout("ddp", 4, 1, precision="bf16", ep=ep), WORK)
        whole = estimate_memory(moe, Layout("ddp", 4, 1, precision="bf16"), WORK)
        assert whole.compute_copies - low.compute_copies == pytest.approx(2 * experts * (1 - 1 / ep), abs=4)
    plain16, split16 = (estimate_memory(moe, Layout("ddp", 4, 1, precision="bf16", ep=ep), WORK) for ep in (1, 4))
    assert plain16.compute_copies - split16.compute_copies == pytest.approx(2 * away, abs=4)
    slow, fast = (step_cost(moe, Layout("ddp", 4, 1, ep=ep), WORK, GPU) for ep in (1, 4))
    dense = 1 - experts / moe.params
    assert fast.comm_dp < slow.comm_dp and fast.comm_ep > 0 and fast.optimizer < slow.optimizer
    # ep fewer than the replicas: the experts' FSDP traffic over the
    # 2 replicas holding the same ones, their optimizer step over 1/4 of them as at ep = 4
    half_cost = step_cost(moe, Layout("ddp", 4, 1, ep=2), WORK, GPU)
    assert half_cost.comm_dp > fast.comm_dp and half_cost.optimizer == pytest.approx(fast.optimizer, rel=1e-6)
    assert fast.comm_dp == pytest.approx(step_cost(moe, Layout("ddp", 4, 1), WORK, GPU).comm_dp * dense, rel=0.05)
    _, ranked = choose(moe, WORK, 4, 100 * GiB, GPU, tps=(1,), strategies=("ddp",), **SMALL)
    assert {c.layout.ep for c in ranked} == {1, 2, 4}
    layout = next(c.layout for c in ranked if c.layout.ep == 4)
    config = layout.parallel_config()
    assert (config.strategy, config.ep) == ("ddp", 4)
    assert ParallelDims.resolve(config, world_size=4).describe().endswith("(ep=4 of dp_replicate)")


def test_hsdp_experts_all_reduce_over_the_replicas_on_the_inter_node_link(moe):
    """hsdp + ep: the experts' gradients are all-reduced over the replicas (across nodes) whatever
    ep is; at ep = dp_shard their shard group is one rank, which must not move that all-reduce onto
    the in-node link."""
    fast = Link(bandwidth=1e11, latency=1e-6, overlap=0.5)
    two_nodes = replace(GPU, intra=fast, inter=Link(bandwidth=1e7, latency=1e-4, overlap=0.5))
    cost = {ep: step_cost(moe, Layout("hsdp", 2, 8, ep=ep), WORK, two_nodes, nodes=2).comm_dp for ep in (1, 4, 8)}
    # the slow link's replica all-reduce dominates, of the same bytes at every ep (it was 0.39x at ep=8)
    assert cost[8] == pytest.approx(cost[4], rel=0.05) and cost[8] == pytest.approx(cost[1], rel=0.05), cost


def test_all_to_all_bytes_and_seconds_follow_the_formula(moe):
    from hf_scale.layout_preview import ep_report

    tokens, d = 4 * 16, 2
    expected = tokens * 64 * 2 * 2 * 2 * 2 * d  # tokens x hidden x top_k x 2 directions x fwd+bwd x layers x bytes
    assert all_to_all_bytes(moe, tokens, d) == expected
    assert ep_report(moe.model, moe.plan, 2, tokens=tokens, act_bytes=d)["all_to_all_bytes_step"] == expected
    for ep in (2, 4, 8):
        lay = Layout("fsdp", 1, 8, precision="bf16", micro_batch=2, ep=ep)
        cost = step_cost(moe, lay, WORK, GPU)
        runs = WORK.batch // lay.micro_batch  # micro-batches: five all-to-alls per MoE layer each
        assert cost.comm_ep == pytest.approx(expected * (ep - 1) / ep / LINK.bandwidth + 5 * 2 * runs * LINK.latency)
        assert cost.total == pytest.approx(sum(v for k, v in cost.as_dict().items()
                                               if k not in ("tokens_per_step", "total", "tokens_per_second")))
    assert step_cost(moe, Layout("fsdp", 1, 8, precision="bf16"), WORK, GPU).comm_ep == 0.0
    # the ep group leaves the node when ep x tp exceeds its ranks: the inter-node link
    slow = replace(GPU, inter=Link(bandwidth=1e8, latency=1e-4, overlap=0.5))
    assert step_cost(moe, Layout("fsdp", 1, 8, ep=8), WORK, slow, nodes=2).comm_ep > \
        step_cost(moe, Layout("fsdp", 1, 8, ep=4), WORK, slow, nodes=2).comm_ep * 5


def test_moe_compute_counts_the_active_experts_only(moe, dense):
    facts = moe_facts(moe)
    idle = facts.expert_params * (1 - 2 / 8)  # top-2 of 8: 3/4 of the experts' weights idle per token
    attention = 12 * 2 * 64 * 16
    active = moe.matmul_params - idle
    assert flops_per_token(moe, 16) == pytest.approx(6 * active + attention)
    assert flops_per_token(moe, 16, "full") == pytest.approx(6 * active + 2 * (active - moe.head_params)
                                                             + attention * 4 / 3)
    assert flops_per_token(dense, 16) == 6 * dense.matmul_params + 12 * dense.layers * dense.hidden * 16
    # ep moves no compute: the same FLOPs per rank with and without it
    a = step_cost(moe, Layout("fsdp", 1, 8), WORK, GPU)
    b = step_cost(moe, Layout("fsdp", 1, 8, ep=4), WORK, GPU)
    assert a.compute == pytest.approx(b.compute)


def test_qwen3_moe_shaped_model_at_16_gpus_ranks_ep_layouts():
    """Qwen3-30B-A3B's widths (128 experts, top-8, moe_intermediate 768, hidden 2048), 4 of its 48
    layers: at 16 H100s over 2 nodes, ep layouts are ranked by the model's numbers, not a
    preference: each against the same layout without ep, the experts gathered shrink, the
    all-to-all appears, and the order follows tokens/s."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8)
    facts = model_facts(config)
    work = Workload(seq=4096, batch=1, device="cuda")
    best, ranked = choose(facts, work, 16, 80 * 10**9, H100, nodes=2, acs=(None,), chunks=(None,), units=(1,),
                          micro_batches=(1,), precisions=("bf16",), prefetches=(None,))
    fits = [c for c in ranked if c.fits]
    position = {c.layout: i for i, c in enumerate(fits)}
    with_ep = [c for c in fits if c.layout.ep > 1]
    assert {c.layout.ep for c in with_ep} == {2, 4, 8, 16}
    moe = moe_facts(facts)
    for c in with_ep:
        plain = next(x for x in fits if x.layout == replace(c.layout, ep=1))
        ep = c.layout.ep
        gathered = moe.layer_params * (1 - 1 / ep) * 2 * (moe.moe_layers if c.layout.strategy == "zero2" else 1)
        assert c.layout.pp == 1  # a micro-batch of one sequence splits into no pipeline's microbatches
        if c.layout.strategy == "ddp":  # ddp + ep: DDP's buckets hold the dense gradients only; at ep = 16
            # nothing is gathered, below it one MoE layer's 1/ep of the experts (FSDP over the replicas holding them)
            assert plain.memory.comm_buffers - c.memory.comm_buffers > 0
        elif c.layout.tp == 1:  # under tp each rank gathers its tp share of them (the block's share: estimated)
            assert plain.memory.comm_buffers - c.memory.comm_buffers == pytest.approx(gathered, abs=2)
        else:
            assert gathered / c.layout.tp / 2 < plain.memory.comm_buffers - c.memory.comm_buffers <= gathered
        link = H100.intra if ep * c.layout.tp <= 8 else H100.inter  # an ep group: ep x tp neighbouring ranks
        leaving = 4096 * 2048 * 8 * 2 * 2 * 4 * 2 * (ep - 1) / ep
        assert c.cost.comm_ep == pytest.approx(leaving / link.bandwidth + 5 * 4 * link.latency)
        assert c.cost.comm_dp < plain.cost.comm_dp  # the experts' traffic runs over dp_shard / ep (ddp: none)
        # ranked by the estimate: whichever of the two is more than 1% faster comes first
        if c.cost.tokens_per_second > plain.cost.tokens_per_second * 1.01:
            assert position[c.layout] < position[plain.layout]
        elif plain.cost.tokens_per_second > c.cost.tokens_per_second * 1.01:
            assert position[plain.layout] < position[c.layout]
    assert best is fits[0] and best.cost.tokens_per_second >= max(c.cost.tokens_per_second for c in fits) * 0.99


def test_auto_keeps_a_fixed_ep_and_the_report_names_it(moe):
    from hf_scale.layout_search.auto import auto_config
    from hf_scale.layout_search.ranking import format_candidates

    config, best = auto_config(moe.model.config, world_size=4, budget=100 * GiB, device_type="cuda", seq=16,
                               fixed={"ep": 2})
    assert config.ep == 2 and best.layout.ep == 2 and config.strategy in ("fsdp", "zero2")
    text = format_candidates(moe, best, [best], 100 * GiB, WORK)
    assert "ep=2" in text.splitlines()[-1]


def test_tp_splits_the_routed_experts_in_the_planners_count(moe):
    """Under tp each expert's intermediate size is split over the tp ranks (parallel.ep), so a
    tp rank holds half the experts' parameters at tp=2: the planner counted them whole on every
    rank (the simulation of Qwen3-30B-A3B at tp=4 held 7.1 GiB where it estimated 54.7)."""
    from hf_scale.layout_preview import tp_report
    from hf_scale.model_plans.ep import experts_layout

    model, plan = moe.model, moe.plan
    experts = sum(model.get_submodule(m).get_parameter(p).numel()
                  for m, params in experts_layout(model, plan).modules.items() for p in params)
    total = sum(p.numel() for p in model.parameters())
    report = tp_report(model, plan, 2)
    assert experts > total / 2  # the experts dominate this model
    # every expert weight sharded: the rank's count drops by (at least) half the experts
    assert report["sharded_params"] >= experts and report["params_per_rank"] <= total - experts / 2


def test_pipeline_with_ep_counts_its_own_stages_moe_layers():
    """pp + ep (ep carved out of each stage's dp_shard, searched): a rank exchanges tokens for, and
    leaves ungathered the other ep ranks' experts of, its own stages' MoE layers only (before:
    every layer's, pp times the all-to-all and too little memory under pp)."""
    facts = model_facts(moe_config("qwen3_moe", False, layers=4))  # 4 MoE layers of 4 experts, top-2, hidden 64
    per_layer = moe_facts(facts).layer_params
    assert per_layer == 4 * (64 * 64 + 64 * 32)
    work = Workload(seq=16, batch=4, device="cuda")
    for pp in (2, 4):
        here = 4 // pp  # every layer holds experts, the stages split them evenly
        last = pp - 1  # the rank with the most parameters (the head)
        for strategy in ("fsdp", "zero2"):
            lay = {ep: Layout(strategy, 1, 4, pp=pp, micro_batch=4, ep=ep) for ep in (1, 2)}
            cost = step_cost(facts, lay[2], work, GPU)
            # tokens x hidden x top_k x 2 directions x fwd+bwd x the rank's MoE layers x fp32, half of it
            # leaving the rank; five all-to-alls per MoE layer and microbatch (pp of them: one per stage)
            leaving = 4 * 16 * 64 * 2 * 2 * 2 * here * 4 / 2
            assert cost.comm_ep == pytest.approx(leaving / LINK.bandwidth + 5 * here * pp * LINK.latency)
            # a stage holds every parameter of its blocks gathered at the end of the schedule, and
            # their gradients unsharded in fp32, but neither for the half of each of its MoE layers'
            # experts the other ep rank holds (their gradients were counted before: the estimate was
            # 1.37x the simulated peak at pp=2 x dp_shard=4, ep=2, 1.09x now)
            plain, split = (estimate_memory(facts, lay[ep], work, pp_rank=last) for ep in (1, 2))
            assert plain.comm_buffers - split.comm_buffers == pytest.approx(here * per_layer / 2 * (4 + 4), abs=4)
            assert cost.comm_dp < step_cost(facts, lay[1], work, GPU).comm_dp  # the experts' over 2 ranks, not 4
    _, ranked = choose(facts, work, 4, 100 * GiB, GPU, tps=(1,), **SMALL)
    assert any(c.fits and c.layout.pp > 1 and c.layout.ep > 1 for c in ranked)
    # with the load-balancing loss on the plan refuses any pipeline (no stage holds every layer's
    # router logits): never chosen, with the engine's reason
    aux = model_facts(moe_config("qwen3_moe", True, layers=4))
    _, ranked = choose(aux, work, 4, 100 * GiB, GPU, tps=(1,), **SMALL)
    assert not any(c.fits and c.layout.pp > 1 for c in ranked)
    assert any(c.layout.pp > 1 and c.layout.ep > 1 and "load-balancing loss" in c.reason for c in ranked)
    assert any(c.fits and c.layout.ep > 1 for c in ranked)


def test_pipeline_all_to_all_buffers_are_one_microbatch_s_on_a_stage_with_moe_layers():
    """Under pp the all-to-all's token buffers are those of one pipeline microbatch (the micro-batch
    split m ways), and a rank whose stages hold no MoE layer has none (before: the whole
    micro-batch's on every rank, m times too many)."""
    work = Workload(seq=16, batch=4, device="cuda")
    facts = model_facts(moe_config("qwen3_moe", False, layers=4))  # top-2, hidden 64
    for pp, m in ((2, 2), (2, 4), (4, 4)):
        plain, split = (estimate_memory(facts, Layout("fsdp", 1, 2, pp=pp, micro_batch=4, pp_microbatches=m, ep=ep),
                                        work, pp_rank=0) for ep in (1, 2))
        # rows of the micro-batch's 4 / m sequences x 16 tokens x top-2, of hidden 64 in fp32, out and back
        assert split.activations - plain.activations == 2 * (4 // m * 16) * 2 * 64 * 4
    # DeepSeek-V3's first layer is dense: at pp=2 the first stage holds no experts, no buffers
    ds = model_facts(moe_config("deepseek_v3", False))
    lay = {ep: Layout("fsdp", 1, 2, pp=2, micro_batch=2, ep=ep) for ep in (1, 2)}
    first, last = ({ep: estimate_memory(ds, lay[ep], work, pp_rank=r).activations for ep in (1, 2)} for r in (0, 1))
    assert first[2] == first[1] and last[2] - last[1] == 2 * 16 * 2 * 64 * 4


def test_ddp_with_ep_fewer_than_the_replicas_prices_the_experts_fsdp_as_the_engine_runs_it(moe):
    """ddp (4 replicas) + ep=2, bf16 autocast, 4 micro-batches: the experts' FSDP over the 2 replicas
    holding the same ones gathers them in fp32 (``shard_experts`` gives them no mixed-precision
    policy under ddp) and reduce-scatters their gradients every micro-batch (``no_sync`` switches
    DDP's reducer off, not theirs); each of their units costs FSDP's per-unit work. Before: the
    gathers in bf16, one reduce-scatter per step, no unit overhead."""
    per_layer = 8 * (64 * 64 + 64 * 32)  # 8 experts: gate_up [E, 2I, H] + down [E, H, I]
    experts = 2 * per_layer  # 2 MoE layers
    dense = moe.params - experts
    assert moe_facts(moe).expert_params == experts
    lay = Layout("ddp", 4, 1, precision="bf16", ep=2)  # micro-batch 1 of WORK's batch 4: 4 micro-batches
    cost = step_cost(moe, lay, WORK, GPU)
    # the dense gradients all-reduced once over 4 ranks (one bucket), fp32
    dense_s = dense * 4 * 2 * 3 / 4 / LINK.bandwidth + LINK.latency
    # the rank's half of the experts over 2 ranks: all-gathered in fp32 forward and backward per
    # micro-batch, their fp32 gradients reduce-scattered per micro-batch; a latency per collective and unit
    held = experts / 2
    gathers = 2 * 4 * held * 4 / 2
    scatters = 4 * held * 4 / 2
    experts_s = (gathers + scatters) / LINK.bandwidth + (2 * 4 + 4) * 2 * LINK.latency
    assert cost.comm_dp == pytest.approx((dense_s + experts_s) * (1 - LINK.overlap), rel=1e-9)
    # FSDP's per-unit work: one unit per MoE layer and micro-batch (none at ep = the replicas: no FSDP)
    busy = replace(GPU, fsdp_unit_overhead=1e-3)
    half, whole = (step_cost(moe, replace(lay, ep=ep), WORK, busy).compute for ep in (2, 4))
    assert half - whole == pytest.approx(4 * 2 * 1e-3)


def test_pipeline_stage_leaves_out_only_its_own_moe_layers_experts():
    """A pipeline stage holds its parameters gathered and their gradients unsharded; under ep, less
    the other ep ranks' experts of its own MoE layers, counted per pp rank (before: the largest
    rank's MoE layers scaled by each rank's parameters, so a stage with no MoE layer was counted
    with a share of another's experts away)."""
    ds = model_facts(moe_config("deepseek_v3", False))  # block 0 dense, block 1 MoE: 4 experts, hidden 64
    per_layer = 4 * (64 * 64 + 64 * 32)
    assert moe_facts(ds).layer_params == per_layer
    work = Workload(seq=16, batch=4, device="cuda")
    # (dp_shard 4: at ep = dp_shard in fp32 the experts stay out of FSDP, none gathered)
    lay = {ep: Layout("fsdp", 1, 4, pp=2, micro_batch=2, ep=ep) for ep in (1, 2)}
    first, last = ({ep: estimate_memory(ds, lay[ep], work, pp_rank=r).comm_buffers for ep in (1, 2)} for r in (0, 1))
    assert first[2] == first[1]  # the dense first stage: nothing of it on another ep rank
    # the MoE stage: half its layer's experts neither gathered (fp32) nor given a gradient (fp32)
    assert last[1] - last[2] == pytest.approx(per_layer / 2 * (4 + 4), abs=4)
