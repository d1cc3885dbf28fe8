"""What ``hf-scale plan`` prints: a model's resolved plan and mesh, without reading weights.

The model is built from its config on the meta device (no memory, no weights), its plan is
resolved exactly as :func:`hf_scale.parallelize` would, and the mesh degrees are resolved for
the given world size, so a recipe for 8 GPUs or 4 nodes can be checked on a laptop. With
``parallel.tp > 1`` it adds the tensor-parallel layout the engine would apply
(:func:`hf_scale.model_plans.tp.tp_layout`): each module pattern's style with its count, the query and
key/value heads per rank, and the parameters and bytes each tp rank holds (sharded ones / tp,
plus the replicated ones); a plan that does not fit the degree fails with the engine's error.
With ``parallel.pp > 1`` it adds the pipeline split the engine would make
(:func:`hf_scale.model_plans.pp.pp_layout`): each stage's pp rank, blocks, parameters and share of
the compute, and the schedule's bubble (:func:`bubble_fraction`).

Usage::

    report = plan_report(config, ParallelConfig(strategy="hsdp"), world_size=32, num_nodes=4)
    print(format_report(report))
"""

from __future__ import annotations

import math
import re

import torch

from .config import ParallelConfig
from .mesh import ParallelDims
from .model_plans import resolve_plan, wrap_units

# fp32 master weights + gradients + AdamW's two moments
BYTES_PER_PARAM_TRAINING = 16
# tensor-parallel styles that split a module's weight (the packed_colwise family too)


def meta_model(config, task: str = "causal_lm"):
    """``config``'s model for ``task`` on the meta device (falls back to the base model)."""
    import transformers

    auto = {"causal_lm": transformers.AutoModelForCausalLM,
            "sequence_classification": transformers.AutoModelForSequenceClassification,
            "reward": transformers.AutoModelForSequenceClassification}[task]
    with torch.device("meta"):
        try:
            return auto.from_config(config)
        except ValueError:  # e.g. an encoder-decoder asked for a causal LM head
            return transformers.AutoModel.from_config(config)


def plan_report(config, parallel: ParallelConfig, world_size: int, num_nodes: int = 1,
                task: str = "causal_lm") -> dict:
    """Plan, mesh and a per-rank parameter estimate for ``config`` on ``world_size`` ranks."""
    model = meta_model(config, task)
    plan = resolve_plan(model)
    units = wrap_units(model, plan)
    params = sum(p.numel() for p in model.parameters())
    if parallel.ep > 1:  # the model's experts before the degrees, whose advice then names a valid ep
        from .model_plans.ep import check_ep, experts_layout

        check_ep(experts_layout(model, plan), model, plan, parallel.ep)
    dims = ParallelDims.resolve(parallel, world_size, num_nodes) if world_size > 1 or parallel.tp * parallel.pp > 1 else None
    tp = tp_report(model, plan, parallel.tp) if parallel.tp > 1 else None
    pp = pp_report(model, plan, parallel) if parallel.pp > 1 else None
    # the ranks ep is carved out of: dp_shard, or the replicas under ddp
    carved = (dims.dp_replicate if dims.replicated else dims.dp_shard) if dims else 1
    ep = ep_report(model, plan, parallel.ep, parallel.tp, carved) if parallel.ep > 1 else None
    if ep and pp:  # a pipeline rank holds its own stages' experts: the busiest rank's share
        _stage_share(ep, pp, model, units)
    per_tp_rank = tp["params_per_rank"] if tp else params
    if pp:  # the busiest pp rank's part of the model (a tied head counted on both ends)
        per_tp_rank = per_tp_rank * max(pp["rank_params"]) // params
    shards = dims.dp_shard * dims.cp if dims and parallel.sharded else 1  # FSDP shards over dp_shard x cp
    if ep and not parallel.sharded:  # ddp + ep: the dense weights whole, this rank's share of the experts
        per_tp_rank -= ep["expert_params"] // parallel.tp - ep["expert_params_per_rank"]
    return {
        "model_class": type(model).__name__,
        "model_type": plan.model_type,
        "parameters": params,
        "plan": plan,
        "units": len(units),
        "strategy": parallel.strategy,
        "world_size": world_size,
        "num_nodes": num_nodes,
        "mesh": dims.describe() if dims else "one process",
        "params_per_rank": per_tp_rank // shards,
        "train_state_gb_per_rank": per_tp_rank * BYTES_PER_PARAM_TRAINING / shards / 2**30,
        "tp": tp,
        "pp": pp,
        "ep": ep,
    }


