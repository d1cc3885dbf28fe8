"""Generation on a tensor-parallel tiny Llama, run inside one process group (tp = world size).

Each rank first computes one process's plain-transformers tokens on its own unsplit copy of the
model (same seed, same weights, no collectives), then parallelizes the model and generates
again; the tests compare the two, and the ranks with each other.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

import hf_scale
from hf_scale.generate import GenerateArgs, generate_texts
from tests.tiny_models import CAUSAL, tiny_batch, tiny_model, tiny_tokenizer

NEW = 12
PROMPTS = ["What is 12 + 30?", "hello world", "a"]


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts of 6 tokens, the second left-padded by 2 (masked out)."""
    ids = tiny_batch(CAUSAL, 2, seq=6, seed=3)["input_ids"]
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _model(dtype=torch.float32) -> torch.nn.Module:
    """The tiny Llama with weights of std 0.3: at the default init (0.02) greedy decoding repeats
    one token, which a wrong split could also give; these weights make every step's choice
    depend on the whole network."""
    model = tiny_model("llama", CAUSAL)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(dtype).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**_prompts()).logits


def _generate(model, sample_seed: int | None = None) -> list[list[int]]:
    kwargs = {"do_sample": False}
    if sample_seed is not None:
        kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0}
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    with torch.no_grad():
        out = model.generate(**_prompts(), max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, **kwargs)
    return out[:, -NEW:].tolist()


def _args(**changes) -> GenerateArgs:
    base = {"model": "tiny", "tp": int(os.environ["WORLD_SIZE"]), "prompts": PROMPTS, "max_new_tokens": NEW,
            "dtype": "fp32", "batch_size": 2, "chat": False, "do_sample": False, "seed": 0, "temperature": 1.0,
            "top_p": 1.0}
    return GenerateArgs(**{**base, **changes})


def _kv_heads(model) -> int:
    """Key/value heads in the first layer's KV cache after a forward with the cache on."""
    with torch.no_grad():
        out = model(**_prompts(), use_cache=True)
    return out.past_key_values.layers[0].keys.shape[1]


def worker() -> dict:
    tp = int(os.environ["WORLD_SIZE"])
    tokenizer = tiny_tokenizer()
    facts = {}

    model = _model()
    facts["ref_greedy"] = _generate(model)
    ref_logits = _logits(model)
    facts["ref_texts"] = generate_texts(model, tokenizer, PROMPTS, _args())[0]
    facts["ref_kv_heads"] = _kv_heads(model)
    model = hf_scale.parallelize(model, {"tp": tp})
    facts["sharded"] = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})
    facts["greedy"] = _generate(model)
    facts["logits_diff"] = (_logits(model) - ref_logits).abs().max().item() / ref_logits.abs().max().item()
    facts["texts"] = generate_texts(model, tokenizer, PROMPTS, _args())[0]
    facts["kv_heads"] = _kv_heads(model)
    facts["sampled"] = _generate(model, sample_seed=1234)
    facts["sampled_again"] = _generate(model, sample_seed=1234)
    facts["sampled_other_seed"] = _generate(model, sample_seed=99)
    facts["app_sampled"] = generate_texts(model, tokenizer, PROMPTS, _args(do_sample=True, seed=7))[0]

    model = _model(torch.bfloat16)
    facts["bf16_ref"] = _generate(model)
    model = hf_scale.parallelize(model, {"tp": tp})
    facts["bf16_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    facts["bf16"] = _generate(model)
    return facts
