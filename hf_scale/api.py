"""``parallelize``: resolve the plan, build the mesh, apply the engine in a fixed order."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .config import ParallelConfig, as_parallel_config
from .distributed import DistEnv, init_distributed
from .errors import HfScaleConfigError
from .log import log_rank0
from .mesh import ParallelDims, build_mesh
from .parallel import apply_ac, apply_autocast, apply_chunked_loss, apply_ddp, apply_fsdp, apply_tp
from .plans import ModelPlan, fp32_modules, resolve_plan, wrap_units
from .plans.tp import tp_layout
from .state import STATE_ATTR, ParallelState, get_state

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(
    model: nn.Module,
    config: ParallelConfig | Mapping[str, Any] | None = None,
    *,
    plan: ModelPlan | Mapping[str, Any] | None = None,
) -> nn.Module:
    """Distribute a (pretrained) transformers model over the torchrun processes, in place.

    Order: resolve the plan; start the process group; check the degrees (and, with ``tp``,
    the head and MLP sizes); chunked / vocabulary-parallel loss; tensor parallel over the
    ``tp`` mesh dimension; activation checkpointing on the blocks; then FSDP2 (fsdp / zero2 /
    hsdp) or DDP (ddp / zero1) over the data-parallel mesh, with mixed precision and CPU
    offload as configured. Without torchrun (world size 1) only activation checkpointing,
    mixed precision and chunked loss apply.

    Returns the same module object (its class gains the FSDP / DDP mixin), so
    ``model.config``, ``model.generate`` and parameter names are unchanged. Build the
    optimizer afterwards, with :func:`hf_scale.build_optimizer`.

    Usage::

        model = AutoModelForCausalLM.from_pretrained(name)
        model = hf_scale.parallelize(model, {"strategy": "fsdp", "mixed_precision": "bf16"})
    """
    config = as_parallel_config(config)
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
    dims = mesh = layout = None
    if env.world_size > 1:
        # Degrees are checked before any collective: a bad layout fails on every rank alike.
        dims = ParallelDims.resolve(config, env.world_size, env.num_nodes)
        if dims.tp_enabled:
            layout = tp_layout(model, resolved, dims.tp)
    elif config.tp > 1:
        raise HfScaleConfigError(
            f"tp={config.tp} needs {config.tp} processes (or a multiple): start the script with "
            f"torchrun --nproc_per_node {config.tp} (found one process, no torchrun environment)."
        )

    units = wrap_units(model, resolved)
    keep_fp32 = fp32_modules(model, resolved) if dtype is not None else []
    tp_alone = dims is not None and dims.tp_enabled and dims.dp_degree == 1
    on_gpu = env.device.type != "cpu" and not _on_meta(model)
    if on_gpu and (dims is None or not config.sharded) and not tp_alone:
        # FSDP moves each unit itself, never holding the whole model there; DDP and one process
        # (nothing shards it) need the whole model on this rank's GPU. Tensor parallel alone moves
        # after splitting (below): each GPU then receives its shards, not the whole model.
        model.to(env.device)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config.loss_chunk_tokens:
        try:
            apply_chunked_loss(model, head, config.loss_chunk_tokens)
        except ValueError as e:
            raise HfScaleConfigError(str(e)) from None
    elif layout is not None and _vocab_sharded(model, head, layout):
        try:  # the loss on vocabulary shards; a model whose forward does not allow it gathers logits
            apply_chunked_loss(model, head, None)
        except ValueError as e:
            log_rank0(f"tensor parallel: the loss gathers the full logits ({e})", once=True)
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
        mesh = build_mesh(dims, env.device.type)
        dp_mesh = dims.dp_mesh(mesh)
        if layout is not None:
            apply_tp(model, mesh["tp"], layout.styles, layout.local_attrs, resolved.tied_weights)
            if on_gpu and tp_alone:
                model.to(env.device)  # the parameters tp left whole (norms, biases): shards are there
        if config.activation_checkpointing:
            _apply_ac(model, units, config)
        if dims.dp_degree == 1:  # tensor parallel alone: no data-parallel wrapper
            if dtype is not None:
                apply_autocast(model, dtype, env.device.type, keep_fp32)
        elif config.sharded:
            reshard = config.strategy != "zero2" and config.reshard_after_forward is not False
            apply_fsdp(
                model,
                dp_mesh,
                units,
                param_dtype=dtype,
                reshard_after_forward=reshard,
                cpu_offload=config.cpu_offload,
                fp32_modules=keep_fp32,
            )
        else:
            apply_ddp(model, dp_mesh)
            if dtype is not None:
                apply_autocast(model, dtype, env.device.type, keep_fp32)
        log_rank0(
            f"{config.strategy} over {dims.describe()} on {env.device.type} "
            f"({env.backend}); {len(units)} blocks of {', '.join(resolved.wrap_modules)}; "
            f"precision {config.mixed_precision or 'fp32'}"
        )
    setattr(model, STATE_ATTR, ParallelState(config, resolved, env, dims, mesh))
    return model


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
