"""A model's tensor-parallel layout: its plan's patterns expanded to module names, completed
for the vocabulary and tied weights, and checked against the tp degree before any collective.

Usage::

    layout = tp_layout(model, resolve_plan(model), tp=2)
    layout.styles        # {"model.layers.0.self_attn.q_proj": "colwise", ...}
    layout.local_attrs   # {"transformer.h.0.attn": ("split_size", "num_heads"), ...}
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import HfScalePlanError
from .adapters import lora_tp_styles
from .base import ModelPlan
from .ep import ExpertsLayout, experts_layout, experts_tp_split

# Config attributes tp must divide: each rank holds 1/tp of the heads and of the MLP width.
SIZE_ATTRS = {
    "num_attention_heads": "query heads",
    "n_head": "query heads",
    "num_heads": "query heads",
    "n_heads": "query heads",
    "encoder_attention_heads": "encoder heads",
    "decoder_attention_heads": "decoder heads",
    "num_key_value_heads": "key/value heads",
    "intermediate_size": "MLP intermediate size",
    "n_inner": "MLP intermediate size",
    "ffn_dim": "MLP intermediate size",
    "d_ff": "MLP intermediate size",
    "hidden_dim": "MLP intermediate size",
}
_STYLES = (
    "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise",
    "replicated_with_grad_allreduce", "replicate", "local_params", "mla_kv_a_proj", "all_reduce",
)
# styles that leave the module's own weight / bias whole (bare parameters are split by their own entries)
_WHOLE = ("replicate", "replicated_with_grad_allreduce", "local_params", "mla_kv_a_proj", "all_reduce")
_VOCAB_STYLES = ("embedding_rowwise", "colwise_gather_output")


@dataclass(frozen=True)
class TPLayout:
    """Module name -> style, and module name -> attributes divided by tp."""

    styles: dict[str, str]
    local_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # dotted: "config.num_heads"
    # experts module -> parameter -> (split dim or None, parts): see model_plans.ep.experts_tp_split
    experts: dict[str, dict[str, tuple[int | None, int]]] = field(default_factory=dict)
    # a bare per-head parameter (attention sinks, a gate bias) -> the dim split with its heads; its
    # module computes with the local shard ("local_params")
    params: dict[str, int] = field(default_factory=dict)


def replicated_kv_width(style: str) -> int:
    """The whole trailing features ``K`` of a ``colwise_replicated_kv:K`` style; 0 for others."""
    head, _, width = style.partition(":")
    return int(width) if head == "colwise_replicated_kv" and width.isdigit() and int(width) > 0 else 0


def heads_input(style: str) -> str:
    """The argument a ``heads_input:ARG`` style splits (an attention's ALiBi biases); "" for others."""
    head, _, arg = style.partition(":")
    return arg if head == "heads_input" and arg.isidentifier() else ""


def packed_parts(style: str) -> int:
    """Parts of a ``packed_colwise`` (2) or ``packed_colwise:N`` (N) style; 0 for others."""
    if style == "packed_colwise":
        return 2
    head, _, parts = style.partition(":")
    return int(parts) if head == "packed_colwise" and parts.isdigit() and int(parts) > 1 else 0


def tp_layout(model: nn.Module, plan: ModelPlan, tp: int, experts: ExpertsLayout | None = None) -> TPLayout:
    """Expand ``plan.tp_plan`` for ``model`` at degree ``tp``; raise :class:`HfScalePlanError` for
    a plan that does not fit (unknown style, pattern matching nothing, sizes tp does not divide).

    A mixture-of-experts model's experts (``experts``, else found from the plan) are split by
    :func:`~hf_scale.model_plans.ep.experts_tp_split` whatever the plan says of them:
    transformers' entries for the experts module and its fused parameters (``moe_tp_experts``,
    ``packed_colwise`` on ``experts.gate_up_proj``) and for the dense MLP of layers the model
    does not have (``mlp.gate_proj`` where every layer is MoE) are left to it."""
    name = type(model).__name__
    experts = experts if experts is not None else experts_layout(model, plan)
    if experts.is_moe or experts.unrouted:
        plan = plan.replace(tp_plan=_without_expert_entries(plan.tp_plan, dict(model.named_modules()), experts))
    if not plan.tp_plan and not experts.is_moe:
        why = plan.source.get("tp_plan", "")
        raise HfScalePlanError(
            f"{name} (model_type={plan.model_type!r}) has no tensor-parallel plan: transformers "
            "declares none, hf_scale's registry has none"
            + (f", and none is inferred from its modules: {why.partition(': ')[2].rstrip(')')}" if why.startswith("none (") else "")
            + ". Pass one, e.g. "
            "plan={'tp_plan': {'model.layers.*.self_attn.q_proj': 'colwise', ..., "
            "'model.layers.*.mlp.down_proj': 'rowwise'}}, or call hf_scale.register_plan("
            f"{plan.model_type!r}, tp_plan=...)."
        )
    _check_config_sizes(model, tp)
    modules = dict(model.named_modules())
    entries, params = _param_entries({k: v for k, v in plan.tp_plan.items() if v is not None}, modules, tp)
    styles = _expand(entries, modules, name, "tp_plan")
    for owner in {p.rpartition(".")[0] for p in params}:
        styles.setdefault(owner, "local_params")
    if "mla_kv_a_proj" in styles.values() and not isinstance(rope_dim(model), int):
        raise HfScalePlanError(
            f"tp_plan gives a module of {name} the style 'mla_kv_a_proj', which splits its output at the "
            "config's qk_rope_head_dim, and the config has none: give the module 'replicate' and its "
            "rope part's consumers a plan of their own."
        )
    for module_name, style in styles.items():
        if style not in _STYLES and not packed_parts(style) and not replicated_kv_width(style) \
                and not heads_input(style):
            raise HfScalePlanError(
                f"tp_plan gives {module_name!r} the style {style!r}, which hf_scale does not apply. "
                f"Styles: {', '.join(_STYLES)}, packed_colwise, packed_colwise:N, colwise_replicated_kv:K, "
                "heads_input:ARG."
            )
    styles = lora_tp_styles(styles, modules)  # a LoRA layer's style goes to its base and one factor
    _add_local_params(modules, styles)
    for module_name, style in styles.items():
        if style == "embedding_rowwise" and next(modules[module_name].children(), None) is not None:
            # its forward does more than the lookup (Inkling's holds a norm applied after it): each
            # rank would normalise its partial rows before the all-reduce. Whole on every rank.
            styles[module_name] = "replicate"
    _add_vocabulary(model, styles)
    _check_head(model, styles)
    _add_tied(model, plan, styles)
    for module_name, style in styles.items():
        _check_module(module_name, modules[module_name], style, tp)
    attrs = _expand(plan.tp_local_attrs, modules, name, "tp_local_attrs")
    for module_name, names in attrs.items():
        for attr in names:
            value = _getattr_path(modules[module_name], attr)
            if not isinstance(value, int):
                raise HfScalePlanError(f"tp_local_attrs: {module_name} has no integer attribute {attr!r}.")
            if value % tp:
                raise HfScalePlanError(f"tp={tp} does not divide {module_name}.{attr}={value}: choose a tp that divides it.")
    split = experts_tp_split(model, experts, tp) if experts.is_moe else {}
    return TPLayout(styles, {k: tuple(v) for k, v in attrs.items()}, split, params)


def rope_dim(model: nn.Module):
    """The rotary width an ``mla_kv_a_proj`` output ends with (the config's ``qk_rope_head_dim``)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "qk_rope_head_dim", None)


def _param_entries(patterns: dict, modules: dict[str, nn.Module], tp: int) -> tuple[dict, dict[str, int]]:
    """``patterns`` less the ``colwise`` / ``rowwise`` entries naming a bare parameter of a module
    (attention ``sinks`` ``[heads]``, a per-head ``gate_bias``, shared experts' stacked
    ``gate_proj`` ``[n, inter, hidden]``: transformers' plans shard them so), and those parameters'
    full names -> the dim split: transformers' ``colwise`` of a parameter splits ``ndim - 2`` (the
    only dim of a 1-D one), its ``rowwise`` the last dim of a matrix."""
    kept, params = {}, {}
    for key, style in patterns.items():
        regex, (owner, _, leaf) = _pattern(key), key.rpartition(".")
        if style not in ("colwise", "rowwise") or any(m and regex.fullmatch(m) for m in modules):
            kept[key] = style
            continue
        found = [m for m in modules if m and _pattern(owner).fullmatch(m)
                 and isinstance(modules[m]._parameters.get(leaf), nn.Parameter)
                 and not (isinstance(modules[m], (nn.Linear, nn.Embedding)) or is_conv1d(modules[m]))]
        if not found:
            kept[key] = style  # _expand says what it matches
            continue
        for m in found:
            param = modules[m]._parameters[leaf]
            if style == "rowwise" and param.dim() < 2:
                kept[key] = style  # a row-parallel bias stays whole: nothing to split
                break
            dim = max(param.dim() - 2, 0) if style == "colwise" else param.dim() - 1
            if param.shape[dim] % tp:
                raise HfScalePlanError(
                    f"tp={tp} does not divide {m}.{leaf} ({tuple(param.shape)}, split on dim {dim} with its "
                    "heads): choose a tp that divides the head count."
                )
            params[f"{m}.{leaf}"] = dim
    return kept, params


def _without_expert_entries(tp_plan, modules: dict[str, nn.Module], experts: ExpertsLayout) -> dict:
    """``tp_plan`` less its entries for the experts (the module, its parameters, anything inside)
    and those matching nothing under an MoE block (the dense MLP of layers this model lacks)."""
    names = tuple(experts.modules) + experts.unrouted  # unrouted experts: whole on every tp rank
    blocks = {n.rpartition(".")[0] for n in names}
    kept = {}
    for key, value in tp_plan.items():
        regex = _pattern(key)
        matched = [m for m in modules if m and regex.fullmatch(m)]
        owner = _pattern(key.rpartition(".")[0])
        if any(m == n or m.startswith(n + ".") for m in matched for n in names):
            continue
        if not matched and any(owner.fullmatch(n) or owner.fullmatch(b) for n in names for b in blocks):
            continue
        kept[key] = value
    return kept


def _getattr_path(obj, attr: str):
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def _pattern(key: str) -> re.Pattern:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


def _expand(patterns, modules: dict[str, nn.Module], model_name: str, what: str) -> dict:
    out = {}
    for key, value in patterns.items():
        regex = _pattern(key)
        matched = [m for m in modules if m and regex.fullmatch(m)]
        if not matched:
            owner, _, leaf = key.rpartition(".")
            params = [m for m in modules if m and _pattern(owner).fullmatch(m) and leaf in dict(modules[m].named_parameters(recurse=False))]
            if params:  # a parameter, as transformers' expert-parallel (MoE) plans name them
                raise HfScalePlanError(
                    f"{what} entry {key!r} names a parameter of {params[0]} ({type(modules[params[0]]).__name__}), "
                    f"not a module: hf_scale's tensor parallel shards Linear, Embedding and Conv1D "
                    f"modules and does not split experts. Drop the entry with plan={{'{what}': "
                    f"{{{key!r}: None}}}} (the experts then stay whole on every tp rank)."
                )
            close = difflib.get_close_matches(key, [re.sub(r"\.\d+\.", ".*.", m) for m in modules], n=3)
            raise HfScalePlanError(
                f"{what} pattern {key!r} matches no module of {model_name}. "
                f"Close module names: {sorted(set(close)) or 'none'}; '*' stands for one name component."
            )
        out.update(dict.fromkeys(matched, value))
    return out


def _check_config_sizes(model: nn.Module, tp: int) -> None:
    check_tp_sizes(getattr(model, "config", None), tp, type(model).__name__)


def check_tp_sizes(config, tp: int, name: str) -> None:
    """Refuse a ``tp`` that does not divide the heads or the MLP width of ``config`` (of the
    model ``name``): each rank must hold whole heads. Needs the config only, so the launcher
    checks it before starting any worker."""
    bad = []
    for attr, label in SIZE_ATTRS.items():
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            bad.append(f"{label} ({attr}={value})")
    if bad:
        raise HfScalePlanError(
            f"tp={tp} does not divide the {', '.join(bad)} of {name}: each rank must "
            f"hold whole heads and an equal part of the MLP. Choose a tp that divides them "
            f"({_divisors(config, tp)})."
        )


def _divisors(config, tp: int) -> str:
    sizes = [getattr(config, a) for a in SIZE_ATTRS if isinstance(getattr(config, a, None), int)]
    good = [d for d in range(2, max(sizes, default=1) + 1) if all(s % d == 0 for s in sizes)]
    return f"tp in {good[:6]}" if good else "no tp > 1 does"


def _add_vocabulary(model: nn.Module, styles: dict[str, str]) -> None:
    """The input embedding shards its vocabulary, and so does the output head (whose loss then
    never gathers the full logits), unless the plan says otherwise. A module whose forward does
    more than its own lookup or matmul (Inkling's embedding holds a norm applied after the
    lookup: it would normalise each rank's partial rows) stays whole."""
    names = {id(m): n for n, m in model.named_modules()}
    pairs = (("get_input_embeddings", "embedding_rowwise"), ("get_output_embeddings", "colwise_gather_output"))
    for getter, style in pairs:
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except (NotImplementedError, AttributeError):
            module = None
        name = names.get(id(module))
        if name and name not in styles and isinstance(module, (nn.Embedding, nn.Linear)) \
                and next(module.children(), None) is None:
            styles[name] = style


_COLS = ("colwise", "packed_colwise")
_ROWS = ("rowwise",)


def _add_local_params(modules: dict[str, nn.Module], styles: dict[str, str]) -> None:
    """Parameters that compute on a rank's local features (between a group's column- and
    row-parallel layers) but are whole on every rank get ``replicated_with_grad_allreduce``:
    their gradient on each rank covers its own heads / features only and must be summed.

    Found by shape, in the innermost modules holding both a column- and a row-parallel layer
    (an attention or an MLP, not the block holding both), for an unstyled module with parameters of its own that is not Linear / Embedding:
    a norm over the head width (``q_layernorm`` of ``[..., heads, head_dim]``: a 1-D weight
    narrower than the column-parallel outputs, whose widths it divides, and not as wide as their
    inputs -- multi-head latent attention's ``q_a_layernorm`` feeds ``q_b_proj`` whole) or an activation with scalar
    parameters (xIELU's ``alpha_p``, ``alpha_n``). Without it training diverges from one process
    by the missing gradient halves (the forward is right: a probe of the forward alone passes)."""
    groups = {}
    for group in modules:
        inside = [n for n in styles if group and n.startswith(group + ".")]
        cols = [n for n in inside if styles[n].startswith(_COLS)]
        if cols and any(styles[n] in _ROWS for n in inside):
            groups[group] = cols
    for group, cols in groups.items():
        if any(g.startswith(group + ".") for g in groups):  # a block holding its attention and MLP
            continue
        widths = {_out_features(modules[n]) for n in cols}
        inputs = {_in_features(modules[n]) for n in cols}
        for name, module in modules.items():
            if not name.startswith(group + ".") or name in styles or _under_styled(name, styles):
                continue
            own = dict(module.named_parameters(recurse=False))
            if not own or isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module):
                continue
            scalars = all(p.numel() == 1 for p in own.values())
            weight = own.get("weight")
            per_head = (weight is not None and weight.dim() == 1 and weight.shape[0] not in inputs
                        and all(w > weight.shape[0] and w % weight.shape[0] == 0 for w in widths))
            if scalars or per_head:
                styles[name] = "replicated_with_grad_allreduce"


def _out_features(module: nn.Module) -> int:
    weight = module.weight
    return int(weight.shape[1] if is_conv1d(module) else weight.shape[0])


def _in_features(module: nn.Module) -> int:
    weight = module.weight
    return int(weight.shape[0] if is_conv1d(module) else weight.shape[-1])


def _under_styled(name: str, styles: dict[str, str]) -> bool:
    parts = name.split(".")
    return any(styles.get(".".join(parts[:i]), "local_params") != "local_params"
               and not heads_input(styles[".".join(parts[:i])]) for i in range(1, len(parts)))


def _check_head(model: nn.Module, styles: dict[str, str]) -> None:
    """The output head must give the loss whole-vocabulary logits: ``colwise`` alone would hand
    transformers' loss each rank's vocabulary slice (an index error, or a device assert).
    ``rowwise_split_input`` (Inkling's plan) sums whole logits over the ranks' hidden features."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    style = styles.get(name) if name else None
    if style is not None and style not in ("colwise_gather_output", "replicate", "rowwise_split_input"):
        raise HfScalePlanError(
            f"tp_plan gives the output head {name!r} the style {style!r}; the loss and generate need "
            "the whole vocabulary's logits: use 'colwise_gather_output' (training still computes the "
            "loss on vocabulary shards, without gathering) or 'replicate'."
        )


def _add_tied(model: nn.Module, plan: ModelPlan, styles: dict[str, str]) -> None:
    """A module whose weight is tied to a sharded one gets a style with the same placement."""
    for target, source in plan.tied_weights:
        t_mod, s_mod = target.rpartition(".")[0], source.rpartition(".")[0]
        for a, b in ((t_mod, s_mod), (s_mod, t_mod)):
            if a not in styles and b in styles and styles[b] != "replicate":
                a_module = model.get_submodule(a)
                if not (isinstance(a_module, (nn.Linear, nn.Embedding)) or is_conv1d(a_module)):
                    continue  # a head holding its decoder's bias: re-tied to the sharded one by apply_tp
                if styles[b] in _VOCAB_STYLES:
                    styles[a] = "embedding_rowwise" if isinstance(a_module, nn.Embedding) else "colwise_gather_output"
                elif type(a_module) is type(model.get_submodule(b)):
                    styles[a] = styles[b]


def shard_dim(module: nn.Module, param_name: str, style: str) -> int | None:
    """The dimension of ``module.<param_name>`` that ``style`` splits over the tp ranks, or None
    when it stays whole: replicated modules, a row-parallel bias (added after the all-reduce)
    and a packed bias (DTensor takes each rank's part columns in forward)."""
    if style in _WHOLE or replicated_kv_width(style) or heads_input(style) or param_name not in ("weight", "bias"):
        return None
    rowwise = style in ("rowwise", "rowwise_split_input", "embedding_rowwise")
    if param_name == "bias":
        return None if rowwise or packed_parts(style) else 0
    if isinstance(module, nn.Embedding) or is_conv1d(module):  # Conv1D: [in, out]
        return 0 if rowwise else 1
    return 1 if rowwise else 0  # Linear: [out, in]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a Linear with the weight stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _check_module(name: str, module: nn.Module, style: str, tp: int) -> None:
    if style in _WHOLE:
        return
    if heads_input(style):
        import inspect

        if heads_input(style) not in inspect.signature(module.forward).parameters:
            raise HfScalePlanError(
                f"tp_plan gives {name} ({type(module).__name__}) the style {style!r}, and its forward takes no "
                f"argument {heads_input(style)!r}: name the argument that holds a slice per attention head."
            )
        return
    weight = getattr(module, "weight", None)
    kind = type(module).__name__
    if not (isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module)):
        raise HfScalePlanError(
            f"tp_plan shards {name} ({kind}); hf_scale's styles apply to Linear, Embedding and "
            "Conv1D modules. Name its Linear sub-modules instead."
        )
    tail = replicated_kv_width(style)
    if tail:
        out = weight.shape[0] if isinstance(module, nn.Linear) else 0
        if not isinstance(module, nn.Linear) or not 0 < tail < out or (out - tail) % tp:
            raise HfScalePlanError(
                f"tp_plan gives {name} ({kind}, {out} output features) the style {style!r}: it needs a Linear "
                f"whose first {out - tail} features (the query heads) tp={tp} divides and whose last {tail} "
                "(the shared key/value heads) stay whole. Check the width, or use 'replicate'."
            )
        return
    if style in _VOCAB_STYLES or weight is None:
        return  # vocabularies may split unevenly (DTensor pads the last shard)
    size = weight.shape[shard_dim(module, "weight", style)]
    parts = packed_parts(style) or 1
    if size % (tp * parts):
        what = f"{parts} packed parts of {size // parts}" if parts > 1 else f"{size}"
        raise HfScalePlanError(
            f"tp={tp} does not divide {name} ({style}): its sharded dimension holds {what} "
            "features. Choose a tp that divides it."
        )
