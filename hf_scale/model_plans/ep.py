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

import inspect
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
    # experts modules not called as transformers' routed experts (``experts(hidden_states,
    # top_k_index, top_k_weights)``; Llama 4's take tokens already scattered per expert): neither
    # ep nor tp splits them; tp leaves them whole on every rank
    unrouted: tuple[str, ...] = ()

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
    unrouted = tuple(n for n in found if not _routed(modules[n]))
    found = {n: p for n, p in found.items() if n not in unrouted}
    counts = {modules[n].get_parameter(p[0]).shape[0] for n, p in found.items()}
    if len(counts) > 1:
        raise HfScalePlanError(
            f"{type(model).__name__}: its experts modules hold different numbers of experts {sorted(counts)}; "
            "hf_scale's expert parallel splits one count evenly. Pass plan={'ep_plan': {...}} naming "
            "the modules to split."
        )
    return ExpertsLayout(found, counts.pop() if counts else 0, source, unrouted)


def moe_blocks(model: nn.Module, units: list[nn.Module], modules) -> frozenset[int]:
    """Indices into ``units`` (the wrap units, in order) of the blocks holding one of the experts
    ``modules`` (their names in ``model``)."""
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(unit)] + "." for unit in units]
    return frozenset(i for i, prefix in enumerate(prefixes) if any(m.startswith(prefix) for m in modules))


def _routed(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes transformers' routed experts arguments (hidden states,
    top-k expert ids, top-k weights), which expert parallel and the tp split rely on."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return sum(p.kind in kinds for p in params) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


def check_ep(layout: ExpertsLayout, model: nn.Module, plan: ModelPlan, ep: int) -> None:
    """Refuse an ``ep`` this model cannot take: a dense model, or experts ``ep`` does not divide."""
    name = type(model).__name__
    if not layout.is_moe and layout.unrouted:
        raise HfScalePlanError(
            f"ep={ep}: the experts of {name} ({layout.unrouted[0]}, {type(model.get_submodule(layout.unrouted[0])).__name__}) "
            "are not called as transformers' routed experts, experts(hidden_states, top_k_index, "
            "top_k_weights) (the model scatters the tokens per expert itself), which hf_scale's expert "
            "parallel exchanges by all-to-all. Train it without ep: fsdp shards its experts, tp leaves "
            "them whole on every tp rank."
        )
    wrapped = sorted(n for n, m in model.named_modules()
                     if type(getattr(m, "base_layer", None)).__name__.endswith("Experts"))
    if not layout.is_moe and wrapped:
        raise HfScalePlanError(
            f"ep={ep}: the experts of {name} ({wrapped[0]}, ...) carry peft adapters on their "
            "parameters (LoRA target_parameters, or target_modules='all-linear', which peft applies to "
            "experts), which expert parallel does not split. Leave the experts out of the LoRA targets "
            "(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']), or train without ep (fsdp "
            "shards them)."
        )
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


def experts_tp_split(model: nn.Module, layout: ExpertsLayout, tp: int) -> dict[str, dict[str, tuple[int | None, int]]]:
    """How tensor parallel splits each expert over ``tp`` ranks: its intermediate dimension, as
    Megatron splits an MLP. Experts module -> parameter -> ``(dim, parts)``: ``dim`` the split
    dimension (None: whole on every rank), ``parts`` 2 for a fused ``[gate; up]`` split per part
    (rank r holds ``[gate_r; up_r]``, what the forward's ``chunk(2)`` expects), 1 for a plain
    split (an interleaved ``gate_up`` keeps its pairs whole: a contiguous even slice), 0 for the
    ``down_proj`` bias, added once (on the first tp rank) to the partial sums.

    The layout follows transformers' experts contract (``integrations/moe.py``: ``gate_up_proj``
    / ``up_proj``, ``down_proj`` and their ``_bias``; ``is_transposed`` stores ``[E, in, out]``;
    ``is_concatenated=False`` interleaves gate and up), not a model name."""
    out: dict[str, dict[str, tuple[int | None, int]]] = {}
    for name, params in layout.modules.items():
        module = model.get_submodule(name)
        transposed = bool(getattr(module, "is_transposed", False))
        concatenated = bool(getattr(module, "is_concatenated", True))
        split = {}
        for p in params:
            shape = tuple(module.get_parameter(p).shape)
            base, bias = p.removesuffix("_bias"), p.endswith("_bias")
            if base == "down_proj":
                split[p] = (None, 0) if bias else (1 if transposed else 2, 1)
            elif base in ("gate_up_proj", "up_proj"):
                parts = 2 if base == "gate_up_proj" and concatenated else 1
                split[p] = (1 if bias or not transposed else 2, parts)
            else:
                raise HfScalePlanError(
                    f"{name}.{p} {list(shape)}: hf_scale's tensor-parallel experts split gate_up_proj / "
                    "up_proj / down_proj (and their _bias), transformers' experts layout; it cannot tell "
                    f"how to split {p!r}. Leave the experts whole with tp (plan={{'tp_plan': ...}}) or use ep."
                )
            dim, parts = split[p]
            if dim is not None and shape[dim] % (tp * parts):
                raise HfScalePlanError(
                    f"tp={tp} does not divide {name}.{p} {list(shape)} on its intermediate dimension "
                    f"({shape[dim]}{f' = {parts} packed parts' if parts > 1 else ''}): each tp rank holds an "
                    "equal slice of every expert. Choose a tp that divides the experts' intermediate size."
                )
        out[name] = split
    return out


def _match(pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    regex = re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [m for m in modules if m and regex.fullmatch(m)]
