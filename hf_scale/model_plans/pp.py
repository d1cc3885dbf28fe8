"""Pipeline stages from a model's ``pp_plan``: which modules each stage runs, and where to cut.

The plan (transformers' ``base_model_pp_plan`` or our registry) names the base model's modules
in forward order; the one that is a ``ModuleList`` is the block stack. Entries before it run on
the first stage only (embeddings), entries after it on the last stage only (final norm), and the
top model's own modules outside the base model (``lm_head``) on the last stage too. Modules the
plan leaves out (rotary embeddings: buffers only) run on every stage.

The default cut balances each stage's compute, counted as matmul parameters per token (forward
and backward both scale with it): a block's parameters, the head's weight on the last stage
(tied or not: it is a full vocabulary matmul), nothing for an embedding lookup. In small models
the head is worth several blocks (SmolLM2-135M: 28M head parameters, 3.5M per block), so the
last stage gets fewer blocks.

Usage::

    layout = pp_layout(model, plan, pp=2)
    layout.stage_blocks        # ((0, ..., 18), (19, ..., 29)) for SmolLM2
    layout.stages_of(pp_rank=1)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import HfScaleConfigError, HfScalePlanError
from .base import ModelPlan
from .from_hf import base_model_name


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model is cut into pipeline stages, and which pp rank runs each stage."""

    base: str  # attribute of the top model holding the base model ("model", "transformer")
    blocks: str  # dotted path of the block ModuleList from the top model ("model.layers")
    first: tuple[str, ...]  # dotted paths of first-stage-only modules ("model.embed_tokens")
    last: tuple[str, ...]  # last-stage-only modules, the head included ("model.norm", "lm_head")
    stage_blocks: tuple[tuple[int, ...], ...]
    stage_ranks: tuple[int, ...]  # pp rank of each stage
    costs: tuple[int, ...]  # relative compute per stage (matmul parameters per token)
    params: tuple[int, ...]  # parameters each stage holds (a tied head counted on both ends)
    head: str  # dotted path of the output head ("lm_head")

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pp rank ``pp_rank`` runs, in order."""
        return [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]

    @property
    def balance(self) -> float:
        """Slowest / fastest stage by estimated compute (1.0 = perfectly balanced)."""
        return max(self.costs) / max(min(self.costs), 1)


def pp_layout(
    model: nn.Module,
    plan: ModelPlan,
    pp: int,
    stages_per_rank: int = 1,
    v_shape: bool = False,
    split_points: Sequence[int] | None = None,
) -> PipelineLayout:
    """Cut ``model`` into ``pp * stages_per_rank`` stages; raise a clear error when it cannot be.

    ``v_shape`` places stages as a V (rank r runs stages r and 2p-1-r: the zbv schedule);
    otherwise in a loop (stage s on rank s % pp). ``split_points`` are the first block of every
    stage after the first; None balances the stages' compute.
    """
    _check_causal_lm(model)
    _check_stagewise(model)
    _check_router_loss(model)
    base_name = base_model_name(model) or getattr(model, "base_model_prefix", "")
    base = getattr(model, base_name, None) if base_name else None
    if not isinstance(base, nn.Module):
        raise HfScalePlanError(
            f"{type(model).__name__} has no base model attribute (base_model_prefix={base_name!r}): "
            "pipeline parallel cuts the base model's block stack."
        )
    entries = list(plan.pp_plan) or _inferred_entries(base, plan)
    modules = dict(base.named_modules())
    # a module the architecture leaves out in this config (OPT's project_in / project_out are
    # None when word_embed_proj_dim == hidden_size) is skipped, not missing
    entries = [e for e in entries if e in modules or not _set_to_none(base, e)]
    missing = [e for e in entries if e not in modules]
    if missing:
        raise HfScalePlanError(
            f"pp_plan of {type(model).__name__} names {missing}, which its base model does not have. "
            "Fix the plan: parallelize(model, config, plan={'pp_plan': {...}}) or register_plan()."
        )
    lists = [i for i, e in enumerate(entries) if isinstance(modules[e], nn.ModuleList)]
    if len(lists) != 1:
        raise HfScalePlanError(
            f"pp_plan of {type(model).__name__} must name exactly one block ModuleList; it names "
            f"{[entries[i] for i in lists] or 'none'} among {entries}. Pass "
            "plan={'pp_plan': {...}} to parallelize (transformers' base_model_pp_plan format) or "
            "call hf_scale.register_plan(model_type, pp_plan=...)."
        )
    cut = lists[0]
    blocks = modules[entries[cut]]
    head_name, head = _head(model)
    outside = [n for n, _ in model.named_children() if n != base_name]
    others = [e for e in entries[:cut] + entries[cut + 1 :] if modules[e] is not None]
    # first stage: what is registered before the blocks (a vision tower that a text probe does not
    # run stays with the embeddings), and what the forward runs before them wherever registered
    called, fed = _before_blocks(base, tuple(others), blocks) or (set(), [])
    if fed:
        raise HfScaleConfigError(
            f"pipeline parallel cannot split {type(model).__name__} yet: its base forward hands the output of "
            f"{base_name}.{fed[0]} to every block beside the hidden states, and only the first stage would "
            "hold it. Use fsdp / tp for this model, or pp=1."
        )
    before = set(entries[:cut]) | called
    first = tuple(f"{base_name}.{e}" for e in others if e in before)
    last = tuple(f"{base_name}.{e}" for e in others if e not in before) + tuple(outside)

    stages = pp * stages_per_rank
    count = len(blocks)
    if stages > count:
        raise HfScaleConfigError(
            f"pp={pp} x {stages_per_rank} stage(s) per rank = {stages} stages, but "
            f"{type(model).__name__} has {count} blocks: a stage needs at least one. Lower pp or "
            "pp_stages_per_rank."
        )
    block_cost = [_numel(b) for b in blocks]
    first_cost = 0  # embedding lookups: no matmul
    last_cost = sum(_numel(model.get_submodule(n)) for n in last if n != head_name) + _numel(head)
    if split_points is None:
        bounds = _balanced(block_cost, stages, first_cost, last_cost)
    else:
        bounds = _check_points(list(split_points), stages, count)
    stage_blocks = tuple(tuple(range(a, b)) for a, b in pairwise(bounds))
    costs = [sum(block_cost[i] for i in idx) for idx in stage_blocks]
    costs[0] += first_cost
    costs[-1] += last_cost
    held = [sum(block_cost[i] for i in idx) for idx in stage_blocks]
    held[0] += sum(_numel(model.get_submodule(n)) for n in first)
    held[-1] += sum(_numel(model.get_submodule(n)) for n in last)
    if v_shape:
        ranks = tuple(s if s < pp else 2 * pp - 1 - s for s in range(stages))
    else:
        ranks = tuple(s % pp for s in range(stages))
    return PipelineLayout(
        base=base_name,
        blocks=f"{base_name}.{entries[cut]}",
        first=first,
        last=last,
        stage_blocks=stage_blocks,
        stage_ranks=ranks,
        costs=tuple(costs),
        params=tuple(held),
        head=head_name,
    )


# Architectures whose stages do not compose (a hang in the architecture scan of 2026-11-26), each
# with the reason a user reads.
_SECOND_STREAM = ("its base forward carries a second stream from block to block beside the hidden "
                  "states ({}), which a stage boundary does not pass on (the scan saw the stages hang)")
NOT_STAGEWISE = {
    "hy_v4": _SECOND_STREAM.format("a 'shared' layer reuses the previous full layer's top-k selection"),
    "inkling2_text": _SECOND_STREAM.format("block_states, the hidden states of every block boundary"),
    "inkling2_loop_text": _SECOND_STREAM.format("block_states, the hidden states of every block boundary"),
}


def _check_stagewise(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if model_type in NOT_STAGEWISE:
        raise HfScaleConfigError(
            f"pipeline parallel cannot split {type(model).__name__} yet: {NOT_STAGEWISE[model_type]} "
            f"(model_type {model_type!r}). Use fsdp / tp for this model, or pp=1."
        )


def _check_router_loss(model: nn.Module) -> None:
    """A mixture-of-experts model whose loss adds the routers' load-balancing term
    (``output_router_logits=True``) cannot be cut into stages: the term is computed from every
    layer's router logits together (a product of two means over all layers' tokens, not a sum
    per layer), and the last stage sees its own layers' only. Run, it would add that stage's term
    once per microbatch (measured: Qwen3-MoE's loss off by twice the term at pp=2)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise HfScaleConfigError(
            f"pipeline parallel with {type(model).__name__}'s load-balancing loss (config."
            "output_router_logits=True): the loss needs every layer's router logits in one place, "
            "and a pipeline stage holds only its own layers. Set model.config.output_router_logits = "
            "False before parallelize (the loss without the auxiliary term), or use ep / tp / fsdp "
            "for this model (they keep the term)."
        )


