"""``strategy: "auto"``: the chooser's layout for the ranks and memory this run has.

The world size comes from torchrun's environment, the memory budget from the device (a GPU's
total memory; on CPU the machine's RAM divided among the local processes), the device's speed
from :data:`hf_scale.layout_search.cost.H100` on a GPU (a stand-in: the ranking, not the seconds,
matters) or this machine's calibration on CPU. ``parallelize`` does not see a batch, so its
workload is one sequence of ``min(max_position_embeddings, 1024)`` tokens per rank; the
fine-tuning loop passes the recipe's ``max_seq_len``, ``batch_size`` and ``grad_accum``.
Fields given beside ``strategy: "auto"`` are kept fixed (a mapping's keys; a ParallelConfig's
fields away from their defaults: use a mapping to pin a field to its default, e.g. ``tp: 1``),
and only layouts that run with them are ranked; degrees that contradict the world size are
refused. Under torchrun rank 0 decides and every rank gets
its answer (:func:`hf_scale.ranks.share_from_rank0`): a calibration or a tie can never make
two ranks choose differently.

Usage::

    model = hf_scale.parallelize(model, "auto")
    model = hf_scale.parallelize(model, {"strategy": "auto", "mixed_precision": "bf16"})
    config, best = auto_config(model, world_size=8, budget=parse_memory("80GB"), seq=4096, batch=2)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..config import ParallelConfig, from_dict
from ..config import is_auto_request as is_auto  # noqa: F401 - re-exported
from ..errors import HfScaleConfigError
from ..log import log_rank0
from ..mesh import ParallelDims
from .choose import Candidate, choose
from .cost import H100
from .estimate import GiB, Workload
from .machine import cpu_device
from .profile import model_facts

# ParallelConfig fields the chooser varies; a value given for one of them narrows its search.
_SPACE = {"mixed_precision": "precisions", "activation_checkpointing": "acs", "cpu_offload": "offloads",
          "loss_chunk_tokens": "chunks", "tp": "tps", "pp": "pps", "ep": "eps", "cp": "cps",
          "cp_exchange": "cp_exchanges", "cp_layout": "cp_layouts"}
_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


def fixed_fields(config) -> dict:
    """What ``"auto"`` must keep: a mapping's keys, or a ParallelConfig's non-default fields."""
    if isinstance(config, str) or config is None:
        return {}
    if isinstance(config, ParallelConfig):
        return config.fixed_fields()
    return {k: v for k, v in config.items() if k != "strategy"}


def resolve_auto(source, requested, *, seq: int | None = None, batch: int = 1, micro_batch: int | None = None,
                 keep=None, reference: int = 0, quantize: str | None = None) -> ParallelConfig:
    """Collective under torchrun: the ``ParallelConfig`` the planner chooses for ``source`` (a
    model, its config, or a function returning one: called on rank 0 only) with ``requested``'s
    fixed fields, for this run's world size, nodes, device and memory (read by
    :func:`hf_scale.distributed.init_distributed`, mpirun's and SLURM's variables included),
    decided on rank 0 and logged once. ``keep(layout, config)`` may refuse candidates.
    ``reference``: a held preference reference's bytes a parameter (:attr:`.estimate.Workload.reference`).
    ``quantize="nf4"``: LoRA's base weights are held in NF4 (QLoRA): priced so, and only the
    layouts the loader takes for them are ranked.

    Usage::

        config = resolve_auto(model, "auto")                           # parallelize's workload
        config = resolve_auto(model.config, job.parallel, seq=512, batch=32, micro_batch=8)
    """
    from ..distributed import init_distributed
    from ..ranks import share_from_rank0

    fixed = fixed_fields(requested)
    env = init_distributed(int(fixed.get("timeout_seconds", ParallelConfig.timeout_seconds)))
    run = {"world_size": env.world_size, "nodes": env.num_nodes, "device_type": env.device.type,
           "budget": _device_memory(env.device.type, env.local_world_size)}
    config, describe = share_from_rank0(_decide, source, fixed, seq, batch, micro_batch, keep, run, reference,
                                        quantize)
    log_rank0(f"strategy 'auto' chose {describe}")
    return config


def _decide(source, fixed, seq, batch, micro_batch, keep, run, reference=0, quantize=None) -> tuple[ParallelConfig, str]:
    if callable(source) and not isinstance(source, torch.nn.Module):
        source = source()
    seq = _seq(source, seq)
    config, best = auto_config(source, fixed=fixed, seq=seq, batch=batch, micro_batch=micro_batch, keep=keep,
                               reference=reference, quantize=quantize, **run)
    mem, cost = best.memory, best.cost
    return config, (f"{best.layout.describe()}: {mem.device_total / GiB:.2f} GiB per rank estimated, "
                    f"{cost.tokens_per_second:,.0f} tokens/s estimated (seq {seq} x batch {batch} per "
                    "data-parallel rank)")


def _seq(source, seq: int | None) -> int:
    config = getattr(source, "config", source)
    return seq or min(getattr(config, "max_position_embeddings", 1024) or 1024, 1024)


def search_space(fixed: Mapping, world_size: int, nodes: int = 1, micro_batch: int | None = None,
                 keep=None) -> tuple[dict, dict]:
    """``(space, rest)``: the chooser's search narrowed by the fixed fields (precision only when
    asked for: it changes the numerics), and the fields merged into the choice afterwards.
    Candidates whose ParallelConfig with those fields would be refused are left out, so the
    ranking only holds layouts that run as configured."""
    rest = {k: v for k, v in dict(fixed).items() if k != "strategy"}
    _check_degrees(rest, world_size)
    space = {key: (rest.pop(field),) for field, key in _SPACE.items() if field in rest}
    if "blocks_per_unit" in rest:
        space["units"] = (rest.pop("blocks_per_unit") or 1,)
    if "fsdp_prefetch" in rest:
        space["prefetches"] = (rest.pop("fsdp_prefetch"),)
    space.setdefault("precisions", (None,))
    if micro_batch is not None:
        space["micro_batches"] = (micro_batch,)
    if rest.get("pp_grad_sync", "auto") == "auto":  # "auto": the chooser tries both (by fit)
        rest.pop("pp_grad_sync", None)
    for field, key in (("pp_schedule", "pp_schedules"), ("pp_microbatches", "pp_microbatches"),
                       ("pp_grad_sync", "pp_grad_syncs")):
        if field in rest:
            space[key] = (rest.pop(field),)
    degrees = {k: rest.pop(k) for k in ("dp_replicate", "dp_shard") if k in rest}

    def accepted(lay) -> bool:
        if any(getattr(lay, k) != v for k, v in degrees.items()):
            return False
        try:
            config = _as_config(lay, world_size, rest)
            if world_size > 1:
                ParallelDims.resolve(config, world_size, nodes)
        except HfScaleConfigError:
            return False
        return keep is None or keep(lay, config)

    space["keep"] = accepted
    return space, rest


def _as_config(lay, world_size: int, rest: Mapping) -> ParallelConfig:
    """The ParallelConfig that runs ``lay`` with the fields merged in (raises when refused)."""
    chosen = lay.parallel_config() if world_size > 1 else ParallelConfig(
        activation_checkpointing=lay.ac, mixed_precision=lay.precision, loss_chunk_tokens=lay.loss_chunk_tokens)
    return from_dict(ParallelConfig, dict(vars(chosen)) | dict(rest))


def auto_config(source, *, world_size: int | None = None, budget: int | None = None, device_type: str | None = None,
                seq: int | None = None, batch: int = 1, fixed: Mapping | None = None,
                nodes: int | None = None, micro_batch: int | None = None,
                keep=None, reference: int = 0, quantize: str | None = None) -> tuple[ParallelConfig, Candidate]:
    """The ``ParallelConfig`` of the fastest layout that fits, and the chosen candidate (one
    process's computation with the sizes given, or one process's: :func:`resolve_auto` is the
    collective entry point that reads the run's)."""
    world_size = world_size or 1
    nodes = nodes or 1
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if budget is None:
        budget = _device_memory(device_type, world_size // nodes)
    space, rest = search_space(fixed or {}, world_size, nodes, micro_batch, keep)
    device = cpu_device() if device_type == "cpu" else H100
    work = Workload(seq=_seq(source, seq), batch=batch, device=device_type, reference=reference)
    best, _ = choose(model_facts(source, quantize=quantize), work, world_size, budget, device, nodes, **space)
    return _as_config(best.layout, world_size, rest), best


def _check_degrees(fixed: Mapping, world_size: int) -> None:
    given = {k: int(fixed[k]) for k in _DEGREES if fixed.get(k) is not None}
    product = math.prod(given.values())
    whole = {"dp_replicate", "dp_shard"} <= set(given)
    if world_size % product or (whole and product != world_size):
        shown = " x ".join(f"{k}={v}" for k, v in given.items())
        raise HfScaleConfigError(
            f"strategy='auto' with {shown} = {product} does not {'equal' if whole else 'divide'} the world size "
            f"{world_size}: drop the fixed degrees (auto chooses them) or start "
            f"{'exactly' if whole else 'a multiple of'} {product} processes."
        )


def _device_memory(device_type: str, local_processes: int = 1) -> int:
    """A GPU's total memory, or this machine's RAM shared by its ``local_processes``."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    import psutil

    return psutil.virtual_memory().total // max(1, local_processes)
