"""Pipeline stages built from the model's own modules (no tracing): prune, view, wrap.

``torch.distributed.pipelining``'s tracer fails on HF models (RoPE, cached forwards), so each
stage is made of the pretrained modules themselves, and runs the model's own forward:

- :func:`prune_to_stages` keeps, in the user's model, only the parameters of this rank's stages
  (in place: the rest is freed, or never materialised when the model is on the meta device).
  The block ``ModuleList`` keeps its original indices as keys, so parameter names, and so
  checkpoints, are those of the unsplit model. Modules of stages held elsewhere become
  parameter-free stand-ins: an embedding adds zeros, anything else passes the hidden states on.
- :func:`stage_module` gives one stage a *view* of that model: shallow copies of the modules on
  the path to what differs (the block list, the stand-ins), sharing every parameter. The first
  stage runs the base model from ``input_ids``, later ones from the received hidden states
  (``inputs_embeds``): transformers then builds the causal mask and the rotary embeddings on
  each stage as it would in one process. The last stage runs the top model with ``labels`` and
  returns its loss, a sum over the microbatch's label tokens divided by the batch's count.

Usage::

    prune_to_stages(model, layout, [0])
    wrapper = stage_module(model, layout, 0)      # an nn.Module for PipelineStage
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from ..model_plans.pp import PipelineLayout


class SparseModuleList(nn.ModuleList):
    """The blocks a rank holds, keyed by their index in the whole model (``layers.17``).

    Iterating and slicing (``self.layers[: config.num_hidden_layers]``) yield the held blocks in
    order, which is what transformers' forwards do with their block list.
    """

    def __init__(self, blocks: dict[int, nn.Module] | Iterable[nn.Module] | None = None) -> None:
        super().__init__()
        if isinstance(blocks, dict):
            for index, block in sorted(blocks.items()):
                self._modules[str(index)] = block
        elif blocks is not None:  # slicing builds the class from a list
            for index, block in enumerate(blocks):
                self._modules[str(index)] = block

    def indices(self) -> list[int]:
        return [int(k) for k in self._modules]


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding held by the first stage: adds nothing (GPT-2's position
    embeddings are added to the received hidden states on every stage)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, *args, **kwargs) -> torch.Tensor:
        # one zero (0-dim: it broadcasts, and adds nothing nor promotes a bf16 sum to fp32)
        ids = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros((), dtype=self.dtype, device=ids.device)


class PassThrough(nn.Module):
    """Stands in for a module another stage runs (final norm, dropout, head): returns the
    hidden states it was given."""

    def forward(self, *args, **kwargs):
        for key in ("hidden_states", "inputs_embeds"):
            if kwargs.get(key) is not None:
                return kwargs[key]
        return next(a for a in args if isinstance(a, torch.Tensor))


def is_stand_in(module: nn.Module) -> bool:
    """True for the parameter-free module a stage runs in place of another stage's module."""
    return isinstance(module, (ZeroEmbedding, PassThrough))


def stand_in(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return ZeroEmbedding(module.embedding_dim, module.weight.dtype)
    return module if is_stand_in(module) else PassThrough()


def prune_to_stages(model: nn.Module, layout: PipelineLayout, stages: list[int]) -> None:
    """Keep in ``model`` only what ``stages`` run (in place); see the module docstring.

    A head tied to the input embedding, both held here (a V schedule puts the first and the last
    stage on one rank), gets its own copy of the weight: each stage is then one FSDP unit with its
    own parameters, and the pipeline sums the two gradients, as it does across ranks.
    """
    held = {i for s in stages for i in layout.stage_blocks[s]}
    blocks = model.get_submodule(layout.blocks)
    _replace(model, layout.blocks, SparseModuleList({i: blocks[i] for i in sorted(held)}))
    first, last = 0 in stages, layout.num_stages - 1 in stages
    for name in () if first else layout.first:
        _replace(model, name, stand_in(model.get_submodule(name)))
    for name in () if last else layout.last:
        _replace(model, name, stand_in(model.get_submodule(name)))
    if first and last:
        head = model.get_submodule(layout.head)
        embedded = {id(p) for n in layout.first for p in model.get_submodule(n).parameters()}
        if id(head.weight) in embedded:
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)