def _check_causal_lm(model: nn.Module) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {v for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(v, str)}
    config = getattr(model, "config", None)
    if type(model).__name__ not in names or getattr(config, "is_encoder_decoder", False):
        raise HfScaleConfigError(
            f"pipeline parallel supports causal language models (AutoModelForCausalLM) so far, not "
            f"{type(model).__name__}: encoders, classifiers and encoder-decoders are not supported "
            "yet. Use strategy='fsdp' (and tp) for this model, or pp=1."
        )


def _head(model: nn.Module) -> tuple[str, nn.Module]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = next((n for n, m in model.named_modules() if m is head), None)
    if not isinstance(head, nn.Linear) or name is None:
        raise HfScalePlanError(
            f"{type(model).__name__} has no Linear output head (get_output_embeddings() gave "
            f"{type(head).__name__}): the last pipeline stage computes the loss through it. Use "
            "fsdp / tp for this model, or pp=1."
        )
    return name, head


def _inferred_entries(base: nn.Module, plan: ModelPlan) -> list[str]:
    """No declared plan: the base model's children in registration order, the block list
    among them; parameter-free modules other than dropout run everywhere (left out)."""
    wanted = set(plan.wrap_modules)

    def is_blocks(child: nn.Module) -> bool:
        # a list of the wrap units, or of modules holding them (RoBERTa-PreLayerNorm's
        # _no_split_modules names its attention, not its layer)
        return isinstance(child, nn.ModuleList) and len(child) > 0 and any(
            type(m).__name__ in wanted for m in child[0].modules())

    def holds_blocks(module: nn.Module) -> bool:
        return any(is_blocks(m) for m in module.modules())

    entries, tail, prefix, node = [], [], "", base
    while True:
        # the blocks one level down (BERT's encoder.layer, BART's decoder.layers): the child that
        # holds them is entered and its children listed in its place, dotted
        inner = [(n, c) for n, c in node.named_children() if not is_blocks(c) and holds_blocks(c)]
        if len(inner) > 1:  # a vision tower beside the language model: the text blocks are the stages'
            inner = [(n, c) for n, c in inner if "language" in n or "text" in n] or inner
        if any(is_blocks(c) for c in node.children()) or len(inner) != 1:
            break
        children = [n for n, c in node.named_children() if _numel(c) or isinstance(c, nn.Dropout) or n == inner[0][0]]
        at = children.index(inner[0][0])
        entries += [prefix + n for n in children[:at]]
        tail = [prefix + n for n in children[at + 1:]] + tail  # RoBERTa-PreLayerNorm's final LayerNorm
        prefix, node = f"{prefix}{inner[0][0]}.", inner[0][1]
    names = [n for n, c in node.named_children() if is_blocks(c) or isinstance(c, nn.Dropout) or _numel(c)]
    return entries + [prefix + n for n in names] + tail


