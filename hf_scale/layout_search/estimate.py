"""Per-rank memory of one training step, from a model's config alone, for a given layout.

What hf_scale really keeps (read from ``hf_scale/parallel``):

- fsdp / hsdp / zero2 (FSDP2): sharded fp32 parameters (the master copy, also under mixed
  precision: ``MixedPrecisionPolicy`` casts at all-gather time), fp32 sharded gradients
  (``reduce_dtype`` fp32), AdamW's two fp32 moments on the shard. Communication buffers at
  the peak (the start of backward): the gathered root unit (embeddings, head: never resharded
  after forward) and the last unit (``blocks_per_unit`` blocks, kept gathered for backward) in
  the compute dtype; zero2 keeps every block gathered between forward and backward. In the second
  block unit's backward (beside a recomputation, after the logits' peak) FSDP2 has already
  all-gathered the next unit (its default backward prefetch; an explicit ``prefetch`` of k units:
  k of them; ``prefetched``), still holds the first unit's reduce-scatter input in fp32
  (``reduce_buffer``) and its sharded gradient, the head's unsharded gradient (``head_grad``) and
  the gradients this unit's backward has made so far (the compute dtype's, unsharded:
  ``unit_grads`` counts the whole unit's), while the first unit's kept activations are freed
  (``unit_freed``): the simulation's peak of Llama-3-70B at fsdp 32 x tp 2 with selective
  checkpointing lies there, in block 78 of 80 after its MLP's weight gradients. With two units on
  the rank that moment is the step's last block backward (``first_block``).
- ddp / zero1 (composable ``replicate``): fp32 parameters and gradients on every rank, the
  gradients views into DDP's all-reduce buckets (``gradient_as_bucket_view``: no second copy);
  zero1's ``ZeroRedundancyOptimizer`` keeps 1/n of AdamW's state. Mixed precision is autocast:
  the low-precision weight casts are saved for backward (``compute_copies``).
- tp: each rank's parameters from :func:`hf_scale.layout_preview.tp_report` (``tp_layout``); pp: the
  busiest pp rank's stage parameters (``pp_layout``), a tied head counted on both ends.
- ep (MoE models, :mod:`.experts`): each of ep ranks holds 1/ep of every MoE layer's experts
  (ddp + ep: the dense weights replicated; the experts 1/ep, FSDP-sharded over the replicas
  holding the same ones when ep is fewer than the replicas),
  FSDP-sharded over the dp_shard / ep ranks holding the same ones: per rank the same weight,
  gradient and optimizer bytes as FSDP over dp_shard, but a gathered layer holds only 1/ep of its
  experts (zero2: of every layer's), and the unsharded fp32 gradients that no_sync (gradient
  accumulation) and a pipeline stage keep are those of its 1/ep only. The all-to-all's token
  buffers (``tokens x top_k`` rows of ``hidden``, out and back, in the compute dtype) count as
  activations, one MoE layer's at a time (of one pipeline microbatch under pp): the experts'
  inputs and outputs that backward keeps are the model's own, already measured by the meta
  forward (its experts gather the same ``tokens x top_k`` rows).
- pp under FSDP (1F1B, GPipe): the peak is a later microbatch's, beside the gradients the earlier
  ones made (``scripts/simulate_published.py``'s pp=4 rows, read at each schedule step): at most
  ``m - 1`` microbatches in flight then (the first's freed; ``first_microbatch``: the one more at
  the first backward, before any gradient), each with the stage output torch keeps for its
  backward, and a receive buffer per microbatch throughout. A stage's root unit is its own part of
  the root (embeddings first, norm and head last: ``stage_root_params``). ``pp_grad_sync="each"``:
  every sharded gradient, the previous microbatch's root reduce-scatter input (``root_reduce``),
  the top unit's own gradients unsharded (bf16); on the last stage the loss's forward (the logits,
  their fp32 copy and log-softmax, all forward's) beside the root and two units gathered.
  ``"last"``: the stage is gathered whole with every gradient unsharded only from a microbatch's
  backward to the next forward (``regathered``): the peak is a backward's end beside the other
  microbatches in flight (on the last stage none).
- cpu_offload: parameters, gradients and optimizer state live in host memory (``host``); on a
  CPU device that is the device's own memory, where they stay counted.
- activations: :mod:`.profile` (saved tensors counted on a meta forward), per micro-batch, with
  checkpointing none / selective (every matmul and attention output kept, whether backward
  needs it or not; the rest recomputed one block at a time) / full
  (block inputs kept, one block recomputed); beside a block's backward, with or without
  checkpointing, the gradients of its widest activation (two of the block's largest saved
  tensor: the MLP's product's gradient and one factor's; ``activation_bytes``' workspace, the
  simulation's peak at Llama-3-8B with 105k tokens a rank); a pipeline's in-flight microbatches (1F1B: p on
  stage 0, p - r on rank r; gpipe: all m; interleaved: torch's warm-up forwards plus one, stage
  by stage).
- logits and loss: the saved log-softmax (fp32), the logits the forward returns, and one fp32
  gradient at the start of backward; with ``loss_chunk_tokens`` only one chunk's; under tp
  (a vocabulary-parallel loss) the local fp32 logits and one buffer of their size.
- the peak: gradients do not exist yet when backward starts (``zero_grad(set_to_none=True)``)
  and activations are freed as they appear, so the peak is parameters + optimizer state + the
  larger of two moments: backward's start (activations + the larger of logits and one block's
  recomputation) and its end (the gradients, with what the first block's backward, the step's
  last, holds beside them: that block's kept and recomputed activations, less its own gradients,
  made only then; ``MemTracker``'s per-module peaks put the ``tiny_full_w1`` leg's peak there,
  in block 0's MLP backward: ``scripts/bench_planner.py --legs tiny_full_w1 --peak-module``). With gradient
  accumulation the gradients of earlier micro-batches are there at the start of backward too.
  Checked against ``torch.distributed._tools.MemTracker`` by ``scripts/bench_planner.py``.
- overhead: a process's fixed memory, measured once per device type (``OVERHEAD``).
- adapter runs (frozen parameters: a LoRA base, frozen layers; :mod:`.frozen`): a frozen weight
  is held as stored (a bf16 base: 2 bytes), sharded or replicated as the strategy holds weights,
  with no gradient and no optimizer state; the trainable ones as above. Gathered units hold the
  frozen weights in the compute dtype (without mixed precision, in their own); DDP's buckets,
  no_sync's accumulators, the root's unsharded gradient and a tied head's second gradient count
  trainable parameters only; autocast copies no frozen weight already in the compute dtype.
  Activations need no assumption: the meta forward runs with the model's own ``requires_grad``,
  so what autograd saves is what backward needs (a frozen Linear whose weight makes no gradient
  keeps no input for it; the input gradients through frozen layers still need theirs). Under tp
  and pp a rank is assumed to hold the frozen share of the whole model among its parameters.
- QLoRA (``ModelFacts.quantize == "nf4"``, :mod:`.quantized`): the LoRA base weights the loader
  quantizes at the layout's dp_shard slices are held, sharded and gathered in NF4 bytes (4.127
  bits a parameter, from the inner tensors: ``element_size()`` says 2 or 4), never cast by mixed
  precision; one weight dequantized to the compute dtype (``dequant``) lies beside a block's
  backward (the step's end, a recomputation). Layouts the loader refuses (tp, pp, ep, zero1)
  raise here, as the loader would.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch

from ..config import ParallelConfig
from .experts import check_layout_ep, dispatch_buffer_bytes, moe_facts
from .profile import DTYPE_BYTES, ModelFacts
from .quantized import check_layout_quantize, dequant_workspace, nf4_share

GiB = 2**30
# RSS of one CPU process after `import torch, transformers, hf_scale` (llama modeling loaded) and a
# gloo process group of 1, measured on this machine (torch 2.13 CPU, transformers 5.23): 338-339 MiB
# in three runs. CUDA: the context and cuBLAS workspace, a usual ~0.5 GiB (not measured here).
OVERHEAD = {"cpu": 339 * 2**20, "cuda": 512 * 2**20}
TORCH_DTYPES = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes on each data-parallel rank."""

    seq: int  # tokens per sequence
    batch: int  # sequences per data-parallel rank per optimizer step
    attn: str = "sdpa"  # the attention implementation ("sdpa" or "eager")
    device: str = "cpu"
    # preference training with a frozen reference held beside the policy (``preference.reference:
    # model``): the bytes a reference parameter is stored in (its model.dtype: 4 fp32, 2 bf16); 0: none
    reference: int = 0


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel degrees and the knobs the chooser varies."""

    strategy: str = "fsdp"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ac: str | None = None
    precision: str | None = None
    cpu_offload: bool = False
    micro_batch: int = 1  # sequences per forward (gradient accumulation = batch / micro_batch)
    loss_chunk_tokens: int | None = None
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    blocks_per_unit: int = 1  # consecutive blocks per FSDP unit (fsdp, zero2, hsdp)
    prefetch: int | None = None  # FSDP units all-gathered ahead, explicitly (None: FSDP2's default)
    # expert parallel (MoE models): carved out of dp_shard, as ``ParallelDims`` does (each of ep
    # ranks holds 1/ep of the experts, FSDP-sharded over dp_shard / ep); not a factor of world_size
    ep: int = 1
    # when a pipeline stage under FSDP reduces its gradients (``ParallelConfig.pp_grad_sync``):
    # "last" (torch's: unsharded fp32 through the schedule) or "each" microbatch (kept sharded)
    pp_grad_sync: str = "last"
    # context parallel (:mod:`.context`): each sequence split over cp ranks, which share a batch
    # (not counted in ``dp``); FSDP shards over dp_shard x cp, DDP averages over dp_replicate x cp
    cp: int = 1
    cp_exchange: str = "allgather"
    cp_layout: str = "head_tail"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def parallel_config(self) -> ParallelConfig:
        """The ``ParallelConfig`` that runs this layout (raises its own error when invalid)."""
        extra = {}
        if self.strategy in ("fsdp", "zero2", "hsdp"):
            extra = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
            if self.blocks_per_unit > 1:
                extra["blocks_per_unit"] = self.blocks_per_unit
            if self.prefetch:
                extra["fsdp_prefetch"] = self.prefetch
            if self.pp > 1:
                extra["pp_grad_sync"] = self.pp_grad_sync
        if self.ep > 1:
            extra["ep"] = self.ep
        if self.cp > 1:
            extra.update(cp=self.cp, cp_exchange=self.cp_exchange, cp_layout=self.cp_layout)
        return ParallelConfig(
            strategy=self.strategy, mixed_precision=self.precision, cpu_offload=self.cpu_offload,
            activation_checkpointing=self.ac, tp=self.tp, pp=self.pp, pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches, loss_chunk_tokens=self.loss_chunk_tokens, **extra)

    def describe(self) -> str:
        mesh = f"{self.dp_replicate}x{self.dp_shard}x{self.tp}x{self.pp}"
        if self.cp > 1:  # cp=N and its exchange (and layout, when not the default head_tail)
            mesh += f" cp={self.cp} {self.cp_exchange}" + (f" {self.cp_layout}" if self.cp_layout != "head_tail" else "")
        bits = [self.strategy, mesh + (f" ep={self.ep}" if self.ep > 1 else ""), self.precision or "fp32", f"ac={self.ac or 'none'}",
                f"mb={self.micro_batch}"]
        if self.cpu_offload:
            bits.append("offload")
        if self.loss_chunk_tokens:
            bits.append(f"chunk={self.loss_chunk_tokens}")
        if self.blocks_per_unit > 1:
            bits.append(f"{self.blocks_per_unit}blk/unit")
        if self.prefetch:
            bits.append(f"prefetch={self.prefetch}")
        if self.pp > 1:  # the microbatch count when not the default (one per stage)
            bits.append(self.pp_schedule + (f" m={self.pp_microbatches}" if self.pp_microbatches else ""))
            if self.pp_grad_sync == "each":
                bits.append("grads=each")
        return " ".join(bits)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank, by what holds them; ``device_total`` is their peak together (not
    their sum: see the module doc). ``host`` is not device memory (offload)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    recompute: int  # one checkpointed block's activations rebuilt in backward
    logits_loss: int
    comm_buffers: int
    compute_copies: int
    overhead: int
    host: int = 0
    accumulating: bool = False  # gradient accumulation: gradients live through every backward
    grad_buffers: int = 0  # at backward's end: a tied weight's second gradient; FSDP's unsharded root gradient
    # units FSDP has prefetched in the second block unit's backward (FSDP2's default one, or an
    # explicit prefetch's; after the loss's gradients are freed: beside a recomputation, not the logits)
    prefetched: int = 0
    # beside a block's backward too (FSDP): the previous unit's reduce-scatter input (fp32, held
    # until the next reduce-scatter is issued) and the head's unsharded gradient (the compute
    # dtype's, autograd's: the root reduces it at the step's end), made before any block's backward
    reduce_buffer: int = 0
    head_grad: int = 0
    # in that second unit's backward too: the gradients autograd makes for its own parameters (the
    # compute dtype's, unsharded, until its reduce-scatter copies them) and the first unit's
    # sharded gradient (its reduce-scatter's output); and the first unit's kept activations, freed
    # by its backward (the simulation's peak of Llama-3-70B at fsdp 32 x tp 2 lies there: after
    # the MLP's weight gradients of block 78 of 80 are made)
    unit_grads: int = 0
    unit_freed: int = 0
    # the first block's backward, the step's last: its kept and recomputed activations beside every
    # later block's gradient, less its own gradients, not made yet (not under accumulation: there
    # ``backward`` holds both)
    first_block: int = 0
    # pp_grad_sync="each": every microbatch's backward ends as a step's does (its root unit's
    # gradient unsharded, the first block's backward, beside the sharded gradients), also when
    # later forwards follow, and beside the other in-flight microbatches' activations
    sync_each: bool = False
    others_in_flight: int = 0
    # under pp: of the rank's in-flight activations, those held only until its first backward (the
    # earlier microbatches' backward frees them before a later one, beside the gradients, runs:
    # ``activations`` are a later microbatch's); the stage root's fp32 reduce-scatter input of the
    # previous microbatch (pp_grad_sync="each"), held beside a later microbatch's forward and its
    # first unit's backward; and (pp_grad_sync="last") of ``comm_buffers``, the stage's parameters
    # gathered by backward beyond its root and one unit, there only until the next forward
    first_microbatch: int = 0
    root_reduce: int = 0
    regathered: int = 0
    # QLoRA: one NF4 weight dequantized to the compute dtype inside its matmul (forward, backward,
    # recomputation), beside a block's backward; and, of ``params``, the bytes held in NF4 (not
    # added to the total: already in ``params``)
    dequant: int = 0
    nf4_params: int = 0
    # a held preference reference (``Workload.reference``): its shards (or whole replica), always
    # there; and what its no-grad forward adds before the policy's (its gathered root and unit, its
    # logits and log-probs), beside the policy's parameters and optimizer state only
    reference: int = 0
    reference_forward: int = 0
    # of ``grads``, the bytes that are views into ``comm_buffers`` (DDP's buckets under
    # ``gradient_as_bucket_view``): held all along in the buffers, not added again
    bucket_grads: int = 0
    # of ``comm_buffers``, the bytes that are gradients (DDP's buckets, no_sync's unsharded fp32
    # accumulators, a pipeline stage's unsharded gradients): counted as gradients by :meth:`categories`
    held_grads: int = 0
    # of ``logits_loss``, the bytes backward makes (the loss's fp32 gradient; a chunked loss's
    # recomputed chunk and its gradients; tp's exp / gradient buffer): temporaries, not activations
    logits_temp: int = 0
    # of ``first_block``, the block's kept activations (the rest its recomputation: temporaries)
    first_block_kept: int = 0

    @property
    def device_total(self) -> int:
        """What the accelerator (or, on CPU, the process) must hold at the peak."""
        grads = self.grads - self.bucket_grads
        backward = (self.activations + max(self._loss, self.recompute + self.prefetched + self.dequant
                                           + self.reduce_buffer + self.head_grad + self.unit_grads - self.unit_freed)
                    + max((grads if self.accumulating else 0) + self.root_reduce, self.first_microbatch)
                    - self.regathered)
        late = 0 if self.accumulating and not self.sync_each else (
            grads + self.grad_buffers + self.first_block + self.others_in_flight + self.dequant)
        policy = self.comm_buffers + self.compute_copies + max(backward, late)
        before = self.reference_forward + (grads if self.accumulating else 0) if self.reference_forward else 0
        return self.overhead + self.params + self.optimizer + self.reference + max(policy, before)

    @property
    def _loss(self) -> int:
        """The loss's moment beyond the activations: the logits and loss, and under pp_grad_sync="each"
        a unit more gathered (the simulation of Llama-3-70B at pp=4 gathers the root and two block
        units while the last stage's loss runs)."""
        return self.logits_loss + (self.prefetched if self.sync_each and self.logits_loss else 0)

    def categories(self) -> dict[str, int]:
        """The device total less the overhead at its peak, split as the simulation splits its tracked
        peak (docs/planner.md, "Categories"): ``params`` (the parameters held between steps: FSDP's
        shards, DDP's replicas, a held reference), ``grads`` (every gradient's storage: sharded,
        unsharded, accumulating, DDP's buckets), ``optimizer``, ``activations`` (what forward makes
        and keeps: saved tensors, the logits, autocast's weight copies) and ``buffers`` (buffers and
        temporaries: gathered parameter copies, communication buffers, what backward makes that is
        not a gradient: recomputation, the loss's gradient, a dequantized weight). Their sum is
        ``device_total - overhead``; the moment is the one :attr:`device_total` takes (module doc)."""
        grads = self.grads - self.bucket_grads
        held = {"params": self.params + self.reference, "optimizer": self.optimizer}
        gathered = self.comm_buffers - self.held_grads
        extra = self.recompute + self.prefetched + self.dequant + self.reduce_buffer
        logits = self._loss >= extra + self.head_grad + self.unit_grads - self.unit_freed
        later = (grads if self.accumulating else 0) + self.root_reduce >= self.first_microbatch
        backward = {"grads": self.held_grads + (grads if self.accumulating and later else 0)
                    + (0 if logits else self.head_grad + self.unit_grads),
                    "activations": self.compute_copies + self.activations + (0 if later else self.first_microbatch)
                    + (self.logits_loss - self.logits_temp if logits else -self.unit_freed),
                    "buffers": gathered - self.regathered + (self.root_reduce if later else 0)
                    + (self.logits_temp + self._loss - self.logits_loss if logits else extra)}
        kept = min(self.first_block, self.first_block_kept)
        late = {"grads": self.held_grads + grads + self.grad_buffers,
                "activations": self.compute_copies + self.others_in_flight + kept,
                "buffers": gathered + self.first_block - kept + self.dequant}
        if self.accumulating and not self.sync_each:
            late = {k: self.held_grads if k == "grads" else 0 for k in late}
        policy = max(backward, late, key=lambda c: sum(c.values()))
        if self.reference_forward:
            before = {"grads": grads if self.accumulating else 0, "activations": self.reference_forward,
                      "buffers": 0}
            policy = policy if sum(policy.values()) >= sum(before.values()) else before
        return held | policy

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)} | {"device_total": self.device_total}


