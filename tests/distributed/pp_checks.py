"""Pipeline-parallel checks run inside one process group per world size (2: pp=2; 4: pp=2 x
fsdp2 and pp=2 x tp2), and the one-process reference they are compared with.

The data is a padded batch: rows padded on the left or on the right by 2 to 8 tokens
(attention mask 0, labels -100), so microbatches hold different numbers of label tokens (a
schedule that averaged microbatch means would miss) and the attention mask matters (without it
the reference's losses move by ~1e-3). Models have 4 blocks so that interleaved schedules get
one block per stage (2 ranks x 2 stages).

Each rank trains with ``model.train_step`` (the pipeline's API), weighting its data-parallel
slice by its share of the global label tokens as the fine-tuning loop does, and reports its OWN
parameters by their unchanged names, gathered over fsdp / tp only (never across stages).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.parallel.optim import parameter_groups
from tests.distributed.training import full_params
from tests.tiny_models import AUTO, slice_batch, tiny_batch, tiny_config

LAYERS = 4
GLOBAL_BATCH = 8
SEQ = 16
STEPS = 3
LR = 1e-3
WEIGHT_DECAY = 0.1


def pp_config(arch: str, layers: int = LAYERS):
    """The tiny config of ``arch`` (tests/tiny_models.py) with ``layers`` blocks."""
    config = tiny_config(arch)
    values = config.to_dict()
    values.pop("layer_types", None)  # per-layer lists follow the layer count
    values[config.attribute_map.get("num_hidden_layers", "num_hidden_layers")] = layers
    return type(config)(**values)


def pp_model(arch: str, head: str = "causal", layers: int = LAYERS, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised tiny ``arch`` model with ``layers`` blocks (fp32, dropout off)."""
    torch.manual_seed(seed)
    return AUTO[head].from_config(pp_config(arch, layers))


