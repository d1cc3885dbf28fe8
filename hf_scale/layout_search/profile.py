"""What the planner knows of a model, from its config alone: the module tree on the meta device
(parameter counts per block, root and head) and the tensors one forward saves for backward.

Activations are not a formula here: the model's own forward runs on the meta device (shapes
only, no memory, no FLOPs) under ``saved_tensors_hooks``, and every tensor autograd keeps is
counted once (by storage), parameters left out. Each is tagged with where it was saved (inside
block ``i`` or outside the blocks: embeddings, final norm, head and loss), whether a matmul or
attention kernel produced it (what selective checkpointing keeps), and whether it is
residual-width (``b*s*h`` or ``b*s`` elements: replicated under tensor parallel without sequence
parallel) or not (heads, MLP width, vocabulary: split over tp). The meta device has no fused
attention, so ``sdpa`` is measured with the flash-attention op that CPUs and GPUs run (it saves
the output and one log-sum-exp per row, not the ``T x T`` scores); ``eager`` keeps the scores.

Usage::

    facts = model_facts(config)
    facts.profile(seq=512, dtype=torch.bfloat16, attn="sdpa").block_bytes   # per sequence
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import HfScalePlanError
from ..layout_preview import meta_model
from ..model_plans import resolve_plan, wrap_units
from .frozen import Frozen, adapter_target, block_counts, count_frozen, has_frozen, meta_copy

# bytes per element of a layout's compute dtype (``Layout.precision``; None: fp32)
DTYPE_BYTES = {None: 4, "bf16": 2, "fp16": 2}
_aten = torch.ops.aten
# The outputs selective checkpointing keeps (hf_scale.parallel.activation._SAVE_OPS).
_KEPT_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"}


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes saved for backward by one forward of ONE sequence of ``seq`` tokens.

    ``block_*``: the largest block; split into what selective checkpointing keeps (matmul and
    attention outputs) and the rest, and into residual-width (replicated under tp) and sharded.
    ``logits``: vocabulary-wide tensors outside the blocks (the head's output and the loss's);
    ``outside``: the rest outside the blocks (embedding output, final norm).
    """

    seq: int
    block_bytes: int
    block_kept: int  # matmul / attention outputs, saved or not (selective checkpointing keeps them all)
    block_kept_residual: int  # of which full width under tp (a row-parallel Linear's partial sums)
    block_saved_kept: int  # of ``block_bytes``, what is also in ``block_kept`` (not recomputed)
    block_residual: int  # b*s*h or b*s sized: the same on every tp rank
    block_input: int  # one block's input (what full checkpointing keeps)
    logits: int
    outside: int
    # the block's largest saved tensor (bytes; residual-width or not): the size of the activation
    # gradients its backward makes beside what it saved (the MLP's width in a transformer block)
    block_largest: int = 0
    block_largest_residual: bool = False


@dataclass
class ModelFacts:
    """Parameter counts of a model's parts, and its activation profiles (cached per shape).
    ``frozen``: its frozen parameters (adapter runs; None: every parameter trains)."""

    model: nn.Module = field(repr=False)
    plan: object = field(repr=False)
    params: int
    block_params: list[int]
    root_params: int  # outside every block: embeddings, final norm, head (FSDP's root unit)
    head_params: int  # the output head's weight (a tied head counted here too: it is a matmul)
    embedding_params: int
    hidden: int
    vocab: int
    layers: int
    tied_params: int = 0  # a head tied to the input embedding: the one weight's size
    tensors: int = 0  # parameter tensors (a tied weight once): the optimizer's per-tensor work
    frozen: Frozen | None = None
    quantize: str | None = None  # "nf4": LoRA's base Linear weights in NF4 (QLoRA, :mod:`.quantized`)
    _profiles: dict = field(default_factory=dict, repr=False)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every block's, and the head's."""
        return sum(self.block_params) + self.head_params

    @property
    def frozen_params(self) -> int:
        return self.frozen.params if self.frozen else 0

    @property
    def trainable_params(self) -> int:
        return self.params - self.frozen_params

    @property
    def frozen_bytes(self) -> float:
        """Bytes per frozen parameter as stored (4 when none is frozen)."""
        return self.frozen.element_bytes if self.frozen else 4.0

    @property
    def trainable_matmul_params(self) -> int:
        """Of ``matmul_params``, those whose weight gradient backward computes."""
        if not self.frozen:
            return self.matmul_params
        head = 0 if self.frozen.head else self.head_params
        return sum(self.block_params) - sum(self.frozen.blocks) + head

    @property
    def trainable_tensors(self) -> int:
        return self.frozen.trainable_tensors if self.frozen else self.tensors

    @property
    def tied_trainable(self) -> int:
        """A tied head's size when it trains (its two uses make two gradients), else 0."""
        return 0 if self.frozen and self.frozen.head else self.tied_params

    def largest_block_index(self) -> int:
        """The index of the largest block (the first of equals)."""
        return max(range(len(self.block_params)), key=self.block_params.__getitem__)

    def largest_block(self) -> tuple[int, int]:
        """The largest block's parameters and, of them, the frozen ones."""
        i = self.largest_block_index()
        return self.block_params[i], self.frozen.blocks[i] if self.frozen else 0

    @property
    def root_frozen(self) -> int:
        return self.frozen.root if self.frozen else 0

    def cached(self, key, compute):
        """``compute()`` once per ``key`` (tp / pp layouts of this model are reused per candidate)."""
        if key not in self._profiles:
            self._profiles[key] = compute()
        return self._profiles[key]

    def tp_modules(self) -> tuple[int, int, int]:
        """Tensor-parallel modules: (column-parallel, row-parallel) in the largest block, and the
        rest (embedding, head); zeros without a tp plan."""
        return self.cached("tp_modules", lambda: _tp_modules(self))

    def profile(self, seq: int, dtype: torch.dtype, attn: str) -> ActivationProfile:
        key = (seq, dtype, attn)
        if key not in self._profiles:
            self._profiles[key] = measure_activations(self, seq, dtype, attn)
        return self._profiles[key]