def rank_params(facts: ModelFacts, layout: Layout) -> int:
    """Parameters one rank holds before data-parallel sharding (its tp shards, its pp stages)."""
    return facts.cached(("rank_params", layout.tp, layout.pp, layout.pp_schedule),
                        lambda: _rank_params(facts, layout))


def _rank_params(facts: ModelFacts, layout: Layout) -> int:
    from ..layout_preview import tp_report

    params = facts.params
    if layout.tp > 1:
        params = tp_report(facts.model, facts.plan, layout.tp)["params_per_rank"]
    if layout.pp > 1:
        params = params * max(pp_rank_params(facts, layout)) // facts.params
    return params


def pp_share(facts: ModelFacts, layout: Layout) -> float:
    """The busiest pp rank's share of the model's parameters (1 without pp)."""
    return max(pp_rank_params(facts, layout)) / facts.params if layout.pp > 1 else 1.0


def pp_stages(facts: ModelFacts, layout: Layout) -> dict:
    """``plan_report.pp_report`` for the layout's pipeline, once per pp degree and schedule (the
    schedule sets the stages per rank): read its ``stages`` and ``rank_params``, which do not
    depend on the microbatch count."""
    from ..layout_preview import pp_report

    return facts.cached(("pp_report", layout.pp, layout.pp_schedule),
                        lambda: pp_report(facts.model, facts.plan, _pp_config(layout)))