def padded_batch(seed: int, batch: int = GLOBAL_BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """A causal-LM batch whose odd rows are left-padded and even rows right-padded, row ``i``
    by ``2 + i`` tokens (pad id 0, attention mask 0, label -100)."""
    out = tiny_batch("causal", batch, seq, seed=seed)
    ids, mask = out["input_ids"], out["attention_mask"]
    for row in range(batch):
        pads = 2 + row  # later rows hold fewer tokens: microbatches differ in label tokens
        cols = slice(0, pads) if row % 2 else slice(seq - pads, seq)
        ids[row, cols] = 0
        mask[row, cols] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    return [padded_batch(100 + s) for s in range(steps)]


def eval_batch() -> dict[str, torch.Tensor]:
    return padded_batch(999)


def label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the shifted causal-LM loss averages over."""
    return int((batch["labels"][:, 1:] != -100).sum())


def reference_run(arch: str, steps: int = STEPS, use_mask: bool = True) -> dict:
    """The ground truth: plain transformers, plain AdamW (HF Trainer's groups), one process,
    whole batch, no clipping. Parameters by every name, tied ones included (``lm_head.weight``
    of a tied model is the embedding), so any rank's names can be looked up."""
    model = pp_model(arch)
    names = dict(model.named_parameters(remove_duplicate=False))
    initial = {n: p.detach().clone() for n, p in names.items()}
    grad_max = {n: torch.zeros_like(p) for n, p in names.items()}
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    losses, norms = [], []
    for batch in batches(steps):
        if not use_mask:
            batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        loss = model(**batch).loss
        loss.backward()
        for n, p in names.items():
            grad_max[n] = torch.maximum(grad_max[n], p.grad.abs())
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        eval_loss = float(model(**eval_batch()).loss)
    params = {n: p.detach().clone() for n, p in names.items()}
    return {"losses": losses, "norms": norms, "params": params, "initial": initial, "grad_max": grad_max,
            "eval_loss": eval_loss, "tie_targets": sorted(set(names) - dict(model.named_parameters()).keys())}


def _dp_mean(value: torch.Tensor, tokens: int, state) -> float:
    """The global mean over label tokens from this data-parallel slice's mean."""
    pair = torch.tensor([float(value) * tokens, float(tokens)], dtype=torch.float64)
    if state.dp_degree > 1:
        dist.all_reduce(pair, group=state.dp_group)
    return float(pair[0] / pair[1])


def _param_groups(stage: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [group for module in stage.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups]


def gathered_units(stage: torch.nn.Module) -> int:
    """FSDP units of the stage whose parameters are gathered (unsharded) now."""
    return sum(group.is_unsharded for group in _param_groups(stage))


def held_grad_bytes(stage: torch.nn.Module) -> int:
    """Gradient bytes an FSDP stage holds now: its units' unsharded gradients (autograd's, and
    FSDP2's fp32 accumulators) and its sharded gradients (this rank's shard)."""
    held = 0
    for group in _param_groups(stage):
        for fp in group.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), fp.unsharded_accumulated_grad):
                if grad is not None:
                    held += grad.numel() * grad.element_size()
            grad = fp.sharded_param.grad
            if grad is not None:
                local = grad._local_tensor
                held += local.numel() * local.element_size()
    return held


class GradBytesAfterBackward:
    """While entered, records after every microbatch's backward on this rank's pipeline stage the
    gradient bytes it holds (:func:`held_grad_bytes`) over the stage's whole fp32 gradient bytes,
    and its FSDP units left gathered (:func:`gathered_units`)."""

    def __enter__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from hf_scale.parallel.pp_grads import unsharded_grad_bytes

        self.ratios: list[float] = []
        self.gathered: list[int] = []
        self.cls, self.original = _PipelineStageBase, _PipelineStageBase.backward_one_chunk
        ratios, gathered, original = self.ratios, self.gathered, self.original

        def measured(stage, *args, **kwargs):
            out = original(stage, *args, **kwargs)
            ratios.append(held_grad_bytes(stage.submod) / unsharded_grad_bytes(stage.submod))
            gathered.append(gathered_units(stage.submod))
            return out

        _PipelineStageBase.backward_one_chunk = measured
        return self

    def __exit__(self, *exc):
        self.cls.backward_one_chunk = self.original


def pp_run(case: dict) -> dict:
    """Train ``case`` on this rank with ``train_step``; return the global losses, the raw
    per-rank step losses, the eval loss, this rank's own parameters and its stage facts (with
    ``measure_grads``: the gradient bytes held after each microbatch's backward, over the
    stage's, in ``grad_ratios``; and the mode the pipeline ran)."""
    import contextlib

    model = hf_scale.parallelize(pp_model(case["arch"]), case["config"])
    state = hf_scale.get_state(model)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    measure = GradBytesAfterBackward() if case.get("measure_grads") else contextlib.nullcontext()
    with measure:
        losses, raw = _train(model, state, optimizer, case)
    local = slice_batch(eval_batch(), state.dp_rank, state.dp_degree)
    eval_loss = _dp_mean(model.eval_step(local), label_tokens(local), state)
    extra = {"grad_ratios": measure.ratios, "gathered_units": measure.gathered} if case.get("measure_grads") else {}
    return {"losses": losses, "raw_losses": raw, "eval_loss": eval_loss, "params": full_params(model),
            "grad_sync": state.pipeline.grad_sync if state.pipeline is not None else None,
            **extra, **stage_facts(model)}


def _train(model, state, optimizer, case: dict) -> tuple[list[float], list[float]]:
    losses, raw = [], []
    for batch in batches(case.get("steps", STEPS)):
        local = slice_batch(batch, state.dp_rank, state.dp_degree)
        mine, total = label_tokens(local), label_tokens(batch)
        # "accum": gradient accumulation, several train_steps (each a share of the rows) per step
        parts = [slice_batch(local, i, case.get("accum", 1)) for i in range(case.get("accum", 1))]
        loss = sum(model.train_step(part, loss_scale=label_tokens(part) * state.dp_degree / total)
                   * label_tokens(part) / mine for part in parts)
        optimizer.step()
        optimizer.zero_grad()
        raw.append(float(loss))
        losses.append(_dp_mean(loss, mine, state))
    return losses, raw


def stage_facts(model) -> dict:
    """Which pp rank this is, its stages and the blocks it holds (by original index)."""
    state = hf_scale.get_state(model)
    if state.pipeline is None:  # a baseline without pp: every block on every rank
        return {"pp_rank": 0, "dp_rank": state.dp_rank, "rank": int(os.environ["RANK"]), "stages": [0],
                "stage_blocks": [list(range(LAYERS))], "held_blocks": list(range(LAYERS)), "head_is_embedding": None}
    layout = state.pipeline.layout
    blocks = model.get_submodule(layout.blocks)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return {
        "pp_rank": state.pp_rank, "dp_rank": state.dp_rank, "rank": int(os.environ["RANK"]),
        "stages": list(layout.stages_of(state.pp_rank)),
        "stage_blocks": [list(b) for b in layout.stage_blocks],
        "held_blocks": sorted(int(k) for k in blocks._modules),
        "head_is_embedding": getattr(head, "weight", None) is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0),
    }