def model_facts(source, task: str = "causal_lm", quantize: str | None = None) -> ModelFacts:
    """Facts of a model given as a config (``PretrainedConfig``) or a model object (a real one is
    rebuilt on the meta device from its config, or copied there with its adapters and frozen
    flags when it has frozen parameters: nothing of it is touched). A peft ``PeftModel`` is read
    as the transformers model it wraps, the one hf_scale parallelizes. ``quantize="nf4"``: the
    run holds LoRA's base weights in NF4 (QLoRA; ``source`` must carry the adapters)."""
    if isinstance(source, nn.Module):
        source = adapter_target(source)
        if getattr(source, "config", None) is None:
            raise HfScalePlanError(
                f"{type(source).__name__} has no transformers config: the planner builds the model from its "
                "config on the meta device. Give a transformers model, its config or its config.json."
            )
        model = source
        if any(not p.is_meta for p in source.parameters()):  # a real model: its class, on meta
            if has_frozen(source):  # adapters, frozen flags and dtypes: as they are
                model = meta_copy(source)
            else:
                with torch.device("meta"):
                    model = type(source)(copy.deepcopy(source.config))
    else:
        model = meta_model(source, task)
    plan = resolve_plan(model)
    units = wrap_units(model, plan)
    if not units:
        raise HfScalePlanError(
            f"{type(model).__name__} has no repeated blocks (plan.wrap_modules finds none): the planner "
            "estimates per block. Give plan={'wrap_modules': [...]} or register_plan()."
        )
    if quantize is not None:
        _check_quantize_source(model, quantize)
    blocks, _ = block_counts(units)
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    config = model.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or config.n_embd
    return ModelFacts(
        model=model, plan=plan, params=total, block_params=blocks, root_params=total - sum(blocks),
        head_params=head.weight.numel() if head is not None else 0,
        embedding_params=emb.weight.numel() if emb is not None else 0,
        hidden=hidden, vocab=getattr(config, "vocab_size", 0) or 0, layers=len(units),
        tied_params=head.weight.numel() if head is not None and emb is not None and head.weight is emb.weight else 0,
        tensors=len(list(model.parameters())),
        frozen=count_frozen(model, units) if has_frozen(model) else None, quantize=quantize,
    )


def _check_quantize_source(model: nn.Module, quantize: str) -> None:
    """A quantized run's planner source must hold LoRA adapters (the weights NF4 replaces are
    their base layers); say what to give instead."""
    from ..model_plans.adapters import is_lora_layer
    from ..model_plans.quantize import QUANTIZE_CHOICES

    if quantize not in QUANTIZE_CHOICES:
        raise HfScalePlanError(f"quantize={quantize!r}: the choices are {QUANTIZE_CHOICES} (or None).")
    if not any(is_lora_layer(m) for m in model.modules()):
        raise HfScalePlanError(
            f"quantize={quantize!r} prices LoRA's base weights in 4-bit, but the model has no LoRA adapters: "
            "give the peft model (or a recipe with a peft section), or drop quantize."
        )


