"""Tensor parallel: shard a model's layers over the ``tp`` mesh dimension with PyTorch's DTensor
styles (``torch.distributed.tensor.parallel``), following a plan of module names -> styles.

The styles use transformers' vocabulary, so a ``tp_plan`` written for transformers works here:

====================== ===================================================================
``colwise``            output features sharded (Linear weight dim 0, Conv1D weight dim 1,
                       Embedding weight dim 1); input replicated, output stays local
                       ``Shard(-1)`` (the local heads of an attention projection)
``rowwise``            input features sharded; input local ``Shard(-1)``, output all-reduced
``colwise_gather_output`` ``colwise`` whose output is all-gathered (replicated)
``rowwise_split_input`` ``rowwise`` whose replicated input is split locally (no collective)
``embedding_rowwise``  an Embedding's vocabulary sharded; output all-reduced
``packed_colwise``     a fused ``[a; b]`` projection (gate_up): each part split by ``tp``, so
                       rank r holds ``[a_r; b_r]`` (``_StridedShard``, split_factor 2) and its
                       output is ``[a_r, b_r]`` -- what the model's ``chunk(2)`` expects
``packed_colwise:N``   the same for N equal parts (fused ``q; k; v``: N = 3)
``replicated_with_grad_allreduce`` a per-head norm between a colwise and a rowwise layer
                       (Qwen3's ``q_norm``): weight whole on every rank, input the local
                       heads (``[..., heads, head_dim]``, ``Shard(-2)``); DTensor sums the
                       weight's gradient over the tp ranks, each of which saw its own heads
``colwise_replicated_kv:K`` a fused ``[q; k; v]`` Linear with one key/value head (multi-query):
                       weight whole on every rank; it computes this rank's query rows and the
                       last ``K`` features (k, v) whole; gradients summed over the tp ranks
``heads_input:ARG``    a module's argument ``ARG`` holding a slice per head for every head on its
                       first dim (ALiBi biases, ``[batch x heads, ...]``): this rank's heads kept
``replicate``          nothing: parameters stay whole on every tp rank
====================== ===================================================================

Modules: ``nn.Linear``, ``nn.Embedding`` and transformers' ``Conv1D`` (GPT-2, weight
``[in, out]``). :func:`apply_tp` never names a model; the plan says what goes where.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor._api import _ToTorchTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from ..model_plans.tp import heads_input, is_conv1d, packed_parts, replicated_kv_width, rope_dim
from . import tp_local
from .group_grad import copy_to_group, sum_over_group

# styles applied by forward hooks on a module that is not itself sharded (apply_tp, after the rest)
HOOK_STYLES = ("local_params", "mla_kv_a_proj", "all_reduce")


def apply_tp(
    model: nn.Module,
    tp_mesh,
    styles: dict[str, str],
    local_attrs: dict[str, tuple[str, ...]] | None = None,
    ties: tuple[tuple[str, str], ...] = (),
    params: dict[str, int] | None = None,
) -> None:
    """Shard the modules named in ``styles`` (full module names -> style) over ``tp_mesh``.

    Sharded parameters become ``DTensor`` s on ``tp_mesh``; others stay plain tensors, whole on
    every rank. ``local_attrs`` names integer attributes of modules (head counts, split sizes)
    that the module's forward uses on its local shard: they are divided by the tp degree.
    ``ties`` (``(target, source)`` parameter names, the plan's ``tied_weights``) are tied again
    afterwards: each module distributes its own copy, so both sides must get the same placement.
    ``params`` (full parameter name -> dim) are bare parameters split on that dim (attention
    sinks, per head); their modules have the style ``local_params``: their forward computes
    with the local shards of their own parameters.

    Usage::

        apply_tp(model, mesh["tp"], {"model.layers.0.self_attn.q_proj": "colwise", ...})
    """
    tp = tp_mesh.size()
    nf4 = {name: style for name, style in styles.items() if _has_nf4_weight(model.get_submodule(name))}
    plan = {name: _style(model.get_submodule(name), style) for name, style in styles.items()
            if style != "replicate" and style not in HOOK_STYLES and not replicated_kv_width(style)
            and not heads_input(style) and name not in nf4}
    parallelize_module(model, tp_mesh, plan)
    for name, style in nf4.items():  # QLoRA's NF4 base: computed on local NF4 slices, never by DTensor
        _nf4_style(model.get_submodule(name), tp_mesh, name, style)
    for name, dim in (params or {}).items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        param = module._parameters[leaf]
        module.register_parameter(leaf, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(dim)]),
                                                     requires_grad=param.requires_grad))
    for name, style in styles.items():
        if style in ("local_params", "all_reduce"):
            _compute_locally(model.get_submodule(name))
        if style == "all_reduce":
            _sum_partial_output(model.get_submodule(name), tp_mesh)
        elif style == "mla_kv_a_proj":
            _sum_rope_grad(model.get_submodule(name), tp_mesh, rope_dim(model))
        elif replicated_kv_width(style):
            _replicated_kv(model.get_submodule(name), tp_mesh, replicated_kv_width(style))
        elif heads_input(style):
            _split_heads_input(model.get_submodule(name), tp_mesh, heads_input(style), _global_heads(model, name))
    for name, attrs in (local_attrs or {}).items():
        module = model.get_submodule(name)
        for attr in attrs:
            _divide_attr(module, attr, tp)
    _retie(model, ties)


def _has_nf4_weight(module: nn.Module) -> bool:
    from ..quantize.nf4 import is_nf4

    return is_nf4(getattr(module, "weight", None))


def _nf4_style(module: nn.Module, tp_mesh, name: str, style: str) -> None:
    """An NF4 Linear (a QLoRA base) under ``style``: local slices (:mod:`.tp_nf4`), or refused."""
    from .tp_nf4 import NF4_TP_STYLES, apply_nf4_tp

    if style == "replicate":
        return
    if style not in NF4_TP_STYLES or type(module) is not nn.Linear:
        from ..errors import HfScaleConfigError

        raise HfScaleConfigError(
            f"tensor parallel: {name} holds an NF4 (4-bit) base weight under the {style!r} style; NF4 bases are "
            f"split under {', '.join(NF4_TP_STYLES)} only (DTensor's dispatch on NF4 is wrong in backward). "
            "Leave that layer out of the LoRA target_modules, or use tp=1 with quantize='nf4'.")
    apply_nf4_tp(module, tp_mesh, style)


def _divide_attr(module: nn.Module, attr: str, tp: int) -> None:
    """``module.<attr> //= tp``. A dotted attribute (``"config.num_attention_heads"``, read by
    Phi-3's attention) is set on a copy of the object it lives in, made for this module alone:
    the config is shared by the whole model and must keep the global counts."""
    owner = module
    *path, leaf = attr.split(".")
    if path:
        for part in path[:-1]:
            owner = getattr(owner, part)
        copied = copy.copy(getattr(owner, path[-1]))
        setattr(owner, path[-1], copied)
        owner = copied
    setattr(owner, leaf, getattr(owner, leaf) // tp)


def _style(module: nn.Module, style: str):
    if style == "replicated_with_grad_allreduce":
        return _local_path(PerHeadReplicated(), "replicated")
    conv1d = is_conv1d(module)
    parts = packed_parts(style)
    if parts:
        packed = PackedColwise(parts, conv1d=conv1d)
        return packed if conv1d else _local_path(packed, "packed")
    if conv1d:  # (no local inference path: Conv1D's forward reshapes to its global width)
        return {"colwise": Conv1DColwise(), "colwise_gather_output": Conv1DColwise(output_layouts=Replicate()),
                "rowwise": Conv1DRowwise(), "rowwise_split_input": Conv1DRowwise(input_layouts=Replicate())}[style]
    make, kind, gather = {
        "colwise": (lambda: ColwiseParallel(), "colwise", False),
        "rowwise": (lambda: RowwiseParallel(), "rowwise", False),
        "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=Replicate()), "colwise", True),
        "rowwise_split_input": (lambda: RowwiseParallel(input_layouts=Replicate()), "rowwise_split", False),
        "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), "embedding_rowwise", False),
    }[style]
    made = make()
    made._prepare_output_fn = _prepare_output
    return _local_path(made, kind, gather)


def _local_path(style, kind: str, gather: bool = False):
    """Give ``style`` the plain-tensor inference path of :mod:`.tp_local` (no_grad forwards);
    other forwards keep the style's DTensor hooks. (torch checks the hooks' arity: the layouts
    torch binds first, then module, inputs/outputs, mesh.)"""
    base_in, base_out = style._prepare_input_fn, style._prepare_output_fn

    def enter(mod, inputs, mesh, *bound):
        local = tp_local.enter(mod, inputs, mesh, kind)
        return local if local is not None else base_in(*bound, mod, inputs, mesh)

    def leave(mod, outputs, mesh, *bound):
        done = tp_local.leave(mod, outputs, mesh, kind, gather)
        return done if done is not None else base_out(*bound, mod, outputs, mesh)

    if len(inspect.signature(base_in).parameters) == 5:
        style._prepare_input_fn = lambda a, b, mod, inputs, mesh: enter(mod, inputs, mesh, a, b)
    else:
        style._prepare_input_fn = lambda mod, inputs, mesh: enter(mod, inputs, mesh)
    if len(inspect.signature(base_out).parameters) == 5:
        style._prepare_output_fn = lambda a, b, mod, outputs, mesh: leave(mod, outputs, mesh, a, b)
    else:
        style._prepare_output_fn = lambda mod, outputs, mesh: leave(mod, outputs, mesh)
    return style



class _OwnedLocal(_ToTorchTensor):
    """``DTensor.to_local`` whose result is not an autograd view: torch's returns
    ``local.view_as(local)`` from a custom Function, and a model that then changes the output in
    place (CTRL's ``inputs_embeds *= sqrt(d)`` after a vocabulary-parallel embedding, Llama 4's
    ``out.add_(...)`` after a row-parallel ``down_proj``) fails with "a view ... is being modified
    inplace". A ``detach`` of the local tensor is a fresh tensor object on the same storage that
    autograd does not track as a view (same version counter: a saved tensor still checks); the
    backward is torch's. No copy."""

    @staticmethod
    def forward(ctx, input, grad_placements):  # type: ignore[override]
        _ToTorchTensor.forward(ctx, input, grad_placements)
        return input._local_tensor.detach()


