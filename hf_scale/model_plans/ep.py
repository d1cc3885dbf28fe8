"""A mixture-of-experts model's expert layout: which modules hold the experts, which of their
weights are indexed by expert (dim 0), and how many experts there are; checked against the
expert-parallel degree before any collective.

transformers 5 stores a layer's experts as fused 3-D parameters (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) in an experts module called as
``experts(hidden_states, top_k_index, top_k_weights)`` by its MoE block, after the model's own
router. The layout comes from the plan's ``ep_plan`` (transformers' ``base_model_ep_plan``:
``"...experts": "ep_dispatch_experts"``, ``"...experts.gate_up_proj": "grouped_gemm"``), else is
inferred: a module whose class name ends in ``Experts`` with a ``num_experts`` attribute, and its
parameters whose first dimension is that count.

Usage::

    layout = experts_layout(model, resolve_plan(model))
    layout.modules     # {"model.layers.0.mlp.experts": ("gate_up_proj", "down_proj"), ...}
    check_ep(layout, model, plan, ep=2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import HfScalePlanError
from .base import ModelPlan

DISPATCH_STYLE = "ep_dispatch_experts"
WEIGHT_STYLES = ("grouped_gemm", "local_colwise", "local_rowwise", "local_packed_rowwise")


@dataclass(frozen=True)
class ExpertsLayout:
    """Experts module name -> its expert-indexed parameter names; the number of experts."""

    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    num_experts: int = 0
    source: str = "none"

    @property
    def is_moe(self) -> bool:
        return bool(self.modules)


def experts_layout(model: nn.Module, plan: ModelPlan) -> ExpertsLayout:
    """The experts of ``model``: from ``plan.ep_plan`` where declared, else inferred."""
    modules = dict(model.named_modules())
    declared = {k: v for k, v in (plan.ep_plan or {}).items() if v is not None}
    found: dict[str, list[str]] = {}
    source = "inferred"
    if declared:
        source = plan.source.get("ep_plan", "transformers")
        for key, style in declared.items():
            if style == DISPATCH_STYLE:
                for name in _match(key, modules):
                    found.setdefault(name, [])
        for key, style in declared.items():
            if style == DISPATCH_STYLE:
                continue
            owner, _, leaf = key.rpartition(".")
            for name in _match(owner, modules):
                if name in found and leaf in dict(modules[name].named_parameters(recurse=False)):
                    found[name].append(leaf)
    if not found:  # nothing declared, or declared names this model lacks (a renamed block)
        source = "inferred"
        for name, module in modules.items():
            count = getattr(module, "num_experts", None)
            if type(module).__name__.endswith("Experts") and isinstance(count, int):
                found[name] = [p for p, t in module.named_parameters(recurse=False) if t.dim() >= 2 and t.shape[0] == count]
    found = {n: tuple(p) for n, p in found.items() if p}
    counts = {modules[n].get_parameter(p[0]).shape[0] for n, p in found.items()}
    if len(counts) > 1:
        raise HfScalePlanError(
            f"{type(model).__name__}: its experts modules hold different numbers of experts {sorted(counts)}; "
            "hf_scale's expert parallel splits one count evenly. Pass plan={'ep_plan': {...}} naming "
            "the modules to split."
        )
    return ExpertsLayout(found, counts.pop() if counts else 0, source)


def check_ep(layout: ExpertsLayout, model: nn.Module, plan: ModelPlan, ep: int) -> None:
    """Refuse an ``ep`` this model cannot take: a dense model, or experts ``ep`` does not divide."""
    name = type(model).__name__
    if not layout.is_moe:
        raise HfScalePlanError(
            f"ep={ep} but {name} (model_type={plan.model_type!r}) has no mixture-of-experts layers: "
            "transformers declares no base_model_ep_plan and no module holds expert-indexed weights "
            "(an '...Experts' module with num_experts). Drop ep (use dp_shard / tp), or pass "
            "plan={'ep_plan': {'model.layers.*.mlp.experts': 'ep_dispatch_experts', "
            "'model.layers.*.mlp.experts.gate_up_proj': 'grouped_gemm', ...}}."
        )
    if layout.num_experts % ep:
        divisors = [d for d in range(1, layout.num_experts + 1) if layout.num_experts % d == 0]
        raise HfScalePlanError(
            f"ep={ep} does not divide the {layout.num_experts} experts of {name} "
            f"(model_type={plan.model_type!r}): each expert-parallel rank holds num_experts / ep whole "
            f"experts. Choose ep in {divisors}."
        )


def _match(pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    regex = re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [m for m in modules if m and regex.fullmatch(m)]