class _MetaScalars(TorchDispatchMode):
    """On the meta device, a tensor's value read as a Python scalar (``.item()``, ``bool(t.all())``:
    transformers' mask code checks for padding) is 1 / True: the probe below only records which
    modules run, and the mask of all-ones probe tokens has no padding anyway."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


class _Reached(Exception):
    """Raised by the probe's hook on the first block: the rest of the forward is not needed."""


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> {entries: probe result}


def _before_blocks(base: nn.Module, names: tuple[str, ...], blocks: nn.ModuleList):
    """:func:`_run_before_blocks`, once per base model and entries (the planner asks per layout)."""
    seen = _PROBED.setdefault(base, {})
    if names not in seen:
        seen[names] = _run_before_blocks(base, {n: base.get_submodule(n) for n in names}, blocks)
    return seen[names]


def _run_before_blocks(base: nn.Module, candidates: dict[str, nn.Module],
                       blocks: nn.ModuleList) -> tuple[set[str], list[str]] | None:
    """Which of ``candidates`` the base forward runs before its first block, and which of those
    hand their output to the block beside the hidden states, from one forward on two tokens
    stopped at that block (no block runs; on the meta device if the model is there).

    A module registered after the blocks may run before them (BART-family decoders'
    ``layernorm_embedding``) and one named for the embeddings may run after (LFM2's
    ``embedding_norm`` is its final norm): the order of registration tells neither. A module
    whose output (or a view of it) reaches the block as another argument (RoFormer's sinusoidal
    positions) is needed on every stage, which a stage split does not give.
    None when the forward cannot be run this way (registration order then decides alone)."""
    called: set[str] = set()
    outputs: list[tuple[str, torch.Tensor]] = []  # held: a freed output's id could be reused

    def ran(name, module, args, out):
        called.add(name)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                outputs.append((name, t))

    fed: list[str] = []

    def stop(module, args, kwargs):
        rest = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")]
        for t in rest:
            if isinstance(t, torch.Tensor):
                name = next((n for n, o in outputs if t is o or t._base is o), None)
                if name and name not in fed:
                    fed.append(name)
        raise _Reached

    handles = [m.register_forward_hook(lambda mod, a, o, name=n: ran(name, mod, a, o)) for n, m in candidates.items()]
    handles.append(blocks[0].register_forward_pre_hook(stop, with_kwargs=True))
    param = next(base.parameters(), None)
    ids = torch.zeros((1, 2), dtype=torch.long, device=param.device if param is not None else "cpu")
    modes = [(m, m.training) for m in base.modules()]
    # eval, and the random state put back: dropout before the blocks draws nothing from the run's
    devices = [ids.device] if ids.device.type == "cuda" else []
    try:
        with torch.no_grad(), _MetaScalars(), torch.random.fork_rng(devices=devices):
            base.eval()
            base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except _Reached:
        return called, fed
    except Exception:  # noqa: BLE001 - a forward that needs more than token ids: fall back
        return None
    finally:
        for module, mode in modes:
            module.training = mode
        for handle in handles:
            handle.remove()
    return None  # the blocks never ran


