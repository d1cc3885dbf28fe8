"""Pipeline stages built from the model's own modules (no tracing): prune, view, wrap.

``torch.distributed.pipelining``'s tracer fails on HF models (RoPE, cached forwards), so each
stage is made of the pretrained modules themselves, and runs the model's own forward:

- :func:`prune_to_stages` keeps, in the user's model, only the parameters of this rank's stages
  (in place: the rest is freed, or never materialised when the model is on the meta device).
  The block ``ModuleList`` keeps its original indices as keys, so parameter names, and so
  checkpoints, are those of the unsplit model. Modules of stages held elsewhere become
  parameter-free stand-ins: an embedding adds zeros, anything else passes the hidden states on.
- :func:`stage_module` gives one stage a *view* of that model: shallow copies of the modules on
  the path to what differs (the block list, the stand-ins), sharing every parameter. Every stage
  runs the base model's own forward from the microbatch's ``input_ids``, so transformers builds
  the causal mask, the positions and the rotary embeddings as it would in one process. On a
  later stage the embeddings are stand-ins that give zeros of the received hidden states' shape
  and dtype, and the first block it holds runs on the received hidden states in place of what
  the base forward computed before it (a forward pre-hook, for the length of the stage's
  forward). Whatever the base forward does to the embeddings before the blocks (a
  ``sqrt(d_model)`` scale, learned or sinusoidal positions, an embedding norm: BART-family
  decoders, XGLM, CTRL, Granite's multiplier) is therefore computed on stage 0 only, as in one
  process. The last stage runs the top model with ``labels`` and returns its loss, a sum over
  the microbatch's label tokens divided by the batch's count.

Usage::

    prune_to_stages(model, layout, [0])
    wrapper = stage_module(model, layout, 0)      # an nn.Module for PipelineStage
    hidden = wrapper(input_ids, attention_mask)   # a later stage: wrapper(hidden, mask, input_ids=ids)
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


class Received:
    """The hidden states a later stage received, set for the length of its forward."""

    tensor: torch.Tensor | None = None


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding held by the first stage. In a stage's view it gives zeros
    shaped as its indices plus the received hidden states' last dimension, in their dtype: the
    base forward's code up to the first block runs on them (masks and positions need the shape,
    eager masks the dtype), and the first block then takes the received hidden states instead."""

    def __init__(self, dim: int, dtype: torch.dtype, received: Received | None = None) -> None:
        super().__init__()
        self.dim, self.dtype, self.received = dim, dtype, received

    @property
    def weight(self) -> torch.Tensor:
        """An empty weight on the stage's device (Llama 4 moves the ids to ``embed_tokens.weight.device``)."""
        hidden = self.received.tensor if self.received is not None else None
        return torch.empty(0, self.dim, dtype=self.dtype, device=hidden.device if hidden is not None else "meta")

    def forward(self, *args, **kwargs) -> torch.Tensor:
        ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        hidden = self.received.tensor if self.received is not None else None
        if hidden is None:  # outside a stage's forward (the pruned model itself never runs)
            shape, dtype = (*ids.shape, self.dim) if ids is not None else (), self.dtype
            return torch.zeros(shape, dtype=dtype, device=ids.device if ids is not None else None)
        if ids is None:  # called with a shape (RoFormer's positions): one zero broadcasts
            return hidden.new_zeros(())
        return hidden.new_zeros((*ids.shape, hidden.shape[-1]))


class PassThrough(nn.Module):
    """Stands in for a module another stage runs (final norm, dropout, head): returns the
    hidden states it was given; on a later stage, a module that is given none (RoFormer's
    embeddings take keyword token ids) gives zeros shaped as the received hidden states."""

    def __init__(self, received: Received | None = None) -> None:
        super().__init__()
        self.received = received

    def forward(self, *args, **kwargs):
        for key in ("hidden_states", "inputs_embeds"):
            if kwargs.get(key) is not None:
                return kwargs[key]
        given = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        hidden = self.received.tensor if self.received is not None else None
        if given is None and hidden is not None:
            return torch.zeros_like(hidden)
        return given if given is not None else next(a for a in args if isinstance(a, torch.Tensor))


def is_stand_in(module: nn.Module) -> bool:
    """True for the parameter-free module a stage runs in place of another stage's module."""
    return isinstance(module, (ZeroEmbedding, PassThrough))


def stand_in(module: nn.Module, received: Received | None = None) -> nn.Module:
    if isinstance(module, ZeroEmbedding):
        return ZeroEmbedding(module.dim, module.dtype, received)
    if isinstance(module, nn.Embedding):
        return ZeroEmbedding(module.embedding_dim, module.weight.dtype, received)
    return PassThrough(received) if received is not None or not is_stand_in(module) else module


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
    received = Received()
    if stage != 0:
        for name in layout.first:
            _replace(view, name, stand_in(model.get_submodule(name), received), copied)
    if stage != layout.num_stages - 1:
        for name in layout.last:
            _replace(view, name, stand_in(model.get_submodule(name)), copied)
    return StageModule(view, layout.base, first=stage == 0, last=stage == layout.num_stages - 1,
                       entry=mine[min(mine)], exit=mine[max(mine)], received=received)