def pp_rank_params(facts: ModelFacts, layout: Layout) -> list[int]:
    """Parameters on each pp rank, before tp and data-parallel sharding."""
    return pp_stages(facts, layout)["rank_params"]


def stage_root_params(facts: ModelFacts, layout: Layout) -> list[int]:
    """Of each pp rank's parameters (before tp and data-parallel sharding), those outside its
    blocks: its stages' part of the model's root (embeddings on the first, final norm and head on
    the last, a tied weight on both), the root unit FSDP gathers and reduces on that rank."""
    stages = pp_stages(facts, layout)["stages"]
    return [sum(st["params"] - sum(facts.block_params[b] for b in st["blocks"]) for st in stages if st["rank"] == r)
            for r in range(layout.pp)]


def moe_layers_per_pp_rank(facts: ModelFacts, layout: Layout) -> list[int]:
    """The MoE layers (blocks holding routed experts) on each pp rank: its stages' own; one
    entry, every MoE layer, without pp; zeros for a dense model."""
    from ..layout_preview import moe_layers_per_rank

    moe = moe_facts(facts)
    if moe is None:
        return [0] * layout.pp
    if layout.pp == 1:
        return [moe.moe_layers]
    return moe_layers_per_rank(moe.blocks, pp_stages(facts, layout)["stages"])