def stage_module(model: nn.Module, layout: PipelineLayout, stage: int) -> StageModule:
    """The module ``PipelineStage`` runs for ``stage`` (held by this rank: pruned ``model``)."""
    view = _shallow(model)
    copied = {id(view)}
    blocks = model.get_submodule(layout.blocks)
    mine = {i: blocks._modules[str(i)] for i in layout.stage_blocks[stage]}
    _replace(view, layout.blocks, SparseModuleList(mine), copied)
    _stage_config(view.get_submodule(layout.blocks.rpartition(".")[0]), sorted(mine), sum(map(len, layout.stage_blocks)))
    if stage != 0:
        for name in layout.first:
            _replace(view, name, stand_in(model.get_submodule(name)), copied)
    if stage != layout.num_stages - 1:
        for name in layout.last:
            _replace(view, name, stand_in(model.get_submodule(name)), copied)
    return StageModule(view, layout.base, first=stage == 0, last=stage == layout.num_stages - 1)


class StageModule(nn.Module):
    """One pipeline stage: ``(tokens or hidden states, attention_mask, position_ids, labels) ->
    hidden states``,
    or the loss on the last stage. The model view is its only child, so under FSDP this module
    is the stage's root unit (the blocks are units of their own)."""

    def __init__(self, view: nn.Module, base: str, first: bool, last: bool) -> None:
        super().__init__()
        self.view = view
        self.base, self.first, self.last = base, first, last
        self.label_tokens: int = 1  # set by the pipeline before each batch

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"input_ids" if self.first else "inputs_embeds": x, "use_cache": False}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:  # every stage: rotary blocks read them, GPT-2 / OPT embed them
            inputs["position_ids"] = position_ids
        if not self.last:
            out = getattr(self.view, self.base)(**inputs)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            # GPT-2 returns a view (.view(output_shape)); the zero-bubble schedules detach a
            # stage's output in place after the input gradient, which a view refuses.
            return hidden.clone() if hidden._is_view() else hidden
        out = self.view(**inputs, labels=labels, num_items_in_batch=self.label_tokens)
        loss = out.loss if hasattr(out, "loss") else out[0]
        full = getattr(loss, "full_tensor", None)  # a tensor-parallel loss is a DTensor
        return full() if full else loss


_MODULE_DICTS = (
    "_modules", "_parameters", "_buffers", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)


def _stage_config(loop: nn.Module, held: list[int], total: int) -> None:
    """The module that loops over the blocks (a copy in the stage's view) gets a config whose
    per-layer lists (``layer_types``: sliding / full attention, linear / full...) are those of
    the blocks it holds: transformers' loops index them by the position in the block list
    (``enumerate(self.layers)``), which starts at 0 on every stage."""
    config = getattr(loop, "config", None)
    if config is None or len(held) == total:
        return
    lists = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == total}
    if not lists:
        return
    staged = copy.copy(config)
    staged.__dict__.update({k: type(v)(v[i] for i in held) for k, v in lists.items()})  # no validation: a view
    loop.__dict__["config"] = staged


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s parameters, buffers, children and hooks, whose
    containers can be changed without changing ``module``."""
    new = copy.copy(module)
    for attr in _MODULE_DICTS:
        if attr in module.__dict__:
            object.__setattr__(new, attr, copy.copy(module.__dict__[attr]))
    return new


def _replace(root: nn.Module, dotted: str, new: nn.Module, copied: set[int] | None = None) -> None:
    """Set ``root.<dotted>`` to ``new``; with ``copied``, copy each parent on the way first
    (copy on write), so ``root`` is a view and the original model is unchanged."""
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        child = node._modules[part]
        if copied is not None and id(child) not in copied:
            child = _shallow(child)
            copied.add(id(child))
            node._modules[part] = child
        node = child
    node._modules[leaf] = new
