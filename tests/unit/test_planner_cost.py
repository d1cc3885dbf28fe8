"""The planner's step-time arithmetic on a device with round numbers (no calibration run)."""

import math
from dataclasses import replace

import pytest

from hf_scale.layout_preview import bubble_fraction
from hf_scale.layout_search.cost import Device, Link, flops_per_token, step_cost
from hf_scale.layout_search.estimate import Layout, Workload, rank_params
from hf_scale.layout_search.profile import model_facts
from tests.tiny_models import tiny_config

LINK = Link(bandwidth=1e6, latency=0.0, overlap=0.0)
DEV = Device("test", flops_fp32=1e9, flops_low=2e9, mem_bandwidth=1e9, intra=LINK, inter=LINK)
WORK = Workload(seq=16, batch=4)


@pytest.fixture(scope="module")
def tiny():
    return model_facts(tiny_config("llama"))


def test_flops_per_token(tiny):
    n, attn = tiny.matmul_params, 12 * 2 * 32 * 16
    assert flops_per_token(tiny, 16) == 6 * n + attn
    blocks = n - tiny.head_params
    assert flops_per_token(tiny, 16, "full") == 6 * n + 2 * blocks + attn * 4 / 3  # one more forward of the blocks
    assert flops_per_token(tiny, 16, chunked=True) == 6 * n + 2 * tiny.head_params + attn


def test_compute_and_collectives(tiny):
    p = tiny.params
    fsdp = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, DEV)
    assert fsdp.compute == pytest.approx(64 * flops_per_token(tiny, 16) / 1e9)
    # all-gather in forward and backward (fp32), reduce-scatter fp32 gradients, ring (n-1)/n
    assert fsdp.comm_dp == pytest.approx((2 * p * 4 + p * 4) / 2 / 1e6)
    zero2 = step_cost(tiny, Layout("zero2", 1, 2, micro_batch=4, precision="bf16"), WORK, DEV)
    assert zero2.comm_dp == pytest.approx((p * 2 + p * 4) / 2 / 1e6)
    assert zero2.compute == pytest.approx(fsdp.compute / 2)  # bf16 at twice the FLOP/s
    ddp = step_cost(tiny, Layout("ddp", 2, 1, micro_batch=4), WORK, DEV)
    assert ddp.comm_dp == pytest.approx(p * 4 * 2 / 2 / 1e6)
    zero1 = step_cost(tiny, Layout("zero1", 2, 1, micro_batch=4), WORK, DEV)
    assert zero1.comm_dp == pytest.approx(ddp.comm_dp + p * 4 / 2 / 1e6)
    assert zero1.optimizer == pytest.approx(ddp.optimizer / 2)
    assert ddp.tokens_per_step == 2 * 64


def test_overlap_hides_data_parallel_traffic(tiny):
    hidden = Device("t", 1e9, 2e9, 1e9, Link(1e6, 0.0, 0.75), Link(1e6, 0.0, 0.75))
    a = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, DEV)
    b = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, hidden)
    assert b.comm_dp == pytest.approx(a.comm_dp / 4)


def test_pipeline_bubble_and_tp(tiny):
    pp = step_cost(tiny, Layout("fsdp", 1, 1, pp=2, micro_batch=4), WORK, DEV)
    fraction, _ = bubble_fraction("1f1b", 2, 1, 2)
    assert pp.bubble == pytest.approx(pp.compute * fraction / (1 - fraction))
    tp = step_cost(tiny, Layout("fsdp", 1, 1, tp=2, micro_batch=4), WORK, DEV)
    one = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=4), WORK, DEV)
    assert tp.compute == pytest.approx(one.compute / 2)
    # one all-reduce of the residual stream per sharded module: per block 5 column-parallel (q, k,
    # v, gate, up: their inputs' gradients, in backward) and 2 row-parallel (o, down: forward),
    # and the vocabulary-sharded embedding (forward) and head (backward); 2 blocks
    assert tiny.tp_modules() == (5, 2, 2)
    assert tp.comm_tp == pytest.approx((2 * 7 + 2) * 64 * 32 * 4 * 2 * 1 / 2 / 1e6)
    assert rank_params(tiny, Layout("fsdp", 1, 1, tp=2)) < tiny.params


