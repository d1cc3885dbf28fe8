"""Step time of a layout: compute at a throughput, communication over links, the pipeline bubble.

- compute: ``6 x N + 12 x L x h x s`` FLOPs per token (N: matmul parameters, the head's
  included; the attention term of Chinchilla / PaLM's MFU accounting; a mixture of experts counts
  its active parameters only: ``top_k`` of each layer's ``E`` routed experts, :mod:`.experts`); a frozen weight (an
  adapter run's base) costs ``4`` per token, not ``6``: backward computes its input's gradient,
  not its own (``4 N + 2 N_trainable``; the first block's input gradient, which nothing needs
  when the embeddings are frozen, is counted: one block in L). Split over tp and the
  pipeline stages, at the device's achieved FLOP/s for the compute dtype. Full checkpointing
  adds one forward of the blocks (``2N_blocks + 4Lhs``), the chunked loss one of the head
  (``2N_head``: each chunk is checkpointed); selective adds ``SELECTIVE_RECOMPUTE`` of the compute (the
  norms and activations it recomputes are memory-bound: an assumption, not measured).
- communication per step, ring algorithms (bus bytes ``(n-1)/n`` per all-gather / reduce-scatter,
  ``2(n-1)/n`` per all-reduce): fsdp all-gathers the parameters in the compute dtype in forward
  and again in backward (frozen weights too: in the compute dtype, or without mixed precision in
  their own) and reduce-scatters fp32 gradients (trainable parameters only: an adapter run's are
  a small fraction; a QLoRA run's NF4 base weights move in NF4 bytes, :mod:`.quantized`, and
  each is dequantized in every forward, backward and recomputation at the memory bandwidth:
  ``StepCost.dequant``); zero2 all-gathers once; hsdp adds
  the all-reduce of the shards over the replicas (on the inter-node link); ddp all-reduces fp32
  gradients; zero1 all-reduces them and broadcasts the updated parameters; tp all-reduces the
  residual stream once per sharded module (a row-parallel output in forward, a column-parallel
  input's gradient in backward: q, k and v each their own), and pays DTensor's dispatch per module
  (measured on CPU); pp sends each microbatch's activations and receives their gradients, once
  per stage on the rank; ep (MoE) runs each layer's experts as FSDP units of their own over
  ``dp_shard / ep`` ranks, each rank gathering 1/ep of them (ddp + ep: the dense gradients
  all-reduced; at ep = the replicas each rank its own experts, no collective for them, below it
  FSDP units over the replicas holding the same ones, gathered in fp32 and reduced every
  micro-batch), and exchanges the tokens by
  all-to-all (:func:`.experts.all_to_all_bytes`, ``(ep-1)/ep`` of it off the rank, on the
  critical path; five all-to-alls per MoE layer and micro-batch, each paying a latency). The fixed costs (per block, per tp module, per message) are paid once
  per microbatch: more pipeline microbatches shrink the bubble but repeat them, the trade the
  chooser weighs. FSDP's collectives run per unit (``blocks_per_unit`` blocks, and the root).
  Each collective pays a latency; all-gather and reduce-scatter may run at their own bus
  bandwidth (gloo's run at 1/2 and 1/3 of its all-reduce's here: it has no native reduce-scatter). FSDP's own work per unit (hooks, copy-in / copy-out) and
  DDP's per step are measured on CPU and add to the compute. On CPU the links and these
  overheads are measured at 2 and at 4 processes (on 2 cores the second is oversubscribed: its
  per-unit cost came out 2.9-3.5x, latency 2.1-3.0x and all-reduce bandwidth 0.73-0.89x of 2
  processes' in two calibrations); more ranks than that are scaled by the cores'
  oversubscription, as the compute (:meth:`Device.at_world`). The data-parallel
  traffic overlaps compute by the link's ``overlap`` fraction (0 on a 2-core CPU, where gloo
  competes with compute for the same cores); tp's is on the critical path.
- host-bound GPUs: the host issues each block's kernels in ``host_block`` seconds; when that
  exceeds the device's compute the step takes the host's time, and FSDP2's default forward
  prefetch (the next all-gather issued when the host reaches it) exposes the forward
  all-gathers, which an explicit ``prefetch`` hides (:func:`_host_bound_gathers`): the case
  PyTorch gives for explicit prefetching (pytorch#78608: "when applications' CUDA queueing
  lags"). On a CPU the host is the device and prefetching changes nothing (measured here:
  FSDP2 with explicit prefetch 1-3, async or not, within the runs' +-10% noise of the default).
  hf_scale's fsdp nevertheless issues them asynchronously one unit ahead on a CPU mesh
  (:func:`hf_scale.parallel.fsdp.overlap_on_host`); the model keeps pricing no overlap there.
- optimizer: AdamW reads parameter, gradient and two moments and writes three (28 bytes per
  local trainable parameter) at the memory bandwidth; with cpu_offload at host bandwidth, plus the
  parameter / gradient copies over PCIe on a GPU; and a fixed cost per parameter tensor, higher
  on DTensors (measured on CPU).
- pipeline bubble: :func:`hf_scale.layout_preview.bubble_fraction` (the formulas P2 wrote there).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .estimate import (
    DTYPE_BYTES,
    Layout,
    Workload,
    _pp_config,
    fsdp_units,
    moe_layers_per_pp_rank,
    pipeline_shape,
    pp_rank_params,
    pp_share,
    pp_stages,
    rank_blocks,
    rank_moe_layers,
    rank_params,
)
from .experts import all_to_all_bytes, inactive_params, moe_facts
from .profile import ModelFacts
from .quantized import dequant_bytes_per_step, nf4_share

SELECTIVE_RECOMPUTE = 0.05
# the share of a block's forward kernels that selective checkpointing issues again in backward (the
# norms, activations, rotary embedding, residual adds between the matmuls): an assumption, not measured
SELECTIVE_HOST_OPS = 0.6
WIDE = 576  # the hidden size the CPU calibration measures its main FLOP/s at
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Link:
    """A network between ranks: bus bandwidth per rank (bytes/s), latency per collective (s), and
    the share of data-parallel traffic hidden behind compute."""

    bandwidth: float
    latency: float
    overlap: float
    gather_bandwidth: float | None = None  # all-gather bus bandwidth, when it differs (gloo: measured)
    scatter_bandwidth: float | None = None  # reduce-scatter's (gloo has no native one: an all-reduce inside)

    @property
    def gather(self) -> float:
        return self.gather_bandwidth or self.bandwidth

    @property
    def scatter(self) -> float:
        return self.scatter_bandwidth or self.bandwidth


@dataclass(frozen=True)
class Device:
    """One rank's achieved FLOP/s per compute dtype, memory bandwidth, and its links."""

    name: str
    flops_fp32: float
    flops_low: float  # bf16 / fp16
    mem_bandwidth: float
    intra: Link  # within a node (NVLink, shared memory)
    inter: Link  # between nodes (InfiniBand)
    host_bandwidth: float = 20e9  # PCIe (cpu offload copies) and the host's memory for the optimizer
    cores: int = 0  # CPU only: ranks share these cores (flops were measured with ``threads``)
    threads: int = 1
    block_overhead: float = 0.0  # seconds of fixed cost per block per micro-batch (CPU: measured)
    # seconds per checkpointed block per micro-batch that checkpointing's machinery adds (hooks, RNG
    # state, the selective policy per op), beyond its recomputation's FLOPs (CPU: measured)
    full_ac_overhead: float = 0.0
    selective_ac_overhead: float = 0.0
    narrow: tuple[int, float] | None = None  # (hidden, fp32 FLOP/s) measured at a narrower width
    fsdp_unit_overhead: float = 0.0  # seconds per FSDP unit per micro-batch (hooks, copies; CPU: measured)
    ddp_overhead: float = 0.0  # seconds per DDP step beyond its all-reduce (CPU: measured)
    # seconds per tensor-parallel module per micro-batch, forward + backward, beyond its compute and
    # its all-reduce (DTensor's dispatch, the input / output redistribution hooks; CPU: measured)
    tp_module_overhead: float = 0.0
    # seconds per parameter tensor of an AdamW step and zero_grad, beyond its memory traffic: on
    # plain tensors, and on DTensors (FSDP's shards, tp's); CPU: measured
    optimizer_tensor: float = 0.0
    optimizer_dtensor: float = 0.0
    # CPU: (world, link, fsdp_unit_overhead, ddp_overhead[, tp_module_overhead]) measured at more
    # processes (:meth:`at_world`)
    wider: tuple = ()
    busy: float = 1.0  # CPU: a core's speed while every core computes, against one process alone (measured)
    # GPU: seconds the host takes to issue one block's forward and backward per micro-batch (Python,
    # dispatch, kernel launches; the device runs them asynchronously). A step whose host time
    # exceeds its device compute is host-bound. (On a CPU the host is the device: block_overhead.)
    host_block: float = 0.0

    def flops(self, precision: str | None, world: int = 1, hidden: int | None = None) -> float:
        """Achieved FLOP/s of one rank; on a CPU, ``world`` ranks split the cores (each at the
        ``busy`` speed once every core computes), and a model narrower than the calibration's 576
        runs at a rate interpolated (log-width) towards the narrow measurement."""
        rate = self.flops_low if precision else self.flops_fp32
        if self.narrow and hidden and hidden < WIDE:
            width, slow = self.narrow
            x = min(1.0, max(0.0, math.log(WIDE / hidden) / math.log(WIDE / width)))
            rate *= (slow / self.flops_fp32) ** x
        if self.cores:
            if self._all_busy(world):
                rate *= self.busy
            rate *= min(1.0, self.cores / world / self.threads)
        return rate

    def _all_busy(self, world: int) -> bool:
        return world > 1 and world * self.threads >= self.cores

    def at_world(self, world: int) -> Device:
        """This device as each of ``world`` ranks sees it. On a CPU: the links and the wrappers'
        overheads measured at the largest calibrated world size not above ``world`` (2 processes,
        then 4: ``wider``); beyond it, and for the per-block overhead and the optimizer's memory
        traffic (measured in one process), slowed by how much more the ranks oversubscribe the
        cores (``world x threads / cores``, as the compute's share in :meth:`flops`) and, once every
        core computes, by ``busy``. A GPU: unchanged."""
        if not self.cores:
            return self
        dev, measured = self, 2
        for w, link, unit, ddp, *tp in sorted(self.wider, key=lambda entry: entry[0]):
            if w <= world:
                dev, measured = replace(dev, intra=link, inter=link, fsdp_unit_overhead=unit, ddp_overhead=ddp,
                                        tp_module_overhead=tp[0] if tp else dev.tp_module_overhead), w

        def crowding(n: int) -> float:
            return max(1.0, n * self.threads / self.cores)

        beyond, alone = crowding(world) / crowding(measured), crowding(world)
        if self._all_busy(world):  # measured in one process: slower with every core computing
            alone /= self.busy
        if beyond == alone == 1:
            return dev

        def slow(link: Link) -> Link:
            if beyond == 1:
                return link
            return replace(link, bandwidth=link.bandwidth / beyond, latency=link.latency * beyond,
                           gather_bandwidth=link.gather / beyond, scatter_bandwidth=link.scatter / beyond)

        return replace(dev, intra=slow(dev.intra), inter=slow(dev.inter), mem_bandwidth=dev.mem_bandwidth / alone,
                       host_bandwidth=dev.host_bandwidth / alone, block_overhead=dev.block_overhead * alone,
                       full_ac_overhead=dev.full_ac_overhead * alone,
                       selective_ac_overhead=dev.selective_ac_overhead * alone,
                       fsdp_unit_overhead=dev.fsdp_unit_overhead * beyond, ddp_overhead=dev.ddp_overhead * beyond,
                       tp_module_overhead=dev.tp_module_overhead * beyond)


