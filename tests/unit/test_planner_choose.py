"""The chooser: memory strings, rejections with the engine's reasons, the fastest layout that
fits with ties toward less memory, and a clear error when nothing fits."""

from dataclasses import replace

import pytest

from hf_scale.errors import HfScaleConfigError
from hf_scale.layout_search.choose import (
    Candidate,
    choose,
    enumerate_layouts,
    evaluate,
    parse_memory,
    rank,
    unit_sizes,
)
from hf_scale.layout_search.cost import Device, Link
from hf_scale.layout_search.estimate import GiB, Layout, Workload, estimate_memory
from hf_scale.layout_search.profile import model_facts
from tests.tiny_models import tiny_config

LINK = Link(bandwidth=1e9, latency=1e-5, overlap=0.5)
GPU = Device("gpu", flops_fp32=1e12, flops_low=2e12, mem_bandwidth=1e12, intra=LINK, inter=LINK)
WORK = Workload(seq=16, batch=4, device="cuda")


@pytest.fixture(scope="module")
def tiny():
    return model_facts(tiny_config("llama"))


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("8e10", 8 * 10**10), ("512MiB", 512 * 2**20),
    (" 1.5 TB ", 1.5e12), (2**30, 2**30)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == int(expected)


@pytest.mark.parametrize("text", ["eighty", "80 parsecs", "", "-5GB", "0"])
def test_parse_memory_refuses(text):
    with pytest.raises(HfScaleConfigError, match="not a size"):
        parse_memory(text)


@pytest.mark.parametrize("text", ["80", " 24 ", "1e3"])
def test_a_bare_small_number_is_refused_as_bytes_no_model_fits(text):
    """``--gpu-memory 80`` meant 80 GB: read as 80 bytes, every layout was refused "0.00 GiB per rank"."""
    with pytest.raises(HfScaleConfigError, match=f"has no unit, so it reads as .* bytes: write '{text.strip()}GB'"):
        parse_memory(text)


def test_enumeration_covers_the_mesh_space():
    layouts = enumerate_layouts(4, Workload(seq=16, batch=2), acs=(None,), precisions=(None,), offloads=(False,),
                                chunks=(None,))
    meshes = {(x.strategy, x.dp_replicate, x.dp_shard, x.tp, x.pp) for x in layouts}
    assert ("hsdp", 2, 2, 1, 1) in meshes and ("ddp", 4, 1, 1, 1) in meshes and ("fsdp", 1, 1, 2, 2) in meshes
    assert all(x.world_size == 4 for x in layouts)
    assert {x.micro_batch for x in layouts} == {1, 2}
    grouped = enumerate_layouts(4, Workload(seq=16, batch=2), acs=(None,), precisions=(None,), offloads=(False,),
                                chunks=(None,), units=(1, 2))
    assert {x.strategy for x in grouped if x.blocks_per_unit == 2} == {"fsdp", "zero2", "hsdp"}
    assert unit_sizes(30) == (1, 2, 4, 8, 16) and unit_sizes(2) == (1, 2)


def test_rejections_name_the_engine_reason(tiny):
    bad_tp = evaluate(tiny, Layout("fsdp", 1, 1, tp=8), WORK, 10 * GiB, GPU)
    assert not bad_tp.fits and "tp=8" in bad_tp.reason
    ddp_tp = evaluate(tiny, Layout("ddp", 2, 1, tp=2), WORK, 10 * GiB, GPU)
    assert "DDP does not take tensor-parallel" in ddp_tp.reason
    cpu = evaluate(tiny, Layout("fsdp", 1, 2, cpu_offload=True), Workload(seq=16, batch=4), 10 * GiB, GPU)
    assert "moves nothing" in cpu.reason
    small = evaluate(tiny, Layout("fsdp", 1, 2), WORK, 100 * 2**20, GPU)
    assert "GiB usable" in small.reason and small.memory is not None


def test_margin(tiny):
    need = estimate_memory(tiny, Layout("fsdp", 1, 2), WORK).device_total
    assert evaluate(tiny, Layout("fsdp", 1, 2), WORK, int(need / 0.9) + 1, GPU).fits
    assert not evaluate(tiny, Layout("fsdp", 1, 2), WORK, int(need / 0.9) - 1, GPU).fits


def test_fastest_that_fits_ties_toward_less_memory(tiny):
    best, ranked = choose(tiny, WORK, 2, 10 * GiB, GPU)
    fits = [c for c in ranked if c.fits]
    top = max(c.cost.tokens_per_second for c in fits)
    assert best.cost.tokens_per_second >= top * 0.99
    tied = [c for c in fits if c.cost.tokens_per_second >= top * 0.99]
    assert best.memory.device_total == min(c.memory.device_total for c in tied)
    # a budget just under the winner's need: it is rejected, and the fastest of the rest wins
    budget = int((best.memory.device_total - 1) / 0.9)
    best2, ranked2 = choose(tiny, WORK, 2, budget, GPU)
    assert best2.layout != best.layout and best2.memory.device_total <= budget * 0.9
    left = [c for c in ranked if c.memory and c.memory.device_total <= budget * 0.9]
    assert best2.cost.tokens_per_second >= max(c.cost.tokens_per_second for c in left) * 0.99
    assert any(c.layout == best.layout and "GiB usable" in c.reason for c in ranked2)


