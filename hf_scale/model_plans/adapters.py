"""Adapters (peft's LoRA) seen through: the transformers model inside a peft wrapper, and how a
LoRA layer's parts follow its base layer under tensor parallel.

``get_peft_model`` wraps a transformers model twice (``PeftModel`` -> ``LoraModel`` -> the
model) and replaces each targeted ``nn.Linear`` by a ``lora.Linear`` holding it as
``base_layer`` beside ``lora_A[<adapter>]`` (in -> r) and ``lora_B[<adapter>]`` (r -> out).
The plans and the engine work on the inner transformers model (:func:`adapter_host`), whose
module names are the ones transformers' plans use; ``inject_adapter_in_model`` gives that
model directly.

Under tensor parallel a LoRA layer follows its base (torchtitan's and peft's rule,
:data:`LORA_TP_FACTOR`): a column-parallel base splits ``lora_B`` the same way and keeps
``lora_A`` whole (its input is the replicated activation); a row-parallel base splits
``lora_A``'s input features and keeps ``lora_B`` whole (its input is ``lora_A``'s all-reduced
output). Each rank's LoRA output then matches its slice of the base layer's output.

Usage::

    host = adapter_host(peft_model)              # the LlamaForCausalLM inside
    styles = lora_tp_styles({"model.layers.0.self_attn.q_proj": "colwise"}, dict(host.named_modules()))
    # {"model.layers.0.self_attn.q_proj.base_layer": "colwise",
    #  "model.layers.0.self_attn.q_proj.lora_B.default": "colwise"}
"""

from __future__ import annotations

import sys

from torch import nn

from ..errors import HfScalePlanError

# The LoRA factor that takes its base layer's tensor-parallel style; the other stays whole.
LORA_TP_FACTOR = {
    "colwise": "lora_B",
    "colwise_gather_output": "lora_B",
    "packed_colwise": "lora_B",
    "rowwise": "lora_A",
    "rowwise_split_input": "lora_A",
}
_WHOLE = ("replicate", "replicated_with_grad_allreduce")


def adapter_host(model: nn.Module) -> nn.Module:
    """The transformers model a peft wrapper (``PeftModel`` or a tuner such as ``LoraModel``)
    holds; ``model`` itself when it is not one. peft is looked up only if it was imported."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model
    if isinstance(model, peft.PeftModel):
        return model.get_base_model()
    tuner = getattr(getattr(peft, "tuners", None), "tuners_utils", None)
    if tuner is not None and isinstance(model, tuner.BaseTuner):
        return model.model
    return model


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` (a wrapper or the model inside) holds peft adapter layers."""
    return any(is_lora_layer(m) for m in model.modules())


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: a ``base_layer`` and its ``lora_A`` / ``lora_B`` per adapter."""
    return (hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def is_modules_to_save(module: nn.Module) -> bool:
    """peft's ``modules_to_save`` wrapper: a trained copy per adapter beside the original module."""
    return hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)


def lora_tp_styles(styles: dict[str, str], modules: dict[str, nn.Module]) -> dict[str, str]:
    """``styles`` (module name -> tp style) with each LoRA layer's style moved to its
    ``base_layer`` and given to the factor :data:`LORA_TP_FACTOR` names, for every adapter.

    Raises :class:`HfScalePlanError` for what tensor parallel cannot split with its base:
    ``modules_to_save`` copies, DoRA magnitudes, LoRA on embeddings or non-Linear layers."""
    _refuse_modules_to_save(modules)
    out: dict[str, str] = {}
    for name, style in styles.items():
        module = modules[name]
        if not is_lora_layer(module):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        if style in _WHOLE:
            continue
        _check_splittable(name, module)
        factor = LORA_TP_FACTOR.get(style.partition(":")[0])
        if factor is None:
            raise HfScalePlanError(
                f"tensor parallel: {name} is a LoRA layer over a {style!r} base; hf_scale splits "
                f"LoRA layers over {', '.join(LORA_TP_FACTOR)} bases. Leave {name.rpartition('.')[2]!r} "
                "out of the LoRA target_modules, or use tp=1."
            )
        for adapter in getattr(module, factor):
            out[f"{name}.{factor}.{adapter}"] = style
    return out


def _refuse_modules_to_save(modules: dict[str, nn.Module]) -> None:
    saved = sorted(name for name, m in modules.items() if is_modules_to_save(m))
    if saved:
        raise HfScalePlanError(
            f"tensor parallel with peft modules_to_save {saved}: each keeps a full trained copy of its "
            "module, which tp would have to split like the original. Use tp=1 (fsdp shards the copies), "
            "or train those modules with LoRA (add them to target_modules) instead of modules_to_save."
        )


def _check_splittable(name: str, module: nn.Module) -> None:
    if len(getattr(module, "lora_magnitude_vector", ()) or ()):
        raise HfScalePlanError(
            f"tensor parallel: {name} uses DoRA (use_dora=True), whose per-output magnitude tp does "
            "not split yet. Use plain LoRA under tp, or tp=1."
        )
    if len(getattr(module, "lora_embedding_A", ()) or ()):
        raise HfScalePlanError(
            f"tensor parallel: {name} is a LoRA embedding; hf_scale splits LoRA on Linear layers "
            "only. Leave the embedding out of target_modules, or use tp=1."
        )
    for factor in ("lora_A", "lora_B"):
        for adapter, part in getattr(module, factor).items():
            if type(part) is not nn.Linear:
                raise HfScalePlanError(
                    f"tensor parallel: {name}.{factor}.{adapter} is a {type(part).__name__}; hf_scale "
                    "splits LoRA factors that are nn.Linear. Use tp=1 for this adapter."
                )
