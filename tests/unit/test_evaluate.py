"""Exact match by one teacher-forced forward equals exact match by greedy ``generate``."""

from __future__ import annotations

import torch
from datasets import Dataset

from hf_scale.train.config import DataConfig
from hf_scale.train.data import tokenize_causal_lm
from hf_scale.train.evaluate import evaluate
from hf_scale.train.loader import PadCollator
from tests.tiny_models import CAUSAL, tiny_model, tiny_tokenizer


def _greedy_hits(model, rows, tok) -> list[bool]:
    hits = []
    for row in rows:
        start = next(i for i, t in enumerate(row["labels"]) if t != -100)
        answer = row["labels"][start:]
        prompt = torch.tensor([row["input_ids"][:start]])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(answer),
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        hits.append(out[0, start:].tolist() == answer)
    return hits


def test_teacher_forced_exact_match_equals_greedy_generation():
    tok = tiny_tokenizer()
    # Answers the untrained model may or may not produce: make it produce some by training it briefly.
    pairs = [{"prompt": f"{i}", "response": "7"} for i in range(12)]
    rows = tokenize_causal_lm(Dataset.from_list(pairs), tok, DataConfig(), 32)
    model = tiny_model("llama", CAUSAL, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    collate = PadCollator(0)
    results = []
    for round_ in range(40):
        if round_:
            batch = collate(list(rows))
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        scores = evaluate(model, rows, collate, task="causal_lm", batch_size=5, rank=0, world=1,
                          device=torch.device("cpu"))
        hits = _greedy_hits(model, rows, tok)
        assert scores["eval_exact_match"] == sum(hits) / len(hits)
        results.append(sum(hits))
        model.train()
        if 0 < max(results) and min(results) < 12 and round_ > 5:
            break
    assert min(results) < max(results)  # the comparison saw both misses and hits
    assert scores["eval_examples"] == 12 and scores["eval_loss"] > 0