def to_local(tensor: DTensor, grad_placements=None) -> torch.Tensor:
    """``tensor.to_local(grad_placements=...)`` that the caller may change in place."""
    if not torch.is_grad_enabled():
        return tensor._local_tensor  # what DTensor.to_local returns without autograd
    return _OwnedLocal.apply(tensor, tuple(grad_placements) if grad_placements is not None else None)


def _prepare_output(output_layouts, use_local_output, mod, outputs, device_mesh):
    """torch's Colwise/RowwiseParallel output hook, with :func:`to_local`."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=True)
    return to_local(outputs) if use_local_output else outputs


def _sum_rope_grad(module: nn.Module, mesh, rope: int) -> None:
    """``mla_kv_a_proj`` (multi-head latent attention's ``kv_a_proj_with_mqa``, whole on every
    rank): its output is ``[kv latent, k_rope]``. The latent feeds a column-parallel
    ``kv_b_proj``, whose DTensor input sums its gradient over the ranks; ``k_rope`` goes straight
    to this rank's heads, so its gradient covers them only: it is summed over the tp ranks in
    backward (:func:`.group_grad.copy_to_group`), as transformers' style does."""
    def hook(mod, args, output):
        if not torch.is_grad_enabled() or isinstance(output, DTensor):
            return output
        latent, rot = output.split([output.shape[-1] - rope, rope], dim=-1)
        rot = copy_to_group(rot, mesh.get_group())
        return torch.cat([latent, rot], dim=-1)

    module.register_forward_hook(hook)


