"""The planner's context parallel (issue 39): its estimate's cp terms, the chooser trying cp only
when no layout without it fits, and the real ``parallelize`` of a cp layout simulated on fake
CUDA tensors (one process, no process group launched) against the estimate and the collectives
it really issues."""

from dataclasses import replace

import pytest
import torch

from hf_scale.layout_search import H100, Workload, choose, model_facts
from hf_scale.layout_search.choose import MARGIN, enumerate_layouts
from hf_scale.layout_search.context import attention_share, exchange_bytes
from hf_scale.layout_search.cost import step_cost
from hf_scale.layout_search.estimate import DTYPE_BYTES, Layout, estimate_memory
from hf_scale.layout_search.simulate import simulate
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 8,
                                reason="a CUDA build of torch with fewer than 8 visible GPUs")
SEQ = 4096


@pytest.fixture(scope="module")
def config():
    config = tiny_config("llama")  # 4 heads, 2 key-value heads, head size 8
    config._attn_implementation = "sdpa"
    return config


@pytest.fixture(scope="module")
def facts(config):
    return model_facts(config)


def cp_layout(cp: int, exchange: str = "alltoall", ac=None, world: int = 4, **kw) -> Layout:
    return Layout("fsdp", 1, world // cp, ac=ac, precision="bf16", cp=cp, cp_exchange=exchange, **kw)


def test_a_cp_layout_counts_its_ranks_and_runs_as_configured():
    lay = cp_layout(2, world=8)
    assert lay.world_size == 8 and lay.dp == 4
    config = lay.parallel_config()
    assert (config.cp, config.cp_exchange, config.cp_layout, config.dp_shard) == (2, "alltoall", "head_tail", 4)
    assert "cp=2 alltoall" in lay.describe()


def test_state_is_sharded_over_dp_shard_times_cp(facts):
    """FSDP shards parameters, gradients and AdamW's state over dp_shard x cp (DDP replicates)."""
    work = Workload(seq=SEQ, batch=1, device="cuda")
    cp = estimate_memory(facts, cp_layout(2, world=4), work)
    four = estimate_memory(facts, Layout("fsdp", 1, 4, precision="bf16"), work)
    assert (cp.params, cp.grads, cp.optimizer) == (four.params, four.grads, four.optimizer)
    two = estimate_memory(facts, Layout("fsdp", 1, 2, precision="bf16"), work)
    assert cp.params < two.params
    ddp = estimate_memory(facts, Layout("ddp", 2, 1, precision="bf16", cp=2), work)
    assert ddp.params == estimate_memory(facts, Layout("ddp", 4, 1, precision="bf16"), work).params


@pytest.mark.parametrize("ac", [None, "full"])
def test_activations_fall_as_one_over_cp(facts, ac):
    """The all-to-all keeps what one process keeps for S/cp tokens (this model's key-value heads
    repeated for the fused kernel aside): the saved activations per rank fall as 1/cp."""
    work = Workload(seq=SEQ, batch=1, device="cuda")
    acts = {cp: estimate_memory(facts, cp_layout(cp, ac=ac), work).activations for cp in (1, 2, 4)}
    for cp in (2, 4):
        assert acts[cp] * cp == pytest.approx(acts[1], rel=0.05 if ac else 0.2), (cp, acts)
        assert acts[cp] * cp <= acts[1] * (1.2 if ac is None else 1.0)


@pytest.mark.parametrize("cp_layout_name", ["head_tail", "contiguous"])
def test_the_allgather_on_a_gpu_keeps_its_keys_prefixes_and_no_mask(facts, config, cp_layout_name):
    """On a GPU the all-gather's plain causal layers attend chunk by chunk to the prefix of keys
    they may see (lower-right causal, no mask): per layer they keep each chunk's prefix of K / V
    repeated for every query head (the fused kernel's), where one process keeps S/cp of the
    key-value heads; the busiest rank's prefixes add up to (2cp+1)/(2cp) of the sequence under
    head_tail, the whole of it on the last rank under contiguous. No S/cp x S term, no mask held."""
    work = Workload(seq=SEQ, batch=1, device="cuda")
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, DTYPE_BYTES["bf16"]
    dim = config.hidden_size // heads
    for cp in (2, 4):
        local = SEQ // cp
        keys = (2 * cp + 1) * SEQ // (2 * cp) if cp_layout_name == "head_tail" else SEQ
        gather = estimate_memory(facts, cp_layout(cp, "allgather", cp_layout=cp_layout_name), work).activations
        a2a = estimate_memory(facts, cp_layout(cp, "alltoall", cp_layout=cp_layout_name), work).activations
        per_layer = 2 * keys * heads * dim * d - 2 * local * kv * dim * d  # what the prefixes keep
        per_layer -= 2 * (heads - kv) * local * dim * d  # what the all-to-all keeps beyond one process
        assert gather - a2a == config.num_hidden_layers * per_layer, cp


def test_the_masked_allgather_keeps_the_whole_sequence_s_keys_and_its_mask():
    """A sliding window shorter than the sequence keeps the mask on a GPU: per layer the gathered
    K / V repeated for every query head and the kernel's additive mask, and the boolean mask lives
    through the step: the estimate grows by exactly those bytes over the all-to-all's."""
    config = tiny_config("mistral")
    config.sliding_window, config._attn_implementation = SEQ // 4, "sdpa"
    facts = model_facts(config)
    work = Workload(seq=SEQ, batch=1, device="cuda")
    cp, d = 2, DTYPE_BYTES["bf16"]
    local, heads, kv = SEQ // cp, config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    gather = estimate_memory(facts, cp_layout(cp, "allgather"), work).activations
    a2a = estimate_memory(facts, cp_layout(cp, "alltoall"), work).activations
    per_layer = 2 * SEQ * heads * dim * d + local * SEQ * d - 2 * local * kv * dim * d  # what allgather keeps
    per_layer -= 2 * (heads - kv) * local * dim * d  # what the all-to-all keeps beyond one process
    assert gather - a2a == config.num_hidden_layers * per_layer + local * SEQ


@pytest.mark.parametrize("ac", [None, "full"])
def test_exchange_bytes_per_layer(facts, config, ac):
    """Bytes one rank receives per layer: the all-gather (cp-1)/cp of the whole sequence's K / V
    forward and its gradients' reduce-scatter backward (a recomputation gathers again); the
    all-to-all (cp-1)/cp of q, k / v and the output each way."""
    work = Workload(seq=SEQ, batch=1, device="cuda")
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, DTYPE_BYTES["bf16"]
    dim = config.hidden_size // heads
    for cp in (2, 4):
        off = (cp - 1) / cp
        whole_kv = SEQ * kv * 2 * dim * d
        moved = exchange_bytes(facts, cp_layout(cp, "allgather", ac), work)
        assert moved["forward"] == pytest.approx(whole_kv * off)
        assert moved["backward"] == pytest.approx(whole_kv * off * (2 if ac else 1))
        sent_kv = max(kv, cp)  # key-value heads fewer than cp are repeated up to cp
        moved = exchange_bytes(facts, cp_layout(cp, "alltoall", ac), work)
        assert moved["forward"] == pytest.approx((2 * heads + 2 * sent_kv) * SEQ // cp * dim * d * off)
        assert moved["backward"] == pytest.approx(moved["forward"] * (2 if ac else 1))


def test_head_tail_balances_the_causal_work_contiguous_does_not():
    for cp in (2, 4, 8):
        assert attention_share(cp, "head_tail") == pytest.approx(1 / cp)
        assert attention_share(cp, "contiguous") == pytest.approx((2 * cp - 1) / cp**2)


def test_the_step_time_pays_the_exchange_and_the_busiest_rank_s_attention(facts):
    work = Workload(seq=SEQ, batch=1, device="cuda")
    balanced = step_cost(facts, cp_layout(4, "allgather"), work, H100)
    skewed = step_cost(facts, cp_layout(4, "allgather", cp_layout="contiguous"), work, H100)
    assert balanced.comm_cp > 0 and skewed.compute > balanced.compute
    flat = step_cost(facts, Layout("fsdp", 1, 4, precision="bf16"), replace(work, seq=SEQ // 4), H100)
    assert balanced.total > flat.total  # the exchange and the attention past the rank's own tokens
    assert balanced.tokens_per_step == SEQ  # one sequence per data-parallel rank, one data-parallel rank


def test_cp_is_enumerated_where_the_engine_takes_it():
    work = Workload(seq=SEQ, batch=1, device="cuda")
    layouts = enumerate_layouts(8, work, cps=(2, 8), cp_exchanges=("allgather", "alltoall"), ranks_per_node=4)
    cps = {lay.cp for lay in layouts}
    assert cps == {2}  # cp=8 is larger than a node
    for lay in layouts:
        assert lay.tp == lay.pp == lay.ep == 1 and lay.strategy in ("fsdp", "zero2", "ddp")
        assert lay.world_size == 8
    odd = enumerate_layouts(8, replace(work, seq=SEQ + 2), cps=(2,))
    assert odd == []  # the head_tail layout needs a multiple of 2 cp


def test_the_planner_chooses_cp_only_when_no_layout_without_it_fits(facts):
    """A budget 2% above the least a layout without cp needs: no cp tried; 2% below: cp chosen.
    (A long sequence: the activations, which cp splits, outweigh the process overhead.)"""
    work = Workload(seq=32 * SEQ, batch=1, device="cuda")
    space = dict(precisions=("bf16",), offloads=(False,), units=(1,))
    _, ranked = choose(facts, work, 4, 2**40, H100, cps=(1,), **space)
    need = min(c.memory.device_total for c in ranked if c.fits) / (1 - MARGIN)  # the least cp=1 needs
    best, ranked = choose(facts, work, 4, int(need * 1.02), H100, **space)
    assert best.layout.cp == 1 and not any(c.layout.cp > 1 for c in ranked)
    best, ranked = choose(facts, work, 4, int(need * 0.98), H100, **space)
    assert best.layout.cp > 1, best.layout.describe()
    assert best.memory.device_total <= need * 0.98 * (1 - MARGIN)


class _Collectives:
    """The functional collectives cp issues (FSDP2 and the loss use c10d's own ops), as the fake
    tensor mode sees them (the backward's, dispatched from autograd's C++, too), with the bytes
    this rank receives from the others: all-gather (cp-1) inputs, reduce-scatter and all-to-all
    (cp-1)/cp of their input."""

    SHARE = {"all_gather_into_tensor": lambda cp: cp - 1, "reduce_scatter_tensor": lambda cp: (cp - 1) / cp,
             "all_to_all_single": lambda cp: (cp - 1) / cp}

    def __init__(self, monkeypatch, cp: int):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.calls, self.received = 0, 0.0
        dispatch = FakeTensorMode.__torch_dispatch__

        def counted(mode, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func._opname in self.SHARE:
                self.calls += 1
                self.received += args[0].numel() * args[0].element_size() * self.SHARE[func._opname](cp)
            return dispatch(mode, func, types, args, kwargs)

        monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", counted)


@pytest.mark.parametrize("exchange,ac", [("allgather", "full"), ("alltoall", None)])
def test_a_simulated_cp_layout_agrees_with_the_estimate(config, facts, monkeypatch, exchange, ac):
    """The real parallelize and two training steps of a cp=2 layout as rank 0 on fake CUDA: every
    tensor on its GPU, MemTracker's peak within +-10% of the estimate, and the collectives cp
    issues (count and bytes per layer and step) those the estimate prices."""
    layout = cp_layout(2, exchange, ac, world=2)
    counted = _Collectives(monkeypatch, 2)
    result = simulate(config, 2, 0, layout, seq=SEQ, batch=1)
    assert result.misplaced == [] and set(result.placement["parameters"]) == {"cuda:0"}
    assert 0.9 <= result.ratio <= 1.1, result.format()
    moved = exchange_bytes(facts, layout, Workload(seq=SEQ, batch=1, device="cuda"))
    per = 2 * config.num_hidden_layers  # two steps
    assert counted.calls == per * moved["collectives"]
    assert counted.received == pytest.approx(per * (moved["forward"] + moved["backward"]))


def test_an_unpacked_simulation_builds_no_dense_mask(config):
    """The simulated batches are unpacked: transformers' packed-document check, which takes fake
    tensors for a traced graph, must not make it build an ``S x S`` mask (here 48 MB beside a few
    MB of activations) that an unpacked batch on a GPU never makes."""
    result = simulate(config, 2, 0, Layout("fsdp", 1, 2, precision="bf16"), seq=SEQ, batch=1)
    assert 0.9 <= result.ratio <= 1.1, result.format()
