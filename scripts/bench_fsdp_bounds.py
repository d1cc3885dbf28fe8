"""``bench_parallelize.py --bounds``: what any FSDP implementation can reach on this machine.

Two legs that are not ways to train, run by the same worker loop as the contenders (2 ranks at
once, 1 thread each, the same tokens per rank), and one line reading them against the fsdp legs:

* ``bound_compute``: every rank trains the whole unsharded SmolLM2-135M (plain tensors, no FSDP)
  on its own 2 x 256 tokens, and fused AdamW (hf_scale's optimizer) steps this rank's half of
  every parameter (``torch.chunk`` on dim 0, what FSDP gives a rank): the forward, backward and
  optimizer work per rank of any FSDP step, and no collective (only the worker's barrier and
  its one-number loss all-reduce after the timed steps). Half the parameters, not the whole
  model, because an FSDP rank updates 1/world of them; the whole forward and backward, because
  it computes on every gathered block. Both ranks run together, so they share the cores, caches
  and memory bandwidth as the fsdp legs' ranks do. Its ranks drift apart (each updates half
  of every parameter): its loss is not the others'.
* ``bound_collectives``: the step's collectives alone, on hf_scale's fsdp layout of the model
  (its units' flat shard sizes): forward, one all-gather per unit; backward, one all-gather
  per unit resharded after forward (not the root, not the last block) and one reduce-scatter
  per unit (hf_scale's all-to-all + local sum on gloo), back to back, no compute between.

Any FSDP step is at least the compute (communication perfectly hidden, no copies, no hooks):
``bound_compute``'s tok/s is the ceiling; without any overlap a step costs about compute +
collectives. The line prints each fsdp leg as a fraction of the ceiling and where 1.1x torch's
``fully_shard`` would sit.
"""

from __future__ import annotations

BOUNDS = ("bound_compute", "bound_collectives")


class ShardStepAdamW:
    """Fused AdamW over this rank's dim-0 chunk of each parameter (views of the parameters and
    of their gradients, rows as ``torch.chunk`` splits them): the optimizer work of one FSDP
    rank, on an unsharded model."""

    def __init__(self, model, world: int, rank: int, **adamw):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rows = [_rows(p.shape[0], world, rank) for p in self.params]
        self.chunks = [p.detach()[lo:hi] for p, (lo, hi) in zip(self.params, self.rows)]
        self.optimizer = torch.optim.AdamW(self.chunks, fused=True, **adamw)

    def step(self) -> None:
        for param, chunk, (lo, hi) in zip(self.params, self.chunks, self.rows):
            chunk.grad = None if param.grad is None else param.grad[lo:hi]
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, chunk in zip(self.params, self.chunks):
            param.grad = chunk.grad = None