def _global_heads(model: nn.Module, name: str) -> int:
    """The model's query head count (its config's ``num_attention_heads``)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        from ..errors import HfScalePlanError

        raise HfScalePlanError(f"{name} has a 'heads_input' style, and the model's config has no "
                               "num_attention_heads to split that input by: give the module 'replicate'.")
    return heads


def _split_heads_input(module: nn.Module, mesh, arg: str, heads: int) -> None:
    """``heads_input:ARG``: the argument ``ARG`` of ``module`` holds one slice per attention head
    on its first dim, for all ``heads`` heads, flattened as ``[batch x heads]`` or ``[heads]``
    (BLOOM's ``alibi``, MPT's ``position_bias``: ALiBi biases, which the base model builds
    for every head before the blocks). Each rank keeps its own heads' slices: those of the heads
    its column-parallel projections compute."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    local = heads // tp
    names = list(inspect.signature(module.forward).parameters)
    index = names.index(arg)

    def split(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or t.shape[0] % heads:
            from ..errors import HfScalePlanError

            raise HfScalePlanError(
                f"{type(module).__name__}'s {arg!r} has shape {tuple(t.shape)}, whose first dim is not a multiple "
                f"of the {heads} heads, so 'heads_input:{arg}' cannot keep this rank's heads: give the attention "
                "a plan without it, or train without tp.")
        grouped = t.view(t.shape[0] // heads, heads, *t.shape[1:])
        return grouped[:, rank * local:(rank + 1) * local].reshape(-1, *t.shape[1:])

    def enter(mod, args, kwargs):
        if arg in kwargs:
            return args, {**kwargs, arg: split(kwargs[arg])}
        if index < len(args):
            return (*args[:index], split(args[index]), *args[index + 1:]), kwargs
        return args, kwargs

    module.register_forward_pre_hook(enter, with_kwargs=True)


def _replicated_kv(module: nn.Module, mesh, tail: int) -> None:
    """``colwise_replicated_kv:K``: a fused ``[q; k; v]`` Linear with fewer key/value heads than
    tp ranks (multi-query attention: one k and one v head, the last ``K`` features). Its weight
    and bias stay whole on every rank (plain tensors, saved whole); each forward computes this
    rank's query rows and the whole k/v rows, ``[q_r, k, v]``: the layout the model's own split
    of a local ``[heads + 2, head_dim]`` view expects (Megatron replicates kv heads so when they
    are fewer than the tp ranks). Each rank's gradient covers its own heads, for the weight
    (query rows: its own; k/v rows: its heads' share) and for the input alike: both are summed
    over the tp ranks in backward (:func:`.group_grad.copy_to_group`)."""
    tp, rank = mesh.size(), mesh.get_local_rank()

    def summed(t):
        if not torch.is_grad_enabled() or not t.requires_grad:
            return t
        return copy_to_group(t, mesh.get_group())

    def rows(t):
        q = (t.shape[0] - tail) // tp
        return torch.cat([t[rank * q:(rank + 1) * q], t[t.shape[0] - tail:]])

    def enter(mod, args):
        saved = dict(mod._parameters)
        mod.__dict__["_hf_scale_whole_params"] = saved
        for name, param in saved.items():
            if param is not None:
                mod._parameters[name] = rows(summed(param))
        return (summed(args[0]), *args[1:]) if args and isinstance(args[0], torch.Tensor) else args

    def leave(mod, args, output):
        mod._parameters.update(mod.__dict__.pop("_hf_scale_whole_params", {}))

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _sum_partial_output(module: nn.Module, mesh) -> None:
    """``all_reduce``: ``module`` computes a partial sum over the features its parameters split
    (stacked shared experts: colwise ``gate/up``, rowwise ``down``). Its tensor inputs are whole
    on every rank and each rank's gradient for them covers its features only: summed over the tp
    ranks in backward; its output is summed in forward."""
    def as_replicated(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad:
            return copy_to_group(x, mesh.get_group())
        return x

    def enter(mod, args, kwargs):
        return tuple(as_replicated(a) for a in args), {k: as_replicated(v) for k, v in kwargs.items()}

    def leave(mod, args, kwargs, output):
        if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
            return sum_over_group(output, mesh.get_group())
        return output

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True)


def _compute_locally(module: nn.Module) -> None:
    """``local_params``: ``module``'s forward sees its own DTensor parameters as their local
    shards (a differentiable ``to_local``: the gradient comes back with the shard's placement),
    as transformers' style of that name does; they are put back after the forward."""
    def enter(mod, args):
        swapped = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
        mod.__dict__["_hf_scale_dtensor_params"] = swapped
        for n, p in swapped.items():
            mod._parameters[n] = p.to_local()

    def leave(mod, args, output):
        mod._parameters.update(mod.__dict__.pop("_hf_scale_dtensor_params", {}))

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _distribute(module: nn.Module, mesh, placements: dict[str, list]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, placements[name])
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """``colwise`` for transformers' Conv1D: weight ``[in, out]`` sharded on dim 1, bias on dim 0."""

    _prepare_output_fn = staticmethod(_prepare_output)

    def _apply(self, module, device_mesh):
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """``rowwise`` for transformers' Conv1D: weight ``[in, out]`` sharded on dim 0, bias whole."""

    _prepare_output_fn = staticmethod(_prepare_output)

    def _apply(self, module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)  # the matmul needs its input split on features
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class PackedColwise(ColwiseParallel):
    """``colwise`` for a projection whose output packs ``parts`` equal blocks (``[q; k; v]``).

    Each block is split over the tp ranks (``_StridedShard`` with ``split_factor=parts``), so
    rank r computes ``[q_r, k_r, v_r]``: the model's own ``split``/``chunk`` on the local output
    gives its local heads. The saved tensor is the plain fused weight (a checkpoint reads it as
    ``parts`` blocks per rank), so it reshards to any tp degree. The bias stays whole (DTensor
    takes each rank's columns of it in forward): a 1-D strided bias, sharded again by FSDP on
    its only dimension, would be a layout DTensor cannot describe.
    """

    def __init__(self, parts: int, conv1d: bool = False):
        super().__init__()
        self.parts, self.conv1d = parts, conv1d

    @staticmethod
    def _prepare_output_fn(mod, outputs, mesh):
        return _local_output(mod, outputs, mesh)

    def _apply(self, module, device_mesh):
        dim = 1 if self.conv1d else 0
        placements = {"weight": [_StridedShard(dim, split_factor=self.parts)],
                      "bias": [Replicate()]}
        module = distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, placements),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            self._prepare_output_fn,
        )
        bias = getattr(module, "bias", None)
        if isinstance(bias, DTensor) and bias.requires_grad:
            # DTensor hands the whole bias a gradient laid out like the output (strided): make it
            # whole again, as the bias is (FSDP, when it follows, does the same to its own copy).
            bias.register_hook(lambda grad: grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim))
        return module