class _KeptOutputs(TorchDispatchMode):
    """Records the outputs of the ops selective checkpointing keeps (storage -> block, bytes,
    full width under tp), and which outputs a column-parallel Linear made (split under tp).

    ``where`` holds the block running (None outside), ``tp`` the tensor-parallel style of the
    Linear running ("col", "row" or None); ``width`` says whether a tensor is residual-width."""

    def __init__(self, where: list, tp: list, width):
        super().__init__()
        self.kept: dict[int, tuple] = {}
        self.by_col: set[int] = set()
        self.held: list[torch.Tensor] = []  # meta tensors (no memory): their storages' ids stay unique
        self.where, self.tp, self.width = where, tp, width

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default and args and args[0].is_meta:
            raise HfScalePlanError(
                "the model's forward reads a value of its inputs (Tensor.item(), or a tensor used as a "
                "bool) that the planner's meta-device profile does not have: strategy 'auto' cannot "
                "profile this model. Give the layout (e.g. strategy: fsdp) instead, or file an issue."
            )
        out = func(*args, **(kwargs or {}))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if func.__name__.split(".")[0] in _KEPT_OPS:
            if self.tp[0] == "col":  # the matmul's output (not the views of its input)
                self.by_col.update(t.untyped_storage()._cdata for t in outs)
            for t in outs:
                self.keep(t, self.tp[0] == "row" or (self.tp[0] is None and self.width(t)))
        return out

    def keep(self, t: torch.Tensor, full_width: bool) -> None:
        self.held.append(t)
        self.kept.setdefault(t.untyped_storage()._cdata, (self.where[0], t.untyped_storage().nbytes(), full_width))


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: q, k, v (key/value heads not repeated:
    ``enable_gqa``), the output and one fp32 log-sum-exp per query row."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _):
        _, k, v, _, _ = ctx.saved_tensors
        return grad, k.new_zeros(k.shape), v.new_zeros(v.shape)


def _flash_sdpa(original, kept: _KeptOutputs):
    """``F.scaled_dot_product_attention`` as a fused kernel on meta tensors (the meta device
    would decompose it into the math path and save the ``T x T`` scores no GPU or CPU keeps)."""

    @functools.wraps(original)
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not q.is_meta or attn_mask is not None:
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        out, lse = _FusedAttention.apply(q, k, v)
        for t in (out, lse):  # selective checkpointing keeps them; heads: split under tp
            kept.keep(t, False)
        return out

    return sdpa


@contextlib.contextmanager
def _attention(model: nn.Module, attn: str, kept: _KeptOutputs):
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    before = [c._attn_implementation for c in configs]
    original = torch.nn.functional.scaled_dot_product_attention
    try:
        for c in configs:
            c._attn_implementation = attn
        if attn == "sdpa":
            torch.nn.functional.scaled_dot_product_attention = _flash_sdpa(original, kept)
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        for c, b in zip(configs, before):
            c._attn_implementation = b


