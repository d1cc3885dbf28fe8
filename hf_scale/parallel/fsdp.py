"""FSDP2 (``fully_shard``): ZeRO-3, ZeRO-2 and HSDP over a 1-D or 2-D data-parallel mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .ep import divide_gradients, unsplit_parameters
from .reduce_scatter import install_reduce_scatter


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    units: list[nn.Module],
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    fp32_modules: list[nn.Module] = (),
    blocks_per_unit: int = 1,
    prefetch: int | None = None,
    experts: list[nn.Module] = (),
    experts_mesh=None,
    data_ranks: int | None = None,
) -> None:
    """Shard ``model`` with one FSDP unit per ``blocks_per_unit`` consecutive modules of
    ``units``, plus the root.

    Layout: parameters are ``DTensor`` s sharded on dim 0 over a 1-D mesh (FSDP), or
    ``(Replicate, Shard(0))`` over a 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP). Everything
    not inside a unit (embeddings, final norm, heads) belongs to the root unit, so tied
    input/output embeddings stay one parameter.

    Args:
        dp_mesh: 1-D or 2-D data-parallel ``DeviceMesh``.
        units: the blocks, in forward order (from the model plan).
        param_dtype: compute dtype of gathered parameters (None: keep fp32).
        reduce_dtype: dtype gradients are reduced and kept in.
        reshard_after_forward: False keeps gathered parameters until backward (ZeRO-2).
        cpu_offload: sharded parameters, gradients and optimizer state live on the CPU.
        fp32_modules: submodules that must compute in fp32 under mixed precision; each gets
            its own unit that casts its inputs to fp32.
        blocks_per_unit: consecutive blocks sharded as one unit (``fully_shard`` of a list):
            one all-gather / reduce-scatter per group instead of per block. The last group may
            be shorter.
        prefetch: all-gathers issued ahead, explicitly: each unit's forward prefetches the next
            ``prefetch`` units and its backward the ``prefetch`` before it (the root's forward
            the first ones). ``None`` keeps FSDP2's defaults (forward: the next unit's
            all-gather is queued when the host reaches it; backward: the previous unit, by the
            reverse forward order). An explicit prefetch issues the next all-gather as soon as
            the current one lands, which hides it when the host, not the device, is the
            bottleneck (small blocks, slow launches); each unit deeper than one keeps one more
            gathered unit alive. On a CPU mesh ``None`` means 1, with asynchronous all-gathers
            (:func:`overlap_on_host`): without them nothing overlaps there.
        experts: expert-parallel experts modules (their weights ``DTensor`` s sharded over the ep
            mesh): each its own unit over ``experts_mesh``, the ranks holding the same experts.
            Their gradients arrive summed over the ep ranks' tokens (the all-to-all's backward),
            so the reduction divides by ``data_ranks`` (every data-parallel rank), not by the
            size of ``experts_mesh``: the same mean over all ranks' data as the dense weights.
            When ``experts_mesh`` is one rank (no other rank holds these experts) and neither
            ``param_dtype`` nor ``cpu_offload`` is set, they stay out of FSDP (``ignored_params``
            of the enclosing units): FSDP would only copy them whole into its buffers and back
            every step; a gradient hook does the division.

    On gloo every unit reduce-scatters its gradients with an all-to-all and a local sum
    (:mod:`.reduce_scatter`: gloo's own reduce-scatter is a whole all-reduce); other backends
    keep their native reduce-scatter.

    Usage::

        apply_fsdp(model, mesh["dp_shard"], wrap_units(model, plan), param_dtype=torch.bfloat16)
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    ignored = shard_experts(experts, experts_mesh, data_ranks, mp_policy=mp_policy, offload=offload,
                            reshard_after_forward=reshard_after_forward)
    common = {"mesh": dp_mesh, "offload_policy": offload, "shard_placement_fn": _shard_placement,
              "ignored_params": ignored or None}
    if param_dtype is not None:
        keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in fp32_modules:
            fully_shard(module, mp_policy=keep, reshard_after_forward=reshard_after_forward, **common)
    groups = [list(units[i : i + blocks_per_unit]) for i in range(0, len(units), blocks_per_unit)]
    for index, group in enumerate(groups):
        # The last unit's parameters are needed first in backward: keep them gathered.
        last = index == len(groups) - 1
        fully_shard(
            group[0] if len(group) == 1 else group,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward and not last,
            **common,
        )
    # The root's parameters (embeddings, head) are needed again as soon as backward starts.
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=False, **common)
    install_reduce_scatter(model, dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)))
    on_host = overlap_on_host(model, dp_mesh.device_type)
    if prefetch or on_host:
        set_prefetch(model, [group[0] for group in groups], prefetch or 1)


