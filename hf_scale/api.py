"""``parallelize``: resolve the plan, build the mesh, apply the engine in a fixed order."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import ParallelConfig, as_parallel_config
from .distributed import DistEnv, init_distributed
from .errors import HfScaleConfigError
from .log import log_rank0
from .mesh import ParallelDims, build_mesh
from .parallel import apply_ac, apply_autocast, apply_chunked_loss, apply_ddp, apply_fsdp, apply_tp
from .parallel.pp import is_stand_in, prune_to_stages, stage_module
from .parallel.pp_schedule import Pipeline, tie_group, tied_across_stages
from .parallel.step import eval_step, train_step
from .plans import ModelPlan, fp32_modules, resolve_plan, wrap_units
from .plans.pp import pp_layout
from .plans.tp import tp_layout
from .state import STATE_ATTR, ParallelState, get_state

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(
    model: nn.Module,
    config: ParallelConfig | Mapping[str, Any] | str | None = None,
    *,
    plan: ModelPlan | Mapping[str, Any] | None = None,
) -> nn.Module:
    """Distribute a (pretrained) transformers model over the torchrun processes, in place.

    Order: resolve the plan; start the process group; check the degrees (and, with ``tp``,
    the head and MLP sizes); chunked / vocabulary-parallel loss; tensor parallel over the
    ``tp`` mesh dimension; activation checkpointing on the blocks; then FSDP2 (fsdp / zero2 /
    hsdp) or DDP (ddp / zero1) over the data-parallel mesh, with mixed precision and CPU
    offload as configured. Without torchrun (world size 1) only activation checkpointing,
    mixed precision and chunked loss apply. ``config="auto"`` (or ``{"strategy": "auto", ...}``
    with fields to keep) asks :mod:`hf_scale.planner` for the fastest layout that fits this world
    size and device memory, and logs it.

    Returns the same module object (its class gains the FSDP / DDP mixin), so
    ``model.config``, ``model.generate`` and parameter names are unchanged. Build the
    optimizer afterwards, with :func:`hf_scale.build_optimizer`.

    Usage::

        model = AutoModelForCausalLM.from_pretrained(name)
        model = hf_scale.parallelize(model, {"strategy": "fsdp", "mixed_precision": "bf16"})
    """
    config = resolve_parallel_config(model, config)
    if get_state(model) is not None:
        raise HfScaleConfigError(
            f"parallelize() was already applied to this {type(model).__name__} "
            f"(strategy={get_state(model).config.strategy!r}). Call it once, on a model "
            "that has not been parallelized."
        )
    if not isinstance(model, nn.Module):
        raise HfScaleConfigError(f"parallelize() needs a torch.nn.Module, got {type(model).__name__}.")
    resolved = resolve_plan(model, plan)
    env = init_distributed(config.timeout_seconds)
    dtype = DTYPES[config.mixed_precision]
    _check_precision(dtype, env)
    dims = mesh = layout = stages_layout = None
    if env.world_size > 1:
        # Degrees are checked before any collective: a bad layout fails on every rank alike.
        dims = ParallelDims.resolve(config, env.world_size, env.num_nodes)
        if dims.pp_enabled:
            stages_layout = pp_layout(model, resolved, dims.pp, config.stages_per_rank,
                                      config.pp_schedule == "zbv", config.pp_split_points)
        if dims.tp_enabled:
            layout = tp_layout(model, resolved, dims.tp)
        mesh = build_mesh(dims, env.device.type)
    elif config.tp > 1 or config.pp > 1:
        need = config.tp * config.pp
        degrees = " x ".join(f"{n}={v}" for n, v in (("tp", config.tp), ("pp", config.pp)) if v > 1)
        raise HfScaleConfigError(
            f"{degrees} needs {need} processes (or a multiple): start the "
            f"script with torchrun --nproc_per_node {need} (found one process, no torchrun environment)."
        )
    stages = []
    if stages_layout is not None:  # this rank keeps only its stages' modules from here on
        stages = stages_layout.stages_of(dims.pp_rank(mesh))
        prune_to_stages(model, stages_layout, stages)

    units = wrap_units(model, resolved)
    keep_fp32 = fp32_modules(model, resolved) if dtype is not None else []
    fsdp_moves = dims is not None and dims.dp_degree > 1 and config.sharded
    on_gpu = env.device.type != "cpu" and not _on_meta(model) and not fsdp_moves
    if on_gpu and layout is None:
        # FSDP moves each unit itself, never holding the whole model there; DDP, one process and
        # a pipeline stage alone need this rank's model on its GPU. Tensor parallel without FSDP
        # moves after splitting (below): each GPU then receives its shards, not the whole model.
        model.to(env.device)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    holds_head = stages_layout is None or stages_layout.num_stages - 1 in stages
    if (config.loss_chunk_tokens or config.loss_labeled_only) and holds_head:
        try:
            apply_chunked_loss(model, head, config.loss_chunk_tokens, labeled_only=config.loss_labeled_only)
        except ValueError as e:
            raise HfScaleConfigError(str(e)) from None
    elif layout is not None and holds_head and _vocab_sharded(model, head, layout):
        try:  # the loss on vocabulary shards; a model whose forward does not allow it gathers logits
            apply_chunked_loss(model, head, None)
        except ValueError as e:
            log_rank0(f"tensor parallel: the loss gathers the full logits ({e})", once=True)
    pipeline = None
    if dims is None:
        if config.activation_checkpointing:
            _apply_ac(model, units, config)
        log_rank0(
            "running in one process (no torchrun environment): only activation checkpointing, "
            "mixed precision and chunked loss apply",
            once=True,
        )
        if dtype is not None:
            apply_autocast(model, dtype, env.device.type, keep_fp32)
    else:
        dp_mesh = dims.dp_mesh(mesh)
        if layout is not None:
            present = {name for name, m in model.named_modules() if not is_stand_in(m)}
            apply_tp(
                model,
                mesh["tp"],
                {n: style for n, style in layout.styles.items() if n in present},
                {n: attrs for n, attrs in layout.local_attrs.items() if n in present},
                _present_ties(model, resolved.tied_weights, stages_layout),
            )
            if env.device.type != "cpu" and not _on_meta(model) and not fsdp_moves:
                model.to(env.device)  # the parameters tp left whole (norms, biases): shards are there
        if config.activation_checkpointing:
            _apply_ac(model, units, config)
        # Under pipeline parallel each stage is its own root (FSDP unit, autocast scope).
        roots = [model]
        if stages_layout is not None:
            roots = [stage_module(model, stages_layout, s) for s in stages]
        for root in roots:
            if dims.dp_degree == 1:  # tensor / pipeline parallel alone: no data-parallel wrapper
                if dtype is not None:
                    apply_autocast(root, dtype, env.device.type, keep_fp32)
            elif config.sharded:
                reshard = config.strategy != "zero2" and config.reshard_after_forward is not False
                inside = {id(m) for m in root.modules()}
                apply_fsdp(
                    root,
                    dp_mesh,
                    [u for u in units if id(u) in inside],
                    param_dtype=dtype,
                    reshard_after_forward=reshard,
                    cpu_offload=config.cpu_offload,
                    fp32_modules=[m for m in keep_fp32 if id(m) in inside],
                    blocks_per_unit=config.blocks_per_unit or 1,
                    prefetch=config.fsdp_prefetch,
                )
            else:
                apply_ddp(root, dp_mesh)
                if dtype is not None:
                    apply_autocast(root, dtype, env.device.type, keep_fp32)
        if stages_layout is not None:
            pipeline = _pipeline(model, stages_layout, stages, roots, mesh, dims, env, config, resolved)
        log_rank0(
            f"{config.strategy} over {dims.describe()} on {env.device.type} "
            f"({env.backend}); {len(units)} blocks of {', '.join(resolved.wrap_modules)}"
            + (f" ({config.blocks_per_unit} per FSDP unit)" if (config.blocks_per_unit or 1) > 1 else "")
            + (f"; FSDP prefetch {config.fsdp_prefetch} ahead" if config.fsdp_prefetch and config.sharded else "")
            + "; "
            f"precision {config.mixed_precision or 'fp32'}"
            + (f"; pipeline {config.pp_schedule}, stages {_describe(stages_layout)}" if pipeline else "")
        )
    setattr(model, STATE_ATTR, ParallelState(config, resolved, env, dims, mesh, pipeline))
    model.train_step = functools.partial(train_step, model)
    model.eval_step = functools.partial(eval_step, model)
    return model


def resolve_parallel_config(model: nn.Module, config) -> ParallelConfig:
    """``config`` as a ParallelConfig; ``"auto"`` (or ``strategy: auto``) becomes the planner's
    choice for ``model`` (a real or meta model), decided on rank 0 for every rank, logged. The one
    way from the library into the application's planner (DESIGN)."""
    if is_auto_request(config):
        from .planner.auto import resolve_auto

        return resolve_auto(model, config)  # parallelize's workload: one sequence per rank
    return as_parallel_config(config)


