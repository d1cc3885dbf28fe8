"""Check a tensor-parallel layout before use: one forward of a sharded copy of the model on a
probe batch must give the unsharded copy's outputs, block by block.

Used for plans inferred from a model's structure (:mod:`hf_scale.model_plans.tp_infer`): they
are guesses from names and shapes, so they are checked, not trusted. The check runs on every
rank of the job (the verdict is gathered, so all ranks agree) on an fp32 copy of the model; the
model itself is untouched. The copy is whole: a model that does not fit twice (host or device)
should be built on the meta device (``hf_scale.from_pretrained``), where ``parallelize`` runs
the check on the same architecture built tiny (``model_plans/shrink.py``), or given an explicit
``plan={'tp_plan': ...}``.

Usage::

    differs = check_tp_forward(model, mesh["tp"], layout.styles, layout.local_attrs, ties, blocks)
    if differs: raise HfScalePlanError(f"the inferred plan does not hold: {differs}")
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..ranks import gather
from .tp import apply_tp

PROBE_BATCH, PROBE_SEQ = 2, 8
RTOL, ATOL = 1e-4, 1e-5


def check_tp_forward(model: nn.Module, tp_mesh, styles: dict[str, str], local_attrs: dict[str, tuple[str, ...]],
                     ties: tuple, blocks: list[str], device: torch.device, params: dict[str, int] | None = None) -> str | None:
    """None when the sharded copy's block outputs and logits equal the unsharded copy's on every
    rank; else what differed first (block name, class, largest difference). A collective."""
    error = None
    try:
        error = _compare(model, tp_mesh, styles, local_attrs, ties, blocks, device, params)
    except Exception as e:  # noqa: BLE001 - a forward that fails sharded is a mismatch too
        error = f"the sharded forward raised {type(e).__name__}: {str(e).strip()[:300]}"
    errors = [e for e in gather([error]) if e]
    return errors[0] if errors else None


def _compare(model, tp_mesh, styles, local_attrs, ties, blocks, device, params=None) -> str | None:
    # fp32: a bf16 model's row-parallel partial sums round differently from the whole matmul by
    # more than the tolerance (a correct plan would be refused); the check is of the layout
    probe = _copy(model, device)
    vocab = probe.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, min(vocab, 64)), (PROBE_BATCH, PROBE_SEQ), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        want = _outputs(probe, batch, blocks)
    except Exception:  # noqa: BLE001 - the model needs other inputs: nothing to compare against
        return None
    # a fresh copy to shard: the first forward may change a model (BigBird swaps its attention
    # modules for others on the first short input), and the real model is sharded before it
    del probe
    probe = _copy(model, device)
    apply_tp(probe, tp_mesh, styles, local_attrs, ties, params)
    before = {name: id(m) for name, m in probe.named_modules()}
    try:
        got = _outputs(probe, batch, blocks)
    except Exception:  # a swapped module is the cause to report, when there is one
        if _swapped(probe, before):
            return _swapped(probe, before)
        raise
    if _swapped(probe, before):
        return _swapped(probe, before)
    for name in [*blocks, "logits"]:
        a, b = got.get(name), want.get(name)
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            return f"{name} gives shape {tuple(a.shape)} sharded, {tuple(b.shape)} whole"
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            kind = "" if name == "logits" else f" ({type(probe.get_submodule(name)).__name__})"
            return f"the output of {name}{kind} differs by up to {float((a - b).abs().max()):.2e}"
    return None


def _copy(model: nn.Module, device) -> nn.Module:
    probe = copy.deepcopy(model).float().to(device)
    probe.eval()
    return probe


def _swapped(model: nn.Module, before: dict[str, int]) -> str | None:
    """What replaced one of ``model``'s modules during its forward, if anything did: a module
    created at run time is not sharded (its head counts are the global ones)."""
    for name, module in model.named_modules():
        if name in before and before[name] != id(module):
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            return (f"{parent or 'the model'} ({type(owner).__name__}) replaced its sub-module {child!r} by a new "
                    f"{type(module).__name__} during the forward: a module created at run time is not sharded. "
                    "Configure the model so that its forward keeps its modules")
    return None


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in (_first_tensor(x) for x in value) if v is not None), None)
    return getattr(value, "last_hidden_state", None) if value is not None else None


def _outputs(model: nn.Module, batch: dict, blocks: list[str]) -> dict[str, torch.Tensor]:
    """Each block's output and the logits, whole, in fp32 (grad on: the training forward)."""
    out: dict[str, torch.Tensor] = {}
    hooks = []
    for name in blocks:
        def keep(module, args, output, name=name):
            t = _first_tensor(output)
            if t is not None:
                t = t.full_tensor() if isinstance(t, DTensor) else t
                out.setdefault(name, t.detach().float().clone())
        hooks.append(model.get_submodule(name).register_forward_hook(keep))
    try:
        with torch.enable_grad():
            result = model(**batch)
    finally:
        for h in hooks:
            h.remove()
    logits = getattr(result, "logits", None)
    if logits is None:
        logits = _first_tensor(result)
    if logits is not None:
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        out["logits"] = logits.detach().float()
    return out