class PerHeadReplicated(ParallelStyle):
    """A module (a norm) whose whole weight applies to the local heads of its input: its
    gradient is a partial sum on each rank, which DTensor all-reduces (``Replicate`` weight
    times a ``Shard(-2)`` input)."""

    def _apply(self, module, device_mesh):
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, {n: [Replicate()] for n, _ in mod.named_parameters(recurse=False)}),
            self._prepare_input_fn,
            self._prepare_output_fn,
        )

    @staticmethod
    def _prepare_input_fn(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Shard(-2)], run_check=False) if i == 0 else x
                     for i, x in enumerate(inputs))

    @staticmethod
    def _prepare_output_fn(mod, outputs, mesh):
        return _local_output(mod, outputs, mesh)


def _local_output(mod, outputs, device_mesh):
    """The packed output as the local ``[a_r, b_r, ...]`` columns, with no collective."""
    return to_local(outputs) if isinstance(outputs, DTensor) else outputs


def _retie(model: nn.Module, ties) -> None:
    """Make tied parameters one again: each module distributed its own copy."""
    for target, source in ties:
        src = model.get_parameter(source)
        owner, _, attr = target.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, attr)
        if old is src:
            continue
        placements = lambda t: tuple(t.placements) if isinstance(t, DTensor) else None
        if placements(src) is None and placements(old) is not None:
            # the source lives in a module tp does not shard (BERT's prediction head holds the
            # decoder's bias): it takes the sharded parameter, the tie's other end
            s_owner, _, s_attr = source.rpartition(".")
            setattr(model.get_submodule(s_owner), s_attr, old)
            continue
        if placements(old) != placements(src):
            from ..errors import HfScalePlanError

            raise HfScalePlanError(
                f"{target} is tied to {source}, but the tp plan shards them differently "
                f"({placements(old)} vs {placements(src)}): give both modules styles with the same "
                "placement (e.g. 'embedding_rowwise' and 'colwise_gather_output' both shard the vocabulary)."
            )
        setattr(module, attr, src)