def _rows(size: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of a dim 0 of ``size``, as ``torch.chunk`` (and FSDP) split it."""
    per = -(-size // world)
    return min(size, rank * per), min(size, (rank + 1) * per)


class NoOptimizer:
    """``bound_collectives`` updates nothing."""

    def step(self) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def bound_compute(lr: float, world: int):
    """The ``bound_compute`` leg's (model, optimizer, note, load s, parallelize s): the unsharded
    model and :class:`ShardStepAdamW` (the process group only for the worker's barriers)."""
    import time

    import torch.distributed as dist

    from hf_scale.zoo import load_smollm2

    dist.init_process_group("gloo")
    start = time.perf_counter()
    model, _ = load_smollm2()
    load_s = time.perf_counter() - start
    optimizer = ShardStepAdamW(model, world, dist.get_rank(), lr=lr, weight_decay=0.0)
    note = f"bound: no FSDP, no collective; fused AdamW on this rank's 1/{world} of each parameter"
    return model, optimizer, note, load_s, None


def bound_collectives():
    """The ``bound_collectives`` leg's (model, optimizer, note, load s, parallelize s): a
    :class:`CollectivesOnly` on hf_scale's fsdp layout of SmolLM2-135M."""
    import time

    import hf_scale
    from hf_scale.zoo import load_smollm2

    start = time.perf_counter()
    model, _ = load_smollm2()
    load_s = time.perf_counter() - start
    collectives = _collectives_module()(hf_scale.parallelize(model, {"strategy": "fsdp"}))
    note = (f"bound: {len(collectives.sizes)} units' all-gathers (forward), "
            f"{sum(collectives.regather)} re-gathers + {len(collectives.sizes)} all-to-all "
            "reduce-scatters (backward), nothing else")
    return collectives, NoOptimizer(), note, load_s, None


def _collectives_module():
    """The CollectivesOnly class (built here: it needs torch, which the launcher does not import)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp import FSDPModule

    from hf_scale.parallel.reduce_scatter import AllToAllReduceScatter

    class CollectivesOnly(nn.Module):
        """A step's FSDP collectives on ``fsdp_model``'s units (their flat shard sizes, in
        forward order), with buffers allocated per call as FSDP does, and no compute: the
        forward all-gathers every unit; the loss's backward re-gathers each unit resharded after
        forward, then reduce-scatters it, last unit first."""

        def __init__(self, fsdp_model: nn.Module):
            super().__init__()
            self.config = fsdp_model.config
            groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_model.modules()
                      if isinstance(m, FSDPModule)]
            groups = [g for g in groups if g is not None]
            self.sizes = [sum(p._sharded_param_data.numel() for p in g.fsdp_params) for g in groups]
            self.regather = [g.post_forward_mesh_info is not None for g in groups]
            self.group = groups[0].mesh_info.shard_process_group
            self.anchor = nn.Parameter(torch.zeros(()))  # the loss needs a leaf to backward to

        def _gather(self, size: int) -> None:
            world = self.group.size()
            dist.all_gather_into_tensor(torch.empty(world * size), torch.zeros(size), group=self.group)

        def backward_collectives(self) -> None:
            reduce = AllToAllReduceScatter()
            for size, regather in zip(reversed(self.sizes), reversed(self.regather)):
                if regather:
                    self._gather(size)
                grads = torch.zeros(self.group.size() * size)
                reduce(torch.empty(size), grads, self.group, op=ReduceOp.AVG)

        def forward(self, input_ids=None, labels=None, use_cache=None):
            from types import SimpleNamespace

            for size in self.sizes:
                self._gather(size)
            return SimpleNamespace(loss=_BackwardCollectives.apply(self.anchor, self))

    class _BackwardCollectives(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor, module):
            ctx.module = module
            return anchor.detach().clone()

        @staticmethod
        def backward(ctx, grad):
            ctx.module.backward_collectives()
            return grad, None

    return CollectivesOnly


def bounds_line(runs: list[tuple[str, dict]], labels: dict[str, str], tokens_per_step: int) -> list[str]:
    """The (g) line: the mean tok/s of each leg's runs against ``bound_compute``'s (the
    ceiling), with ``bound_collectives``' seconds per step and the no-overlap estimate;
    empty when ``bound_compute`` did not run."""
    mean = {}
    for name in ("bound_compute", "bound_collectives", "hf_fsdp", "torch_fsdp"):
        tok = [row["tok_s"] for leg, row in runs if leg == name and row.get("status") == "ok"]
        if tok:
            mean[name] = sum(tok) / len(tok)
    if "bound_compute" not in mean:
        return []
    ceiling = mean["bound_compute"]
    lines = [f"(g) bound: {labels['bound_compute']} {ceiling:.1f} tok/s: the ceiling of any FSDP step here "
             "(the same compute per rank, communication free and hidden)"]
    if "bound_collectives" in mean:
        comm = tokens_per_step / mean["bound_collectives"]
        serial = tokens_per_step / (tokens_per_step / ceiling + comm)
        lines.append(f"    collectives alone {comm:.2f} s per step; compute + collectives without overlap "
                     f"{serial:.1f} tok/s ({serial / ceiling:.3f} of the ceiling)")
    for name in ("hf_fsdp", "torch_fsdp"):
        if name in mean:
            lines.append(f"    {labels[name]}: {mean[name]:.1f} tok/s = {mean[name] / ceiling:.3f} of the ceiling")
    if "torch_fsdp" in mean:
        target = 1.1 * mean["torch_fsdp"]
        where = "beyond it: no FSDP reaches it here" if target > ceiling else "within it"
        lines.append(f"    1.1x torch fully_shard = {target:.1f} tok/s = {target / ceiling:.3f} of the ceiling ({where})")
    return ["\n".join(lines)]
