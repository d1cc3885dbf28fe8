"""Preference (DPO-family) training on N ranks against one process of the same model and pairs.

A *case*: ``config`` (a ParallelConfig dict), ``loss`` (PreferenceLoss kwargs), ``lora``
(train a LoRA adapter; the reference is the base with it disabled), ``held`` (the reference a
frozen copy of the starting weights held beside the policy, loaded by the fine-tuning loop's
``load_reference`` and scored per micro-batch), ``steps`` (AdamW steps) and ``arch``; kto cases (``loss: kto``, unpaired examples, ``ref_scale``:
the held reference's other weights) run in :mod:`tests.distributed.kto_checks`. The data are interleaved pairs (tests.tiny_models.pair_rows): prompts masked, chosen
and rejected of different lengths, right padding. Data-parallel ranks take distinct pairs;
the reference's log-probs (losses that need one, without LoRA) are precomputed under the
case's own layout with ``reference_logps`` before the first step, as the fine-tuning loop does.

Each rank reports per step the global loss, the gradient norm and TRL's metrics, the whole
gradient of every parameter it holds after the first step (DTensors gathered; pp: its stages'),
its parameters after the last step, and the precomputed reference.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.data.preference import PairCollator
from hf_scale.parallel.preference import PairTotals, pair_totals, preference_step, sequence_logps
from hf_scale.parallel.preference_loss import PreferenceLoss
from hf_scale.parallel.preference_reference import frozen_reference_logps, reference_logps
from tests.distributed import kto_checks
from tests.tiny_models import pair_rows, tiny_model

PAIRS = 4  # per step, global
LR = 1e-3
BIG_NORM = 1e9  # clip_grad_norm_ reports the norm; nothing is clipped
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "init_lora_weights": False}


def make_model(case: dict):
    model = tiny_model(case.get("arch", "llama"), "causal")
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(**LORA))
    return model


def step_rows(step: int) -> list[dict]:
    return pair_rows(PAIRS, seed=100 + step)


def _with_ref(rows: list[dict], ref: torch.Tensor) -> list[dict]:
    return [{**row, "ref_chosen_logps": float(r[0]), "ref_rejected_logps": float(r[1])} for row, r in zip(rows, ref)]


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def reference_run(case: dict) -> dict:
    """The ground truth: the unparallelized model, the whole batch, one process."""
    if case["loss"]["loss"] == "kto":
        return kto_checks.reference_run(case, make_model)
    model = make_model(case)
    knobs = PreferenceLoss(**case["loss"])
    collate = PairCollator(0)
    names = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.0)
    out = {"losses": [], "norms": [], "metrics": [], "refs": []}
    for step in range(case.get("steps", 1)):
        rows = step_rows(step)
        batch = collate(rows)
        if knobs.needs_reference and not case.get("lora"):
            if step == 0:  # the reference is the policy before the first step, for every step
                model.eval()
                first = [sequence_logps(model, collate(step_rows(s))).view(-1, 2) for s in range(case.get("steps", 1))]
                model.train()
            batch = collate(_with_ref(rows, first[step]))
            out["refs"].append(first[step])
        result = preference_step(model, batch, knobs)
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in names.items() if p.grad is not None}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(_trainable(model), BIG_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(float(result.loss))
        out["metrics"].append({k: float(v) / result.pairs for k, v in result.sums.items()})
    out["params"] = {n: p.detach().clone() for n, p in names.items()}
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full else t).detach().float().cpu().clone()


def parallel_run(case: dict) -> dict:
    if case["loss"]["loss"] == "kto":
        return kto_checks.parallel_run(case, make_model)
    model = hf_scale.parallelize(make_model(case), case["config"])
    state = hf_scale.get_state(model)
    knobs = PreferenceLoss(**case["loss"])
    collate = PairCollator(0)
    steps = case.get("steps", 1)
    per_rank = PAIRS // state.dp_degree
    refs, held = None, None
    if case.get("held"):
        held = held_reference(case, state.env.device)
    elif knobs.needs_reference and not case.get("lora"):
        every = [row for s in range(steps) for row in step_rows(s)]
        refs = reference_logps(model, every, collate, batch_size=2, rank=state.dp_rank, world=state.dp_degree,
                               group=state.dp_group if state.dp_degree > 1 else None)
    # built after the reference pass, as the fine-tuning loop does: it must find the sharded parameters
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.0)
    out = {"losses": [], "norms": [], "metrics": [], "refs": refs}
    for step in range(steps):
        rows = step_rows(step)
        if refs is not None:
            rows = _with_ref(rows, refs[step * PAIRS:(step + 1) * PAIRS])
        mine = rows[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]  # rank-distinct pairs
        accum = case.get("accum", 1)  # micro-batches of different lengths, gradient sync on the last
        micro = [collate(mine[i::accum]) for i in range(accum)]
        for batch in micro if held is not None else []:
            batch["ref_logps"] = frozen_reference_logps(held, batch)
        local = [pair_totals(b, knobs) for b in micro]
        counts = torch.tensor([sum(t.pairs for t in local), sum(t.nll_tokens for t in local)], dtype=torch.float64)
        if state.dp_degree > 1:
            dist.all_reduce(counts, group=state.dp_group)
        totals = PairTotals(float(counts[0]), float(counts[1]))
        result = None
        for i, batch in enumerate(micro):
            with hf_scale.no_sync(model, enabled=i < accum - 1):
                part = preference_step(model, batch, knobs, loss_scale=state.dp_degree, totals=totals)
            if result is None:
                result = part
            else:
                result.loss = result.loss + part.loss
                result.sums = {k: v + part.sums[k] for k, v in result.sums.items()}
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        out["norms"].append(float(hf_scale.clip_grad_norm_(model, BIG_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        names = sorted(result.sums)
        values = torch.tensor([float(result.loss)] + [float(result.sums[n]) for n in names], dtype=torch.float64)
        if state.dp_degree > 1:
            dist.all_reduce(values, group=state.dp_group)
        out["losses"].append(float(values[0]))
        out["metrics"].append({n: float(v) / PAIRS for n, v in zip(names, values[1:])})
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    if held is not None:  # between forwards the reference holds its shards only, and trains nothing
        from torch.distributed.tensor import DTensor

        params = list(held.parameters())
        out["held"] = {"frozen": not any(p.requires_grad or p.grad is not None for p in params),
                       "sharded": all(isinstance(p, DTensor) for p in params),
                       "local_share": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
                       / sum(p.numel() for p in params)}
    return out


def held_reference(case: dict, device):
    """The case's starting weights saved by rank 0 and loaded back on every rank as the
    fine-tuning loop loads ``preference.reference: model``."""
    import tempfile

    from hf_scale.config import ParallelConfig
    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_reference

    folder = [tempfile.mkdtemp(prefix="held-reference-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if dist.get_rank() == 0:  # the starting weights, or (ref_scale) another initialisation
        source = kto_checks.reference_model(case) if "ref_scale" in case else make_model({**case, "lora": False})
        source.save_pretrained(folder[0])
    dist.barrier()
    return load_reference(ModelConfig(name_or_path=folder[0]), ParallelConfig(**case["config"]), device)


def expect_error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def odd_microbatch() -> str:
    """pp=2 with 2 microbatches of a 3-pair batch: a microbatch would split a pair."""
    model = hf_scale.parallelize(make_model({}), {"strategy": "ddp", "pp": 2, "pp_microbatches": 2})
    return expect_error(preference_step, model, PairCollator(0)(pair_rows(3)), PreferenceLoss("simpo"))


def world_checks(cases: dict) -> dict:
    """Every case in this one process group; a failing case reports its traceback."""
    results = {}
    for name, case in cases.items():
        try:
            results[name] = parallel_run(case)
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = {"error": traceback.format_exc()}
    results["odd_microbatch"] = odd_microbatch()
    return results
