"""Labeled-only loss under fsdp, tp=2 and pp=2, run in one 2-rank process group by
test_labeled_only.py, and the one-process reference it is compared with.

The batches are instruction-tuning shaped: each row's prompt (a prefix of its own length; one
row has none, so its first position is labeled) is masked with -100 and rows are right-padded
by different amounts (attention mask 0, label -100), so rows, data-parallel shards and
pipeline microbatches hold different numbers of label tokens: rows 0-3 (data-parallel rank
0's shard, the pipeline's first microbatch) 23 of a batch's 67, rows 4-7 44.

Each rank trains as the fine-tuning loop does (``model.train_step``, its data-parallel slice
weighted by its share of the global label tokens times the data-parallel degree) and reports
its step losses, its gradients after the first step and its parameters after the last (its
own, whole: gathered over fsdp / tp, never across pipeline stages), and how many positions
the output head ran on (spied on ``hf_scale.parallel.loss._chunk_loss``).
"""

from __future__ import annotations

import os
import sys

import torch

import hf_scale
from hf_scale.parallel.optim import parameter_groups
from tests.distributed.pp_checks import LR, WEIGHT_DECAY, label_tokens, pp_model, stage_facts
from tests.distributed.training import full_params
from tests.tiny_models import slice_batch, tiny_batch

ARCH = "llama"
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 2
PROMPTS = (9, 7, 11, 8, 0, 3, 2, 4)  # masked prompt prefix of each row: rank 0's rows long, rank 1's short
PADS = (0, 3, 1, 2, 5, 0, 4, 1)  # right padding of each row


def masked_batch(seed: int, unlabeled_rows: int = 0) -> dict[str, torch.Tensor]:
    """A causal-LM batch with row ``i``'s first ``PROMPTS[i]`` labels and its last ``PADS[i]``
    positions (padding: id 0, attention mask 0) masked with -100; the first ``unlabeled_rows``
    rows masked whole (prompts whose answers were cut off)."""
    out = tiny_batch("causal", GLOBAL_BATCH, SEQ, seed=seed)
    ids, mask = out["input_ids"], out["attention_mask"]
    labels = ids.clone()
    for row, (prompt, pad) in enumerate(zip(PROMPTS, PADS, strict=True)):
        if pad:
            ids[row, SEQ - pad:], mask[row, SEQ - pad:], labels[row, SEQ - pad:] = 0, 0, -100
        labels[row, :prompt] = -100
    labels[:unlabeled_rows] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(steps: int = STEPS, unlabeled_rows: int = 0) -> list[dict[str, torch.Tensor]]:
    return [masked_batch(200 + s, unlabeled_rows) for s in range(steps)]


def named_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (DTensors gathered: a collective), by name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        out[name] = None if grad is None else grad.detach().float().cpu().clone()
    return out


def reference_run(steps: int = STEPS, unlabeled_rows: int = 0) -> dict:
    """The ground truth: plain transformers (its own loss, full logits), plain AdamW (HF
    Trainer's groups), one process, the whole batch. Tensors by every name, tied ones included
    (a pipeline's last stage holds the tied head as ``lm_head.weight``)."""
    model = pp_model(ARCH)
    names = dict(model.named_parameters(remove_duplicate=False))
    initial = {n: p.detach().clone() for n, p in names.items()}
    grad_max = {n: torch.zeros_like(p) for n, p in names.items()}
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    losses, grads, norms = [], None, []
    for batch in batches(steps, unlabeled_rows):
        loss = model(**batch).loss
        loss.backward()
        grads = grads or {n: p.grad.detach().clone() for n, p in names.items()}
        for n, p in names.items():
            grad_max[n] = torch.maximum(grad_max[n], p.grad.abs())
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in names.items()}
    return {"losses": losses, "grads": grads, "norms": norms, "params": params, "initial": initial,
            "grad_max": grad_max, "tie_targets": sorted(set(names) - dict(model.named_parameters()).keys())}


def _global_mean(loss: torch.Tensor, mine: int, total: int, state) -> float:
    """The batch's mean over its label tokens from this data-parallel slice's mean (a slice
    with no label token adds nothing: its own mean is 0 / 0)."""
    part = torch.tensor(float(loss) * mine if mine else 0.0, dtype=torch.float64)
    if state.dp_degree > 1:
        torch.distributed.all_reduce(part, group=state.dp_group)
    return float(part) / total


def labeled_only_run(case: dict) -> dict:
    """``case["config"]`` with ``loss_labeled_only`` on this rank, trained as the fine-tuning
    loop weights data-parallel slices."""
    from hf_scale.parallel import loss as loss_module

    head_rows: list[int] = []
    chunk_loss = loss_module._chunk_loss

    def counted(hidden, *args):
        head_rows.append(int(hidden.shape[0]))
        return chunk_loss(hidden, *args)

    loss_module._chunk_loss = counted
    try:
        model = hf_scale.parallelize(pp_model(ARCH), {**case["config"], "loss_labeled_only": True})
        state = hf_scale.get_state(model)
        optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
        losses, raw, rows, labels, grads = [], [], [], [], None
        for batch in batches(unlabeled_rows=case.get("unlabeled_rows", 0)):
            local = slice_batch(batch, state.dp_rank, state.dp_degree)
            mine, total = label_tokens(local), label_tokens(batch)
            head_rows.clear()
            loss = model.train_step(local, loss_scale=mine * state.dp_degree / total)
            rows.append(sum(head_rows))
            labels.append(mine)
            grads = grads or named_grads(model)
            optimizer.step()
            optimizer.zero_grad()
            raw.append(float(loss))
            losses.append(_global_mean(loss, mine, total, state))
    finally:
        loss_module._chunk_loss = chunk_loss
    return {"losses": losses, "raw_losses": raw, "head_rows": rows, "label_tokens": labels, "grads": grads,
            "params": full_params(model), **stage_facts(model)}


def world_checks(cases: list[dict]) -> list[dict]:
    """Every case in this one process group; a failing case is reported, the group goes on."""
    import traceback

    results = []
    for case in cases:
        print(f"[labeled_only_checks] rank {os.environ['RANK']}: {case['id']}", file=sys.stderr, flush=True)
        try:
            results.append(labeled_only_run(case))
        except (hf_scale.HfScaleError, RuntimeError, ValueError, AssertionError, TypeError, AttributeError):
            results.append({"error": traceback.format_exc()})
    return results
