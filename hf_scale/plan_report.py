"""What ``hf-scale plan`` prints: a model's resolved plan and mesh, without reading weights.

The model is built from its config on the meta device (no memory, no weights), its plan is
resolved exactly as :func:`hf_scale.parallelize` would, and the mesh degrees are resolved for
the given world size, so a recipe for 8 GPUs or 4 nodes can be checked on a laptop.

Usage::

    report = plan_report(config, ParallelConfig(strategy="hsdp"), world_size=32, num_nodes=4)
    print(format_report(report))
"""

from __future__ import annotations

import torch

from .config import ParallelConfig
from .mesh import ParallelDims
from .plans import resolve_plan, wrap_units

# fp32 master weights + gradients + AdamW's two moments
BYTES_PER_PARAM_TRAINING = 16


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
    dims = ParallelDims.resolve(parallel, world_size, num_nodes) if world_size > 1 else None
    shards = dims.dp_shard * dims.tp * dims.pp if dims and parallel.sharded else 1
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
        "params_per_rank": params // shards,
        "train_state_gb_per_rank": params * BYTES_PER_PARAM_TRAINING / shards / 2**30,
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
    return "\n".join(lines)


def _entries(tp_plan) -> str:
    if not tp_plan:
        return "none"
    shown = ", ".join(f"{k}: {v}" for k, v in list(tp_plan.items())[:3])
    more = f", ... ({len(tp_plan)} entries)" if len(tp_plan) > 3 else ""
    return shown + more