def is_auto_request(config) -> bool:
    """``"auto"``, ``{"strategy": "auto", ...}`` or ``ParallelConfig(strategy="auto")``."""
    if isinstance(config, str):
        return config == "auto"
    if isinstance(config, ParallelConfig):
        return config.auto
    return isinstance(config, Mapping) and config.get("strategy") == "auto"


def _pipeline(model, stages_layout, stages, roots, mesh, dims, env, config, resolved) -> Pipeline:
    """The schedule runner for this rank's stages; ``model`` itself can no longer run forward."""
    ties = tied_across_stages(stages_layout, resolved.tied_weights)
    group = tie_group(mesh, stages_layout, dims.pp) if ties else None
    pipeline = Pipeline(model, stages_layout, stages, roots, mesh["pp"].get_group(), env.device,
                        config.pp_schedule, config.pp_microbatches, group, ties)
    held = ", ".join(str(s) for s in stages)

    def refuse(module, args, kwargs):
        raise HfScaleConfigError(
            f"this rank holds pipeline stage(s) {held} of {stages_layout.num_stages}, not the whole "
            f"{type(module).__name__}: train with model.train_step(batch) and evaluate with "
            "model.eval_step(batch) (generate needs pp=1: save, then load without pp)."
        )

    model.register_forward_pre_hook(refuse, with_kwargs=True)
    return pipeline