def _set_to_none(base: nn.Module, dotted: str) -> bool:
    """True when ``base.<dotted>`` exists as an attribute whose value is None."""
    *parents, leaf = dotted.split(".")
    node = base
    for part in parents:
        node = getattr(node, part, None)
        if node is None:
            return False
    return hasattr(node, leaf) and getattr(node, leaf) is None


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _balanced(cost: list[int], stages: int, first: int, last: int) -> list[int]:
    """Stage bounds minimising the costliest stage (contiguous blocks, each stage non-empty)."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def span(a: int, b: int, s: int) -> int:
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == stages - 1 else 0)

    inf = float("inf")
    # best[s][b]: the smallest max cost placing blocks [0, b) in stages 0..s; cut[s][b] its last cut.
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for b in range(1, n + 1):
        best[0][b] = span(0, b, 0)
    for s in range(1, stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], span(a, b, s))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return [0] + bounds[::-1]


def _check_points(points: list[int], stages: int, count: int) -> list[int]:
    if len(points) != stages - 1:
        raise HfScaleConfigError(
            f"pp_split_points={points} gives {len(points) + 1} stages, but pp x stages per rank = "
            f"{stages}: give {stages - 1} split points (the first block of every stage after the first)."
        )
    bounds = [0, *points, count]
    if any(not isinstance(p, int) for p in points) or any(a >= b for a, b in pairwise(bounds)):
        raise HfScaleConfigError(
            f"pp_split_points={points}: must be increasing block indices between 1 and {count - 1} "
            f"(the model has {count} blocks), so every stage gets at least one block."
        )
    return bounds