def test_tp_pays_per_module_and_full_checkpointing_repeats_the_forward_all_reduces(tiny):
    link = Link(bandwidth=1e6, latency=0.001, overlap=0.0)
    dev = Device("t", 1e9, 2e9, 1e9, link, link, tp_module_overhead=0.01)
    plain = step_cost(tiny, Layout("fsdp", 1, 1, tp=2, micro_batch=2), WORK, dev)  # 2 micro-batches
    one = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2), WORK, dev)
    assert plain.compute - one.compute / 2 == pytest.approx(2 * 16 * 0.01)  # 16 modules, 2 micro-batches
    full = step_cost(tiny, Layout("fsdp", 1, 1, tp=2, micro_batch=2, ac="full"), WORK, dev)
    size = 64 * 32 * 4 * 2 * 1 / 2 / 1e6  # one all-reduce of the step's residual stream
    assert full.comm_tp - plain.comm_tp == pytest.approx(2 * 2 * (size + 2 * 0.001))  # o, down again x 2 blocks


def test_checkpointing_overhead_per_block(tiny):
    dev = replace(DEV, full_ac_overhead=0.01, selective_ac_overhead=0.03)
    cost = {ac: step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2, ac=ac), WORK, dev).compute
            for ac in (None, "full", "selective")}
    bare = {ac: step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2, ac=ac), WORK, DEV).compute
            for ac in (None, "full", "selective")}
    assert cost[None] == bare[None]
    assert cost["full"] - bare["full"] == pytest.approx(2 * 2 * 0.01)  # 2 micro-batches x 2 blocks
    assert cost["selective"] - bare["selective"] == pytest.approx(2 * 2 * 0.03)


def test_optimizer_fixed_cost_per_tensor(tiny):
    """Plain tensors under ddp, DTensors under fsdp and tp; zero1 updates 1/dp of them."""
    dev = replace(DEV, optimizer_tensor=0.001, optimizer_dtensor=0.004)
    cost = lambda lay, d: step_cost(tiny, lay, WORK, d).optimizer
    assert tiny.tensors == 20  # 2 blocks x 9 (7 Linear, 2 norms), the embedding (tied head), the final norm
    for lay, per in ((Layout("ddp", 2, 1), 0.001), (Layout("fsdp", 1, 2), 0.004), (Layout("fsdp", 1, 1, tp=2), 0.004),
                     (Layout("fsdp", 1, 1), 0.001), (Layout("zero1", 2, 1), 0.0005)):
        assert cost(lay, dev) - cost(lay, DEV) == pytest.approx(20 * per), lay


def test_block_overhead_and_narrow_width(tiny):
    slow = Device("t", flops_fp32=1e9, flops_low=2e9, mem_bandwidth=1e9, intra=LINK, inter=LINK, block_overhead=0.01)
    base = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2), WORK, DEV)
    more = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2), WORK, slow)
    assert more.compute - base.compute == pytest.approx(2 * (2 + 1) * 0.01)  # 2 micro-batches x (2 blocks + 1)
    full = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2, ac="full"), WORK, slow)
    full0 = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2, ac="full"), WORK, DEV)
    assert full.compute - full0.compute == pytest.approx(2 * 3 * 0.01 * 4 / 3)
    narrow = Device("t", 1e9, 2e9, 1e9, LINK, LINK, narrow=(256, 0.25e9))
    assert narrow.flops(None, hidden=576) == 1e9 and narrow.flops(None, hidden=256) == pytest.approx(0.25e9)
    assert narrow.flops(None, hidden=384) == pytest.approx(1e9 * 0.25 ** (math.log(576 / 384) / math.log(576 / 256)))
    assert narrow.flops(None, hidden=64) == pytest.approx(0.25e9)  # clamped at the narrow measurement