class StageModule(nn.Module):
    """One pipeline stage: ``(tokens or hidden states, attention_mask, labels, position_ids,
    input_ids) -> hidden states``, or the loss on the last stage. A later stage needs the
    microbatch's ``input_ids`` too (the pipeline passes them to every stage): its base forward
    runs from them up to the first block, which takes the received hidden states (see the module
    docstring). The model view is its only child, so under FSDP this module is the stage's root
    unit (the blocks are units of their own)."""

    def __init__(self, view: nn.Module, base: str, first: bool, last: bool, entry: nn.Module,
                 exit: nn.Module, received: Received | None = None) -> None:
        super().__init__()
        self.view = view
        self.base, self.first, self.last = base, first, last
        self.label_tokens: int = 1  # set by the pipeline before each batch: label tokens after the shift
        self.label_positions: int = 1  # and labelled positions (the shift not applied)
        # a top model that reduces its own loss to a mean (BART-family heads) ignores
        # num_items_in_batch: its microbatch means are weighted by their share of labels instead
        self.own_mean = last and not honours_num_items(view)
        # not submodules (the blocks are the view's; the holder is no module)
        self.__dict__.update(_entry=entry, _exit=exit, _received=received or Received())

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            input_ids = x
        elif input_ids is None:
            raise ValueError("a later pipeline stage needs the microbatch's input_ids beside the hidden states")
        inputs = {"input_ids": input_ids, "use_cache": False}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:  # every stage: rotary blocks read them, GPT-2 / OPT embed them
            inputs["position_ids"] = position_ids
        handles = []
        if not self.first:  # prepended: FSDP's pre-forward hook then casts what we pass
            handles.append(self._entry.register_forward_pre_hook(_Inject(x), with_kwargs=True, prepend=True))
        out: list[torch.Tensor] = []
        if not self.last:
            handles.append(self._exit.register_forward_hook(
                lambda m, a, o: out.append(o[0] if isinstance(o, (tuple, list)) else o)))
        self._received.tensor = None if self.first else x
        try:
            loss = self._run(inputs, labels)
        finally:
            self._received.tensor = None
            for handle in handles:
                handle.remove()
        if self.last:
            return loss
        # what the last block held here gave, as the next stage's first block takes it (DeepSeek-V4's
        # blocks pass several residual streams; the base forward merges them after its last block).
        # GPT-2's blocks return views; the zero-bubble schedules detach a stage's output in place
        # after the input gradient, which a view refuses.
        hidden = out[-1]
        return hidden.clone() if hidden._is_view() else hidden

    def _run(self, inputs: dict, labels: torch.Tensor | None) -> torch.Tensor | None:
        if not self.last:
            getattr(self.view, self.base)(**inputs)
            return None
        held = int((labels != -100).sum()) if self.own_mean else None
        if held == 0:  # its mean over no labels is NaN (and so would its gradients be): nothing to add
            out = self.view(**inputs)
            logits = out.logits if hasattr(out, "logits") else out[0]
            full = getattr(logits, "full_tensor", None)
            return (full() if full else logits).sum() * 0.0
        out = self.view(**inputs, labels=labels, num_items_in_batch=self.label_tokens)
        loss = out.loss if hasattr(out, "loss") else out[0]
        full = getattr(loss, "full_tensor", None)  # a tensor-parallel loss is a DTensor
        loss = full() if full else loss
        if self.own_mean:  # its mean is over the labelled positions it holds (no shift: BART's)
            loss = loss * (held / self.label_positions)
        return loss


def honours_num_items(model: nn.Module) -> bool:
    """Whether ``model``'s loss is transformers' ``loss_function``, which sums the token losses
    over ``num_items_in_batch`` (a microbatch's loss is then its share of the batch mean), not a
    ``CrossEntropyLoss()`` mean the forward computes itself. Read from the forward's source, as a
    signature does not tell (both take ``**kwargs``; and ``accepts_loss_kwargs = False``, which
    Qwen2.5-VL declares, is Trainer's business: its forward still hands them to ``loss_function``)."""
    import inspect

    try:
        return "loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source (compiled, interactive): assume transformers' loss
        return True


class _Inject:
    """Forward pre-hook of a later stage's first block: its hidden states are the received ones.
    Once per stage forward (a model that calls a block twice gets the received states once)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden: torch.Tensor | None = hidden

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            return None
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": hidden}
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"{type(module).__name__} received no hidden states to replace (first argument "
                             "or hidden_states=): pipeline parallel cannot feed this block")
        return (hidden, *args[1:]), kwargs


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
