"""Packing under the layouts (world 2): the loss and every gradient of packed rows, split over
the ranks as the fine-tuning loop splits them, against one process running the same examples
padded one per row (plain transformers). See tests/distributed/test_packing.py."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

import hf_scale
from hf_scale.data.packing import PackedCollator, pack_examples
from hf_scale.parallel import packed_attention
from hf_scale.train.dp import DataParallel
from hf_scale.train.loader import PadCollator
from tests.tiny_models import packing_examples, packing_model, slice_batch

MAX_LEN = 28
EXAMPLES = 10  # 4 packed rows of MAX_LEN: 2 per data-parallel rank, 2 pipeline microbatches


def packed_rows(examples: list[dict]) -> list[dict]:
    rows = pack_examples({k: [e[k] for e in examples] for k in ("input_ids", "labels")}, max_len=MAX_LEN)
    return [dict(zip(rows, values)) for values in zip(*rows.values())]


def _model(arch: str, lora: bool = False):
    """The tiny model, or a peft LoRA model on it (adapters on q and v, drawn non-zero so that
    they change the output; the same seed on every rank and in the reference)."""
    model = packing_model(arch)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def reference(arch: str, lora: bool = False) -> tuple[float, dict]:
    """One process, plain transformers: the examples padded, one per row, with a mask."""
    model = _model(arch, lora)
    loss = model(**PadCollator(0)(packing_examples(EXAMPLES))).loss
    loss.backward()
    # every name of a tied weight (a pipeline's last stage holds the output head as its own parameter)
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
                                  if p.grad is not None}


def packed_run(case: dict) -> dict:
    """This rank's share of the packed rows through ``hf_scale.train_step``, weighted by its label
    tokens as the loop weighs them; returns the global loss and the largest relative gradient
    difference from :func:`reference`, per parameter."""
    arch, layout = case["arch"], dict(case["config"], packed_attention=True)  # as hf-scale finetune packs
    ref_loss, ref_grads = reference(arch, case.get("lora", False))
    model = hf_scale.parallelize(_model(arch, case.get("lora", False)), copy.deepcopy(layout))
    found = []  # the masks the per-document attention split (tests/unit/test_packed_attention.py)
    split = packed_attention.document_starts
    packed_attention.document_starts = lambda mask: found.append(split(mask)) or found[-1]
    rows = packed_rows(packing_examples(EXAMPLES))
    assert len(rows) == 4, len(rows)
    dp = DataParallel.of(model)
    batch = slice_batch(PackedCollator(0, flatten=False)(rows), dp.rank, dp.degree)
    if case.get("flatten"):  # padding-free: this rank's rows as one row
        per_rank = len(rows) // dp.degree
        batch = PackedCollator(0, flatten=True)(rows[dp.rank * per_rank : (dp.rank + 1) * per_rank])
    mine = (batch["labels"][:, 1:] != -100).sum().double()
    total = dp.all_reduce(mine.clone())
    share = float(mine / total)
    try:
        loss = hf_scale.train_step(model, batch, loss_scale=share * dp.degree)
    finally:
        packed_attention.document_starts = split
    global_loss = dp.all_reduce(torch.tensor(float(loss) * share, dtype=torch.float64))
    errors = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = ref_grads[name]
        errors[name] = float((grad - want).norm() / want.norm().clamp_min(1e-12))
    return {"loss": float(global_loss), "ref_loss": ref_loss, "grad_errors": errors, "rows": len(rows),
            "documents_split": sum(starts is not None and any(len(r) > 1 for r in starts) for starts in found)}


def run_packed_cases(cases: list[dict]) -> list[dict]:
    """Every case in one process group; a case's error is its result."""
    import traceback

    out = []
    for case in cases:
        try:
            out.append(packed_run(case))
        except Exception:  # noqa: BLE001 - reported per case, the group goes on
            out.append({"error": traceback.format_exc()})
    return out
