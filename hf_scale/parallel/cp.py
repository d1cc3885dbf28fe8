"""Context parallel: each sequence split over the ``cp`` ranks of a group, attention all-gathering
keys and values, the loss that of the whole sequence on every rank.

The user's loop does not change: every rank of a cp group runs ``model(**batch).loss`` (or
``hf_scale.train_step``) on the SAME, whole batch. :func:`apply_cp` adds, in one place and for
every model whose attention goes through transformers' attention registry (no model names):

* a forward pre-hook on the model that splits the batch along the sequence: ``input_ids`` /
  ``inputs_embeds``, ``position_ids`` (made from the whole sequence first, so every token keeps
  its global position) and the labels, shifted BEFORE the split (``shift_labels``: the label of a
  chunk's last token is the next chunk's first token, not lost at the boundary). A length that
  the layout does not divide is padded at the end with a document of its own whose labels are
  ignored (it changes nothing a real token sees). Layouts (``cp_layout``): ``head_tail`` (rank r
  holds chunks r and 2cp-1-r of 2cp: as much causal work on every rank) or ``contiguous``.
* an attention function registered as ``"hf_scale_cp"`` in ``AttentionInterface`` and set as
  the model's ``config._attn_implementation``. Causal layers without a sliding window shorter
  than the sequence or soft-capping attend WITHOUT a mask (:mod:`hf_scale.parallel.cp_blocks`,
  ``cp_attention="auto"``, on the CPU): K and V all-gathered (one collective for both), this
  rank's query chunks against them in blocks by chunk and packed document (earlier chunks with
  no mask, the diagonal ``is_causal``), merged by their log-sum-exp; only this rank's part is
  saved and K / V are gathered again in the backward, so every tensor a layer keeps is S/cp.
  Off the CPU the same layers of unpacked rows attend without a mask too
  (:mod:`hf_scale.parallel.cp_prefix`): K and V all-gathered with autograd and put in global
  order, each query chunk against the prefix of keys it may see, lower-right causal (flash /
  memory-efficient kernels, no ``S/cp x S`` tensor). The other layers (sliding windows,
  soft-capping, packed documents off the CPU, ``cp_attention="masked"``) all-gather K and V with autograd (the backward a reduce-scatter of their gradients) and attend
  under a mask built from GLOBAL indices: causal, the layer's sliding window, packed documents
  (from the whole batch's ``position_ids``, restarting per document, as transformers finds
  them), logit soft-capping where the model passes it.
* the loss: this rank's token sum over the WHOLE batch's label count, summed over the group (an
  all-reduce whose backward sums the gradients): every rank returns the whole sequence's
  token-weighted loss, and the gradients FSDP / DDP average over ``dp x cp`` are those of one
  process (no factor cp in the loss, the gradients or their norm).

Layout contract: parameters replicated (or FSDP-sharded) over cp; activations and the output
``logits`` hold this rank's positions only (:func:`local_positions`); the loss is global.

Memory: in the block path a layer saves its S/cp queries, keys, values, output and log-sum-exp
and nothing of size S (activation bytes saved per rank: 0.50x of one process at cp=2, 0.25x at
cp=4, tests/distributed/test_cp_memory.py); the gathered K / V (S) and the blocks' scores exist
only while a layer runs. The prefix path keeps the gathered K / V (S, linear) for backward and
makes no mask. The masked path keeps the gathered K / V (repeated for grouped-query
heads) for backward and builds a dense boolean ``batch x S/cp x S`` mask per window and forward.
``cp_exchange="alltoall"`` (Ulysses, :mod:`hf_scale.parallel.cp_alltoall`) exchanges heads for
sequence instead of gathering K / V: each rank attends over the whole sequence with heads/cp of
the heads, the same masks built from global positions. A ring exchange is not implemented
(docs/context-parallel.md).

Usage::

    model = hf_scale.parallelize(model, {"strategy": "fsdp", "cp": 2})
    loss = model(**batch).loss          # the whole batch on each of the 2 ranks; the global loss
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ..errors import HfScaleConfigError
from . import cp_alltoall, cp_blocks, cp_prefix

ATTENTION = "hf_scale_cp"  # the attention function's name in transformers' registry
PROBE = "hf_scale_cp_probe"  # the attention function of the tiny model that checks an architecture
FORWARD_KWARG = "hf_scale_cp"  # the forward's context, passed down to the attention function
IGNORE = -100
SPLIT = ("input_ids", "inputs_embeds", "position_ids", "labels", "token_type_ids")  # [batch, seq, ...]
TENSOR_KWARGS = {"position_ids", "cache_position"}  # tensors the attention function may be passed
_PACK = "Pack the rows instead (documents kept apart by position_ids restarting at 0, no mask: hf_scale.data.packing)"


def chunk_indices(length: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds of a sequence of ``length`` (a multiple
    of :func:`granule`), in order: its chunk (``contiguous``), or chunks r and 2cp-1-r of 2cp
    (``head_tail``)."""
    if layout == "contiguous":
        size = length // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = length // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * size, (rank + 1) * size), torch.arange(tail * size, (tail + 1) * size)])


