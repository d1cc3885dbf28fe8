"""``ModelPlan``: what hf_scale must know about a model architecture, as data.

A plan names module classes and parameter names; it holds no torch.distributed logic. The
engine (``hf_scale.parallel``) reads it. Plans come from what transformers declares
(:mod:`hf_scale.model_plans.from_hf`), completed by entries of the registry below, keyed by
``config.model_type``, where transformers declares nothing or something we cannot use.

Usage::

    register_plan("my_arch", wrap_modules=("MyBlock",))        # a new architecture
    parallelize(model, plan={"wrap_modules": ("MyBlock",)})    # one run's override
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import HfScalePlanError


@dataclass(frozen=True)
class ModelPlan:
    """The model knowledge the engine needs.

    Attributes:
        model_type: ``config.model_type`` the plan was resolved for.
        wrap_modules: class names of the repeated blocks. Each instance becomes one FSDP unit
            and one activation-checkpointing unit; everything else (embeddings, final norm,
            heads) lives in the root unit, which keeps tied input/output embeddings together.
        keep_fp32_modules: module-name components (``"wo"`` matches ``...DenseReluDense.wo``)
            whose parameters and compute stay fp32 under mixed precision.
        tied_weights: ``(target, source)`` parameter names that share storage.
        tp_plan: tensor-parallel styles per module pattern, in transformers' vocabulary, with
            names from the top model (``"model.layers.*.self_attn.q_proj": "colwise"``, as
            transformers' ``model.tp_plan`` gives them); ``*`` matches one name component. Read
            by :func:`hf_scale.model_plans.tp.tp_layout` and applied by the tensor-parallel engine.
        tp_local_attrs: module pattern -> integer attributes its forward uses as head counts or
            split sizes (GPT-2's ``split_size``); divided by the tp degree after sharding.
        ep_plan: expert-parallel entries, transformers' ``base_model_ep_plan`` vocabulary with
            names from the top model: the experts module (``"model.layers.*.mlp.experts":
            "ep_dispatch_experts"``) and its expert-indexed weights (``"...experts.gate_up_proj":
            "grouped_gemm"``, dim 0 = expert). Read by :func:`hf_scale.model_plans.ep.ep_layout`.
        pp_plan: pipeline stages' module names and their inputs/outputs, as transformers
            declares them (``base_model_pp_plan``).
        source: where each field came from, for ``hf-scale plan`` and error messages.
    """

    model_type: str
    wrap_modules: tuple[str, ...]
    keep_fp32_modules: tuple[str, ...] = ()
    tied_weights: tuple[tuple[str, str], ...] = ()
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    tp_local_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    ep_plan: Mapping[str, str] = field(default_factory=dict)
    pp_plan: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **fields: Any) -> ModelPlan:
        return dataclasses.replace(self, **fields)


# Fields a registry entry or a user override may set.
OVERRIDABLE = ("wrap_modules", "keep_fp32_modules", "tp_plan", "tp_local_attrs", "ep_plan", "pp_plan")

_REGISTRY: dict[str, dict[str, Any]] = {}


def register_plan(model_type: str, **fields: Any) -> None:
    """Record plan fields for ``model_type`` that transformers does not declare.

    Only the fields given are set; the rest still come from transformers. Registering a
    model type twice replaces its entry. ``tp_plan`` and ``tp_local_attrs`` patterns are
    relative to the base model, as transformers' ``base_model_tp_plan`` (``"h.*.attn.c_attn"``
    for GPT-2; the ``transformer.`` prefix of GPT2LMHeadModel is added when resolving);
    ``tp_plan`` may also be a function of the model's config returning such a dict.
    """
    check_override_fields(fields, f"register_plan({model_type!r})")
    _REGISTRY[model_type] = {k: _freeze(v) for k, v in fields.items()}


def extend_plan(model_type: str, **fields: Any) -> None:
    """Add fields to ``model_type``'s registry entry, keeping the fields it has (the tp and pp
    registries each add theirs to the encoders' ``wrap_modules``)."""
    register_plan(model_type, **{**registered_fields(model_type), **fields})


def registered_fields(model_type: str) -> dict[str, Any]:
    """The registry entry for ``model_type`` (empty when there is none)."""
    return dict(_REGISTRY.get(model_type, {}))


def registered_model_types() -> list[str]:
    return sorted(_REGISTRY)


def check_override_fields(fields: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(fields) - set(OVERRIDABLE))
    if unknown:
        raise HfScalePlanError(
            f"{where}: unknown plan field(s) {unknown}; a plan sets {', '.join(OVERRIDABLE)}."
        )


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, set, frozenset)):
        return tuple(sorted(value)) if isinstance(value, (set, frozenset)) else tuple(value)
    if isinstance(value, str):
        return (value,)
    return value