def _valueless(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


@contextlib.contextmanager
def one_sequence():
    """The checks transformers makes on a forward's input values, answered for the profile's
    input (one unpacked, unpadded sequence) when the tensors are meta, whose values do not exist
    (``Tensor.item() cannot be called on meta tensors``), or fake (a simulation's: transformers
    then takes them for a traced graph and builds a dense ``S x S`` mask of packed documents that
    an unpacked batch on a GPU never makes):

    - the packed-sequence detection (``masking_utils.find_packed_sequence_indices``, run when a
      forward gets no attention mask and no cache, as a cache-off model's does): one sequence;
    - the padding warning (``PreTrainedModel.warn_if_padding_and_no_attention_mask``, GPT-2 and
      others with a ``pad_token_id``): no padding, no warning.

    Real tensors still take the originals. Any other read of a meta value is refused clearly by
    :class:`_KeptOutputs`."""
    from transformers import PreTrainedModel, masking_utils

    find, warn = masking_utils.find_packed_sequence_indices, PreTrainedModel.warn_if_padding_and_no_attention_mask

    @functools.wraps(find)
    def one_sequence(position_ids):
        return None if _valueless(position_ids) else find(position_ids)

    @functools.wraps(warn)
    def no_padding(self, input_ids, attention_mask):
        if input_ids is None or not _valueless(input_ids):
            warn(self, input_ids, attention_mask)

    masking_utils.find_packed_sequence_indices = one_sequence
    PreTrainedModel.warn_if_padding_and_no_attention_mask = no_padding
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find
        PreTrainedModel.warn_if_padding_and_no_attention_mask = warn


@contextlib.contextmanager
def _experts_kernel():
    """transformers' grouped experts matmul on meta tensors of any dtype: ``torch._grouped_mm``'s
    meta kernel accepts bf16 only, so a meta fp32 / fp16 forward takes transformers' own fallback
    op (``transformers::grouped_mm_fallback``, shapes from its registered fake), which saves the
    same input and weight for backward. Without it a mixture-of-experts model could not be
    profiled in fp32 (a RuntimeError from the meta kernel). Dense models never reach it."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def usable(input, weight, offs):
        if weight.is_meta and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = usable
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _tp_styles(facts: ModelFacts) -> dict[str, str]:
    """Module name -> tensor-parallel style (none without a tp plan), expanded once per model."""
    from ..model_plans.tp import tp_layout

    def expand() -> dict[str, str]:
        if not facts.plan.tp_plan:
            return {}
        try:
            return {n: s for n, s in tp_layout(facts.model, facts.plan, 1).styles.items() if s != "replicate"}
        except HfScalePlanError:
            return {}

    return facts.cached("tp_styles", expand)


def _tp_kinds(facts: ModelFacts) -> dict[str, str]:
    """Module name -> "col" / "row" for the plan's column- and row-parallel Linears: what tp
    splits of a block's activations, and its all-reduces, depend on them."""
    return {name: "row" if style.startswith("rowwise") else "col" for name, style in _tp_styles(facts).items()
            if style.startswith(("rowwise", "colwise", "packed_colwise"))}


def _tp_modules(facts: ModelFacts) -> tuple[int, int, int]:
    styles = _tp_styles(facts)
    if not styles:
        return 0, 0, 0
    kinds = _tp_kinds(facts)
    names = {id(m): n for n, m in facts.model.named_modules()}
    per_block = []
    for unit in wrap_units(facts.model, facts.plan):
        prefix = names[id(unit)] + "."
        inside = [kind for name, kind in kinds.items() if name.startswith(prefix)]
        per_block.append((inside.count("col"), inside.count("row")))
    col, row = max(per_block, key=sum)
    return col, row, len(styles) - sum(sum(b) for b in per_block)


def measure_activations(facts: ModelFacts, seq: int, dtype: torch.dtype, attn: str) -> ActivationProfile:
    """Run one training forward of one sequence on the meta device and count saved tensors.

    Residual-width (the same on every tp rank): a ``seq x hidden`` tensor (or one value per
    token) that no column-parallel Linear made and no row-parallel Linear saved (its input is
    split); a row-parallel Linear's output (partial sums, full width) when kept."""
    # a copy (cheap on meta): the facts' model may be the caller's, whose dtypes stay as given
    model = copy.deepcopy(facts.model).to(dtype)
    model.train()
    units = wrap_units(model, facts.plan)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    where: list = [None]
    tp: list = [None]
    saved: dict[int, tuple] = {}
    inputs: dict[int, int] = {}
    hooks = []
    for i, unit in enumerate(units):
        def enter(mod, args, kwargs, i=i):
            where[0] = i
            x = args[0] if args else next(iter(kwargs.values()))
            inputs[i] = x.numel() * x.element_size()

        hooks.append(unit.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(unit.register_forward_hook(lambda mod, a, o: where.__setitem__(0, None)))
    modules = dict(model.named_modules())
    for name, kind in _tp_kinds(facts).items():
        hooks.append(modules[name].register_forward_pre_hook(lambda mod, a, kind=kind: tp.__setitem__(0, kind)))
        hooks.append(modules[name].register_forward_hook(lambda mod, a, o: tp.__setitem__(0, None)))

    def width(t: torch.Tensor) -> bool:
        return (t.numel() == seq * facts.hidden and t.shape[-1] == facts.hidden) or t.numel() == seq

    mode = _KeptOutputs(where, tp, width)

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in saved:
            residual = tp[0] != "row" and key not in mode.by_col and width(t)
            saved[key] = (where[0], t.untyped_storage().nbytes(), residual, t.shape[-1] if t.dim() else 1)
        return t

    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    try:
        with _attention(model, attn, mode), _experts_kernel(), one_sequence(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            model(input_ids=ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    per_block: dict[int, list] = {}
    logits = outside = 0
    for key, (blk, nbytes, residual, last) in saved.items():
        if blk is None:
            if facts.vocab and last == facts.vocab:
                logits += nbytes
            else:
                outside += nbytes
        else:
            per_block.setdefault(blk, []).append((key, nbytes, residual))
    biggest = max(per_block, key=lambda b: sum(n for _, n, _ in per_block[b]))
    rows = per_block[biggest]
    kept = [(n, full) for blk, n, full in mode.kept.values() if blk == biggest]
    return ActivationProfile(
        seq=seq,
        block_bytes=sum(n for _, n, _ in rows),
        block_kept=sum(n for n, _ in kept),
        block_kept_residual=sum(n for n, full in kept if full),
        block_saved_kept=sum(n for k, n, _ in rows if k in mode.kept),
        block_residual=sum(n for _, n, residual in rows if residual),
        block_input=inputs[biggest],
        logits=logits,
        outside=outside,
        block_largest=max(n for _, n, _ in rows),
        block_largest_residual=max(rows, key=lambda r: r[1])[2],
    )
