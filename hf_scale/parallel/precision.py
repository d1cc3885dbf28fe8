"""Mixed precision for replicated models (DDP, ZeRO-1, one process) via ``torch.autocast``.

FSDP2 casts parameters itself (``MixedPrecisionPolicy``, see :mod:`.fsdp`). A replicated model
keeps fp32 parameters, so fp32 gradients come out of backward and are all-reduced in fp32;
its forward runs under autocast, which computes matmuls in the low precision. This is what
accelerate does for DDP, done with forward hooks so the model keeps its own ``forward``.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_autocast(
    model: nn.Module, dtype: torch.dtype, device_type: str, fp32_modules: list[nn.Module] = ()
) -> None:
    """Run ``model``'s forward under ``torch.autocast(device_type, dtype)``.

    ``fp32_modules`` run with autocast disabled and their floating-point inputs cast to fp32,
    matching the fp32 units FSDP gets under mixed precision.

    Usage::

        apply_autocast(model, torch.bfloat16, "cuda")
    """
    _wrap_forward(model, lambda: torch.autocast(device_type, dtype=dtype), cast_inputs=None)
    for module in fp32_modules:
        _wrap_forward(
            module, lambda: torch.autocast(device_type, enabled=False), cast_inputs=torch.float32
        )


def _wrap_forward(module: nn.Module, make_ctx, cast_inputs: torch.dtype | None) -> None:
    stack: list = []

    def enter(mod, args, kwargs):
        ctx = make_ctx()
        ctx.__enter__()
        stack.append(ctx)
        if cast_inputs is None:
            return None
        return _cast(args, cast_inputs), _cast(kwargs, cast_inputs)

    def leave(mod, args, kwargs, output):
        stack.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value