def _stage_share(ep: dict, pp: dict, model, units) -> None:
    """Scale ``ep``'s per-rank figures (expert weights and state, all-to-all bytes, MoE layers) to
    the pipeline rank holding the most MoE layers (each rank holds and runs its own stages' only)."""
    from .model_plans.ep import moe_blocks

    blocks = moe_blocks(model, units, ep["modules"])
    per_rank = moe_layers_per_rank(blocks, pp["stages"])
    share = max(per_rank) / max(1, len(blocks))
    for key in ("expert_params_per_rank", "expert_train_state_bytes_per_rank", "all_to_all_bytes_forward",
                "all_to_all_bytes_step"):
        ep[key] = int(ep[key] * share)
    ep["moe_layers"] = max(per_rank)


def moe_layers_per_rank(blocks: frozenset[int], stages: list[dict]) -> list[int]:
    """The MoE layers on each pp rank: ``blocks`` (indices of the blocks holding experts) that
    fall in the rank's stages (``pp_report``'s ``stages``: each a ``rank`` and its ``blocks``)."""
    per_rank = [0] * (1 + max(stage["rank"] for stage in stages))
    for stage in stages:
        per_rank[stage["rank"]] += len(blocks.intersection(stage["blocks"]))
    return per_rank


def ep_report(model, plan, ep: int, tp: int = 1, dp_shard: int | None = None, tokens: int = 1024,
              act_bytes: int = 4) -> dict:
    """Expert parallel at degree ``ep``: the experts' parameters and their training state on one
    rank (1/ep of the experts, each also split by tp; FSDP then shards them over the
    ``dp_shard / ep`` ranks holding the same ones), and the all-to-all volume of ``tokens``
    tokens on a rank: tokens x hidden x top-k x 2 (out and back) per MoE layer in forward, as
    much again in backward (``act_bytes`` per value; fp32: 4)."""
    from .model_plans.ep import check_ep, experts_layout

    layout = experts_layout(model, plan)
    check_ep(layout, model, plan, ep)
    expert_params = sum(model.get_submodule(n).get_parameter(p).numel() for n, ps in layout.modules.items() for p in ps)
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1
    hidden = getattr(config, "hidden_size", None) or 0
    shards = max(1, (dp_shard or ep) // ep)
    per_rank = expert_params // ep // tp
    forward = tokens * hidden * top_k * 2 * act_bytes * len(layout.modules)
    return {
        "degree": ep,
        "num_experts": layout.num_experts,
        "experts_per_rank": layout.num_experts // ep,
        "moe_layers": len(layout.modules),
        "expert_params": expert_params,
        "expert_params_per_rank": per_rank // shards,  # held between steps (FSDP shards)
        "expert_params_gathered": per_rank // len(layout.modules),  # one layer's, during its compute
        # fp32 weight + gradient + AdamW's two moments, sharded
        "expert_train_state_bytes_per_rank": per_rank * BYTES_PER_PARAM_TRAINING // shards,
        "top_k": top_k,
        "hidden": hidden,
        "tokens": tokens,
        "all_to_all_bytes_forward": forward,
        "all_to_all_bytes_step": 2 * forward,
        "off_rank_fraction": (ep - 1) / ep,  # with routing spread evenly
        "source": layout.source,
        "modules": sorted(layout.modules),
    }


def tp_report(model, plan, tp: int) -> dict:
    """The tensor-parallel layout of ``model`` at degree ``tp``: styles per module pattern
    (``layers.N`` collapsed to ``layers.*``, with how many modules), heads per rank, and the
    parameters one tp rank holds (the largest shard where a vocabulary does not divide)."""
    from .model_plans.tp import SIZE_ATTRS, shard_dim, tp_layout

    layout = tp_layout(model, plan, tp)
    patterns: dict[str, list] = {}
    for name, style in layout.styles.items():
        key = (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name), style)
        patterns.setdefault(key, []).append(name)
    sharded = replicated = local = bytes_local = 0
    seen: set[int] = set()  # a tied weight is one tensor under two modules: count it once
    # routed experts: each expert's intermediate size split over the tp ranks (parallel.ep)
    experts = {f"{m}.{p}": dim for m, split in layout.experts.items() for p, (dim, _) in split.items()}
    for module_name, module in model.named_modules():
        style = layout.styles.get(module_name, "replicate")
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{p_name}"
            dim = experts[full] if full in experts else layout.params.get(full, shard_dim(module, p_name, style))
            if dim is None:
                replicated += param.numel()
                kept = param.numel()
            else:
                sharded += param.numel()
                kept = param.numel() // param.shape[dim] * math.ceil(param.shape[dim] / tp)
            local += kept
            bytes_local += kept * param.element_size()
    config = getattr(model, "config", None)
    heads = {}
    for attr, label in SIZE_ATTRS.items():
        value = getattr(config, attr, None)
        if "heads" in label and isinstance(value, int) and not isinstance(value, bool) and label not in heads:
            heads[label] = (value // tp, value)
    return {
        "degree": tp,
        "styles": [(pattern, style, len(names)) for (pattern, style), names in patterns.items()],
        "heads": heads,
        "sharded_params": sharded,
        "replicated_params": replicated,
        "params_per_rank": local,
        "bytes_per_rank": bytes_local,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def format_report(report: dict) -> str:
    """The report as the lines ``hf-scale plan`` prints."""
    plan = report["plan"]
    src = plan.source
    lines = [
        f"model: {report['model_class']} ({report['model_type']}), "
        f"{report['parameters'] / 1e6:,.1f}M parameters (built on the meta device, no weights read)",
        f"wrap units: {report['units']} x {', '.join(plan.wrap_modules)}  [{src.get('wrap_modules', '?')}]",
        f"tied weights: {', '.join(f'{a} = {b}' for a, b in plan.tied_weights) or 'none'}",
        f"fp32 under mixed precision: {', '.join(plan.keep_fp32_modules) or 'none'}",
        f"tensor-parallel plan: {_entries(plan.tp_plan)}  [{_tp_source(src)}]",
        f"pipeline plan: {', '.join(plan.pp_plan) or 'none'}  [{src.get('pp_plan', 'none declared')}]",
        f"mesh: {report['strategy']} over {report['world_size']} rank(s) on {report['num_nodes']} node(s): "
        f"{report['mesh']}",
    ]
    if report["train_state_gb_per_rank"] is not None:  # None: an adapter run says its own (the CLI)
        lines.append(f"per rank: {report['params_per_rank'] / 1e6:,.1f}M parameters; fp32 weights + gradients + "
                     f"AdamW state ~{report['train_state_gb_per_rank']:.2f} GB (activations not included)")
    if report.get("tp"):
        lines += _tp_lines(report["tp"], report["parameters"])
    if report.get("pp"):
        lines += _pp_lines(report["pp"])
    if report.get("ep"):
        lines += _ep_lines(report["ep"])
    return "\n".join(lines)


def _ep_lines(ep: dict) -> list[str]:
    return [
        f"expert parallel over {ep['degree']} ranks: {ep['experts_per_rank']} of {ep['num_experts']} experts per rank "
        f"in each of {ep['moe_layers']} MoE layers [{ep['source']}]; expert weights {ep['expert_params'] / 1e6:,.2f}M, "
        f"{ep['expert_params_per_rank'] / 1e6:,.2f}M per rank between steps (fp32 weights + gradients + AdamW "
        f"{ep['expert_train_state_bytes_per_rank'] / 2**20:,.1f} MiB), {ep['expert_params_gathered'] / 1e6:,.2f}M "
        "gathered per layer in compute",
        f"  all-to-all per {ep['tokens']:,} tokens on a rank: tokens x hidden {ep['hidden']} x top-k {ep['top_k']} x 2 "
        f"x {ep['moe_layers']} layers = {ep['all_to_all_bytes_forward'] / 2**20:,.1f} MiB in forward, "
        f"{ep['all_to_all_bytes_step'] / 2**20:,.1f} MiB per step with backward (fp32; "
        f"{ep['off_rank_fraction']:.0%} leaves the rank when routing is even)",
    ]


def _tp_source(src) -> str:
    """Where the tp plan came from; an inferred (or pruned) one is checked by parallelize."""
    source = src.get("tp_plan", "none declared")
    if source == "inferred" or source.startswith("transformers, entries"):
        source += "; parallelize checks it on a probe batch before use"
    if src.get("tp_whole"):
        source += f"; left whole on every tp rank: {src['tp_whole']}"
    return source


def _tp_lines(tp: dict, parameters: int) -> list[str]:
    heads = ", ".join(f"{local} of {total} {label}" for label, (local, total) in tp["heads"].items())
    lines = [
        f"tensor parallel over {tp['degree']} ranks: per tp rank {heads or 'no head counts in the config'}; "
        f"{tp['params_per_rank'] / 1e6:,.2f}M of {parameters / 1e6:,.2f}M parameters "
        f"({tp['sharded_params'] / 1e6:,.2f}M sharded / {tp['degree']} + {tp['replicated_params'] / 1e6:,.2f}M "
        f"replicated), {tp['bytes_per_rank'] / 2**20:,.1f} MiB in {tp['dtype']}",
    ]
    width = max(len(pattern) for pattern, _, _ in tp["styles"])
    style_width = max(len(style) for _, style, _ in tp["styles"])
    for pattern, style, count in tp["styles"]:
        lines.append(f"  {pattern:{width}}  {style:{style_width}}  x{count}".rstrip())
    return lines


def pp_report(model, plan, parallel: ParallelConfig) -> dict:
    """The pipeline split of ``model`` for ``parallel`` (pp, schedule, stages per rank, split
    points, microbatches) as the engine would cut it, with the schedule's bubble."""
    from .model_plans.pp import pp_layout

    layout = pp_layout(model, plan, parallel.pp, parallel.stages_per_rank,
                       v_shape=parallel.pp_schedule == "zbv", split_points=parallel.pp_split_points)
    microbatches = parallel.pp_microbatches or layout.num_stages
    total = sum(layout.costs)
    stages = [{"stage": s, "rank": layout.stage_ranks[s], "blocks": blocks, "params": layout.params[s],
               "compute": layout.costs[s] / total} for s, blocks in enumerate(layout.stage_blocks)]
    rank_params = [sum(layout.params[s] for s in layout.stages_of(r)) for r in range(parallel.pp)]
    fraction, formula = bubble_fraction(parallel.pp_schedule, parallel.pp, parallel.stages_per_rank, microbatches)
    return {"degree": parallel.pp, "schedule": parallel.pp_schedule, "stages_per_rank": parallel.stages_per_rank,
            "microbatches": microbatches, "stages": stages, "rank_params": rank_params,
            "balance": layout.balance, "bubble": fraction, "bubble_formula": formula}


def bubble_fraction(schedule: str, p: int, v: int, m: int) -> tuple[float, str]:
    """The share of a step that a pipeline rank idles, ideally, and the formula used.

    ``p`` pp ranks, ``v`` stages per rank, ``m`` microbatches, every stage equally fast:

    - gpipe and 1f1b: ``(p-1)/(m+p-1)`` (GPipe, Huang et al. 2019; 1F1B has GPipe's bubble and
      less activation memory, Narayanan et al. 2021).
    - interleaved_1f1b: ``(p-1)/(v*m+p-1)``: the bubble over ideal time is ``(p-1)/(v*m)``
      (Narayanan et al. 2021, arXiv 2104.04473, section 2.2).
    - zero_bubble (torch's ``ScheduleInterleavedZeroBubble``, the paper's ZB-1P): ZB-H1's
      bubble ``(p-1)(T_F+T_B-T_W)`` (Qi et al. 2024, arXiv 2401.10241, section 2), a third of
      1F1B's when forward, input-backward and weight-backward take equally long (bubble rate
      ``(p-1)/(3m)``), with each of the ``v`` stages of a rank ``1/v`` of its work:
      ``(p-1)/(3*v*m+p-1)``.
    - zbv: 0, the ZB-V schedule's bubble when those three times are equal (same paper,
      section 6; torch's ``ScheduleZBVZeroBubble`` docstring says so too). Real models have
      unequal times, so measured steps keep some bubble.

    ``scripts/pipeline_ideal.py`` (the benchmark's arithmetic) gives the same fractions with equal
    stages and passes, from its formulas and by replaying torch's own action order of each
    schedule (zbv's replay excepted: torch's ZB-V order idles 1/7 of a step at p=2, m=2 and the
    zero_bubble fraction from m=4).
    """
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m + p - 1), "(p-1)/(3*v*m+p-1), ZB-1P with F = B = W (arXiv 2401.10241)"
    if schedule == "zbv":
        return 0.0, "0 when F = B = W (ZB-V, arXiv 2401.10241 section 6; torch's order idles some at few microbatches)"
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _pp_lines(pp: dict) -> list[str]:
    p, v, m = pp["degree"], pp["stages_per_rank"], pp["microbatches"]
    lines = [
        (f"pipeline parallel over {p} ranks: {len(pp['stages'])} stages ({v} per rank), schedule {pp['schedule']}, "
         f"{m} microbatches per batch; balance (slowest / fastest stage compute) {pp['balance']:.2f}"),
        f"  {'stage':5}  {'rank':4}  {'blocks':16}  {'parameters':>10}  {'compute':>7}",
    ]
    for st in pp["stages"]:
        blocks = st["blocks"]
        span = f"{blocks[0]}-{blocks[-1]} ({len(blocks)})" if len(blocks) > 1 else f"{blocks[0]} (1)"
        lines.append(f"  {st['stage']:<5}  {st['rank']:<4}  {span:16}  {st['params'] / 1e6:>9,.2f}M  "
                     f"{st['compute']:>7.1%}")
    shrink = "; more microbatches (pp_microbatches) shrink it" if pp["bubble"] else ""
    lines.append(f"  bubble: {pp['bubble']:.1%} of a step idle (p={p}, v={v}, m={m}: {pp['bubble_formula']}){shrink}")
    return lines


def _entries(tp_plan) -> str:
    if not tp_plan:
        return "none"
    shown = ", ".join(f"{k}: {v}" for k, v in list(tp_plan.items())[:3])
    more = f", ... ({len(tp_plan)} entries)" if len(tp_plan) > 3 else ""
    return shown + more