def test_rank_orders_ties_by_memory():
    from hf_scale.layout_search.cost import StepCost
    from hf_scale.layout_search.estimate import MemoryEstimate

    mem = lambda total: MemoryEstimate(total, 0, 0, 0, 0, 0, 0, 0, 0)
    cost = lambda seconds: StepCost(seconds, 0, 0, 0, 0, 0, 0, 1000)
    a = Candidate(Layout("fsdp", 1, 2), mem(5), cost(1.0))
    b = Candidate(Layout("ddp", 2, 1), mem(9), cost(0.995))  # 0.5% faster: a tie
    c = Candidate(Layout("zero2", 1, 2), mem(7), cost(0.9))  # 10% faster
    # ties are counted against the fastest: behind it, the order is by speed
    assert [x.layout.strategy for x in rank([a, b, c])] == ["zero2", "ddp", "fsdp"]
    assert [x.layout.strategy for x in rank([a, b])] == ["fsdp", "ddp"]


def test_nothing_fits_says_the_smallest_need_and_what_would_fit(tiny):
    with pytest.raises(HfScaleConfigError) as e:
        choose(tiny, WORK, 2, 2**20, GPU, acs=(None,), offloads=(False,))
    msg = str(e.value)
    assert "smallest need is" in msg and "GiB" in msg and "activation_checkpointing='full'" in msg
    assert "cpu_offload" in msg


def test_pipelines_try_each_schedule_and_microbatch_count_that_splits_the_batch():
    layouts = enumerate_layouts(2, Workload(seq=16, batch=4), strategies=("fsdp",), acs=(None,), precisions=(None,),
                                offloads=(False,), chunks=(None,), pps=(2,), micro_batches=(4,))
    pipes = {(x.pp_schedule, x.pp_microbatches) for x in layouts}
    # one stage per rank: 2 stages, so 2 (the default) or 4 microbatches (8 does not split 4 sequences);
    # two stages per rank: 4 stages, the default only
    assert pipes == {("gpipe", None), ("gpipe", 4), ("1f1b", None), ("1f1b", 4),
                     ("interleaved_1f1b", None), ("zero_bubble", None), ("zbv", None)}
    fixed = enumerate_layouts(2, Workload(seq=16, batch=4), strategies=("fsdp",), acs=(None,), precisions=(None,),
                              offloads=(False,), chunks=(None,), pps=(2,), micro_batches=(4,),
                              pp_schedules=("1f1b",), pp_microbatches=(2,))
    assert {(x.pp_schedule, x.pp_microbatches) for x in fixed} == {("1f1b", 2)}


@pytest.mark.parametrize("overhead, microbatches", [(0.0, 4), (0.05, None)])
def test_more_microbatches_win_until_their_fixed_costs_outweigh_the_bubble(tiny, overhead, microbatches):
    """A smaller bubble against the per-block cost paid once more per microbatch: free fixed
    costs pick 4 microbatches, dear ones the default (one per stage)."""
    cpu = Device("cpu", flops_fp32=1e9, flops_low=1e9, mem_bandwidth=1e9, intra=LINK, inter=LINK,
                 block_overhead=overhead)
    work = Workload(seq=16, batch=4)
    best, _ = choose(tiny, work, 2, 10 * GiB, cpu, strategies=("fsdp",), acs=(None,), precisions=(None,),
                     offloads=(False,), chunks=(None,), pps=(2,), micro_batches=(4,), pp_schedules=("1f1b",))
    assert (best.layout.pp, best.layout.pp_microbatches) == (2, microbatches)


def test_prefetch_is_chosen_only_where_the_host_falls_behind(tiny):
    """An explicit FSDP prefetch costs the same on a device-bound step (a tie: FSDP2's default
    kept) and is not tried on a device without a host time; a host slower than the device's
    compute makes it pay."""
    kw = dict(strategies=("fsdp",), acs=(None,), precisions=(None,), offloads=(False,), chunks=(None,),
              pps=(1,), tps=(1,), micro_batches=(4,), units=(1,))
    best, ranked = choose(tiny, WORK, 2, 10 * GiB, GPU, **kw)
    assert best.layout.prefetch is None and {c.layout.prefetch for c in ranked} == {None}
    hidden = Link(bandwidth=1e9, latency=1e-5, overlap=0.9)  # NVLink-like: most traffic hidden
    slow_host = replace(GPU, host_block=1e-5, intra=hidden, inter=hidden)  # 2x the compute
    best, ranked = choose(tiny, WORK, 2, 10 * GiB, slow_host, **kw)
    assert {c.layout.prefetch for c in ranked} == {None, 1}
    assert best.layout.prefetch == 1
    fast_host = replace(slow_host, host_block=1e-12)
    best, _ = choose(tiny, WORK, 2, 10 * GiB, fast_host, **kw)
    assert best.layout.prefetch is None
