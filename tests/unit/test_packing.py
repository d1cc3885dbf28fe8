"""Packing (hf_scale.data.packing): best-fit-decreasing rows, documents kept apart by
``position_ids``, the padding-free collator, and one process's parity: a packed batch's loss and
gradients equal those of the same examples padded one per row (token-weighted, fp32)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers as tf

from hf_scale.data.packing import (
    IGNORE,
    PackedCollator,
    bfd_bins,
    check_packing,
    pack_examples,
    packing_refusal,
    real_tokens,
    split_long,
)
from hf_scale.errors import HfScaleConfigError
from hf_scale.train.loader import PadCollator
from tests.tiny_models import packing_examples, packing_model

# ------------------------------------------------------------------ best-fit-decreasing


def _naive_bfd(lengths, capacity):
    """The definition, quadratic: longest first, into the bin with the least room that fits."""
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b, room in enumerate(rooms) if room >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
            bins[b].append(i)
            rooms[b] -= lengths[i]
        else:
            bins.append([i])
            rooms.append(capacity - lengths[i])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_bfd_bins_are_best_fit_decreasing(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(300)]
    bins = bfd_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))  # each example once, none split
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert [sorted(b) for b in bins] == [sorted(b) for b in _naive_bfd(lengths, 64)]
    assert len(bins) <= -(-sum(lengths) // 64) * 11 // 9 + 1  # BFD's bound: 11/9 OPT + 6/9, loosely


def test_bfd_bins_known_case_and_refusal():
    assert bfd_bins([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]  # 6+2, 5+3, 4
    with pytest.raises(ValueError, match="9 tokens does not fit a row of 8"):
        bfd_bins([9], 8)


def test_pack_examples_restart_positions_and_ignore_each_first_label():
    batch = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[-100, 2, 3], [4, 5], [6, 7, 8, 9]]}
    rows = pack_examples(batch, max_len=6)
    assert rows["input_ids"] == [[6, 7, 8, 9, 4, 5], [1, 2, 3]]
    assert rows["position_ids"] == [[0, 1, 2, 3, 0, 1], [0, 1, 2]]
    assert rows["labels"] == [[IGNORE, 7, 8, 9, IGNORE, 5], [IGNORE, 2, 3]]


def test_bfd_split_cuts_long_examples_into_documents():
    ids, labels = split_long([list(range(10)), [1, 2]], [list(range(10)), [1, 2]], 4)
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [1, 2]] and labels == ids
    rows = pack_examples({"input_ids": [list(range(10))], "labels": [list(range(10))]}, max_len=4, split=True)
    assert rows["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1]]


# ------------------------------------------------------------------ the collator


def test_collator_pads_with_a_document_of_its_own_and_flattens():
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "position_ids": [0, 1, 2]},
            {"input_ids": [8, 9], "labels": [8, 9]}]  # a plain example: one document
    batch = PackedCollator(pad_id=0)(rows)
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, 9, IGNORE]]
    assert real_tokens(batch) == 5
    flat = PackedCollator(pad_id=0, flatten=True)(rows)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert flat["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, 9]]
    assert real_tokens(flat) == 5
    assert real_tokens(PadCollator(0)([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}])) == 3


# ------------------------------------------------------------------ one process: packed == padded

def _loss_and_grads(model, batch, plain: bool = False, **options):
    """The loss and gradients of ``batch`` through ``hf_scale.train_step`` (packed batches are
    run without a cache), or (``plain``, or options given) of ``model(**batch, **options)``."""
    import hf_scale

    plain = plain or bool(options)
    model.zero_grad()
    loss = model(**batch, **options).loss if plain else hf_scale.train_step(model, batch)
    if plain:
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("flatten", [False, True], ids=["rows", "padding_free"])
def test_packed_batch_equals_padded_batch(arch, flatten):
    model = packing_model(arch)
    examples = packing_examples()
    padded_loss, padded = _loss_and_grads(model, PadCollator(0)(examples))
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=24)
    rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    assert 1 < len(rows) < len(examples)  # several documents share rows
    packed_loss, packed = _loss_and_grads(model, PackedCollator(0, flatten=flatten)(rows))
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    for name, grad in padded.items():
        assert torch.allclose(packed[name], grad, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_padding_free_unpacked_examples_equal_padded(arch):
    """Padding-free without packing: each plain example one document of the flattened row."""
    model = packing_model(arch)
    examples = packing_examples(seed=4)
    assert any(e["labels"][0] != IGNORE for e in examples)  # a first label the flattened row must ignore
    padded_loss, padded = _loss_and_grads(model, PadCollator(0)(examples))
    flat_loss, flat = _loss_and_grads(model, PackedCollator(0, flatten=True)(examples))
    assert flat_loss == pytest.approx(padded_loss, rel=1e-5)
    for name, grad in padded.items():
        assert torch.allclose(flat[name], grad, rtol=1e-5, atol=1e-6), name


def test_a_cache_would_let_packed_documents_leak():
    """Why hf_scale runs packed batches with ``use_cache=False``: with the config's cache on (as
    saved checkpoints have it) transformers does not look for packed documents at all."""
    model = packing_model("llama")
    assert model.config.use_cache
    examples = packing_examples()
    padded_loss, _ = _loss_and_grads(model, PadCollator(0)(examples))
    flat = PackedCollator(0, flatten=True)(examples)
    assert _loss_and_grads(model, flat)[0] == pytest.approx(padded_loss, rel=1e-5)
    assert abs(_loss_and_grads(model, flat, use_cache=True)[0] - padded_loss) > 10 * 1e-5 * padded_loss


def test_a_mask_passed_with_packed_rows_would_leak():
    """The check above can fail: the same rows with an all-ones attention mask (the bug of
    transformers#46634, and hf_scale's old packing) let documents see each other."""
    model = packing_model("llama")
    examples = packing_examples()
    padded_loss, _ = _loss_and_grads(model, PadCollator(0)(examples))
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=24)
    batch = PackedCollator(0)([dict(zip(rows, v)) for v in zip(*rows.values())])
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    assert abs(_loss_and_grads(model, batch, use_cache=False)[0] - padded_loss) > 10 * 1e-5 * padded_loss  # 10x the tolerance


