"""Packed documents attended one at a time (hf_scale.parallel.packed_attention): the same loss and
gradients as transformers' sdpa under its block-diagonal mask and as the examples padded one per
row, the per-document path really taken (its SDPA calls are document-long), and every call whose
mask is not exactly causal-within-documents (a padding mask, a sliding window shorter than a
document) left to sdpa unchanged. Under fsdp / tp / pp: tests/distributed/test_packing.py."""

from __future__ import annotations

import pytest
import torch

import hf_scale.parallel.packed_attention as pa
from hf_scale.data.packing import PackedCollator, pack_examples
from hf_scale.train.loader import PadCollator
from tests.tiny_models import SLIDING, packing_examples, packing_model


def _block_causal(lengths: list[int]) -> torch.Tensor:
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ((doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril())[None, None]


def test_document_starts_read_from_a_block_causal_mask_only():
    assert pa.document_starts(_block_causal([3, 4, 1, 2])) == [[0, 3, 7, 8]]
    assert pa.document_starts(_block_causal([6])) == [[0]]  # plain causal: one document
    two = torch.cat([_block_causal([3, 3]), _block_causal([2, 4])])
    assert pa.document_starts(two) == [[0, 3], [0, 2]]
    window = _block_causal([6]) & torch.ones(6, 6, dtype=torch.bool).triu(-2)  # sliding window of 3 < 6
    assert pa.document_starts(window) is None
    padded = _block_causal([6]) & torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)  # a padding mask on keys
    assert pa.document_starts(padded) is None
    assert pa.document_starts(_block_causal([3, 3]).float()) is None  # an additive mask: left to sdpa


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def spans(monkeypatch):
    """The query lengths of every SDPA call the models make (the per-document path's are
    document-long, sdpa's under a mask row-long)."""
    from transformers.integrations import sdpa_attention

    seen, real = [], sdpa_attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("flatten", [False, True], ids=["rows", "padding_free"])
def test_per_document_attention_equals_sdpa_and_padded_examples(arch, flatten, spans):
    examples = packing_examples()
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=24)
    rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    batch = PackedCollator(0, flatten=flatten)(rows)
    padded_loss, padded = _loss_and_grads(packing_model(arch), PadCollator(0)(examples))
    masked_loss, masked = _loss_and_grads(packing_model(arch), batch)
    spans.clear()
    model = packing_model(arch)
    assert pa.apply_packed_attention(model)
    loss, grads = _loss_and_grads(model, batch)
    width = batch["input_ids"].shape[1]
    starts = [torch.nonzero(row == 0).flatten().tolist() + [width] for row in batch["position_ids"]]
    documents = [b - a for row in starts for a, b in zip(row, row[1:])]  # the pad documents included
    assert len(documents) > len(starts)  # rows of several documents
    # each layer that may attends every document alone; gemma3's sliding layer (its window is
    # shorter than the documents) keeps sdpa's one masked call over the whole batch
    full_layers = 1 if arch == "gemma3_text" else 2
    per_document = sorted(documents * full_layers)
    whole_rows = [width] * (2 - full_layers)  # one call for the whole batch
    assert sorted(spans) == sorted(per_document + whole_rows)
    assert loss == pytest.approx(masked_loss, rel=1e-6) and loss == pytest.approx(padded_loss, rel=1e-5)
    for name, grad in padded.items():
        assert torch.allclose(grads[name], masked[name], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-6), name


def test_padding_masks_and_windows_are_left_to_sdpa(spans):
    """A padded batch (attention mask) and a sliding window shorter than its documents: sdpa's
    own call over the whole row, bit for bit."""
    examples = packing_examples(seed=2)
    batch = PadCollator(0)(examples)
    want = packing_model("llama")(**batch, use_cache=False).logits
    model = packing_model("llama")
    assert pa.apply_packed_attention(model)
    spans.clear()
    assert torch.equal(model(**batch, use_cache=False).logits, want)
    assert set(spans) == {batch["input_ids"].shape[1]}
    model = packing_model("gemma3_text")
    model.config.layer_types = ["sliding_attention", "sliding_attention"]
    for layer in model.model.layers:
        layer.self_attn.sliding_window, layer.attention_type = SLIDING, "sliding_attention"
    rows = PackedCollator(0)([{"input_ids": list(range(2, 2 + 2 * SLIDING)), "labels": list(range(2 * SLIDING))}])
    want = model(**rows, use_cache=False).logits
    assert pa.apply_packed_attention(model)
    spans.clear()
    assert torch.equal(model(**rows, use_cache=False).logits, want)
    assert set(spans) == {2 * SLIDING}


def test_only_sdpa_models_switch():
    model = packing_model("llama")
    model.set_attn_implementation("eager")
    assert not pa.apply_packed_attention(model)
    assert model.config._attn_implementation == "eager"
