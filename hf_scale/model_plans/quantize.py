"""Which base weights of a LoRA model become NF4 (QLoRA), and which layouts take them: data,
no torch.distributed.

The weights quantized are the ``nn.Linear`` weights LoRA targets (each LoRA layer's
``base_layer``): embeddings, the head, norms, routers and biases stay in the compute dtype, as
in QLoRA. A weight stays in the compute dtype too where its slice on a rank would not hold whole
64-element NF4 blocks (:func:`hf_scale.quantize.nf4.check_groups`); each weight's scaler block
is the largest (up to 256) whose groups its slice holds whole (:func:`hf_scale.quantize.nf4.scaler_block_for`).

Layouts: the data-parallel ones whose parameters are whole (ddp) or dim-0 FSDP shards (fsdp,
zero2, hsdp), which FSDP2 gathers in 4-bit through ``NF4Tensor``'s all-gather hooks; and tensor
parallel under fsdp or zero2 (tp alone, or tp x fsdp): a ``colwise`` / ``rowwise`` base is
computed on each rank's local NF4 slice (:mod:`hf_scale.parallel.tp_nf4`; DTensor's dispatch on
``NF4Tensor`` gives a silently wrong backward, the weight transposed), each tp slice quantized as
a tensor of its own, then FSDP-sharded as any NF4 weight. A base under another tp style stays in
the compute dtype. Pipeline parallel under fsdp or zero2: each stage's ranks hold and quantize
their blocks' weights. Expert and context parallel, tp x pp, and tp or pp under hsdp or ddp are
refused: not tested yet.
"""

from __future__ import annotations

from torch import nn

from ..errors import HfScaleConfigError
from .adapters import is_lora_layer

QUANTIZE_CHOICES = ("nf4",)
NF4_STRATEGIES = ("fsdp", "zero2", "hsdp", "ddp")
NF4_TP_STRATEGIES = ("fsdp", "zero2")  # tp (local NF4 slices, FSDP on top) or pp with a quantized base
NF4_TP_SPLIT = {"colwise": 0, "rowwise": 1}  # a base's tp style -> the weight dim split (parallel.tp_nf4)


def check_quantize(quantize: str | None, config, adapter) -> None:
    """Refuse a ``quantize`` the layout ``config`` (a resolved ParallelConfig) or the model
    cannot take, naming what to change."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise HfScaleConfigError(f"quantize={quantize!r}: the choices are {QUANTIZE_CHOICES} (or None).")
    if adapter is None:
        raise HfScaleConfigError(
            "quantize='nf4' freezes the base in 4-bit, which only adapters can train on (QLoRA): pass "
            "adapter={'r': 16, 'target_modules': 'all-linear'} (recipe: peft.r, e.g. 16), or drop quantize."
        )
    others = [f"{n}={getattr(config, n)}" for n in ("ep", "cp") if getattr(config, n) > 1]
    split = [f"{n}={getattr(config, n)}" for n in ("tp", "pp") if getattr(config, n) > 1]
    if split and config.strategy not in NF4_TP_STRATEGIES:
        others.insert(0, f"{' and '.join(split)} and strategy={config.strategy!r}")
    elif len(split) == 2:
        others.insert(0, " and ".join(split))
    if config.strategy not in NF4_STRATEGIES or others:
        what = ", ".join(others) or f"strategy={config.strategy!r}"
        raise HfScaleConfigError(
            f"quantize='nf4' with {what}: NF4 bases are supported under strategy {', '.join(NF4_STRATEGIES)} "
            f"with ep = cp = 1, and tp > 1 or pp > 1 (one of them) under strategy {' or '.join(NF4_TP_STRATEGIES)} "
            "(tp: the base computed on local NF4 slices; pp: each stage's blocks); expert and context "
            "parallel, tp x pp, and tp or pp under hsdp or ddp are untested. Use one of those layouts, or "
            "drop quantize."
        )


def nf4_targets(host: nn.Module, parts: int, tp: int = 1, styles: dict[str, str] | None = None
                ) -> tuple[dict[str, int], dict[str, str]]:
    """({parameter name of ``host`` to quantize: its scaler block}, {name: why it stays in the
    compute dtype}) for LoRA's base Linear weights split in ``parts`` dim-0 slices (1: whole on
    every rank), after a tensor-parallel split over ``tp`` ranks by ``styles`` (module name -> tp
    style, the LoRA layers' styles moved to their ``base_layer``: ``TPLayout.styles``). The
    scaler block is the one of the slice a rank holds, the same on every rank."""
    from ..quantize.nf4 import check_groups, scaler_block_for

    chosen, kept = {}, {}
    for name, module in host.named_modules():
        if not is_lora_layer(module) or type(module.base_layer) is not nn.Linear:
            continue
        key = f"{name}.base_layer.weight"
        piece = _tp_slice(tuple(module.base_layer.weight.shape), tp, (styles or {}).get(f"{name}.base_layer"))
        why = piece if isinstance(piece, str) else check_groups(piece, parts)
        if why is None:
            chosen[key] = scaler_block_for(piece[0] * piece[1] // parts)
        else:
            kept[key] = why
    return chosen, kept


def _tp_slice(shape: tuple[int, ...], tp: int, style: str | None):
    """The shape of a base weight's tp slice under ``style``, or why it cannot be an NF4 slice."""
    if tp == 1 or style in (None, "replicate"):
        return shape
    dim = NF4_TP_SPLIT.get(style)
    if dim is None:
        return f"its tp style {style!r} computes through DTensor, which NF4 weights do not support"
    if len(shape) != 2 or shape[dim] % tp:
        return f"its dim {dim} ({shape}) does not split evenly over tp={tp}"
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))
