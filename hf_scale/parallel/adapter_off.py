"""The base model of a peft model (its adapters switched off) for no-grad forwards, without
touching any parameter's ``requires_grad``: the preference losses' reference is the base.

peft's ``model.disable_adapter()`` switches the adapters off through
``BaseTunerLayer.enable_adapters(False)``, which also sets ``requires_grad=False`` on the
adapter weights, and back to ``True`` on the way out: on the parameter objects registered on
the modules at that moment. Under FSDP2 a weight is two parameter objects, the sharded one and
the gathered one, and the gathered one takes ``requires_grad`` from the sharded one each time
it is gathered (``FSDPParam.to_unsharded`` -> ``set_requires_grad_if_needed`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``). A unit that is gathered on the way out
(fsdp: the last block, which is not resharded after forward; zero2: every block) gets ``True``
back on its gathered weights only, and its sharded ones stay ``False``; the first gather after
the next reshard (after a backward) copies ``False`` to the gathered weights, and that forward
builds no gradient for the unit's adapter. Seen at world 2 with 2 accumulated KTO micro-batches
whose no-grad forwards (the reference, the KL rows) all ran before the first backward
(tests/distributed/test_preference.py, ``*_no_grad_first``): under fsdp the last block's adapter
gradient held micro-batch 1's share only (the gradient norm 5% off), under zero2 micro-batch 2's
loss had no gradient at all ("element 0 of tensors does not require grad"). TRL's order (each
micro-batch's no-grad forwards just before its own forward, what the loop does) hid it: the
reference's forward after a reshard gathers again and sets the gathered copy back to ``True``.
Under DDP (any order) the first forward, the reference's, found no trainable parameter and
``replicate`` refused to start. Not a torch bug: two owners of one flag.

:func:`adapter_disabled` only sets the adapter layers' own "disabled" flag (what their forward
reads), so every order of no-grad and training forwards is safe under every layout.

Usage::

    with adapter_disabled(model), torch.no_grad():
        ref_logits = model(**batch).logits
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..errors import HfScaleConfigError


def _switches(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward skips the adapter when their ``disable_adapters`` is True (peft's
    tuner layers: LoRA's and the other methods', and the modules_to_save / trainable-token
    wrappers)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older peft: ModulesToSaveWrapper only
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper
    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model`` (a peft model, under any layout) computes as its base model: the
    adapter layers' ``disable_adapters`` flag is set and restored after; ``requires_grad`` is left
    alone (see the module docstring for why peft's ``disable_adapter`` is not used)."""
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
    if config is not None and (getattr(config, "is_prompt_learning", False)
                               or getattr(config, "is_adaption_prompt", False)):
        raise HfScaleConfigError("the base of a prompt-learning peft model as the reference is not supported: "
                                 "train a LoRA-style adapter, or hold the reference (preference.reference: model).")
    layers = _switches(model)
    if not layers:
        raise HfScaleConfigError("adapter_disabled needs a peft model with adapter layers; this model has none.")
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        if not all(m.disable_adapters for m in layers):  # what the layers' forward reads
            raise HfScaleConfigError("this peft version's adapter layers do not read _disable_adapters: "
                                     "hf_scale cannot switch them off; report it with the peft version.")
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag
