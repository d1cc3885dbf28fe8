"""Training runs shared by the parity tests: the same loop in one process and on N ranks.

A *case* is a dict: ``arch``, ``head``, ``config`` (a ParallelConfig dict), optionally
``accum`` (micro-batches per step, gradient sync only on the last) and ``steps``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.parallel.optim import parameter_groups
from tests.tiny_models import packed_batch, slice_batch, tiny_batch, tiny_model

GLOBAL_BATCH = 8
STEPS = 3
LR = 1e-3
WEIGHT_DECAY = 0.1
MAX_NORM = 1.0


def _batches(head: str, steps: int, packed: bool = False):
    batches = [tiny_batch(head, GLOBAL_BATCH, seed=100 + s) for s in range(steps)]
    return [packed_batch(b, seed=200 + s) for s, b in enumerate(batches)] if packed else batches


def _model(arch: str, head: str, use_cache: bool | None = None):
    model = tiny_model(arch, head)
    if use_cache is not None:
        model.config.use_cache = use_cache
    return model


def reference_run(arch: str, head: str, steps: int = STEPS, *, packed: bool = False,
                  use_cache: bool | None = None) -> dict:
    """The ground truth: plain transformers model, plain AdamW, one process, whole batch.
    ``packed``: the batches as packed rows (:func:`tests.tiny_models.packed_batch`);
    ``use_cache``: the model config's (most training scripts set it False)."""
    model = _model(arch, head, use_cache)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    losses, norms = [], []
    grad_max = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for batch in _batches(head, steps, packed):
        loss = model(**batch).loss
        loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                grad_max[n] = torch.maximum(grad_max[n], p.grad.abs())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "initial": initial, "grad_max": grad_max}


def full_params(model, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """Every parameter whose name ``keep`` accepts, whole (DTensors gathered), by name. A
    collective: call on every rank."""
    from hf_scale.checkpoint.safetensors_io import reshard_all

    reshard_all(model)  # an evaluation forward may leave gathered compute copies behind
    out = {}
    for name, param in model.named_parameters():
        if not keep(name):
            continue
        data = param.detach()
        if isinstance(data, torch.distributed.tensor.DTensor):
            data = data.full_tensor()
        out[name] = data.float().cpu().clone()
    return out


def parallel_run(case: dict) -> dict:
    """One case on this rank; returns the global losses, grad norms and (rank 0) parameters."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps = case.get("steps", STEPS)
    accum = case.get("accum", 1)
    model = _model(case["arch"], case["head"], case.get("use_cache"))
    model = _parallelize(model, case["config"])
    state = hf_scale.get_state(model)  # data goes by the data-parallel coordinate (tp ranks share it)
    # a forward without backward before the optimizer is built, as the fine-tuning loop's first
    # evaluation or a DPO reference pass does: it leaves FSDP units gathered, and the optimizer
    # must still hold (and zero) the sharded parameters
    first = next(iter(_batches(case["head"], 1, case.get("packed", False))))
    model.eval()
    with torch.no_grad():
        model(**slice_batch(first, state.dp_rank, state.dp_degree))
    model.train()
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    prefetches = _count_prefetches()
    for batch in _batches(case["head"], steps, case.get("packed", False)):
        local = slice_batch(batch, state.dp_rank, state.dp_degree)
        micro = [slice_batch(local, i, accum) for i in range(accum)]
        step_loss = 0.0
        for i, mb in enumerate(micro):
            with hf_scale.no_sync(model, enabled=i < accum - 1):
                loss = model(**mb).loss / accum
                loss.backward()
            step_loss += loss.detach().float()
        norms.append(float(hf_scale.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(step_loss)
        losses.append(float(step_loss) / world)
    params = full_params(model)
    prefetches.stop()
    return {"losses": losses, "norms": norms, "params": params if rank == 0 else None,
            "fsdp_units": fsdp_unit_count(model), "prefetches": prefetches.counts,
            "strategy": hf_scale.get_state(model).config.strategy}


def _parallelize(model, config: dict):
    """``hf_scale.parallelize``; for ``strategy: auto`` with fixed device figures (the H100's: the
    ranking is what matters), not a two-minute calibration of this machine."""
    if config.get("strategy") != "auto":
        return hf_scale.parallelize(model, config)
    from hf_scale.layout_search import auto
    from hf_scale.layout_search.cost import H100

    original, auto.cpu_device = auto.cpu_device, lambda: H100
    try:
        return hf_scale.parallelize(model, config)
    finally:
        auto.cpu_device = original


class _count_prefetches:
    """Counts the all-gathers FSDP2 issued ahead of need, by pass ("forward" / "backward"), and
    those of them issued asynchronously ("async": the unit's ``unshard_async_op``, without which a
    prefetch blocks the host on a CPU), until ``stop()``: its own prefetch entry point, wrapped."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.counts = {"forward": 0, "backward": 0, "async": 0}
        self._owner, self._original = FSDPParamGroup, FSDPParamGroup.__dict__["_prefetch_unshard"]
        inner = self._original.__func__

        def counted(target, pass_type):
            self.counts[pass_type] += 1
            self.counts["async"] += int(target.unshard_async_op)
            return inner(target, pass_type)

        FSDPParamGroup._prefetch_unshard = staticmethod(counted)

    def stop(self) -> None:
        self._owner._prefetch_unshard = self._original


def fsdp_unit_count(model) -> int:
    """FSDP units (communication groups) in ``model``: modules sharded together share one state."""
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def run_cases(cases: list[dict]) -> list[dict]:
    """Run many cases in one process group (spawning ranks costs seconds; cases cost ms)."""
    results = []
    for case in cases:
        try:
            results.append(parallel_run(case))
        except Exception as e:  # report per case, keep the group going
            if not isinstance(e, (hf_scale.HfScaleError, RuntimeError, ValueError, AssertionError)):
                raise
            import traceback

            results.append({"error": traceback.format_exc()})
    return results