def test_parallelize_keeps_documents_apart_in_a_cache_on_model():
    """Most Hub configs (SmolLM2's) say ``use_cache: true``: a training forward then built a KV
    cache, and with a cache transformers does not look for packed documents, so they attended to
    each other (the packed loss of SmolLM2 was 1.52 against 0.67 unpacked). ``parallelize`` turns
    the cache off, with or without activation checkpointing."""
    import hf_scale

    examples = packing_examples()
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=24)
    batch = PackedCollator(0, flatten=True)([dict(zip(rows, v)) for v in zip(*rows.values())])
    cached = packing_model("llama")
    cached.config.use_cache = True
    padded_loss, _ = _loss_and_grads(cached, PadCollator(0)(examples))
    assert abs(_loss_and_grads(cached, batch, plain=True)[0] - padded_loss) > 10 * 1e-5 * padded_loss  # the leak
    model = hf_scale.parallelize(cached, {})
    assert model.config.use_cache is False
    assert _loss_and_grads(model, batch, plain=True)[0] == pytest.approx(padded_loss, rel=1e-5)


# ------------------------------------------------------------------ which models keep documents apart


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_models_that_keep_documents_apart_pass_the_check(arch):
    assert packing_refusal(packing_model(arch).config) is None


def test_a_model_that_ignores_the_positions_is_refused():
    config = tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                          word_embed_proj_dim=32, max_position_embeddings=64)
    assert "opt does not keep packed documents apart" in packing_refusal(config)
    with pytest.raises(HfScaleConfigError, match=r"data.packing: false"):
        check_packing(config)


# ------------------------------------------------------------------ evaluation


def test_packed_evaluation_reports_the_unpacked_loss():
    """Evaluation packed as training is: the same per-token loss and the same example count."""
    from hf_scale.train.evaluate import evaluate

    model = packing_model("llama")
    examples = packing_examples(9, seed=3)
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=24)
    rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    kwargs = dict(task="causal_lm", batch_size=2, rank=0, world=1, device=torch.device("cpu"))
    padded = evaluate(model, examples, PadCollator(0), **kwargs)
    packed = evaluate(model, rows, PackedCollator(0), **kwargs)
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=1e-5)
    assert packed["eval_examples"] == padded["eval_examples"] == 9


def test_exact_match_is_per_document_in_packed_rows():
    """Greedy exact match scores each document of a packed row on its own labels."""
    from hf_scale.train.evaluate import _causal_scores

    labels = torch.tensor([[IGNORE, 5, 6, IGNORE, 7, 8, 0, 0]])  # documents [0,3), [3,6), padding [6,8)
    labels[0, 6:] = IGNORE
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1]])
    logits = torch.zeros(1, 8, 16)
    for t, token in enumerate([5, 6, 9, 7, 3, 0, 0, 0]):  # predicts labels t + 1: doc 1 right, doc 2 wrong at 8
        logits[0, t, token] = 1.0
    _, tokens, hits, examples = _causal_scores(logits, labels, torch.ones(1), positions).tolist()
    assert (tokens, hits, examples) == (4, 1, 2)
    logits[0, 4, 8] = 2.0  # now the second document is right too
    assert _causal_scores(logits, labels, torch.ones(1), positions)[2] == 2
    assert _causal_scores(logits, labels, torch.zeros(1), positions).tolist()[1:] == [0, 0, 0]  # weighted out


@pytest.mark.parametrize("model_type, keeps_apart", [
    ("mistral", True), ("phi3", True), ("gpt2", True), ("gpt_neox", True), ("olmo2", True),
    ("bloom", False), ("gpt_oss", False), ("qwen3_next", False),
])
def test_which_architectures_keep_packed_documents_apart(model_type, keeps_apart):
    """docs/finetuning.md's list: each architecture's default config, checked as a run checks it."""
    config = tf.AutoConfig.for_model(model_type)
    assert (packing_refusal(config) is None) == keeps_apart, packing_refusal(config)
