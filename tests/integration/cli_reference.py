"""The ground truth for ``hf-scale finetune`` parity: plain transformers + ``torch.optim.AdamW``
in one process on the recipe's global batches, and the checks a run must pass against it.

Only the batches come from hf_scale (its tokenisation and loader at world 1, whose order the
data tests cover); the model, loss, clipping, optimizer and schedule are plain transformers and
torch, so a wrong gradient scale in hf_scale's loop shows up as a wrong ``grad_norm`` even when
Adam's scale invariance keeps the losses equal.

Tolerances (fp32): losses and gradient norms agree to 1e-5 relative (summation order and the
fused vs per-tensor AdamW kernel differ); each parameter tensor's update (final minus initial)
agrees to 1e-3 of its norm. Adam turns a gradient element that is pure rounding noise into a
step of up to lr, so the update of a few elements is sensitive; 1e-3 is far below what a
wrong step, a missing step or a wrong learning rate gives (the whole update, relative 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

LOSS_RTOL = 1e-5
UPDATE_RTOL = 1e-3


def plain_reference(recipe: Path, batch_size: int = 8) -> dict:
    """Losses, gradient norms, final parameters (and the non-padding tokens trained on) of plain
    transformers + AdamW on the recipe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.data.packing import PackedCollator, real_tokens
    from hf_scale.train.loader import PadCollator, ShardedBatches

    job = load_job(recipe)
    train, data = job.train, job.data
    assert train.grad_accum == 1 and not train.weight_decay and not train.warmup_steps, "reference covers these only"
    torch.manual_seed(train.seed)
    tokenizer = AutoTokenizer.from_pretrained(job.model.name_or_path)
    dataset = tokenize_causal_lm(load_splits(data)["train"], tokenizer, data, data.max_seq_len, pack=data.packing)
    collate = PadCollator(tokenizer.pad_token_id)
    if data.keeps_documents_apart:  # packed rows: documents kept apart by position_ids, no mask
        collate = PackedCollator(tokenizer.pad_token_id, flatten=data.padding_free)
    batches = iter(ShardedBatches(dataset, batch_size, 0, 1, collate, seed=data.seed))
    model = AutoModelForCausalLM.from_pretrained(job.model.name_or_path, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=tuple(train.betas), weight_decay=0.0)
    scheduler = get_scheduler(train.scheduler, optimizer, num_warmup_steps=0, num_training_steps=train.max_steps)
    losses, norms, tokens = [], [], 0
    for _ in range(train.max_steps):
        batch = next(batches)
        tokens += real_tokens(batch)
        # use_cache=False: with a cache (the config's default) transformers does not look for the
        # documents of a packed / padding-free row, and they attend to each other
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm or float("inf"))))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "initial": initial, "final": final, "tokens": tokens}


def logged_steps(out_dir: Path) -> list[dict]:
    """The run's per-step records (``metrics.jsonl``); fails when there are none."""
    path = Path(out_dir) / "metrics.jsonl"
    assert path.exists(), f"{path} was not written"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps, f"{path} has no training step records: {records}"
    return steps


def check_against_reference(out_dir: Path, ref: dict) -> None:
    """A finished run matches ``ref``: every step logged, its loss and grad_norm, final weights."""
    from transformers import AutoModelForCausalLM

    steps = logged_steps(out_dir)
    assert [r["step"] for r in steps] == list(range(1, len(ref["losses"]) + 1)), [r["step"] for r in steps]
    np.testing.assert_allclose([r["loss"] for r in steps], ref["losses"], rtol=LOSS_RTOL, err_msg="loss")
    np.testing.assert_allclose([r["grad_norm"] for r in steps], ref["norms"], rtol=LOSS_RTOL, err_msg="grad_norm")
    model = AutoModelForCausalLM.from_pretrained(Path(out_dir) / "model", dtype=torch.float32)
    got = dict(model.named_parameters())
    assert set(got) == set(ref["final"]), "parameter names changed"
    for name, want in ref["final"].items():
        want_update = want - ref["initial"][name]
        got_update = got[name].detach() - ref["initial"][name]
        rel = float((got_update - want_update).norm() / want_update.norm().clamp_min(1e-12))
        assert rel <= UPDATE_RTOL, f"{name}: update differs from plain AdamW's by {rel:.2e} of its norm"


def one_process_eval(recipe) -> dict:
    """hf_scale's evaluation of the initial model in one process (no parallelism at all)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.train.evaluate import evaluate
    from hf_scale.train.loader import PadCollator

    job = load_job(recipe)
    tokenizer = AutoTokenizer.from_pretrained(job.model.name_or_path)
    eval_ds = tokenize_causal_lm(load_splits(job.data)["eval"], tokenizer, job.data, job.data.max_seq_len)
    model = AutoModelForCausalLM.from_pretrained(job.model.name_or_path, dtype=torch.float32)
    return evaluate(model, eval_ds, PadCollator(tokenizer.pad_token_id), task="causal_lm",
                    batch_size=job.train.eval_batch_size, rank=0, world=1, device=torch.device("cpu"))