def _describe(stages_layout) -> str:
    return " | ".join(f"{b[0]}-{b[-1]}" for b in stages_layout.stage_blocks)


def _present_ties(model: nn.Module, ties, stages_layout=None) -> tuple:
    """The ties tensor parallel must restore: both ends held here and in one pipeline stage (a
    V schedule's rank holds the embedding and its own copy of the head: they stay two)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    split = set(tied_across_stages(stages_layout, ties)) if stages_layout is not None else set()
    return tuple((t, s) for t, s in ties if t in names and s in names and (t, s) not in split)


def _apply_ac(model: nn.Module, units: list[nn.Module], config: ParallelConfig) -> None:
    count = apply_ac(units, config.activation_checkpointing, config.ac_every)
    _disable_kv_cache(model)
    log_rank0(f"activation checkpointing ({config.activation_checkpointing}) on {count} of {len(units)} blocks")


def _vocab_sharded(model: nn.Module, head, layout) -> bool:
    names = {id(m): n for n, m in model.named_modules()}
    return isinstance(head, nn.Linear) and layout.styles.get(names.get(id(head), "")) == "colwise_gather_output"


def _check_precision(dtype: torch.dtype | None, env: DistEnv) -> None:
    if dtype is torch.bfloat16 and env.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise HfScaleConfigError(
            f"mixed_precision='bf16' but {torch.cuda.get_device_name(env.device)} has no bf16 "
            "support: use mixed_precision='fp16' (with a GradScaler) or None."
        )


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _disable_kv_cache(model: nn.Module) -> None:
    """Turn off the KV cache in training forwards, on every sub-config (T5's decoder has its own).

    A cache filled during a checkpointed forward changes what the recomputation does (T5 reads
    cross-attention keys back from it), and it keeps every layer's keys and values alive,
    undoing what checkpointing frees. ``generate`` still uses its generation config's cache.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
