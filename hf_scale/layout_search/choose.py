"""The chooser: every layout for a world size, its memory and step time, the fastest that fits.

A layout fits when its estimated device memory is at most the budget less a margin (10% by
default: the estimator's error, allocator fragmentation). Among those that fit, the one with the
most tokens per second wins; layouts within 1% of it are a tie, broken toward less memory.
Layouts the engine would refuse (``ParallelConfig`` / ``ParallelDims`` / tp and pp plans) are
rejected with the engine's own message, so a reason here is a reason at launch too.

Usage::

    facts = model_facts(config)
    best, candidates = choose(facts, Workload(seq=1024, batch=8, device="cuda"), world_size=8,
                              budget=parse_memory("80GB"), device=H100)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import product

from ..config import GRAD_SYNC_EACH_SCHEDULES, PP_SCHEDULES, ParallelConfig
from ..errors import HfScaleConfigError, HfScaleError
from ..mesh import ParallelDims
from .cost import Device, StepCost, step_cost
from .estimate import (
    GiB,
    Layout,
    MemoryEstimate,
    Workload,
    estimate_memory,
    estimate_stages,
    rank_blocks,
)
from .experts import check_layout_ep, ep_degrees
from .profile import ModelFacts

MARGIN = 0.10
TIE = 0.01
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value) -> int:
    """Bytes from ``80GiB``, ``80 GB``, ``8e10`` or a number; anything else is an error."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise HfScaleConfigError(
            f"memory {value!r} is not a size: write a number with an optional unit, e.g. '80GB' "
            "(10^9 bytes), '80GiB' (2^30), '512MiB' or '8e10' (bytes)."
        )
    number = float(match.group(1))
    if not unit and number < 2**20:  # "80": meant 80 GB, read as 80 bytes no layout fits in
        raise HfScaleConfigError(
            f"memory {value!r} has no unit, so it reads as {number:g} bytes: write '{match.group(1)}GB' "
            f"(10^9 bytes) or '{match.group(1)}GiB' (2^30)."
        )
    return int(number * _UNITS[unit])


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate | None = None
    cost: StepCost | None = None
    reason: str | None = None  # why it was rejected; None when it fits

    @property
    def fits(self) -> bool:
        return self.reason is None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(world_size: int, work: Workload, *, strategies=("fsdp", "zero2", "zero1", "ddp", "hsdp"),
                      acs=(None, "selective", "full"), precisions=(None, "bf16"), offloads=(False, True),
                      chunks=(None, 1024), tps=None, pps=None, micro_batches=None,
                      ranks_per_node: int | None = None, keep=None, pp_schedules=PP_SCHEDULES,
                      pp_microbatches=None, units=(1,), prefetches=(None,), eps=(1,),
                      pp_grad_syncs=("last", "each"), cps=(1,), cp_exchanges=("allgather",),
                      cp_layouts=("head_tail",)) -> list[Layout]:
    """Every combination of degrees and knobs for ``world_size`` ranks (duplicates removed);
    ``keep(layout)``, when given, filters them (e.g. degrees a user fixed). Pipelines try each
    of ``pp_schedules`` with each of ``pp_microbatches`` microbatches (None: 1, 2 and 4 per
    stage, those that split the micro-batch). ``units``: blocks per FSDP unit to try, and
    ``prefetches``: FSDP prefetch depths (None: FSDP2's default), both for sharded strategies
    over more than one rank only. ``eps``: expert-parallel degrees (MoE models; 1: none), each
    tried where the engine accepts it (:func:`_ep_accepted`). ``pp_grad_syncs``: when an FSDP
    pipeline stage reduces its gradients, each tried under the schedules that allow it (the
    chooser then takes "each", slower, only where "last" does not fit). ``cps``: context-parallel
    degrees (:func:`_cp_layouts`), each with each of ``cp_exchanges`` and ``cp_layouts``."""
    per_node = ranks_per_node or world_size
    knobs = dict(acs=acs, precisions=precisions, offloads=offloads, chunks=chunks, micro_batches=micro_batches,
                 units=units, prefetches=prefetches)
    with_cp = [lay for cp in cps if cp > 1 for lay in _cp_layouts(world_size, work, cp, per_node, strategies, knobs,
                                                                   cp_exchanges, cp_layouts)]
    with_cp = [lay for lay in with_cp if keep is None or keep(lay)]
    if 1 not in cps:
        return list(dict.fromkeys(with_cp))
    tps = tps or [t for t in _divisors(world_size) if t <= per_node]
    micro_batches = micro_batches or _divisors(work.batch)
    layouts = []
    for tp in tps:
        if world_size % tp:
            continue
        for pp in pps or _divisors(world_size // tp):
            if (world_size // tp) % pp:
                continue
            rest = world_size // tp // pp
            meshes = []
            for strategy in strategies if rest > 1 else ("fsdp",):
                if strategy in ("ddp", "zero1"):
                    meshes.append((strategy, rest, 1))
                elif strategy == "hsdp":
                    meshes += [(strategy, r, rest // r) for r in _divisors(rest) if 1 < r < rest]
                else:
                    meshes.append((strategy, 1, rest))
            for (strategy, rep, shard), ac, prec, off, chunk, mb, k, ahead in product(
                    meshes, acs, precisions, offloads, chunks, micro_batches, units, prefetches):
                fsdp = strategy in ("fsdp", "zero2", "hsdp") and rep * shard > 1
                if (off or k > 1 or ahead) and not fsdp:
                    continue  # offload, unit size and prefetch are FSDP's (one process has nothing to offload to)
                if chunk and chunk >= mb * work.seq:
                    continue  # one chunk: the same as no chunking
                for pipe, ep in product(_pipelines(pp, mb, pp_schedules, pp_microbatches, fsdp, pp_grad_syncs), eps):
                    if ep > 1 and not _ep_accepted(strategy, rep, shard, tp, pp, ep):
                        continue
                    layout = Layout(strategy, rep, shard, tp, pp, ac, prec, off, mb, chunk, **pipe, blocks_per_unit=k,
                                    prefetch=ahead, ep=ep)
                    if keep is None or keep(layout):
                        layouts.append(layout)
    return list(dict.fromkeys(layouts + with_cp))


def _cp_layouts(world_size: int, work: Workload, cp: int, per_node: int, strategies, knobs: dict, exchanges,
                cp_layouts) -> list[Layout]:
    """Layouts with context parallel over ``cp`` ranks, where the engine takes it
    (``ParallelConfig``): fsdp, zero2 or ddp over the other ``world_size / cp`` ranks, without tp,
    pp or ep; cp inside a node (its exchange runs every layer); the sequence a multiple of the
    layout's granule (``2 cp`` for head_tail, ``cp`` for contiguous: no padding). The knobs as
    for one rank's ``S/cp`` tokens (a loss chunk below them)."""
    if world_size % cp or cp > per_node:
        return []
    from .context import granule

    local = replace(work, seq=work.seq // cp)
    inner = enumerate_layouts(world_size // cp, local, strategies=[s for s in strategies if s in CP_STRATEGIES],
                              tps=[1], pps=[1], eps=(1,), **knobs)
    out = []
    for lay, exchange, how in product(inner, exchanges, cp_layouts):
        lay = replace(lay, cp=cp, cp_exchange=exchange, cp_layout=how)
        if work.seq % granule(lay) == 0:
            out.append(lay)
    return out


CP_STRATEGIES = ("fsdp", "zero2", "ddp")  # what ParallelConfig takes with cp


def _ep_accepted(strategy: str, rep: int, shard: int, tp: int, pp: int, ep: int) -> bool:
    """Where the engine accepts expert parallel (``ParallelConfig``, ``ParallelDims``): fsdp /
    zero2 / hsdp with ep dividing dp_shard (carved out of it; under pp, each stage's), or ddp
    without tp or pp with ep dividing its replicas (each rank its own experts at ep = the
    replicas, FSDP-sharded over the replicas holding the same ones below). A pipeline on a
    model whose loss adds the load-balancing term is refused by the plan (:func:`evaluate`
    says why)."""
    if strategy in ("fsdp", "zero2", "hsdp"):
        return shard % ep == 0
    return strategy == "ddp" and tp == pp == 1 and rep % ep == 0


def _pipelines(pp: int, micro_batch: int, schedules, microbatches, fsdp: bool = False,
               grad_syncs=("last",)) -> list[dict]:
    """The schedule and microbatch count of each pipeline to try for ``pp`` ranks (no pipeline:
    one empty choice). The default count (None) is one microbatch per stage; 2 and 4 per stage
    are tried where they split ``micro_batch`` (a smaller bubble, paid for in fixed costs per
    microbatch). Stages under FSDP over more than one rank (``fsdp``) also try each of
    ``grad_syncs`` their schedule allows."""
    if pp == 1:
        return [{}]
    pipes = []
    for schedule in schedules:
        stages = pp * ParallelConfig(pp=pp, pp_schedule=schedule).stages_per_rank
        syncs = [g for g in grad_syncs if g == "last" or (fsdp and schedule in GRAD_SYNC_EACH_SCHEDULES)]
        for m in microbatches or (None, 2 * stages, 4 * stages):
            if m is None or micro_batch % m == 0:
                pipes += [{"pp_schedule": schedule, "pp_microbatches": m, "pp_grad_sync": g} for g in syncs]
    return pipes


def unit_sizes(layers: int) -> tuple[int, ...]:
    """Blocks per FSDP unit worth trying: 1, 2, 4, ... up to the number of blocks."""
    return tuple(2**i for i in range(layers.bit_length()) if 2**i <= layers)


def evaluate(facts: ModelFacts, layout: Layout, work: Workload, budget: int, device: Device, nodes: int = 1,
             margin: float = MARGIN) -> Candidate:
    """One layout's memory and step time, or why it cannot run or does not fit."""
    try:
        config = layout.parallel_config()
        check_layout_ep(facts, layout.ep)  # the model's experts first, as the engine checks them
        ParallelDims.resolve(config, layout.world_size, nodes)
        if layout.cpu_offload and work.device == "cpu":
            return Candidate(layout, reason="cpu_offload on a CPU device moves nothing: state already lives in RAM")
        blocks = rank_blocks(facts, layout)
        if layout.blocks_per_unit > blocks:
            return Candidate(layout, reason=f"blocks_per_unit {layout.blocks_per_unit} > the {blocks} blocks on a rank")
        if layout.pp > 1 and layout.micro_batch % (layout.pp_microbatches or layout.pp * config.stages_per_rank):
            return Candidate(layout, reason=f"micro-batch {layout.micro_batch} does not split into the pipeline's "
                                            f"{layout.pp * config.stages_per_rank} microbatches")
        if layout.cp > 1:
            _check_cp(facts, layout)
        memory = estimate_memory(facts, layout, work)
        cost = step_cost(facts, layout, work, device, nodes)
    except HfScaleError as e:
        return Candidate(layout, reason=" ".join(str(e).split()))
    usable = budget * (1 - margin)
    if memory.device_total > usable:
        return Candidate(layout, memory, cost, reason=(
            f"needs {memory.device_total / GiB:.2f} GiB > {usable / GiB:.2f} GiB usable "
            f"({budget / GiB:.2f} GiB less {margin:.0%})"))
    return Candidate(layout, memory, cost)


def _check_cp(facts: ModelFacts, layout: Layout) -> None:
    """The engine's refusals of context parallel for this model: its architecture
    (:func:`hf_scale.parallel.cp_check.check_cp_model`), and heads the all-to-all cannot deal."""
    from ..parallel.cp_alltoall import check_heads
    from ..parallel.cp_check import check_cp_model

    check_cp_model(facts.model)
    if layout.cp_exchange == "alltoall":
        check_heads(facts.model.config, layout.cp)


def fitting_grad_sync(facts: ModelFacts, layout: Layout, work: Workload, budget: int,
                      margin: float = MARGIN) -> Layout:
    """``layout`` with the ``pp_grad_sync`` the chooser would take for it: ``"last"`` (fewer
    collectives) where every pp rank's estimate fits ``budget`` less ``margin``, else ``"each"``
    (gradients sharded through the schedule) where the schedule allows it; what
    ``pp_grad_sync="auto"`` means to the planner and ``hf-scale plan --simulate``."""
    last = replace(layout, pp_grad_sync="last")
    fsdp = layout.strategy in ("fsdp", "zero2", "hsdp") and layout.dp > 1
    if layout.pp == 1 or not fsdp or layout.pp_schedule not in GRAD_SYNC_EACH_SCHEDULES:
        return last
    if max(e.device_total for e in estimate_stages(facts, last, work)) <= budget * (1 - margin):
        return last
    return replace(layout, pp_grad_sync="each")


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting candidates fastest first (ties within 1% toward less memory), then the rejected
    ones (those with an estimate by memory, then the refused)."""
    fits = [c for c in candidates if c.fits]
    order = fastest_first([c.cost.tokens_per_second for c in fits], [c.memory.device_total for c in fits])
    fits = [fits[i] for i in order]
    sized = sorted((c for c in candidates if not c.fits and c.memory), key=lambda c: c.memory.device_total)
    refused = [c for c in candidates if not c.fits and not c.memory]
    return fits + sized + refused


def fastest_first(speeds: list[float], memories: list[float]) -> list[int]:
    """Indices of ``speeds`` (tokens/s) fastest first; those within ``TIE`` of the fastest are
    a tie, ordered by ``memories`` (less first). The chooser's ranking, also the benchmark's."""
    best = max(speeds, default=0.0)

    def key(i: int):
        tied = speeds[i] >= best * (1 - TIE)
        return (not tied, memories[i] if tied else -speeds[i])

    return sorted(range(len(speeds)), key=key)


def choose(facts: ModelFacts, work: Workload, world_size: int, budget: int, device: Device, nodes: int = 1,
           margin: float = MARGIN, **space) -> tuple[Candidate, list[Candidate]]:
    """The recommended candidate and every candidate, ranked; an error when none fits. An
    explicit FSDP prefetch is tried only on a device whose host can fall behind it
    (``device.host_block``): elsewhere it costs the same and is never chosen."""
    per_node = max(1, world_size // nodes)
    space.setdefault("units", unit_sizes(facts.layers))
    space.setdefault("prefetches", (None, 1) if device.host_block else (None,))
    space.setdefault("eps", ep_degrees(facts))  # (1,) for a dense model
    # context parallel only when the sequence fits no layout without it (its exchange is pure cost)
    cps = space.pop("cps", None)
    space.setdefault("cp_exchanges", ("allgather", "alltoall"))
    layouts = enumerate_layouts(world_size, work, ranks_per_node=per_node, cps=cps or (1,), **space)
    ranked = rank([evaluate(facts, lay, work, budget, device, nodes, margin) for lay in layouts])
    if cps is None and (not ranked or not ranked[0].fits):
        more = enumerate_layouts(world_size, work, ranks_per_node=per_node,
                                 cps=[c for c in _divisors(per_node) if c > 1], **space)
        ranked = rank([c for c in ranked] + [evaluate(facts, lay, work, budget, device, nodes, margin)
                                             for lay in more if lay.cp > 1])
    if not ranked:
        fixed = ", ".join(f"{k}={v[0] if isinstance(v, tuple) and len(v) == 1 else v}"
                          for k, v in space.items() if not callable(v))
        raise HfScaleConfigError(
            f"no layout of {world_size} rank(s) for seq {work.seq} x batch {work.batch} matches what was fixed "
            f"({fixed or 'the degrees given'}): e.g. loss_chunk_tokens must be below the tokens of a micro-batch "
            "and dp_replicate x dp_shard x tp x pp must equal the world size. Fix fewer fields, or none.")
    if not ranked[0].fits:
        raise HfScaleConfigError(_nothing_fits(facts, ranked, work, world_size, budget, margin, space))
    return ranked[0], ranked


def _nothing_fits(facts, ranked, work, world_size, budget, margin, space) -> str:
    usable = budget * (1 - margin)
    sized = [c for c in ranked if c.memory]
    if not sized:
        reasons = "; ".join(dict.fromkeys(c.reason for c in ranked[:3]))
        return f"no layout of {world_size} rank(s) can run this model: {reasons}"
    small = sized[0]
    mem = small.memory
    parts = sorted(((v, k) for k, v in mem.as_dict().items() if k not in ("device_total", "host")), reverse=True)
    biggest = ", ".join(f"{k} {v / GiB:.2f} GiB" for v, k in parts[:3])
    hints = []
    # 16 bytes per trainable parameter (fp32 weight, gradient, two AdamW moments), a frozen one's weight only
    state = int(16 * facts.trainable_params + facts.frozen_bytes * facts.frozen_params)
    room = usable - mem.overhead - mem.activations - mem.logits_loss
    if room > 0:
        what = "the 16 bytes/parameter of training state" if not facts.frozen else \
            "the training state (16 bytes per trainable parameter, the frozen weights')"
        hints.append(f"at least {-(-state // int(room))} ranks to shard {what}")
    if "full" not in space.get("acs", ("full",)):
        hints.append("activation_checkpointing='full'")
    if work.device != "cpu" and True not in space.get("offloads", (True,)):
        hints.append("cpu_offload (a sharded strategy)")
    if mem.activations + mem.logits_loss > usable / 2:
        hints.append(f"a shorter sequence or batch (activations + logits are "
                     f"{(mem.activations + mem.logits_loss) / GiB:.2f} GiB of it)")
    if not hints:
        hints.append("more ranks, tensor or pipeline parallel, or a device with more memory")
    return (f"no layout fits {budget / GiB:.2f} GiB per rank ({usable / GiB:.2f} GiB usable with a {margin:.0%} "
            f"margin) on {world_size} rank(s) for seq {work.seq} x batch {work.batch}: the smallest need is "
            f"{mem.device_total / GiB:.2f} GiB ({small.layout.describe()}: {biggest}). To fit, try "
            + "; or ".join(hints) + ".")