def run_cases(cases: list[dict]) -> list[dict]:
    """Many cases in one process group; a failing case is reported, the group goes on (every
    rank fails the same case together, or the spawn's timeout says which hung)."""
    import traceback

    results = []
    for case in cases:
        print(f"[pp_checks] rank {os.environ['RANK']}: {case.get('id')}", file=sys.stderr, flush=True)
        try:
            results.append(pp_run(case))
        except (hf_scale.HfScaleError, RuntimeError, ValueError, AssertionError, TypeError, AttributeError):
            results.append({"error": traceback.format_exc()})
    return results


# ---------------------------------------------------------------- bad input

def bad_input(arch: str, head: str, config: dict, layers: int = LAYERS, step: dict | None = None) -> str:
    """The HfScale error ``parallelize`` (or, with ``step``, the first ``train_step``) raises
    on this rank; it must raise on every rank before any collective (else the spawn hangs).
    ``step``: {"drop": [keys]} removes batch keys, {"batch": n} sets the per-rank batch size,
    {"by_rank": True} gives each rank its own batch (data split by global rank, as for DDP)."""
    model = pp_model(arch, head, layers)
    try:
        model = hf_scale.parallelize(model, config)
        if step is None:
            return "no error from parallelize"
        seed = 7 + (int(os.environ["RANK"]) if step.get("by_rank") else 0)
        batch = padded_batch(seed, batch=step.get("batch", GLOBAL_BATCH))
        batch = {k: v for k, v in batch.items() if k not in step.get("drop", ())}
        model.train_step(batch)
    except hf_scale.HfScaleError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def position_ids_check(arch: str, config: dict) -> dict:
    """``eval_step`` with arbitrary ``position_ids`` (the same on every rank) against one process
    with and without them: they must reach every stage (each block of a rotary model uses them)."""
    model = pp_model(arch)
    with torch.no_grad():  # sharp attention: at random init the scores are near uniform, so positions
        for name, param in model.named_parameters():  # would hardly move the loss
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(30)
    reference = copy.deepcopy(model).eval()
    batch = padded_batch(11)
    batch["position_ids"] = torch.randint(0, SEQ, batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    model = hf_scale.parallelize(model, config)
    model.eval()
    with torch.no_grad():
        plain = {k: v for k, v in batch.items() if k != "position_ids"}
        return {"pp": float(model.eval_step(batch)), "reference": float(reference(**batch).loss),
                "reference_without": float(reference(**plain).loss)}


def forward_refused(arch: str, config: dict) -> str:
    """Calling a stage model as a whole model must say to use train_step / eval_step."""
    model = hf_scale.parallelize(pp_model(arch), config)
    batch = padded_batch(3)
    try:
        model(**batch)
    except hf_scale.HfScaleError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def world_checks(cases: list[dict], extra: dict) -> dict:
    """All pp checks of one world size, in one process group."""
    out = {"rank": int(os.environ["RANK"])}
    for key, (fn, args, kwargs) in extra.items():  # name -> (function of this module, args, kwargs)
        out[key] = globals()[fn](*args, **kwargs)
        dist.barrier()  # a rank that raised no error would hang here, failing the spawn
    out["parity"] = run_cases(cases)  # last: a case that crashes a pipeline can derail the next ones
    return out