def test_gather_and_scatter_bandwidth_and_wrapper_overheads(tiny):
    """gloo's all-gather and reduce-scatter run slower than its all-reduce (measured apart), and
    FSDP's per-unit / DDP's per-step work adds to the compute."""
    p = tiny.params
    slow = Link(bandwidth=1e6, latency=0.0, overlap=0.0, gather_bandwidth=0.5e6, scatter_bandwidth=0.25e6)
    dev = Device("t", 1e9, 2e9, 1e9, slow, slow, fsdp_unit_overhead=0.01, ddp_overhead=0.02)
    fsdp = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=2), WORK, dev)
    assert fsdp.comm_dp == pytest.approx(2 * 2 * p * 4 / 2 / 0.5e6 + p * 4 / 2 / 0.25e6)  # 2 micro-batches
    plain = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=2), WORK, DEV)
    assert fsdp.compute - plain.compute == pytest.approx(2 * (2 + 1) * 0.01)  # micro-batches x (blocks + root)
    ddp = step_cost(tiny, Layout("ddp", 2, 1, micro_batch=2), WORK, dev)
    assert ddp.comm_dp == pytest.approx(p * 4 * 2 / 2 / 1e6)  # all-reduce at its own bandwidth
    assert ddp.compute - step_cost(tiny, Layout("ddp", 2, 1, micro_batch=2), WORK, DEV).compute == pytest.approx(0.04)
    one = step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2), WORK, dev)
    assert one.compute == pytest.approx(step_cost(tiny, Layout("fsdp", 1, 1, micro_batch=2), WORK, DEV).compute)


def test_blocks_per_unit_pays_fewer_unit_overheads_and_latencies(tiny):
    """FSDP's per-unit work and each collective's latency are paid once per unit: 2 blocks in one
    unit are 1 + root = 2 units, against 3."""
    link = Link(bandwidth=1e6, latency=0.001, overlap=0.0)
    dev = Device("t", 1e9, 2e9, 1e9, link, link, fsdp_unit_overhead=0.01)
    one = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, dev)
    two = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4, blocks_per_unit=2), WORK, dev)
    assert one.compute - two.compute == pytest.approx(0.01)  # one micro-batch x one unit fewer
    assert one.comm_dp - two.comm_dp == pytest.approx((2 + 1) * 0.001)  # 2 all-gathers + 1 reduce-scatter


def test_links_and_overheads_measured_at_the_world_size_then_scaled_by_crowding(tiny):
    """On a 2-core CPU: world 2 uses the 2-process measurement, world 4 the 4-process one, world 8
    the 4-process one slowed by the extra oversubscription (8 ranks on 2 cores is 2x 4's); the
    per-block overhead and the optimizer (measured in one process) slow with the cores' share."""
    two = Link(bandwidth=1e6, latency=0.001, overlap=0.0, gather_bandwidth=0.5e6)
    four = Link(bandwidth=0.8e6, latency=0.003, overlap=0.0)
    cpu = Device("cpu", 1e9, 2e9, 1e9, two, two, cores=2, fsdp_unit_overhead=0.01, block_overhead=0.002,
                 tp_module_overhead=0.001, full_ac_overhead=0.003, wider=((4, four, 0.05, 0.02, 0.007),))
    assert cpu.at_world(2) is cpu and cpu.at_world(1) is cpu
    at4 = cpu.at_world(4)
    assert at4.intra == four and at4.fsdp_unit_overhead == 0.05 and at4.ddp_overhead == 0.02
    assert at4.block_overhead == 0.004 and at4.mem_bandwidth == 0.5e9 and at4.tp_module_overhead == 0.007
    assert at4.full_ac_overhead == 0.006
    at8 = cpu.at_world(8)
    assert at8.intra.bandwidth == 0.4e6 and at8.intra.latency == 0.006 and at8.fsdp_unit_overhead == 0.1
    assert at8.block_overhead == 0.008 and at8.tp_module_overhead == 0.014
    # a calibration from before tp's cost was measured: the 4-process entry has no tp figure
    older = replace(cpu, wider=((4, four, 0.05, 0.02),))
    assert older.at_world(4).tp_module_overhead == 0.001
    assert at4.flops(None, 4) == cpu.flops(None, 4) == 0.5e9  # the compute's share is flops' own
    gpu = Device("gpu", 1e9, 2e9, 1e9, two, two)
    assert gpu.at_world(64) is gpu
    lay = Layout("fsdp", 1, 4, micro_batch=4)
    assert step_cost(tiny, lay, WORK, cpu).comm_dp == pytest.approx(step_cost(tiny, lay, WORK, at4).comm_dp)
    # no 4-process measurement (an older calibration): the 2-process one, slowed by the crowding
    assert replace(cpu, wider=()).at_world(4).intra.bandwidth == 0.5e6