NVLINK = Link(bandwidth=200e9, latency=10e-6, overlap=0.9)  # H100 NVLink 4: 450 GB/s per direction peak
INFINIBAND = Link(bandwidth=40e9, latency=20e-6, overlap=0.8)  # 8 x 400 Gb/s NDR per node, per GPU ~50 GB/s
# H100 SXM: 989 TFLOP/s dense bf16 peak at ~45% MFU. fp32 runs at the 67 TFLOP/s of the CUDA
# cores at the same ~45%: PyTorch leaves TF32 matmuls off (torch.backends.cuda.matmul.allow_tf32
# is False by default) and hf_scale does not turn them on.
# Host time per block: an eager Llama block issues ~100 kernels forward and backward at ~5 us each
# (launch and dispatch): 0.5 ms, an assumption (no GPU measured it). It matters for small blocks
# and short sequences only: an 8B block at 4096 tokens computes ~12 ms.
H100 = Device("h100-80gb", flops_fp32=30e12, flops_low=450e12, mem_bandwidth=3.0e12, intra=NVLINK,
              inter=INFINIBAND, host_block=0.5e-3)


def flops_per_token(facts: ModelFacts, seq: int, ac: str | None = None, chunked: bool = False) -> float:
    """Training FLOPs per token (forward + backward), with checkpointing's recomputation (and the
    chunked loss's: each chunk's head matmul runs again in backward)."""
    attention = 12 * facts.layers * facts.hidden * seq
    # a MoE token runs top_k of each layer's E experts: the others' weights are no compute of its
    idle, idle_trainable = inactive_params(facts)
    active, active_trainable = facts.matmul_params - idle, facts.trainable_matmul_params - idle_trainable
    # forward 2N, input gradients 2N, weight gradients 2N of the trainable weights only
    base = 4 * active + 2 * active_trainable + attention
    extra = 2 * facts.head_params if chunked else 0
    if ac == "full":
        return base + extra + (2 * (active - facts.head_params) + attention / 3)
    if ac == "selective":
        return base * (1 + SELECTIVE_RECOMPUTE) + extra
    return base + extra


