"""Which models context parallel can split: checked on the architecture, not listed by name.

:func:`cp_refusal` asks transformers whether the model is a causal LM (its ``loss_type``), then
builds the model's class at a tiny size (:func:`hf_scale.model_plans.shrink.shrunk_config`, a
fixed seed, on the CPU) with a probe attention function registered in transformers'
``AttentionInterface`` that lets every token attend to itself only. If the sequence is then
still mixed somewhere (a token's logits change when an earlier token changes), some layer mixes
tokens outside the attention registry: a recurrent, linear-attention or convolution mixer, or
an attention module that computes its own softmax; their tokens would only see their own
rank's part of the sequence, so they are refused. So are models whose attention calls are not
causal self-attention (encoders, cross-attention), build their own mask, pass extra tensors
(attention sinks, position biases), or do not pass keyword arguments down to the attention
function. One verdict per model class and config class (a second of CPU the first time).

Usage::

    check_cp_model(model)        # HfScaleConfigError naming what the architecture does
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HfScaleConfigError
from .cp import FORWARD_KWARG, PROBE, TENSOR_KWARGS

_VERDICTS: dict[tuple, str | None] = {}
_LENGTH = 8
# transformers' names of per-layer kinds (config.layer_types) that the cp attention function
# masks as the model does; any other kind (conv, linear_attention, mamba, chunked_attention ...)
# is refused by name from the config, before the probe
ATTENTION_KINDS = ("full_attention", "sliding_attention")


class _Marker:
    """Stands in for the forward's context in the probe: it must reach the attention function."""


def cp_refusal(model: nn.Module) -> str | None:
    """Why context parallel cannot split ``model``'s sequences, or None when it can."""
    config = model.config
    loss_type = getattr(model, "loss_type", None)
    if loss_type != "ForCausalLM":
        return (f"{type(model).__name__} is not a causal LM (transformers gives it the {loss_type} loss): context "
                "parallel splits the per-token loss of causal LMs only")
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder: its cross-attention is not split"
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_KINDS))
    if kinds:
        return (f"{type(model).__name__} has {kinds} layers (config.layer_types): only full and sliding-window "
                "attention layers are split")
    key = (type(model), type(config), getattr(config, "model_type", None), str(getattr(config, "layer_types", None)))
    if key not in _VERDICTS:
        # the probe computes on real tensors of its own, also where the model's are fake (a simulation
        # under FakeTensorMode, whose values do not exist): the mode is set aside while it runs
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            _VERDICTS[key] = _probe(model)
    return _VERDICTS[key]


def check_cp_model(model: nn.Module) -> None:
    """Refuse a model :func:`cp_refusal` refuses, saying what to do instead."""
    reason = cp_refusal(model)
    if reason is not None:
        raise HfScaleConfigError(
            f"context parallel (cp > 1): {reason}. Train it without cp (cp=1: fsdp / tp over more ranks, "
            "activation checkpointing for long sequences)."
        )


def _probe(model: nn.Module) -> str | None:
    from transformers import AttentionInterface

    from ..model_plans.shrink import shrunk_config

    calls: list[dict] = []

    def self_only(module, query, key, value, attention_mask, is_causal=None, **kwargs):
        extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in TENSOR_KWARGS)
        calls.append({"marker": isinstance(kwargs.get(FORWARD_KWARG), _Marker), "mask": attention_mask is not None,
                      "causal": is_causal if is_causal is not None else getattr(module, "is_causal", True),
                      "lengths": (query.shape[2], key.shape[2]), "extra": extra,
                      "window": kwargs.get("sliding_window")})
        groups = query.shape[1] // value.shape[1]
        return value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous(), None

    AttentionInterface.register(PROBE, self_only)
    name = type(model).__name__
    try:
        small = shrunk_config(model.config)
        small.use_cache = False
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            tiny = type(model)._from_config(small, dtype=torch.float32).eval()
            vocab = min(getattr(small, "vocab_size", 256) or 256, 256)
            ids = torch.randint(4, vocab, (1, _LENGTH))
        tiny.set_attn_implementation(PROBE)
        if tiny.config._attn_implementation != PROBE:
            return (f"{name}'s attention does not go through transformers' attention registry "
                    "(AttentionInterface): it cannot take the context-parallel attention function")
        other = ids.clone()
        other[0, 0] = 4 + (int(ids[0, 0]) - 3) % (vocab - 4)
        positions = torch.arange(_LENGTH)[None]
        with torch.no_grad():
            logits = [tiny(input_ids=x, position_ids=positions, use_cache=False, **{FORWARD_KWARG: _Marker()}).logits
                      for x in (ids, other)]
    except Exception as e:  # noqa: BLE001 - the verdict says what failed
        return f"a tiny {name} could not be run to check it ({type(e).__name__}: {str(e)[:200]})"
    if not calls:
        return f"{name} never calls an attention function of transformers' attention registry"
    if not all(c["marker"] for c in calls):
        return f"{name}'s forward does not pass its keyword arguments down to the attention function"
    bad = next((c for c in calls if c["lengths"] != (_LENGTH, _LENGTH) or not c["causal"]), None)
    if bad is not None:
        return (f"{name} runs attention that is not causal self-attention over the sequence (is_causal="
                f"{bad['causal']}, {bad['lengths'][0]} queries x {bad['lengths'][1]} keys for {_LENGTH} tokens): "
                "encoders and cross-attention are not split")
    if any(c["mask"] for c in calls):
        return f"{name} builds its own attention mask instead of transformers' masking_utils"
    extra = sorted({k for c in calls for k in c["extra"]})
    if extra:
        return f"{name} passes {extra} to its attention function (attention sinks, position biases): not split yet"
    per_forward = calls[: len(calls) // 2]
    layer_types = getattr(small, "layer_types", None)
    window = getattr(small, "sliding_window", None)
    expected = layer_types.count("sliding_attention") if layer_types else (len(per_forward) if window else 0)
    told = [c["window"] for c in per_forward if c["window"] is not None]
    if len(told) != expected or any(w != window for w in told):
        return (f"{name}'s sliding-window layers do not tell the attention function their window ({expected} "
                f"layer(s) of window {window} by its config, {len(told)} told {sorted(set(told))})")
    diff = float((logits[0][:, 1:] - logits[1][:, 1:]).abs().max())
    if diff > 1e-4 * max(float(logits[0].abs().max()), 1.0):
        return (f"{name} mixes tokens outside its attention function (recurrent, linear-attention or convolution "
                "layers, or attention that does not use transformers' registry): those layers would see only "
                "their own rank's part of the sequence")
    return None