def chunks_held(cp: int, layout: str) -> list[list[int]]:
    """For each rank, the global chunk indices it holds in local order (chunks of
    ``length / (2 cp)`` tokens for ``head_tail``, of ``length / cp`` for ``contiguous``)."""
    if layout == "contiguous":
        return [[r] for r in range(cp)]
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def granule(cp: int, layout: str) -> int:
    """What a sequence length must be a multiple of (shorter ones are padded to it)."""
    return 2 * cp if layout == "head_tail" else cp


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Which packed document each token belongs to (``position_ids`` not rising by exactly one
    starts a new one, as transformers' ``find_packed_sequence_indices``), None for one per row."""
    first = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def _has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values to read (not a fake tensor of a simulation, nor meta)."""
    from torch._subclasses.fake_tensor import is_fake

    return not (tensor.is_meta or is_fake(tensor))


def _documents(positions: torch.Tensor) -> torch.Tensor | None:
    """:func:`document_ids` of positions the caller gave; refused on fake tensors, whose values (the
    documents' starts) do not exist: a simulation runs unpacked sequences (no ``position_ids``)."""
    if not _has_values(positions):
        raise HfScaleConfigError(
            "context parallel finds packed documents by reading position_ids, and these are fake tensors "
            "(a simulation): simulate unpacked sequences (no position_ids in the batch)."
        )
    return document_ids(positions)


class Forward:
    """One forward's split: this rank's global positions (``q_index``), those of the gathered
    keys in gather order (``kv_index``), the documents, the local shifted labels and the whole
    batch's label count; masks are built once per window and reused by every layer. ``chunks``
    / ``chunk``: the global chunks each rank holds and their length; ``pieces``: this rank's
    queries by chunk and document for the attention without a mask (``cp_blocks``; None: masked
    attention only); ``stash``: gathered K / V a recomputed forward leaves for its backward.
    ``exchange``: ``allgather`` or ``alltoall`` (:mod:`cp_alltoall`); ``starts``: each row's packed
    document starts (global positions), None for one document per row; ``order`` / ``placed``: the
    permutations from gather order to global order and back (None when the layout keeps it).

    A plain class, not a dataclass: FSDP2's mixed-precision cast of a unit's forward inputs
    rebuilds every dataclass it meets in the keyword arguments (``dataclasses.replace``), and each
    layer must count its calls on this one object (:meth:`ContextParallel.finish` checks them)."""

    def __init__(self, group, q_index: torch.Tensor, kv_index: torch.Tensor, docs: torch.Tensor | None,
                 shift_labels: torch.Tensor | None = None, num_items: torch.Tensor | None = None, *,
                 chunks: list | None = None, chunk: int = 0, pieces: list | None = None, exchange: str = "allgather",
                 starts: list | None = None, order: torch.Tensor | None = None, placed: torch.Tensor | None = None,
                 held: list[int] | None = None):
        self.group, self.q_index, self.kv_index = group, q_index, kv_index
        self.docs = docs  # [batch, S] global document ids, or None (one document per row)
        self.shift_labels, self.num_items = shift_labels, num_items
        self.chunks, self.chunk, self.pieces = chunks or [], chunk, pieces
        self.stash: dict = {}
        self.masks: dict = {}
        self.exchange, self.starts, self.order, self.placed = exchange, starts, order, placed
        self.held = held  # this rank's global chunks, in local order
        self.block_calls = self.prefix_calls = self.alltoall_calls = self.attention_calls = self.loss_calls = 0

    def mask(self, window: int | None, whole: bool = False) -> torch.Tensor:
        """Boolean ``[batch or 1, 1, S_local, S]``: key j visible to query i (global indices);
        ``whole``: ``[batch or 1, 1, S, S]``, every query and key in global order (all-to-all)."""
        if (window, whole) not in self.masks:
            length = self.kv_index.numel()
            q_index, kv_index = (torch.arange(length, device=self.kv_index.device),) * 2 if whole else (
                self.q_index, self.kv_index)
            q, k = q_index[:, None], kv_index[None, :]
            allowed = k <= q
            if window is not None:
                allowed = allowed & (q - k < window)
            allowed = allowed[None]
            if self.docs is not None:
                allowed = allowed & (self.docs[:, q_index, None] == self.docs[:, None, kv_index])
            self.masks[window, whole] = allowed[:, None]
        return self.masks[window, whole]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) with autograd: the backward sums the incoming gradients too, so each
    rank's part of the loss gets the gradient of the sum every rank differentiates."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``[batch, heads, seq, dim]`` in,
    ``[batch, seq, heads, dim]`` out) over the cp group: K and V all-gathered along the
    sequence (one collective), this rank's queries against every key they may see: without a
    mask where the layer allows (:mod:`cp_blocks` on the CPU, :mod:`cp_prefix` elsewhere for
    unpacked rows), else under the global mask."""
    fwd = kwargs.get(FORWARD_KWARG)
    if not isinstance(fwd, Forward):
        raise HfScaleConfigError(
            f"{type(module).__name__} was called through the context-parallel attention function outside a "
            "context-parallel forward (the model's forward did not pass its keyword arguments down): "
            "cp cannot apply to this model."
        )
    local = fwd.q_index.numel()
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or not causal or query.shape[2] != local or key.shape[2] != local:
        raise HfScaleConfigError(
            f"{type(module).__name__}: context parallel handles causal self-attention over the split sequence "
            f"only (got is_causal={causal}, {query.shape[2]} queries and {key.shape[2]} keys for {local} local "
            f"positions, a mask {'given' if attention_mask is not None else 'absent'})."
        )
    fwd.attention_calls += 1
    length = fwd.kv_index.numel()
    dropout = dropout if module.training else 0.0
    if fwd.exchange == "alltoall":
        return _alltoall_attention(fwd, query, key, value, dropout, scaling, sliding_window, softcap), None
    if (fwd.pieces is not None and softcap is None and not dropout and (sliding_window is None or sliding_window >= length)
            and cp_blocks.supported(query, key, value)):
        fwd.block_calls += 1
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = cp_blocks.block_attention(query, key, value, fwd.group, fwd.chunks, fwd.chunk, fwd.pieces, scale,
                                        fwd.stash, id(module))
        return out.transpose(1, 2).contiguous(), None
    kv = torch.cat([key, value], dim=-1).contiguous()
    kv = funcol.all_gather_single(kv, 2, fwd.group)  # [batch, kv_heads, S, dk + dv], autograd
    # plain causal layers of unpacked rows (the padding at the end is seen by no real token):
    # each query chunk against its keys' prefix, no mask (cp_prefix)
    if fwd.pieces is not None and fwd.starts is None and softcap is None and (sliding_window is None or
                                                                              sliding_window >= length):
        fwd.prefix_calls += 1
        if fwd.order is not None:
            kv = kv.index_select(2, fwd.order)  # global order
        key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        out = cp_prefix.prefix_attention(query, key, value, fwd.held, fwd.chunk, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _masked(query, key, value, fwd.mask(sliding_window), scaling, softcap, dropout)
    return out.transpose(1, 2).contiguous(), None


def _masked(query, key, value, mask, scaling, softcap, dropout) -> torch.Tensor:
    """Attention under a boolean mask (keys already repeated for grouped-query heads)."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    # logits soft-capped before the mask, as transformers' eager attention does
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), p=dropout,
                      training=dropout > 0)
    return probs @ value


