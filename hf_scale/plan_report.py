"""What ``hf-scale plan`` prints: a model's resolved plan and mesh, without reading weights.

The model is built from its config on the meta device (no memory, no weights), its plan is
resolved exactly as :func:`hf_scale.parallelize` would, and the mesh degrees are resolved for
the given world size, so a recipe for 8 GPUs or 4 nodes can be checked on a laptop. With
``parallel.tp > 1`` it adds the tensor-parallel layout the engine would apply
(:func:`hf_scale.plans.tp.tp_layout`): each module pattern's style with its count, the query and
key/value heads per rank, and the parameters and bytes each tp rank holds (sharded ones / tp,
plus the replicated ones); a plan that does not fit the degree fails with the engine's error.

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
from .plans import resolve_plan, wrap_units

# fp32 master weights + gradients + AdamW's two moments
BYTES_PER_PARAM_TRAINING = 16
# tensor-parallel styles that split a module's weight (the packed_colwise family too)


def meta_model(config, task: str = "causal_lm"):
    """``config``'s model for ``task`` on the meta device (falls back to the base model)."""
    import transformers

    auto = {"causal_lm": transformers.AutoModelForCausalLM,
            "sequence_classification": transformers.AutoModelForSequenceClassification}[task]
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
    dims = ParallelDims.resolve(parallel, world_size, num_nodes) if world_size > 1 or parallel.tp > 1 else None
    tp = tp_report(model, plan, parallel.tp) if parallel.tp > 1 else None
    per_tp_rank = tp["params_per_rank"] if tp else params
    shards = dims.dp_shard * dims.pp if dims and parallel.sharded else 1
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
    }


def tp_report(model, plan, tp: int) -> dict:
    """The tensor-parallel layout of ``model`` at degree ``tp``: styles per module pattern
    (``layers.N`` collapsed to ``layers.*``, with how many modules), heads per rank, and the
    parameters one tp rank holds (the largest shard where a vocabulary does not divide)."""
    from .plans.tp import SIZE_ATTRS, shard_dim, tp_layout

    layout = tp_layout(model, plan, tp)
    patterns: dict[str, list] = {}
    for name, style in layout.styles.items():
        key = (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name), style)
        patterns.setdefault(key, []).append(name)
    sharded = replicated = local = bytes_local = 0
    seen: set[int] = set()  # a tied weight is one tensor under two modules: count it once
    for module_name, module in model.named_modules():
        style = layout.styles.get(module_name, "replicate")
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            dim = shard_dim(module, p_name, style)
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
        f"tensor-parallel plan: {_entries(plan.tp_plan)}  [{src.get('tp_plan', 'none declared')}]",
        f"pipeline plan: {', '.join(plan.pp_plan) or 'none'}  [{src.get('pp_plan', 'none declared')}]",
        f"mesh: {report['strategy']} over {report['world_size']} rank(s) on {report['num_nodes']} node(s): "
        f"{report['mesh']}",
        f"per rank: {report['params_per_rank'] / 1e6:,.1f}M parameters; fp32 weights + gradients + AdamW "
        f"state ~{report['train_state_gb_per_rank']:.2f} GB (activations not included)",
    ]
    if report.get("tp"):
        lines += _tp_lines(report["tp"], report["parameters"])
    return "\n".join(lines)


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


def _entries(tp_plan) -> str:
    if not tp_plan:
        return "none"
    shown = ", ".join(f"{k}: {v}" for k, v in list(tp_plan.items())[:3])
    more = f", ... ({len(tp_plan)} entries)" if len(tp_plan) > 3 else ""
    return shown + more