def test_every_core_busy_computes_at_the_measured_busy_speed():
    """A core computes slower while the others do too (shared caches, memory bandwidth, clock):
    from the world size that fills the cores, each rank runs at ``busy`` times its speed alone,
    the per-block overhead (measured alone) likewise."""
    link = Link(bandwidth=1e6, latency=0.001, overlap=0.0)
    cpu = Device("cpu", 1e9, 2e9, 1e9, link, link, cores=2, block_overhead=0.002, busy=0.8)
    assert cpu.flops(None, 1) == 1e9
    assert cpu.flops(None, 2) == pytest.approx(0.8e9)
    assert cpu.flops(None, 4) == pytest.approx(0.4e9)  # half a core each, at the busy speed
    assert cpu.at_world(1) is cpu
    assert cpu.at_world(2).block_overhead == pytest.approx(0.002 / 0.8)
    assert cpu.at_world(4).block_overhead == pytest.approx(0.002 * 2 / 0.8)
    assert cpu.at_world(2).intra == link  # the links were measured with every core busy already


def test_a_host_bound_step_takes_the_hosts_time_and_prefetch_hides_its_forward_gathers(tiny):
    """A device whose host issues each block slower than the device computes it: the step takes
    the host's time; FSDP2's default forward prefetch then exposes the forward all-gathers beside
    the compute (``gathers + compute - host``), which an explicit prefetch hides."""
    p = tiny.params
    plain = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, DEV)
    host_block = 2 * plain.compute / 2  # 2 blocks: the host takes twice the device's compute
    hosted = replace(DEV, host_block=host_block, intra=Link(1e6, 0.0, 0.9), inter=Link(1e6, 0.0, 0.9))
    default = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4), WORK, hosted)
    ahead = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4, prefetch=1), WORK, hosted)
    assert default.compute == ahead.compute == pytest.approx(2 * host_block)
    forward = p * 4 / 2 / 1e6  # one all-gather of the fp32 parameters, ring (n-1)/n
    assert default.comm_dp == pytest.approx(forward + plain.compute - 2 * host_block)
    assert ahead.comm_dp == pytest.approx(plain.comm_dp * 0.1)  # the link's overlap, as everywhere
    # a device-bound step (no host time): prefetch changes nothing
    fast = step_cost(tiny, Layout("fsdp", 1, 2, micro_batch=4, prefetch=1), WORK, DEV)
    assert fast.total == pytest.approx(plain.total)


def test_a_held_reference_adds_its_forward_and_under_fsdp_its_gathers(tiny):
    """Preference training with a held reference (``Workload.reference``: 4 bytes a parameter): its
    no-grad forward each micro-batch (2N a token, a third of attention) on the same rows, and under
    fsdp one all-gather of its shards per forward; under ddp a replica, no traffic."""
    ref = replace(WORK, reference=4)
    forward = 64 * (2 * tiny.matmul_params + 4 * 2 * 32 * 16) / 1e9  # 64 tokens; 2 layers, hidden 32, seq 16
    for layout, gathered in ((Layout("ddp", 2, 1, micro_batch=2), 0.0),
                             (Layout("fsdp", 1, 2, micro_batch=2), 2 * tiny.params * 4 / 2 / 1e6)):
        without, held = step_cost(tiny, layout, WORK, DEV), step_cost(tiny, layout, ref, DEV)
        assert held.compute - without.compute == pytest.approx(forward)
        assert held.comm_dp - without.comm_dp == pytest.approx(gathered)  # 2 micro-batches, (n-1)/n of 4 B each
    bf16 = Layout("fsdp", 1, 2, micro_batch=4, precision="bf16")  # gathered in the compute dtype
    assert step_cost(tiny, bf16, ref, DEV).comm_dp - step_cost(tiny, bf16, WORK, DEV).comm_dp == \
        pytest.approx(tiny.params * 2 / 2 / 1e6)
