"""Resolve a :class:`ModelPlan` for a model: transformers' declarations, then the registry,
then the user's overrides, and check the result against the model's real modules.

transformers declares ``_no_split_modules`` (the blocks), ``_keep_in_fp32_modules``,
``_tied_weights_keys``, ``config.base_model_tp_plan`` and ``config.base_model_pp_plan``. Where
it declares no blocks and the registry has no entry, the class of the longest ``ModuleList`` of
identical modules is used: that is the block stack in every HF transformer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from torch import nn

from ..errors import HfScalePlanError
from .base import ModelPlan, _freeze, check_override_fields, registered_fields
from .tp_infer import collapse, infer_tp_plan


def resolve_plan(model: nn.Module, overrides: ModelPlan | Mapping[str, Any] | None = None) -> ModelPlan:
    """The plan for ``model``: declared fields < registry entry < ``overrides``.

    ``overrides`` may be a full :class:`ModelPlan` (used as is, after checking) or a mapping
    of the fields to change. Raises :class:`HfScalePlanError` when a plan names modules the
    model lacks or would put tied weights in different units.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    ties = find_tied_parameters(model)
    if isinstance(overrides, ModelPlan):
        plan = overrides.replace(tied_weights=ties)
        _check(model, plan, strict=True)
        return plan

    fields: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in _declared_fields(model).items():
        if value:
            fields[name], source[name] = value, "transformers"
    if fields.get("tp_plan"):
        kept = _matching_entries(model, fields["tp_plan"])
        if len(kept) < len(fields["tp_plan"]):
            # transformers' plan lists the modules of every variant of the architecture (DeepSeek-V2's
            # q_proj exists only without q_lora_rank): those this model lacks are dropped, and the
            # rest is checked on a probe batch like an inferred plan
            fields["tp_plan"], source["tp_plan"] = kept, PRUNED
    for name, value in registered_fields(model_type).items():
        if name in ("tp_plan", "tp_local_attrs", "ep_plan"):
            value = _from_base(model, value(config) if callable(value) else value)
        fields[name], source[name] = value, f"registry:{model_type}"
    if overrides:
        check_override_fields(overrides, "plan override")
        for name, value in overrides.items():
            if name in ("tp_plan", "tp_local_attrs", "ep_plan"):  # extends (and overrides entries of) the plan
                value = {**fields.get(name, {}), **dict(value)}
            fields[name], source[name] = _freeze(value), "user"

    if source.get("wrap_modules") in ("transformers", f"registry:{model_type}"):
        # A declared list names classes of sibling models too (Qwen3.5's text model lists its
        # vision block): keep the ones this model has; a list matching nothing still fails below.
        fields["wrap_modules"] = _present_classes(model, fields["wrap_modules"])
    if source.get("wrap_modules") == "transformers":
        # transformers' no-split modules may include embeddings tied to a head: drop those.
        fields["wrap_modules"] = tuple(
            cls for cls in fields["wrap_modules"] if not _splits_ties(model, {cls}, ties)
        )
    if not fields.get("wrap_modules"):
        block = _longest_block_list(model)
        if block is None:
            raise HfScalePlanError(
                f"cannot tell the repeated blocks of {type(model).__name__} "
                f"(model_type={model_type!r}): transformers declares no _no_split_modules and "
                "it has no ModuleList of identical blocks. Pass "
                "plan={'wrap_modules': ('MyBlockClass',)} or call register_plan()."
            )
        fields["wrap_modules"], source["wrap_modules"] = (block,), "inferred"
    plan = ModelPlan(model_type=model_type, tied_weights=ties, source=source, **fields)
    _check(model, plan, strict=source.get("keep_fp32_modules") != "transformers")
    if not plan.tp_plan:
        plan = with_inferred_tp(model, plan)
    return plan


def with_inferred_tp(model: nn.Module, plan: ModelPlan, candidate: int = 0) -> ModelPlan | None:
    """``plan`` with the tp plan inferred from ``model``'s structure (:mod:`.tp_infer`), its
    ``candidate``-th guess (None past the last), marked ``inferred`` (``parallelize`` checks it
    before use); where
    nothing can be inferred, the source says why (``tp_layout`` refuses with that)."""
    units = wrap_units(model, plan)
    names = {id(m): n for n, m in model.named_modules()}
    inferred = infer_tp_plan(model, [(names[id(u)], u) for u in units])
    source = dict(plan.source)
    if not inferred.candidates:
        source["tp_plan"] = f"none (not inferred: {inferred.reason})"
        return plan.replace(source=source)
    if candidate >= len(inferred.candidates):
        return None
    modules = dict(model.named_modules())
    source["tp_plan"] = source["tp_local_attrs"] = "inferred"
    whole = list(inferred.whole)
    if inferred.attention_whole(candidate):
        whole.insert(0, "every attention (its sharded forms did not match one process on the probe batch)")
    if whole:
        source["tp_whole"] = "; ".join(whole[:4]) + (" ..." if len(whole) > 4 else "")
    return plan.replace(tp_plan=collapse(inferred.candidates[candidate], modules),
                        tp_local_attrs=collapse(inferred.attrs_for(candidate), modules), source=source)