def rank_moe_layers(facts: ModelFacts, layout: Layout) -> int:
    """MoE layers on the rank :func:`rank_params` describes (under pp the one with the most
    parameters; every MoE layer without pp)."""
    layers = moe_layers_per_pp_rank(facts, layout)
    if layout.pp == 1:
        return layers[0]
    counts = pp_rank_params(facts, layout)
    return layers[counts.index(max(counts))]


def rank_blocks(facts: ModelFacts, layout: Layout) -> int:
    """Blocks on the first pp rank (every block without pp)."""
    return pipeline_shape(facts, layout)[0][0]


def unit_blocks(facts: ModelFacts, layout: Layout) -> int:
    """Blocks in the largest FSDP unit: ``blocks_per_unit``, at most the blocks on the rank."""
    return min(layout.blocks_per_unit, rank_blocks(facts, layout))


def fsdp_units(facts: ModelFacts, layout: Layout) -> int:
    """FSDP units on the rank: its blocks in groups of ``blocks_per_unit``, plus the root."""
    return -(-rank_blocks(facts, layout) // layout.blocks_per_unit) + 1


def _pp_config(layout: Layout) -> ParallelConfig:
    return ParallelConfig(strategy="fsdp", pp=layout.pp, pp_schedule=layout.pp_schedule,
                          pp_microbatches=layout.pp_microbatches)


def pipeline_shape(facts: ModelFacts, layout: Layout) -> tuple[list[int], list[float], int]:
    """Blocks per pp rank, in-flight microbatches per pp rank (in units of the rank's blocks:
    interleaved schedules hold some stages' microbatches more than others'), and the microbatch
    count."""
    if layout.pp == 1:
        return [facts.layers], [1], 1
    return facts.cached(("pipeline", layout.pp, layout.pp_schedule, layout.pp_microbatches),
                        lambda: _pipeline_shape(facts, layout))


def _pipeline_shape(facts: ModelFacts, layout: Layout) -> tuple[list[int], list[float], int]:
    from ..model_plans.pp import pp_layout

    cfg = _pp_config(layout)
    pl = pp_layout(facts.model, facts.plan, layout.pp, cfg.stages_per_rank, layout.pp_schedule == "zbv")
    m = layout.pp_microbatches or pl.num_stages
    blocks = [sum(len(pl.stage_blocks[s]) for s in pl.stages_of(r)) for r in range(layout.pp)]
    if layout.pp_schedule == "gpipe":
        inflight = [m] * layout.pp
    elif layout.pp_schedule in _INTERLEAVED_WARMUP:
        inflight = [_interleaved_inflight(pl, r, m, layout.pp, _INTERLEAVED_WARMUP[layout.pp_schedule])
                    for r in range(layout.pp)]
    else:  # 1F1B and zbv: warm-up depth p - r
        inflight = [min(m, layout.pp - r) for r in range(layout.pp)]
    return blocks, inflight, m


# torch's interleaved schedules: warm-up forwards grow by this many per hop from the last rank
_INTERLEAVED_WARMUP = {"interleaved_1f1b": 2, "zero_bubble": 1}


def _interleaved_inflight(pl, rank: int, m: int, pp: int, factor: int) -> float:
    """Microbatches in flight on ``rank`` at its first backward under torch's interleaved
    schedules, in units of all the rank's blocks: its warm-up forwards (torch's
    ``_get_warmup_ops``: ``(v - 1) x per_round + factor x (pp - 1 - rank)``) and the first
    steady-state forward, each counted by the blocks of the stage it runs (op ``i`` runs local
    stage ``(i // per_round) % v``). E.g. pp=2, 2 stages per rank, 4 microbatches: rank 0 holds
    3 microbatches of its first stage and 2 of its second, 2.5 where 1F1B's ``p - r`` gives 2."""
    stages = pl.stages_of(rank)
    v = len(stages)
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    peak = min(warmup + 1, m * v)
    held = sum(len(pl.stage_blocks[stages[(op // per_round) % v]]) for op in range(peak))
    return held / sum(len(pl.stage_blocks[s]) for s in stages)


def estimate_memory(facts: ModelFacts, layout: Layout, work: Workload, pp_rank: int | None = None) -> MemoryEstimate:
    """Peak per-rank memory of one training step of ``work`` under ``layout``: of the busiest pp
    rank, or of ``pp_rank`` when given (its stages' parameters, in-flight microbatches, and the
    logits and loss on the last stage's rank only)."""
    if layout.cp > 1:
        return _estimate_cp(facts, layout, work, pp_rank)
    check_layout_ep(facts, layout.ep)  # the engine's refusal (a dense model, experts ep does not divide)
    check_layout_quantize(facts, layout)  # NF4 bases: fsdp, zero2, hsdp or ddp; tp or pp under fsdp / zero2
    d = DTYPE_BYTES[layout.precision]
    params = rank_params(facts, layout)
    frac = params / facts.params  # this rank's share of every part (tp and pp)
    frozen = facts.frozen_params * frac  # frozen weights on this rank (0 for a full fine-tune)
    train = params - frozen
    fb = facts.frozen_bytes  # a frozen weight's bytes as stored (bf16: 2)
    sharded = layout.strategy in ("fsdp", "zero2", "hsdp")
    n = layout.dp_shard if sharded else 1
    # QLoRA: the base weights the loader quantizes at this layout's dim-0 slices, in NF4 bytes
    nf4 = nf4_share(facts, n if layout.world_size > 1 else 1, layout.tp, pp_share(facts, layout))  # this rank's
    nf4_held = nf4.nf4_bytes // n if nf4 else 0
    replicated = layout.strategy in ("ddp", "zero1")
    # cpu_offload: parameters, sharded gradients and optimizer state in host memory; on a CPU device
    # the host memory is the device's, where they stay counted
    offloaded = layout.cpu_offload and work.device != "cpu"
    # ddp + ep: the dense weights replicated, each rank its 1/ep of the experts (FSDP-sharded over the
    # replicas holding the same ones where ep is fewer), which DDP's buckets leave out
    ddp_ep = moe_facts(facts) if replicated and layout.ep > 1 else None
    # held between steps: 1/ep, FSDP-sharded over the dp_replicate / ep replicas holding the same ones
    r_away, r_away_frozen = _experts_not_held(ddp_ep, 1 / layout.dp_replicate, frac)
    own_experts = ddp_ep.trainable_expert_params * frac / layout.dp_replicate if ddp_ep else 0.0
    train, frozen = train - (r_away - r_away_frozen), frozen - r_away_frozen
    # trainable: an fp32 master weight, its fp32 gradient, AdamW's two fp32 moments; frozen: the weight only
    p_bytes, g_bytes = int(4 * train + fb * frozen - (nf4.saved_bytes if nf4 else 0)) // n, int(4 * train) // n
    opt_bytes = int(8 * train) // (layout.dp if layout.strategy == "zero1" else n)

    def gathered(count: float, frozen_count: float, nf4_count: float = 0) -> float:
        """Bytes of ``count`` parameters all-gathered for compute: in the compute dtype; a frozen
        one without mixed precision in its own (FSDP2 casts only under a ``MixedPrecisionPolicy``);
        ``nf4_count`` of the frozen ones in NF4 bytes (their all-gather hooks never cast)."""
        plain = (count - frozen_count) * d + (frozen_count - nf4_count) * (d if layout.precision else fb)
        return plain + (nf4_count * nf4.bytes_per_element if nf4_count else 0)

    biggest, biggest_frozen = facts.largest_block()
    scale = frac if layout.pp == 1 else 1 / layout.tp
    block, block_frozen = biggest * scale, biggest_frozen * scale
    root, root_frozen = facts.root_params * scale, facts.root_frozen * scale
    # expert parallel: a layer gathers at most its 1/ep share of the experts (the rest live on other ranks)
    away, away_frozen, moe_layers = _experts_elsewhere(facts, layout, scale)
    in_unit = away if _largest_holds_experts(facts) else 0.0  # a dense largest block gathers no experts
    in_unit_frozen = away_frozen if in_unit else 0.0
    comm = compute = prefetched = bucket_grads = held = reduce_buffer = unit_grads = freed_units = 0  # held: of comm, gradient storage
    unit_train = 0.0  # the largest unit's trainable parameters (FSDP)
    # under pp each rank holds its own stages' state: ``shares`` of the largest pp rank's parameters
    shares = _pp_rank_shares(facts, layout)
    staged = [0] * len(shares)  # a pipeline stage's gathered parameters and unsharded gradients, per pp rank
    staged_grads = [0] * len(shares)  # of them, the gradients
    if sharded and layout.dp_shard * layout.dp_replicate > 1:
        # the root and the largest unit (blocks_per_unit blocks) gathered at once
        unit = unit_blocks(facts, layout) * gathered(block - in_unit, block_frozen - in_unit_frozen,
                                                     nf4.blocks[facts.largest_block_index()] if nf4 else 0)
        everything = (gathered(params, frozen, nf4.params if nf4 else 0)  # zero2: every block
                      - moe_layers * gathered(away, away_frozen))
        # unsharded fp32 gradients of every trainable parameter the rank's FSDP units hold (not the
        # experts other ep ranks hold: no gradient here; nor its own whole experts, kept out of FSDP)
        unsharded = 4 * (train - moe_layers * (away - away_frozen))
        comm = int(everything if layout.strategy == "zero2" else gathered(root, root_frozen, nf4.root if nf4 else 0)
                   + unit)
        # the second block unit's backward (the simulation's peak of Llama-3-70B at fsdp 32 x tp 2,
        # selective checkpointing): the first one's reduce-scatter input, in fp32, held until this
        # one's reduce-scatter is issued, and the units prefetched for the next ones (FSDP2's
        # default: one; an explicit prefetch: that many) where the rank has them
        units = fsdp_units(facts, layout) - 1  # block units on the rank
        if layout.strategy != "zero2":
            prefetched = int(max(0, min(layout.prefetch or 1, units - 2)) * unit)
        if units > 1:
            unit_train = unit_blocks(facts, layout) * (block - in_unit - block_frozen + in_unit_frozen)
            reduce_buffer = int(4 * unit_train)
        if units > 2:  # with two, the second unit's backward is the step's last: ``first_block``'s moment
            # (its sharded gradient on the host when offloaded)
            unit_grads = int(d * unit_train + (0 if offloaded else 4 * unit_train / n))
            freed_units = unit_blocks(facts, layout)
        if work.batch > layout.micro_batch:  # no_sync: unsharded fp32 gradients accumulate
            comm += int(unsharded)
            held = int(unsharded)
        if layout.pp > 1 and layout.pp_grad_sync != "each":
            # torch's PipelineStage runs each microbatch's backward on an FSDP stage with resharding
            # and gradient reduction off (reshard_after_backward, requires_gradient_sync), and reduces
            # once after the last (perform_reduce_grad): by then the stage holds every parameter
            # gathered in the compute dtype and every gradient unsharded in fp32 (the simulation
            # of Llama-3-70B at pp=4 shows it: 122 GiB on stage 0, where 32 GiB were estimated);
            # of each rank's own parameters, less the experts of its own MoE layers other ep ranks hold.
            # pp_grad_sync="each" (hf_scale.parallel.pp_grads) reduce-scatters and reshards after
            # every microbatch's backward: the stage is then held as without pp, its sharded
            # gradients accumulating beside later microbatches' activations (``piped`` below)
            staged = [int(gathered(params * s, frozen * s) + 4 * train * s
                          - layers * (gathered(away, away_frozen) + 4 * (away - away_frozen)))
                      for s, layers in zip(shares, moe_layers_per_pp_rank(facts, layout))]
            staged_grads = [int(4 * train * s - layers * 4 * (away - away_frozen))
                            for s, layers in zip(shares, moe_layers_per_pp_rank(facts, layout))]
            prefetched = reduce_buffer = unit_grads = freed_units = 0
    elif replicated and layout.dp > 1:
        # DDP's gradient buckets (trainable, not ep's experts), held from the first backward on; the
        # gradients are views into them (``gradient_as_bucket_view``), no second copy
        comm = bucket_grads = held = int(4 * (train - own_experts))
        if r_away and layout.dp_replicate > layout.ep:  # experts FSDP-sharded over the replicas holding
            # the same ones: one MoE layer's 1/ep gathered in fp32, and its gradient before the reduce-scatter
            comm += int(2 * 4 * ddp_ep.layer_params / layout.ep * frac)
    if (replicated or layout.dp == 1) and layout.precision:
        # autocast: low-precision copies of the matmul weights saved for backward (this rank's
        # experts only under ddp + ep); a frozen weight already stored in the compute dtype is used as it is
        # (an NF4 weight never: ``LinearNF4`` saves the NF4 weight and dequantizes it again in backward)
        copied = facts.trainable_matmul_params + (facts.matmul_params - facts.trainable_matmul_params
                                                  - (nf4.params if nf4 else 0) if fb != d else 0)
        # (its 1/ep of the experts, gathered whole by FSDP where ep is fewer than the replicas)
        c_away, c_frozen = _experts_not_held(ddp_ep, 1 / layout.ep, frac)
        compute = int(copied * frac * d - (c_away - c_frozen) * d - (c_frozen * d if fb != d else 0))
    # the busiest pp rank is the one whose state and activations together are the largest (the one
    # with the most parameters may hold fewer activations), a pipeline stage's ``staged`` included
    acts = activation_bytes(facts, layout, work, [(p_bytes + g_bytes + opt_bytes) * s + st
                                                  for s, st in zip(shares, staged)], pp_rank)
    p_bytes, g_bytes, opt_bytes = (int(x * shares[acts.rank]) for x in (p_bytes, g_bytes, opt_bytes))
    staged_here = staged[acts.rank] > 0
    _, inflight, microbatches = pipeline_shape(facts, layout)
    # pp_grad_sync="each" with several microbatches: a later microbatch's forward and backward run
    # beside the sharded gradients of the earlier ones and the stage root's fp32 reduce-scatter
    # input of the previous one (FSDP holds it until the next unit's reduce-scatter: through the
    # next forward, its loss and its first unit's backward; ``root_reduce``)
    each = layout.pp > 1 and layout.pp_grad_sync == "each" and sharded and layout.dp > 1
    later = each and microbatches > 1
    root_reduce = 0
    if layout.pp > 1:
        # a stage's root unit holds its own stage's part of the model's root only: the embeddings on
        # the first, the final norm and the head on the last, nothing on a middle one (the
        # simulation of Llama-3-70B at pp=4 gathers, reduces and keeps those, not the whole root)
        own = stage_root_params(facts, layout)[acts.rank] * scale
        part = own / root if root else 0.0
        if sharded and layout.dp > 1 and layout.strategy != "zero2":
            nf4_root = nf4.root if nf4 else 0
            comm += int(gathered(own, root_frozen * part, nf4_root * part) - gathered(root, root_frozen, nf4_root))
        root, root_frozen = own, root_frozen * part
        if later:
            root_reduce = int(4 * (root - root_frozen))
            # the top unit's backward holds the root's buffer, the next unit's backward this unit's
            reduce_buffer = max(0, reduce_buffer - root_reduce)
            # the sharded gradients are already there (``grads``): the unit's own, unsharded only,
            # the whole unit's, in the stage's first (top) unit, where nothing is freed yet
            unit_grads = int(d * unit_train) if reduce_buffer or root_reduce else 0
            freed_units = 0
    if staged_here:
        # pp_grad_sync="last": the stage is gathered whole and its gradients unsharded only from a
        # microbatch's backward to the next forward (which reshards each unit again): the root and
        # one unit gathered beside a forward's loss (``regathered``: the rest, at the backward's end)
        regathered = max(0, staged[acts.rank] - staged_grads[acts.rank] - comm)
        comm, held = staged[acts.rank], staged_grads[acts.rank]
    else:
        regathered = 0
    # FSDP: the head's unsharded gradient (trainable, on the rank that runs it, not a stage holding
    # every gradient unsharded anyway) in a block's backward, before the root reduces it
    head_rank = 0 if layout.pp_schedule == "zbv" else layout.pp - 1
    trains_head = not (facts.frozen and facts.frozen.head)
    head_grad = int(facts.head_params * scale * d) if (
        sharded and layout.dp > 1 and trains_head and acts.rank == head_rank and not staged[acts.rank]) else 0
    # The last of backward: a tied weight's two uses each make a gradient, summed into one (one
    # more copy, unsharded); FSDP computes the root unit's gradient unsharded, in fp32, before
    # its reduce-scatter. (Under pp the tied ends sit on two stages.) Frozen weights make none.
    tied = 4 * facts.tied_trainable * frac if layout.pp == 1 else 0
    # (a pp_grad_sync="last" stage holds its root's fp32 gradient among its unsharded ones)
    buffers = int(tied + (4 * (root - root_frozen) if sharded and layout.dp > 1 and not staged_here else 0))
    host = 0
    if offloaded:
        host, p_bytes, g_bytes, opt_bytes = p_bytes + g_bytes + opt_bytes, 0, 0, 0
    # a pipeline whose microbatches outnumber the busiest rank's in-flight ones runs forwards after
    # its first backward: the gradients then lie beside in-flight activations, as under accumulation
    # (not a pp_grad_sync="last" stage's sharded gradients: made by the reduction after the last)
    piped = layout.pp > 1 and microbatches > max(inflight) and not staged_here
    # a pipeline stage under FSDP ends each microbatch's backward as a step's (``sync_each``): its
    # root unit's gradient unsharded (each) or every gradient and parameter unsharded (last), the
    # first block's backward, beside the others in flight (gpipe / 1f1b: all but this one) and
    # the stage's receive buffers (``Activations.others``)
    ends_each = each or staged_here
    others = acts.others if ends_each else 0
    # the first block's backward adds its activations (kept, recomputed) to the step's end, less
    # its own gradients, made only then (on the device only if the gradients are there)
    # (under ddp + ep of its own experts only)
    made = block - block_frozen - ((in_unit - in_unit_frozen) if r_away else 0)
    bucket_grads = min(bucket_grads, g_bytes)
    first_block = max(0, acts.first_block - (4 * int(made) // n if g_bytes > bucket_grads else 0))
    # ep: one MoE layer's all-to-all token buffers (sent and received rows) beside the saved
    # activations, of one pipeline microbatch under pp (none on a rank whose stages hold no MoE layer)
    moe_here = layout.ep > 1 and moe_layers_per_pp_rank(facts, layout)[acts.rank] > 0
    exchange = dispatch_buffer_bytes(facts, layout.micro_batch * work.seq // microbatches, d) if moe_here else 0
    reference, reference_forward = _reference_bytes(work.reference, params * shares[acts.rank], n, layout, d,
                                                    gathered_root=(root + block * unit_blocks(facts, layout)),
                                                    logits=acts.logits_loss)
    return MemoryEstimate(params=p_bytes, grads=g_bytes, optimizer=opt_bytes, activations=acts.saved + exchange,
                          first_microbatch=acts.first_extra, root_reduce=root_reduce, regathered=regathered,
                          recompute=acts.recompute, logits_loss=acts.logits_loss, comm_buffers=comm, compute_copies=compute,
                          overhead=OVERHEAD.get(work.device, OVERHEAD["cuda"]), host=host,
                          accumulating=work.batch > layout.micro_batch or piped or later, grad_buffers=buffers,
                          prefetched=prefetched, reduce_buffer=reduce_buffer, head_grad=head_grad,
                          unit_grads=unit_grads, unit_freed=freed_units * acts.first_block_kept,
                          first_block=first_block, sync_each=ends_each,
                          others_in_flight=others, dequant=dequant_workspace(nf4, d),
                          nf4_params=0 if host else nf4_held, reference=reference,
                          reference_forward=reference_forward, bucket_grads=bucket_grads, held_grads=held,
                          logits_temp=acts.logits_temp if acts.logits_loss else 0,
                          first_block_kept=acts.first_block_kept)


def _estimate_cp(facts: ModelFacts, layout: Layout, work: Workload, pp_rank: int | None) -> MemoryEstimate:
    """Under context parallel (:mod:`.context`): the layout with cp folded into the data-parallel
    degree on ``S/cp``-token sequences, plus the attention's own terms: kept per layer (every
    layer without checkpointing, the recomputed one under full), while a layer runs (beside the
    recomputation and the first block's backward), and held through the step."""
    from .context import attention_bytes, flat_layout, local_work

    base = estimate_memory(facts, flat_layout(layout), local_work(work, layout), pp_rank)
    extra = attention_bytes(facts, layout, work)
    every = extra.kept * rank_blocks(facts, layout) if layout.ac != "full" else 0
    one = extra.running + (extra.kept if layout.ac == "full" else 0)
    return replace(base, activations=base.activations + every + extra.held, recompute=base.recompute + one,
                   first_block=base.first_block + one)


def _reference_bytes(stored: int, params: float, n: int, layout: Layout, d: int, gathered_root: float,
                     logits: int) -> tuple[int, int]:
    """(held, forward) bytes of a preference reference stored in ``stored`` bytes a parameter, a
    copy of the rank's ``params`` (:func:`hf_scale.train.model.load_reference`): under fsdp / zero2
    / hsdp sharded over the ``n`` dp_shard ranks as the policy (tp slices under tp), a whole replica
    under ddp / zero1. Its no-grad forward gathers the root and one unit at a time (in the compute
    dtype ``d`` under mixed precision, else as stored; ``gathered_root``: their parameters) and makes
    the logits and log-probs of the batch (``logits``, the policy's own logits-and-loss bytes: its
    rows are the same)."""
    if not stored:
        return 0, 0
    gathered = gathered_root * (d if layout.precision else stored) if n > 1 else 0
    return int(stored * params) // n, int(gathered + logits)


def estimate_stages(facts: ModelFacts, layout: Layout, work: Workload) -> list[MemoryEstimate]:
    """:func:`estimate_memory` of each pp rank in turn (one estimate without pp): the first holds
    the embeddings and the most in-flight microbatches, the last the head, the logits and the loss."""
    if layout.pp == 1:
        return [estimate_memory(facts, layout, work)]
    return [estimate_memory(facts, layout, work, r) for r in range(layout.pp)]


def _experts_elsewhere(facts: ModelFacts, layout: Layout, scale: float) -> tuple[float, float, int]:
    """Under ep: one MoE layer's expert parameters this rank's FSDP unit does not gather, at this
    rank's tp / pp ``scale``: those the other ep ranks hold (``1 - 1/ep`` of them), or all of
    them when no other data-parallel rank holds this rank's experts (ep = dp_shard, no
    dp_replicate; no mixed precision, no cpu offload: ``apply_fsdp`` then leaves them out of
    FSDP); of them the frozen ones, and the MoE layers on the rank (its stages' under pp); zeros
    without ep."""
    moe = moe_facts(facts) if layout.ep > 1 else None
    if moe is None:
        return 0.0, 0.0, 0
    whole = (layout.dp_shard == layout.ep and layout.dp_replicate == 1 and not layout.precision
             and not layout.cpu_offload)
    away = moe.layer_params * (1 if whole else 1 - 1 / layout.ep) * scale
    return away, away * moe.frozen_fraction, rank_moe_layers(facts, layout)


def _experts_not_held(moe, held: float, frac: float) -> tuple[float, float]:
    """Under ddp + ep: the expert parameters (every MoE layer's) outside this rank's ``held``
    share of them, at its tp / pp share ``frac``, and of them the frozen ones; zeros without
    experts (``moe`` None)."""
    if moe is None:
        return 0.0, 0.0
    away = moe.expert_params * (1 - held) * frac
    return away, away * moe.frozen_fraction


def _largest_holds_experts(facts: ModelFacts) -> bool:
    """Whether the largest block (the gathered unit's size) is a MoE layer."""
    moe = moe_facts(facts)
    i = max(range(len(facts.block_params)), key=facts.block_params.__getitem__)
    return moe is not None and i in moe.blocks


class Activations(NamedTuple):
    """The busiest rank's activation bytes (``activation_bytes``)."""

    saved: int  # every block's saved activations
    recompute: int  # one block's recomputation in backward
    logits_loss: int  # the logits and the loss (0 unless the rank runs the head)
    rank: int  # the pp rank (0 without pp)
    first_block: int  # the first block's kept and recomputed activations, at its backward
    logits_temp: int = 0  # of logits_loss (on the last stage), what backward makes: temporaries
    first_block_kept: int = 0  # of first_block, the kept activations
    first_extra: int = 0  # under pp: in flight at the first backward only (of no later one)
    others: int = 0  # under pp: at a microbatch's backward end, the other in-flight ones and receive buffers


def activation_bytes(facts: ModelFacts, layout: Layout, work: Workload,
                     state: list[float] | None = None, pp_rank: int | None = None) -> Activations:
    """Activation bytes of the busiest rank: the one whose ``state[rank]`` bytes (parameters,
    gradients and optimizer state; none when not given) and activations add up to the most; or of
    pp rank ``pp_rank`` when given. The recomputation starts once the loss's gradients are freed,
    so the two never add."""
    prof = facts.profile(work.seq, TORCH_DTYPES[layout.precision], work.attn)
    t = layout.tp
    if layout.pp > 1:
        seqs = layout.micro_batch / (layout.pp_microbatches or pipeline_shape(facts, layout)[2])
    else:
        seqs = layout.micro_batch

    def tp_split(total: int, residual: int) -> float:
        return residual + (total - residual) / t

    full_block = tp_split(prof.block_bytes, prof.block_residual)
    # a block's backward makes, beside what it saved, the gradients of its widest activation: the
    # MLP's output gradient and one of its factors' (two tensors of the block's largest saved one)
    largest = prof.block_largest / (1 if prof.block_largest_residual else t)
    workspace = 2 * largest
    if layout.ac is None:
        kept = full_block
        recompute = workspace
    elif layout.ac == "selective":  # every matmul / attention output kept, saved for backward or not
        kept = prof.block_input + tp_split(prof.block_kept, prof.block_kept_residual)
        recompute = full_block - prof.block_input - prof.block_saved_kept / t + workspace
    else:
        kept = prof.block_input
        recompute = full_block + workspace
    blocks, inflight, microbatches = pipeline_shape(facts, layout)
    per_rank = [blk * kept * f * seqs for blk, f in zip(blocks, inflight)]
    vocab_tokens = work.seq * seqs * facts.vocab / t
    d = DTYPE_BYTES[layout.precision]
    if layout.loss_chunk_tokens:
        chunk = min(layout.loss_chunk_tokens, work.seq * seqs) * facts.vocab / t
        # a chunk's logits and log-softmax (fp32), recomputed in backward, with their two gradients
        logits = chunk * (2 * d + 16) + prof.outside * seqs
        temp = chunk * (2 * d + 16)  # all of the chunk's made in backward
    elif t > 1:  # vocabulary-parallel loss: the local fp32 logits and one buffer (exp, then the gradient)
        logits = vocab_tokens * 8 + prof.outside * seqs
        temp = vocab_tokens * 4  # the buffer
    else:  # saved log-softmax + the returned logits + one fp32 gradient at backward's start
        logits = prof.logits * seqs + vocab_tokens * (d + 4) + prof.outside * seqs
        temp = vocab_tokens * 4  # the gradient
    if layout.pp > 1 and layout.pp_schedule == "gpipe":
        logits += prof.logits / t * seqs * (inflight[-1] - 1)
    # under pp the logits live on the last stage's rank only (rank 0 in a V: zbv folds the last
    # stage back onto it): the busiest rank is the larger of the two
    last = 0 if layout.pp_schedule == "zbv" else len(per_rank) - 1
    state = state or [0.0] * len(per_rank)
    busiest = pp_rank if pp_rank is not None else max(range(len(per_rank)), key=lambda r: state[r] + per_rank[r] + (
        max(logits, recompute * seqs) if r == last else recompute * seqs))
    saved, first_extra = per_rank[busiest], 0.0
    others = saved * (1 - 1 / inflight[busiest]) if inflight[busiest] > 1 else 0.0
    if layout.pp > 1 and layout.pp_schedule in ("1f1b", "gpipe"):
        saved, first_extra, others = _stage_microbatches(prof.block_input * seqs, kept * seqs, blocks[busiest],
                                                         inflight[busiest], microbatches, busiest, layout.pp)
    # under pp the stage returns the loss, not the logits: the loss's forward (the logits, their
    # fp32 copy and log-softmax together) is the moment, all of it forward's (no temporaries)
    return Activations(saved=int(saved), recompute=int(recompute * seqs),
                       logits_loss=int(logits if busiest == last else 0), rank=busiest,
                       first_block=int((kept + recompute) * seqs),
                       logits_temp=int(temp if busiest == last and layout.pp == 1 else 0),
                       first_block_kept=int(kept * seqs), first_extra=int(first_extra), others=int(others))


def _stage_microbatches(hidden: float, kept: float, blocks: int, inflight: float, m: int, rank: int,
                        pp: int) -> tuple[float, float, float]:
    """A 1F1B or GPipe stage's activations (one stage per rank; ``hidden``: one stage boundary
    tensor, ``kept``: one block's kept activations, of a microbatch): (beside a later microbatch's
    backward, in flight at the first backward only, at a microbatch's backward end beside it).
    A microbatch holds its blocks' kept activations and, on every stage but the last, the output
    torch's ``PipelineStage`` keeps for its backward; a later backward (after the first, once
    gradients exist) finds at most ``m - 1`` in flight (the first's freed; 1F1B's steady state
    refills to ``inflight``); the stage's receive buffers, one per microbatch (activations from
    the previous stage, gradients from the next), are there throughout. The simulation of
    Llama-3-70B at pp=4 holds exactly these on stage 0 at its peak (3 x 21 + 4 boundary tensors at
    m=4: mb 1's first unit backward)."""
    one = blocks * kept + (hidden if rank < pp - 1 else 0)
    buffers = m * hidden * ((rank > 0) + (rank < pp - 1))
    later = min(inflight, m - 1) if m > 1 else inflight
    return one * later + buffers, one * (inflight - later), one * (inflight - 1) + buffers


def _pp_rank_shares(facts: ModelFacts, layout: Layout) -> list[float]:
    """Each pp rank's parameters over the largest rank's ([1.0] without pp)."""
    if layout.pp == 1:
        return [1.0]
    counts = pp_rank_params(facts, layout)
    return [c / max(counts) for c in counts]


