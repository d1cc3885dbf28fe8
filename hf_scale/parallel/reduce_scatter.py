"""FSDP2's gradient reduce-scatter as an all-to-all plus a local sum, for gloo.

gloo's ``reduce_scatter_tensor`` is a full all-reduce of the whole flat gradient followed by a copy
of this rank's chunk (profiled on torch 2.13): every rank receives and sums ``world`` chunks
where it needs one. ``all_to_all_single`` sends each rank only the chunk it keeps, and this rank
sums the ``world`` chunks it receives: the same sum, with ``1/world`` of the reductions and
about half the bytes on the wire. NCCL (and every other backend) keeps its native
reduce-scatter: :func:`install_reduce_scatter` only acts on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

#: backends whose ``reduce_scatter_tensor`` is an all-reduce in disguise
SLOW_REDUCE_SCATTER = ("gloo",)


class AllToAllReduceScatter(ReduceScatter):
    """``reduce_scatter_single(output, input, op)`` as ``all_to_all_single`` + a sum over ranks.

    ``input`` is FSDP's flat gradient buffer: ``world`` equal chunks in rank order (FSDP pads
    each parameter's dim 0 to a multiple of ``world`` before the copy-in, so uneven shards arrive
    here already even). Chunk ``r`` goes to rank ``r``; rank ``r`` receives every rank's chunk
    ``r`` and adds them in rank order. ``op`` is what FSDP asks of the collective: ``SUM``,
    ``AVG`` (the sum divided by ``world``) or ``PREMUL_SUM(f)`` (the sum times ``f``: FSDP's
    gradient divide factor ``1/f`` when set); any other op raises.

    Usage::

        unit.set_custom_reduce_scatter(AllToAllReduceScatter())
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=ReduceOp.SUM, async_op: bool = False) -> None:
        world = group.size()
        factor = _factor(op)
        if input_tensor.numel() != world * output_tensor.numel():
            raise ValueError(f"reduce-scatter input of {input_tensor.numel()} elements is not "
                             f"{world} x the output's {output_tensor.numel()}")
        received = torch.empty((world, output_tensor.numel()), dtype=input_tensor.dtype,
                               device=input_tensor.device)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received, dim=0, out=output_tensor.view(-1))
        if factor == "avg":
            output_tensor.div_(world)
        elif factor is not None:
            output_tensor.mul_(factor)
        return None


def _factor(op) -> float | str | None:
    """What the sum is scaled by: None (``SUM``), ``"avg"`` (divided by ``world``, as the
    backend's ``AVG`` does) or ``PREMUL_SUM``'s factor (a multiplier)."""
    kind = getattr(op, "op", op)
    if kind == ReduceOp.SUM:
        return None
    if kind == ReduceOp.AVG:
        return "avg"
    if kind == ReduceOp.PREMUL_SUM:
        return float(op.factor)
    raise ValueError(f"AllToAllReduceScatter sums gradients; FSDP asked for {op}, which it does not "
                     "implement: drop set_custom_reduce_scatter for this unit.")


def install_reduce_scatter(root: nn.Module, backend: str) -> bool:
    """Give every FSDP unit under ``root`` (itself included) the all-to-all reduce-scatter when
    ``backend`` (the data-parallel mesh's, e.g. ``dist.get_backend(group)``) is one whose own
    is slow (gloo); other backends (NCCL, ...) keep their native collective. Returns whether it
    was installed.

    HSDP units reduce-scatter over the shard group (the group FSDP hands the collective) and
    all-reduce over the replicas with ``dist.all_reduce`` as before."""
    if backend not in SLOW_REDUCE_SCATTER:
        return False
    comm = AllToAllReduceScatter()
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_reduce_scatter(comm)
    return True