def overlap_on_host(root: nn.Module, device_type: str) -> bool:
    """On a CPU mesh, make every FSDP unit under ``root`` issue its all-gathers asynchronously
    (FSDP2's ``_set_unshard_async_op``); returns whether it did (the caller then prefetches
    explicitly). Why: FSDP2 overlaps communication with compute through device streams; on a
    CPU there are none and its all-gathers default to ``async_op=False``, so every one, its
    prefetches included, blocks the host that computes. Async all-gathers run in gloo's threads
    while the host computes the current unit, and the explicit prefetch issues the next one
    before that compute. GPU meshes keep FSDP2's defaults."""
    switch = getattr(root, "_set_unshard_async_op", None)  # private in torch 2.13: absent, keep the defaults
    if device_type != "cpu" or switch is None:
        return False
    switch(True)
    return True


def shard_experts(experts: list[nn.Module], experts_mesh, data_ranks: int, *,
                  mp_policy: MixedPrecisionPolicy | None = None, offload: OffloadPolicy | None = None,
                  reshard_after_forward: bool = True) -> set[nn.Parameter]:
    """Each expert-parallel experts module its own FSDP unit over ``experts_mesh`` (the ranks
    holding the same experts), its gradients divided by ``data_ranks`` (every data-parallel
    rank: they arrive summed over the ep ranks' tokens). Experts no other rank holds
    (``experts_mesh`` of one rank), without mixed precision or offload, stay out of FSDP (it
    would copy them whole into its buffers and back, for nothing to gather or scatter): returns
    their parameters, which the enclosing units must ignore.

    Usage (DDP's dense weights, experts over the replicas holding the same ones)::

        shard_experts(experts, erep_mesh, data_ranks=dims.dp_degree)
    """
    policy = mp_policy or MixedPrecisionPolicy()
    whole = (experts_mesh is not None and experts_mesh.size() == 1 and policy.param_dtype is None
             and not isinstance(offload, CPUOffloadPolicy))
    ignored: set[nn.Parameter] = set()
    for module in experts:
        if whole and _keep_whole(module, float(data_ranks), ignored):
            continue
        fully_shard(module, mesh=experts_mesh, offload_policy=offload or OffloadPolicy(), mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(float(data_ranks))
        if experts_mesh.size(experts_mesh.ndim - 1) > 1:
            # a sum, then the division (gloo has no PREMUL_SUM); not when the shard dimension is one
            # rank (ep = dp_shard, HSDP's replicas beside it or not), where torch 2.13's FSDP copies
            # the gradient divided instead of reduce-scattering it, and would divide again after
            module.set_force_sum_reduction_for_comms(True)
    return ignored


def _keep_whole(module: nn.Module, divide_factor: float, ignored: set) -> bool:
    """Leave an experts module out of FSDP when every one of its parameters is a ``DTensor``
    (the ep / tp split) that this rank alone holds: its gradients arrive whole (the
    all-to-all's backward brings every rank's tokens), so FSDP's only work would be the
    division by the data-parallel ranks, done by :func:`~.ep.divide_gradients`. Adds the
    parameters to ``ignored`` (the enclosing units must leave them alone); False (and nothing
    added) when some parameter is a plain tensor, which FSDP must shard and reduce."""
    params = list(module.parameters())
    if not params or unsplit_parameters(module):
        return False
    ignored.update(params)
    divide_gradients(module, divide_factor)
    return True


def set_prefetch(root: nn.Module, units: list[nn.Module], depth: int) -> None:
    """Explicit all-gather prefetch ``depth`` units ahead (PyTorch's FSDP2 example's pattern):
    in forward each unit (and the root, before the first) prefetches the next ``depth``; in
    backward each prefetches the ``depth`` before it, nearest first. ``units``: one module of
    each FSDP unit, in forward order."""
    root.set_modules_to_forward_prefetch(units[:depth])
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(0, i - depth) : i][::-1])


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP's shard dimension: dim 0 (the default), except for a packed tensor-parallel weight
    (``_StridedShard`` on the tp mesh, e.g. a fused qkv split per part): FSDP shards it on
    another dimension, since a data-parallel shard of a strided tp shard on the same dimension
    is not a layout DTensor can describe (its full tensor, and so checkpoints, come out wrong)."""
    if isinstance(param, DTensor) and param.dim() > 1:
        strided = {p.dim for p in param.placements if isinstance(p, _StridedShard)}
        if 0 in strided:
            return Shard(next(d for d in range(1, param.dim()) if d not in strided))
    return None
