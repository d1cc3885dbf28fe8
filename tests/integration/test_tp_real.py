"""The real SmolLM2-135M (9 query, 3 key/value heads) split over 3 tensor-parallel ranks: the loss
of one process on a real sentence and the same greedy text; tp=2 refused with our error, before
any worker starts. One spawn of 3 processes for every tp=3 check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_scale.zoo import load_smollm2
from tests.harness import run_ranks

pytestmark = pytest.mark.slow

SENTENCE = ("The Eiffel Tower was built in Paris for the World's Fair of 1889, and it is still "
            "the most visited monument in France.")
PROMPT = "The capital of France is"
NEW_TOKENS = 16
README_PROMPT = "What is 12 + 30?"  # the README's hf-scale generate example


def _forward_and_generate(model, tokenizer) -> dict:
    """Training forward (loss with grad), eval forward (loss and logits), greedy generation."""
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        evaluated = model(input_ids=ids, labels=ids)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    new = generated[0, prompt.shape[1]:]
    return {"train_loss": float(out.loss.detach()), "train_logits": out.logits, "eval_loss": float(evaluated.loss),
            "eval_logits": evaluated.logits[0, -1].detach(), "tokens": new.tolist(),
            "text": tokenizer.decode(new, skip_special_tokens=True)}


def _readme_generate(model, tokenizer) -> dict:
    """What ``hf-scale generate zoo:smollm2 --tp 3 --prompt "What is 12 + 30?"`` decodes (8 new
    tokens, not 32, to keep it short), and the same with ``--no-chat`` (issue 26, item 3)."""
    from hf_scale.generate import empty_completion_note, eos_ids, generate_texts, parse_args

    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # as load_tokenizer does
    out = {}
    for name, flags in (("chat", []), ("raw", ["--no-chat"])):
        opts = parse_args(["zoo:smollm2", "--tp", "3", "--prompt", README_PROMPT, "--max-new-tokens", "8", *flags])
        (text,), (row,) = generate_texts(model, tokenizer, opts.prompts, opts)
        out[name] = {"text": text, "tokens": row,
                     "note": empty_completion_note(tokenizer, row, eos_ids(model), name == "chat", opts)}
    return out


def tp3_worker() -> dict:
    from torch.distributed.tensor import DTensor

    import hf_scale

    model, tokenizer = load_smollm2()
    model = hf_scale.parallelize(model, hf_scale.ParallelConfig(tp=3))
    state = hf_scale.get_state(model)
    attn = model.model.layers[0].self_attn
    local = {name: tuple(p.to_local().shape) for name, p in (
        ("q_proj", attn.q_proj.weight), ("k_proj", attn.k_proj.weight), ("o_proj", attn.o_proj.weight),
        ("embed", model.model.embed_tokens.weight))}
    result = _forward_and_generate(model, tokenizer)
    result["train_logits"] = result["train_logits"] is None  # never gathered in a training forward
    result["readme"] = _readme_generate(model, tokenizer)
    return result | {"local_shapes": local, "tp": state.dims.tp, "dp_degree": state.dp_degree,
                     "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                     "all_dtensor": isinstance(attn.q_proj.weight, DTensor)}


@pytest.fixture(scope="module")
def tp3():
    return run_ranks(tp3_worker, 3, timeout=900)


@pytest.fixture(scope="module")
def reference():
    model, tokenizer = load_smollm2()
    return _forward_and_generate(model, tokenizer)


def test_tp3_shards_heads_and_vocabulary(tp3):
    for rank in tp3:
        assert (rank["tp"], rank["dp_degree"], rank["all_dtensor"], rank["tied"]) == (3, 1, True, True)
        # 9 query heads / 3 = 3 of 64 dims, 3 key/value heads / 3 = 1; vocabulary 49152 / 3
        assert rank["local_shapes"] == {"q_proj": (192, 576), "k_proj": (64, 576), "o_proj": (576, 192),
                                        "embed": (16384, 576)}


def test_tp3_loss_matches_one_process(tp3, reference):
    for rank in tp3:
        assert rank["train_logits"], "a training forward gathered the full logits"
        assert rank["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-5)
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
        np.testing.assert_allclose(rank["eval_logits"], reference["eval_logits"], rtol=1e-4, atol=1e-4)


def test_tp3_greedy_text_matches_one_process(tp3, reference):
    assert len(reference["tokens"]) == NEW_TOKENS and reference["text"].strip()
    for rank in tp3:
        assert rank["tokens"] == reference["tokens"]
        assert rank["text"] == reference["text"]


def test_tp3_readme_generate_example_answers(tp3):
    """The README's generate example sends the prompt in SmolLM2-Instruct's chat template by
    default and gets an answer; sent raw (--no-chat), the model ends its turn at once, and the
    note printed in place of the empty completion says so."""
    for rank in tp3:
        chat, raw = rank["readme"]["chat"], rank["readme"]["raw"]
        assert chat["text"].strip() and len(chat["tokens"]) > 1, chat
        assert chat == tp3[0]["readme"]["chat"]
        assert (raw["text"], raw["tokens"]) == ("", [2]), raw  # <|im_end|>
        assert raw["note"] == ("(empty completion: the model's first token was its end-of-sequence token <|im_end|>; "
                               "the prompt went as raw text: without --no-chat it goes in the tokenizer's chat "
                               "template)"), raw["note"]


def test_tp2_refused_before_any_worker_starts(capfd):
    """tp=2 splits neither 9 query nor 3 key/value heads: our error, with the sizes, from the
    check ``parallelize`` runs before any collective (here ``hf-scale generate``'s, which runs it
    on the meta device before starting workers). In this process (``hf_scale.cli.main``, whose
    status is the command's): test_generate holds the command as a process to one line."""
    from hf_scale.cli import main

    capfd.readouterr()
    status = main(["generate", "zoo:smollm2", "--tp", "2", "--prompt", PROMPT])
    out = "".join(capfd.readouterr())
    assert status != 0
    assert "HfScalePlanError" in out or "tp=2 does not divide" in out
    assert "num_key_value_heads=3" in out and "num_attention_heads=9" in out
    assert "launching" not in out  # no torchrun started
