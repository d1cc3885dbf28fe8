"""Which base weights of a LoRA model become NF4 (QLoRA), and which layouts take them: data,
no torch.distributed.

The weights quantized are the ``nn.Linear`` weights LoRA targets (each LoRA layer's
``base_layer``): embeddings, the head, norms, routers and biases stay in the compute dtype, as
in QLoRA. A weight stays in the compute dtype too where its slice on a rank would not hold whole
16,384-element NF4 groups (:func:`hf_scale.quantize.nf4.check_groups`).

Layouts: the data-parallel ones whose parameters are whole (ddp) or dim-0 FSDP shards (fsdp,
zero2, hsdp), which FSDP2 gathers in 4-bit through ``NF4Tensor``'s all-gather hooks. Tensor,
pipeline, expert and context parallel are refused: DTensor's dispatch on ``NF4Tensor`` gives a
silently wrong backward under tp (the weight transposed), and the others are not tested yet.
"""

from __future__ import annotations

from torch import nn

from ..errors import HfScaleConfigError
from .adapters import is_lora_layer

QUANTIZE_CHOICES = ("nf4",)
NF4_STRATEGIES = ("fsdp", "zero2", "hsdp", "ddp")


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
    others = [f"{n}={getattr(config, n)}" for n in ("tp", "pp", "ep", "cp") if getattr(config, n) > 1]
    if config.strategy not in NF4_STRATEGIES or others:
        what = ", ".join(others) or f"strategy={config.strategy!r}"
        raise HfScaleConfigError(
            f"quantize='nf4' with {what}: NF4 bases are supported under strategy {', '.join(NF4_STRATEGIES)} "
            "with tp = pp = ep = cp = 1 (tensor parallel would need the base computed on local NF4 "
            "slices; the others are untested). Use one of those layouts, or drop quantize."
        )


def nf4_targets(host: nn.Module, parts: int) -> tuple[list[str], dict[str, str]]:
    """(parameter names of ``host`` to quantize, {name: why it stays in the compute dtype}) for
    LoRA's base Linear weights split in ``parts`` dim-0 slices (1: whole on every rank)."""
    from ..quantize.nf4 import check_groups

    chosen, kept = [], {}
    for name, module in host.named_modules():
        if not is_lora_layer(module) or type(module.base_layer) is not nn.Linear:
            continue
        key = f"{name}.base_layer.weight"
        why = check_groups(tuple(module.base_layer.weight.shape), parts)
        if why is None:
            chosen.append(key)
        else:
            kept[key] = why
    return chosen, kept