@dataclass(frozen=True)
class StepCost:
    """Seconds of one optimizer step on the busiest rank, by part, and the throughput."""

    compute: float
    bubble: float
    comm_dp: float  # exposed part of the data-parallel collectives
    comm_tp: float
    comm_pp: float
    optimizer: float
    offload: float
    tokens_per_step: int  # over all data-parallel ranks
    comm_ep: float = 0.0  # expert parallel's all-to-alls (on the critical path)
    dequant: float = 0.0  # QLoRA: NF4 weights dequantized in each matmul (memory-bound, :mod:`.quantized`)
    comm_cp: float = 0.0  # context parallel's K / V (or heads) exchange, every layer (on the critical path)

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.comm_dp + self.comm_tp + self.comm_pp + self.comm_ep + self.optimizer
                + self.offload + self.dequant + self.comm_cp)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.total

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total, "tokens_per_second": self.tokens_per_second}


def step_cost(facts: ModelFacts, layout: Layout, work: Workload, device: Device, nodes: int = 1) -> StepCost:
    """The estimated step time of ``work`` under ``layout`` on ``device`` ranks."""
    from ..layout_preview import bubble_fraction

    if layout.cp > 1:
        return _cp_cost(facts, layout, work, device, nodes)

    device = device.at_world(layout.world_size)  # CPU: measured at this many ranks, or more crowded
    d = DTYPE_BYTES[layout.precision]
    micro = max(1, work.batch // layout.micro_batch)  # micro-batches (gradient accumulation)
    tokens = work.batch * work.seq  # per data-parallel rank
    share = _stage_share(facts, layout)
    chunked = bool(layout.loss_chunk_tokens)
    compute = tokens * flops_per_token(facts, work.seq, layout.ac, chunked) * share / layout.tp / device.flops(layout.precision, layout.world_size, facts.hidden)
    blocks_here = rank_blocks(facts, layout)
    # a pipeline splits each micro-batch into m microbatches, each run through this rank's blocks:
    # the fixed costs per block, per module and per message are paid m times
    m = pipeline_shape(facts, layout)[2] if layout.pp > 1 else 1
    runs = micro * m
    passes = 4 / 3 if layout.ac == "full" else 1.0  # a recomputed forward is a third of a step's ops
    compute += runs * (blocks_here + 1) * passes * device.block_overhead
    ac_overhead = {"full": device.full_ac_overhead, "selective": device.selective_ac_overhead}.get(layout.ac, 0.0)
    compute += runs * blocks_here * ac_overhead
    # a recomputed forward is issued again: all of it (full), or its ops between the matmuls (selective)
    host_passes = {"full": 4 / 3, "selective": 1 + SELECTIVE_HOST_OPS / 3}.get(layout.ac, 1.0)
    host = runs * blocks_here * host_passes * device.host_block
    device_compute = compute
    compute = max(compute, host)  # host-bound: the device waits for the host's launches
    bubble = 0.0
    if layout.pp > 1:
        fraction, _ = bubble_fraction(layout.pp_schedule, layout.pp, _stages_per_rank(layout), m)
        bubble = compute * fraction / (1 - fraction)
    params = rank_params(facts, layout)
    frozen = facts.frozen_params * (params / facts.params)  # the same share of this rank's parameters
    gather_bytes = params * d if layout.precision or not frozen else (params - frozen) * d + frozen * facts.frozen_bytes
    # QLoRA: the NF4 weights are gathered in NF4 bytes (never cast), and dequantized in every matmul
    nf4 = nf4_share(facts, layout.dp_shard if layout.strategy in ("fsdp", "zero2", "hsdp") and layout.world_size > 1
                    else 1, layout.tp, pp_share(facts, layout))
    if nf4:
        gather_bytes -= nf4.params * (d if layout.precision else facts.frozen_bytes) - nf4.nf4_bytes
    dequant = runs * dequant_bytes_per_step(nf4, d, 3 if layout.ac else 2) / device.mem_bandwidth
    train = params - frozen
    per_node = max(1, layout.world_size // nodes)
    within = nodes == 1 or (layout.strategy == "hsdp" and layout.dp_shard * layout.tp <= per_node)
    dp_link = device.intra if within else device.inter
    units = fsdp_units(facts, layout)
    # ep: the experts (1/ep of them here) are FSDP units of their own, over the dp_shard / ep ranks
    # holding the same ones; the rest of the model as without ep
    moved, expert_units = _ep_experts(facts, layout, params)
    # pp_grad_sync="each": a stage reduce-scatters its gradients after every microbatch's backward
    # (and, resharded, gathers its parameters again for the next): m times a step's reductions
    each = layout.pp > 1 and layout.pp_grad_sync == "each"
    comm_dp = _dp_seconds(layout, gather_bytes * (1 - moved), train * (1 - moved), runs if each else micro, units,
                          dp_link, device, syncs=runs if each else 1)
    replicated_ep = layout.ep > 1 and layout.strategy == "ddp"  # the experts out of DDP's all-reduce
    ddp_fsdp_experts = expert_units if replicated_ep and layout.dp_replicate > layout.ep else 0
    if ddp_fsdp_experts:
        # ep fewer than the replicas: the experts FSDP-sharded over the replicas holding the same ones,
        # gathered as stored (``shard_experts`` gives them no MixedPrecisionPolicy under ddp: fp32, a
        # frozen one in its own dtype) and reduce-scattered every micro-batch (``no_sync`` switches
        # DDP's reducer off, not their FSDP units' gradient sync)
        erep = replace(layout, strategy="fsdp", dp_replicate=1, dp_shard=layout.dp_replicate // layout.ep)
        stored = (4 * train + facts.frozen_bytes * frozen) * moved / layout.ep
        comm_dp += _dp_seconds(erep, stored, train * moved / layout.ep, micro, expert_units, dp_link, device,
                               syncs=micro)
    elif expert_units and not replicated_ep:
        # (the replicas' all-reduce on the link the dense weights' takes, even where ep = dp_shard)
        replicas = device.inter if layout.strategy == "hsdp" and layout.dp_shard > 1 else None
        comm_dp += _dp_seconds(replace(layout, dp_shard=layout.dp_shard // layout.ep), gather_bytes * moved / layout.ep,
                               train * moved / layout.ep, micro, expert_units, dp_link, device, replicas)
        gather_bytes *= 1 - moved * (1 - 1 / layout.ep)  # what a host-bound step's forward gathers
    exposed = _host_bound_gathers(layout, gather_bytes, micro, dp_link, device_compute, host) if host > device_compute else 0.0
    comm_dp = max(comm_dp * (1 - dp_link.overlap), exposed)
    if layout.dp > 1:  # the wrappers' own work per step, on the compute stream (measured on CPU)
        if layout.strategy in ("fsdp", "zero2", "hsdp"):
            compute += micro * (units + expert_units) * device.fsdp_unit_overhead
        else:  # (and under ddp + ep the experts' FSDP units, where ep is fewer than the replicas)
            compute += micro * (device.ddp_overhead + ddp_fsdp_experts * device.fsdp_unit_overhead)
    if work.reference:
        reference_compute, reference_gathers = _reference_seconds(facts, layout, work, device, params, micro, units,
                                                                  dp_link, share, runs * (blocks_here + 1))
        compute += reference_compute
        comm_dp += reference_gathers * (1 - dp_link.overlap)
    comm_tp = 0.0
    if layout.tp > 1:
        size = tokens * facts.hidden * d  # the residual stream of the whole step on this rank
        col, row, root = facts.tp_modules()
        modules = blocks_here * (col + row) + root
        # one all-reduce per module: a row-parallel output in forward (again when a full checkpoint
        # recomputes it), a column-parallel input's gradient in backward (each module its own)
        calls = modules + (blocks_here * row if layout.ac == "full" else 0)
        comm_tp = calls * size * 2 * (layout.tp - 1) / layout.tp / device.intra.bandwidth \
            + calls * runs * device.intra.latency
        compute += runs * modules * passes * device.tp_module_overhead
    comm_ep = 0.0
    if layout.ep > 1:
        comm_ep = _ep_seconds(facts, layout, tokens, d, runs, device, per_node)
    comm_pp = 0.0
    if layout.pp > 1:
        link = device.intra if layout.world_size <= per_node else device.inter
        # every tp rank of a stage holds the whole activation (no sequence parallel) and sends it;
        # each stage on this rank sends its output forward and its input's gradient back, per microbatch
        sends = 2 * _stages_per_rank(layout)
        comm_pp = sends * tokens * facts.hidden * d / link.bandwidth + sends * runs * link.latency
    shards = layout.dp_shard if layout.strategy in ("fsdp", "zero2", "hsdp") else 1
    local = int(train) // (layout.dp if layout.strategy == "zero1" else shards)  # the trainable parameters stepped here
    if replicated_ep:  # the experts' 1/ep here, FSDP-sharded over the replicas holding the same ones
        local = int(train * (1 - moved * (1 - 1 / layout.dp_replicate)))
    optimizer = 28 * local / (device.host_bandwidth if layout.cpu_offload else device.mem_bandwidth)
    # this rank's trainable tensors (pp: its stages'; tp shards every one)
    tensors = facts.trainable_tensors * blocks_here / facts.layers
    if layout.strategy == "zero1":
        tensors /= layout.dp
    dtensors = layout.strategy in ("fsdp", "zero2", "hsdp") and layout.dp > 1 or layout.tp > 1
    optimizer += tensors * (device.optimizer_dtensor if dtensors else device.optimizer_tensor)
    offload = 0.0
    if layout.cpu_offload and device.name != "cpu":
        # parameters in (frozen ones as stored), gradients out (trainable ones)
        offload = (4 * local + facts.frozen_bytes * (int(frozen) // shards) + 4 * local) / device.host_bandwidth
    return StepCost(compute, bubble, comm_dp, comm_tp, comm_pp, optimizer, offload, tokens * layout.dp, comm_ep,
                    dequant)


def _cp_cost(facts: ModelFacts, layout: Layout, work: Workload, device: Device, nodes: int) -> StepCost:
    """Under context parallel (:mod:`.context`): the layout with cp folded into the data-parallel
    degree on ``S/cp``-token sequences, plus the attention that reaches past the rank's own tokens
    (its ``S/cp`` queries see up to ``S`` keys: the busiest rank's share of the sequence's causal
    work, :func:`.context.attention_share`, against the ``S/cp``-token sequences' own) and the
    exchange of every layer, on the critical path (cp inside a node: the intra-node link)."""
    from .context import attention_share, exchange_bytes, flat_layout, local_work, padded

    base = step_cost(facts, flat_layout(layout), local_work(work, layout), device, nodes)
    device = device.at_world(layout.world_size)
    seq = padded(work.seq, layout)
    local = seq // layout.cp
    passes = 4 / 3 if layout.ac == "full" else 1.0  # a recomputed forward: a third of the attention's work again
    per_token = 12 * facts.layers * facts.hidden * passes  # flops_per_token's attention term, over the context
    whole = work.batch * seq * per_token * seq * attention_share(layout.cp, layout.cp_layout)
    attention = (whole - work.batch * local * per_token * local) / device.flops(layout.precision, layout.world_size,
                                                                               facts.hidden)
    per_node = max(1, layout.world_size // nodes)
    link = device.intra if layout.cp <= per_node else device.inter
    moved = exchange_bytes(facts, layout, work)
    micro = max(1, work.batch // layout.micro_batch)
    layers = rank_blocks(facts, layout)
    comm = micro * layers * ((moved["forward"] + moved["backward"]) / link.bandwidth
                             + moved["collectives"] * link.latency)
    return replace(base, compute=base.compute + attention, comm_cp=comm)


def _ep_experts(facts: ModelFacts, layout: Layout, params: int) -> tuple[float, int]:
    """Under ep: the routed experts' share of the rank's parameters (before ep and FSDP split
    them), and the FSDP units they form (one per MoE layer on the rank: under pp its stages'
    own, those of the rank whose parameters ``rank_params`` counts); (0, 0) without ep."""
    moe = moe_facts(facts) if layout.ep > 1 else None
    if moe is None or not params:
        return 0.0, 0
    if layout.pp == 1:
        return moe.expert_params / facts.params, moe.moe_layers
    layers = rank_moe_layers(facts, layout)
    return min(1.0, moe.layer_params * layers / max(pp_rank_params(facts, layout))), layers


def _ep_seconds(facts: ModelFacts, layout: Layout, tokens: int, element_bytes: int, runs: int, device: Device,
                per_node: int) -> float:
    """Seconds of expert parallel's all-to-alls in one step of ``tokens`` tokens on this rank:
    :func:`.experts.all_to_all_bytes` of which ``(ep - 1) / ep`` leaves the rank (routing spread
    evenly), over the link the ep group spans (ep x tp neighbouring ranks: within a node when they
    fit), plus a latency per all-to-all: per MoE layer and micro-batch (pipeline microbatch),
    forward's three (the per-expert counts, the tokens, the outputs back) and backward's two.
    Under pp a rank exchanges for its stages' MoE layers only (the pp rank with the most).
    Not overlapped: the experts wait for their tokens."""
    moe = moe_facts(facts)
    layers = max(moe_layers_per_pp_rank(facts, layout))
    link = device.intra if layout.ep * layout.tp <= per_node else device.inter
    leaving = all_to_all_bytes(facts, tokens, element_bytes) * layers / moe.moe_layers * (layout.ep - 1) / layout.ep
    return leaving / link.bandwidth + 5 * layers * runs * link.latency


def _stages_per_rank(layout: Layout) -> int:
    return _pp_config(layout).stages_per_rank


def _stage_share(facts: ModelFacts, layout: Layout) -> float:
    """The busiest pp rank's share of the compute (1 without pp)."""
    if layout.pp == 1:
        return 1.0
    return facts.cached(("share", layout.pp, layout.pp_schedule), lambda: _busiest_share(facts, layout))


def _busiest_share(facts: ModelFacts, layout: Layout) -> float:
    per_rank = [0.0] * layout.pp
    for stage in pp_stages(facts, layout)["stages"]:
        per_rank[stage["rank"]] += stage["compute"]
    return max(per_rank)


def _reference_seconds(facts: ModelFacts, layout: Layout, work: Workload, device: Device, params: float, micro: int,
                       units: int, link: Link, share: float, block_runs: int) -> tuple[float, float]:
    """(compute, data-parallel traffic) seconds of a held preference reference's no-grad forward
    (``Workload.reference``), once per micro-batch on the same rows as the policy: 2N FLOPs a token
    (N its active matmul parameters) and a third of attention's (:func:`flops_per_token` counts
    forward and backward), with a third of its blocks' fixed costs (no backward). Under fsdp /
    zero2 / hsdp it is sharded like the policy (:func:`hf_scale.train.model.reference_layout`) and
    gathers every unit once per forward (resharded after it), in the compute dtype under mixed
    precision, else as stored; under ddp / zero1 a whole replica: no traffic. (FSDP's per-unit
    hook cost of the reference's forward is not counted: not measured apart from the policy's.)"""
    idle, _ = inactive_params(facts)
    forward = work.batch * work.seq * (2 * (facts.matmul_params - idle) + 4 * facts.layers * facts.hidden * work.seq)
    seconds = forward * share / layout.tp / device.flops(layout.precision, layout.world_size, facts.hidden)
    seconds += block_runs * device.block_overhead / 3
    n = layout.dp_shard if layout.strategy in ("fsdp", "zero2", "hsdp") else 1
    if n == 1:
        return seconds, 0.0
    stored = DTYPE_BYTES[layout.precision] if layout.precision else work.reference
    return seconds, micro * (params * stored * (n - 1) / n / link.gather + units * link.latency)


def _host_bound_gathers(layout: Layout, gather_bytes: float, micro: int, link: Link, compute: float,
                        host: float) -> float:
    """Seconds of forward all-gathers a host-bound step exposes under FSDP2's default prefetch.

    By default a unit's forward all-gather is issued when the host reaches that unit; when the
    host is the bottleneck the device has by then run the previous unit's kernels, so the
    gather and the unit's compute run one after the other, beside the host's launches: per step
    ``gathers + compute - host`` is exposed. An explicit prefetch (``layout.prefetch``) issues it
    as the previous unit's lands, behind that unit's host time: no more exposed than elsewhere.
    ``gather_bytes``: the rank's parameters as all-gathered (before sharding)."""
    n = layout.dp_shard
    if layout.prefetch or layout.strategy not in ("fsdp", "zero2", "hsdp") or n == 1:
        return 0.0
    forward = micro * gather_bytes * (n - 1) / n / link.gather
    return max(0.0, forward + compute - host)


def _dp_seconds(layout: Layout, gather_bytes: float, train: float, micro: int, units: int, link: Link,
                device: Device, replica_link: Link | None = None, syncs: int = 1) -> float:
    """Seconds of data-parallel traffic per step (before overlap): the rank's parameters as
    all-gathered (``gather_bytes``, before sharding) and its ``train`` trainable parameters'
    fp32 gradients reduced (and, under zero1, broadcast once updated). FSDP issues its
    collectives per unit (``units``, the root included), each paying the link's latency.
    ``replica_link``: the link of HSDP's all-reduce over the replicas, when not the one the
    layout implies (ep's experts: their shard group may be one rank, the replicas still span nodes).
    ``syncs``: FSDP's gradient reductions per step (1: gradient accumulation defers them to the
    last micro-batch, ``no_sync``; ddp + ep's experts reduce every micro-batch)."""
    n, r = layout.dp_shard, layout.dp_replicate
    if layout.dp == 1:
        return 0.0
    if layout.strategy in ("fsdp", "zero2", "hsdp"):
        gathers = 1 if layout.strategy == "zero2" else 2
        seconds = 0.0
        if n > 1:
            ag = gathers * micro * gather_bytes * (n - 1) / n
            rs = syncs * train * 4 * (n - 1) / n
            seconds = ag / link.gather + rs / link.scatter + (gathers * micro + syncs) * units * link.latency
        if r > 1:
            inter = replica_link or (device.inter if layout.strategy == "hsdp" and n > 1 else link)
            seconds += train / n * 4 * 2 * (r - 1) / r / inter.bandwidth + units * inter.latency
        return seconds
    buckets = max(1, int(train) * 4 // DDP_BUCKET_BYTES)
    seconds = train * 4 * 2 * (layout.dp - 1) / layout.dp / link.bandwidth + buckets * link.latency
    if layout.strategy == "zero1":  # every rank broadcasts its updated part
        seconds += train * 4 * (layout.dp - 1) / layout.dp / link.bandwidth + layout.dp * link.latency
    return seconds