PRUNED = "transformers, entries for absent modules dropped"


def _matching_entries(model: nn.Module, patterns: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``patterns`` that match a module or a parameter of ``model``."""
    from .tp import _pattern

    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    return {k: v for k, v in patterns.items() if any(_pattern(k).fullmatch(n) for n in names)}


def wrap_units(model: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    """The block instances named by ``plan.wrap_modules``, outermost only, in model order."""
    wanted = set(plan.wrap_modules)
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in wanted and module is not model:
            units.append(module)
            inside.update(id(m) for m in module.modules())
    return units


def fp32_modules(model: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    """Modules kept in fp32 under mixed precision: a name component matches the plan."""
    patterns = set(plan.keep_fp32_modules)
    return [
        module
        for name, module in model.named_modules()
        if name and patterns.intersection(name.split(".")) and any(True for _ in module.parameters())
    ]


def find_tied_parameters(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """``(target, source)`` names of parameters that are the same tensor as an earlier one."""
    first: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return tuple(ties)


def _from_base(model: nn.Module, patterns: Mapping[str, Any]) -> dict[str, Any]:
    """Patterns relative to the base model -> relative to ``model`` (``h.*`` -> ``transformer.h.*``)."""
    prefix = base_model_name(model)
    if not prefix:
        return dict(patterns)
    return {f"{prefix}.{key}": value for key, value in patterns.items()}


def base_model_name(model: nn.Module) -> str:
    """The attribute holding the base model: ``base_model_prefix``, or where that names nothing
    (Llama 4's causal LM says ``language_model`` and holds ``model``) the one child that is a
    transformers model itself; "" when there is none."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:  # a base model itself (T5's encoder-only model holds T5Stacks)
        return ""
    inner = [n for n, c in model.named_children() if hasattr(c, "config") and hasattr(c, "base_model_prefix")]
    return inner[0] if len(inner) == 1 else ""


def _declared_fields(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    tp_plan = getattr(model, "tp_plan", None)  # transformers: full names, head and embeddings included
    if not isinstance(tp_plan, Mapping):
        tp_plan = _from_base(model, getattr(config, "base_model_tp_plan", None) or {})
    fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    fp32 |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return {
        "wrap_modules": _freeze(set(getattr(model, "_no_split_modules", None) or ())),
        "keep_fp32_modules": tuple(sorted(fp32)),
        "tp_plan": dict(tp_plan),
        "ep_plan": _from_base(model, getattr(config, "base_model_ep_plan", None) or {}),
        "pp_plan": dict(getattr(config, "base_model_pp_plan", None) or {}),
    }


def _present_classes(model: nn.Module, classes: tuple[str, ...]) -> tuple[str, ...]:
    """``classes`` less those of which ``model`` has no instance; all of them when it has none
    (so the check names the whole list)."""
    present = {type(m).__name__ for m in model.modules()}
    kept = tuple(cls for cls in classes if cls in present)
    return kept or classes


def _longest_block_list(model: nn.Module) -> str | None:
    best, best_len = None, 1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > best_len:
            classes = {type(child).__name__ for child in module}
            if len(classes) == 1:
                best, best_len = classes.pop(), len(module)
    return best


def _unit_params(model: nn.Module, classes: set[str]) -> dict[str, str]:
    """Parameter name -> name of the unit (an instance of ``classes``) that holds it."""
    owner = {}
    for mod_name, module in model.named_modules():
        if type(module).__name__ in classes:
            for p_name, _ in module.named_parameters(remove_duplicate=False):
                owner.setdefault(f"{mod_name}.{p_name}", mod_name)
    return owner


def _splits_ties(model: nn.Module, classes: set[str], ties) -> list[tuple[str, str]]:
    owner = _unit_params(model, classes)
    return [(a, b) for a, b in ties if owner.get(a) != owner.get(b)]


def _check(model: nn.Module, plan: ModelPlan, strict: bool) -> None:
    present = defaultdict(int)
    for module in model.modules():
        present[type(module).__name__] += 1
    missing = [cls for cls in plan.wrap_modules if cls not in present]  # no lookup: it would add the key
    if missing:
        raise HfScalePlanError(
            f"plan for {type(model).__name__} wraps {missing}, which the model does not "
            f"contain. Module classes it has: {sorted(present)[:40]}."
        )
    split = _splits_ties(model, set(plan.wrap_modules), plan.tied_weights)
    if split:
        raise HfScalePlanError(
            f"wrap_modules={list(plan.wrap_modules)} would put tied weights in different FSDP "
            f"units: {split}. Leave the tied embedding out of wrap_modules (it stays in the "
            "root unit)."
        )
    if strict and plan.keep_fp32_modules:
        names = {part for name, _ in model.named_modules() for part in name.split(".")}
        unknown = [p for p in plan.keep_fp32_modules if p not in names]
        if unknown:
            raise HfScalePlanError(
                f"keep_fp32_modules names {unknown}, which match no module of "
                f"{type(model).__name__}; give a module name component such as 'wo'."
            )