def _alltoall_attention(fwd: Forward, query, key, value, dropout, scaling, sliding_window, softcap) -> torch.Tensor:
    """Heads for sequence (:mod:`cp_alltoall`), attention over the whole sequence in global order
    (no mask for plain causal layers unless ``cp_attention="masked"``), and back."""
    fwd.alltoall_calls += 1
    query, key, value = cp_alltoall.to_heads(query, key, value, fwd.group, fwd.order)
    length = key.shape[2]
    window = None if sliding_window is None or sliding_window >= length else sliding_window
    if window is None and softcap is None and fwd.pieces is not None:
        out = cp_alltoall.causal(query, key, value, fwd.starts, scaling, dropout)
    else:
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = _masked(query, key, value, fwd.mask(window, whole=True), scaling, softcap, dropout)
    return cp_alltoall.to_sequence(out, fwd.group, fwd.placed).transpose(1, 2).contiguous()


class ContextParallel:
    """What :func:`apply_cp` attaches to a model: the split (forward pre-hook), the checks after
    the forward, and the loss over the group. ``group``: the cp process group."""

    def __init__(self, model: nn.Module, group, layout: str, attention: str = "auto", exchange: str = "allgather"):
        self.group, self.layout, self.attention, self.exchange = group, layout, attention, exchange
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.signature = inspect.signature(model.forward)
        self.pad_id = getattr(model.config, "pad_token_id", None) or 0
        self.current: Forward | None = None
        self.checked: set[bool] = set()  # training modes whose first batch was compared over the group
        self.calls = {"blocks": 0, "prefix": 0, "masked": 0, "alltoall": 0}  # attention calls by kind, over every forward so far

    @staticmethod
    def of(model: nn.Module) -> ContextParallel | None:
        """The context parallel :func:`apply_cp` attached to ``model`` (its split hook's owner)."""
        return next((h.__self__ for h in model._forward_pre_hooks.values()
                     if isinstance(getattr(h, "__self__", None), ContextParallel)), None)

    def split(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:  # positional arguments by name (the ** catch-all's contents merged in)
            kwargs = dict(self.signature.bind_partial(*args, **kwargs).arguments)
            for p in self.signature.parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    kwargs.update(kwargs.pop(p.name, None) or {})
        kwargs = dict(kwargs)
        self._refuse(kwargs)
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if tokens is None:
            raise HfScaleConfigError("context parallel needs input_ids or inputs_embeds in the forward.")
        if module.training not in self.checked and _has_values(tokens):  # (a simulation's fake tensors: none)
            self._check_same_batch(tokens)
            self.checked.add(module.training)
        batch, length = tokens.shape[:2]
        device = tokens.device
        positions = kwargs.get("position_ids")
        given = positions is not None  # else one document per row, known without reading the positions
        positions = (torch.arange(length, device=device) if positions is None else positions).expand(batch, length)
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and mask.dim() == 2 and not bool(mask.all()):
            raise HfScaleConfigError(
                "context parallel takes no padding attention mask (its keys are split over the ranks). "
                f"{_PACK}, or pad only at the end with labels -100 and no mask."
            )
        if mask is not None and mask.dim() != 2:
            raise HfScaleConfigError(f"context parallel takes no {mask.dim()}-D attention mask. {_PACK}.")
        docs = _documents(positions) if given else None
        packed = docs is not None
        if mask is not None and docs is not None:
            raise HfScaleConfigError(
                "the position_ids restart (packed documents) and an attention_mask is given: transformers then "
                "lets the documents attend to each other (transformers#46634). Drop the attention_mask."
            )
        labels, shift = kwargs.get("labels"), kwargs.pop("shift_labels", None)
        if shift is None and labels is not None:
            shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # before the split: no boundary label lost
        num_items = kwargs.pop("num_items_in_batch", None)
        if shift is not None and num_items is None:
            num_items = (shift != IGNORE).sum()
        if shift is not None and labels is None:
            kwargs["labels"] = shift  # the model computes a loss only when given labels
        kwargs["position_ids"] = positions
        pad = -length % granule(self.size, self.layout)
        if pad:  # at the end, a document of its own with ignored labels
            kwargs, shift, length = self._pad(kwargs, shift, pad, batch, length)
            positions = kwargs["position_ids"]
            # the padding is a document of its own: the rows' documents, then one more (by construction
            # when the caller gave no positions: the same as reading them, which fake tensors cannot)
            docs = _documents(positions) if given else torch.cat(
                [torch.zeros(length - pad, dtype=torch.long, device=device),
                 torch.ones(pad, dtype=torch.long, device=device)]).expand(batch, length)
        index = chunk_indices(length, self.size, self.rank, self.layout).to(device)
        every = [chunk_indices(length, self.size, r, self.layout) for r in range(self.size)]
        for name in SPLIT:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].index_select(1, index)
        chunks = chunks_held(self.size, self.layout)
        chunk = length // (self.size * len(chunks[0]))
        pieces = starts = None
        if self.attention == "auto":  # the padding at the end is seen by no real token: no document of its own
            starts = None if not packed else [[0, *torch.nonzero(torch.diff(row)).add(1).flatten().tolist()]
                                              for row in docs.cpu()]
            pieces = cp_blocks.plan_pieces(chunks[self.rank], chunk, starts) if self.exchange == "allgather" else []
        gathered = torch.cat(every)
        fwd = Forward(self.group, index, gathered.to(device), docs,
                      None if shift is None else shift.index_select(1, index), num_items,
                      chunks=chunks, chunk=chunk, pieces=pieces, exchange=self.exchange, starts=starts,
                      held=chunks[self.rank])
        in_order = [c for held in chunks for c in held] == list(range(sum(map(len, chunks))))
        if not in_order:  # (the all-gather's prefix path puts its gathered keys in global order too)
            fwd.order, fwd.placed = torch.argsort(gathered).to(device), gathered.to(device)
        kwargs["use_cache"] = False
        kwargs[FORWARD_KWARG] = self.current = fwd
        return (), kwargs

    def _refuse(self, kwargs: dict) -> None:
        if (any(kwargs.get(k) is not None for k in ("cache", "past_key_values")) or kwargs.get("use_cache")
                or kwargs.get("logits_to_keep") not in (None, 0)):  # generate keeps the last logits
            raise HfScaleConfigError(
                "context parallel runs whole sequences without a cache (training and evaluation): generate "
                "with a model loaded without cp (save, then load it in one process or under fsdp / tp)."
            )
        unknown = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in
                   (*SPLIT, "attention_mask", "shift_labels", "num_items_in_batch")]
        if unknown:
            raise HfScaleConfigError(
                f"context parallel does not know how to split the forward's {unknown}: pass input_ids (or "
                "inputs_embeds), position_ids, labels (or shift_labels) only."
            )

    def _pad(self, kwargs: dict, shift, pad: int, batch: int, length: int):
        def extend(tensor, fill):
            shape = (batch, pad, *tensor.shape[2:])
            return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=1)

        for name, fill in (("input_ids", self.pad_id), ("inputs_embeds", 0), ("labels", IGNORE), ("token_type_ids", 0)):
            if kwargs.get(name) is not None:
                kwargs[name] = extend(kwargs[name], fill)
        restart = torch.arange(pad, device=kwargs["position_ids"].device).expand(batch, pad)
        kwargs["position_ids"] = torch.cat([kwargs["position_ids"], restart], dim=1)
        return kwargs, None if shift is None else extend(shift, IGNORE), length + pad

    def _check_same_batch(self, tokens: torch.Tensor) -> None:
        """Once per mode: the ranks of the group must hold the same batch (a loader that deals
        batches by RANK instead of the data-parallel rank would train on nonsense)."""
        flat = tokens.reshape(tokens.shape[0], -1).double()
        weights = torch.arange(1, flat.shape[1] + 1, device=flat.device, dtype=flat.dtype)
        mine = torch.stack([flat.new_tensor(tokens.numel()), flat.sum(), (flat * weights).sum()])
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        if not all(torch.equal(e, every[0]) for e in every):
            raise HfScaleConfigError(
                "the ranks of a context-parallel group got different batches: they must all get the same whole "
                "batch (deal data by hf_scale.get_state(model).dp_rank / dp_degree, not by RANK)."
            )

    def finish(self, module: nn.Module, args, kwargs, output):
        fwd, self.current = self.current, None
        if fwd is not None:
            self.calls["blocks"] += fwd.block_calls
            self.calls["prefix"] += fwd.prefix_calls
            self.calls["alltoall"] += fwd.alltoall_calls
            self.calls["masked"] += fwd.attention_calls - fwd.block_calls - fwd.prefix_calls - fwd.alltoall_calls
        if output is None or fwd is None:
            return output
        if fwd.attention_calls == 0:
            raise HfScaleConfigError(
                f"{type(module).__name__}'s forward never called the context-parallel attention function "
                f"(config._attn_implementation is {getattr(module.config, '_attn_implementation', None)!r}): its "
                "tokens would attend to their own rank's only. Leave the attention implementation as parallelize set it."
            )
        if fwd.shift_labels is not None and fwd.loss_calls != 1:
            raise HfScaleConfigError(
                f"{type(module).__name__} computed its loss {fwd.loss_calls} times through model.loss_function "
                "(context parallel needs exactly one, over the split labels)."
            )
        return output

    def wrap_loss(self, model: nn.Module) -> None:
        """``model.loss_function`` on this rank's shifted labels over the whole batch's label
        count, summed over the group (hf_scale's chunked loss, when applied, stays inside)."""
        inner = model.loss_function

        def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE,
                 shift_labels=None, **kwargs):
            fwd = kwargs.pop(FORWARD_KWARG, None) or self.current
            if fwd is None or fwd.shift_labels is None:
                return inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                             ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
            fwd.loss_calls += 1
            local = inner(logits, labels, vocab_size, num_items_in_batch=fwd.num_items, ignore_index=ignore_index,
                          shift_labels=fwd.shift_labels, **kwargs)
            return _SumOverGroup.apply(local, fwd.group)

        model.loss_function = loss


def apply_cp(model: nn.Module, cp_mesh, layout: str = "head_tail", attention: str = "auto",
             exchange: str = "allgather") -> ContextParallel:
    """Split ``model``'s sequences over the 1-D ``cp_mesh`` (see the module docstring); the
    model must have passed :func:`check_cp_model` (and, for ``exchange="alltoall"``,
    :func:`cp_alltoall.check_heads`). Apply after tensor parallel, before activation
    checkpointing and FSDP / DDP (which then reduce over ``dp x cp``)."""
    from transformers import AttentionInterface

    if exchange == "alltoall":
        cp_alltoall.check_heads(model.config, cp_mesh.size())

    AttentionInterface.register(ATTENTION, cp_attention)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise HfScaleConfigError(f"{type(model).__name__} did not take the context-parallel attention function.")
    cp = ContextParallel(model, cp_mesh.get_group(), layout, attention, exchange)
    model.register_forward_pre_hook(cp.split, with_kwargs=True)
    model.register_forward_hook(cp.finish, with_kwargs=True, always_call=True)
    cp.wrap_loss(model)
    return cp
