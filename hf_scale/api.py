"""``parallelize``: the library's front door. It resolves the configuration (``"auto"``: the
planner's choice) and applies it in a fixed order (:mod:`hf_scale.orchestrate`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .config import ParallelConfig, as_parallel_config, is_auto_request
from .model_plans import ModelPlan
from .orchestrate import apply_parallelism
from .parallel_state import get_state  # noqa: F401 - imported from here by the checkpoint and train modules

__all__ = ["is_auto_request", "parallelize", "resolve_parallel_config"]


def parallelize(
    model: nn.Module,
    config: ParallelConfig | Mapping[str, Any] | str | None = None,
    *,
    plan: ModelPlan | Mapping[str, Any] | None = None,
) -> nn.Module:
    """Distribute a (pretrained) transformers model over the torchrun processes, in place.

    Order (:func:`hf_scale.orchestrate.apply_parallelism`, one step a line): resolve the plan;
    start the process group; check the degrees (and, with ``tp``, the head and MLP sizes) and
    build the mesh; keep this rank's pipeline stages; chunked / vocabulary-parallel loss; tensor
    parallel over the ``tp`` mesh dimension; activation checkpointing on the blocks; then FSDP2
    (fsdp / zero2 / hsdp) or DDP (ddp / zero1) over the data-parallel mesh, with mixed precision
    and CPU offload as configured; the pipeline schedule. Without torchrun (world size 1) only
    activation checkpointing, mixed precision, chunked loss and packed attention apply. ``config="auto"`` (or
    ``{"strategy": "auto", ...}`` with fields to keep) asks :mod:`hf_scale.layout_search` for the
    fastest layout that fits this world size and device memory, and logs it.

    Returns the same module object (its class gains the FSDP / DDP mixin), so
    ``model.config``, ``model.generate`` and parameter names are unchanged. Build the
    optimizer afterwards, with :func:`hf_scale.build_optimizer`.

    Usage::

        model = AutoModelForCausalLM.from_pretrained(name)
        model = hf_scale.parallelize(model, {"strategy": "fsdp", "mixed_precision": "bf16"})
    """
    return apply_parallelism(model, resolve_parallel_config(model, config), plan)


def resolve_parallel_config(model: nn.Module, config, quantize: str | None = None) -> ParallelConfig:
    """``config`` as a ParallelConfig; ``"auto"`` (or ``strategy: auto``) becomes the planner's
    choice for ``model`` (a real or meta model; ``quantize="nf4"``: its LoRA base to be held in
    NF4), decided on rank 0 for every rank, logged. The one way from the library into the
    application's planner (DESIGN)."""
    if is_auto_request(config):
        from .layout_search.auto import resolve_auto

        return resolve_auto(model, config, quantize=quantize)  # parallelize's workload: one sequence per rank
    return as_parallel_config(config)
