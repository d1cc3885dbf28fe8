"""The tensor-parallel inference path (hf_scale.parallel.tp_local), run inside one process group
(tp = world size): no_grad forwards of tiny models compute on local shards, with the logits of the
DTensor path and of one process."""

from __future__ import annotations

import os

import torch

import hf_scale
from hf_scale.parallel import tp_local
from tests.tiny_models import CAUSAL, tiny_batch, tiny_model


def _olmo2_biased():
    """OLMo2 with attention biases: transformers' plan gathers q/k/v and splits o_proj's input
    (rowwise_split_input) -- a biased row-parallel Linear whose bias must be added once."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Olmo2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, attention_bias=True, pad_token_id=0)
    return tf.Olmo2ForCausalLM(config)


def _build(arch):
    return _olmo2_biased() if arch == "olmo2_bias" else tiny_model(arch, CAUSAL)


def worker() -> dict:
    facts = {}
    for arch in ("llama", "opt", "phi3_mha", "olmo2_bias"):
        ref = _build(arch).eval()
        with torch.no_grad():
            for p in ref.parameters():  # weights large enough that every layer shapes the logits
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        model = _build(arch)
        model.load_state_dict(ref.state_dict())
        model = hf_scale.parallelize(model, {"tp": int(os.environ["WORLD_SIZE"])}).eval()
        ids = tiny_batch(CAUSAL, 2, seq=8)["input_ids"]
        entered, original = [], tp_local.enter

        def counting(mod, inputs, mesh, kind, original=original, entered=entered):
            out = original(mod, inputs, mesh, kind)
            entered.append(out is not None)
            return out

        with torch.no_grad():
            want = ref(ids).logits
            tp_local.enter = counting
            try:
                local = model(ids).logits
                single = model(ids[:1]).logits  # batch 1 (generate's one prompt)
            finally:
                tp_local.enter = original
            tp_local.enter = lambda *args: None  # the DTensor path alone
            try:
                dtensor = model(ids).logits
            finally:
                tp_local.enter = original
        scale = float(want.abs().max())
        facts[arch] = {
            "local_vs_one_process": float((local - want).abs().max()) / scale,
            "dtensor_vs_one_process": float((dtensor - want).abs().max()) / scale,
            "single_vs_one_process": float((single - want[:1]).abs().max()) / scale,
            "local_calls": sum(entered), "calls": len(entered),
        }
        with torch.enable_grad():  # training forwards keep the DTensor path
            entered.clear()
            tp_local.enter = counting
            try:
                model(ids)
            finally:
                tp_local.enter = original
            facts[arch]["local_calls_with_grad"] = sum(entered)
    return facts
