"""``parallelize(model, "auto")``: the chooser's layout for the ranks and memory this run has.

The world size comes from torchrun's environment, the memory budget from the device (a GPU's
total memory; on CPU the machine's RAM divided among the local processes), the device's speed
from :data:`hf_scale.planner.cost.H100` on a GPU (a stand-in: the ranking, not the seconds,
matters) or this machine's calibration on CPU. ``parallelize`` does not see a batch, so the
workload is one sequence of ``min(max_position_embeddings, 1024)`` tokens per rank unless
given. Fields given beside ``strategy: "auto"`` are kept fixed, and must fit the world size.

Usage::

    model = hf_scale.parallelize(model, "auto")
    model = hf_scale.parallelize(model, {"strategy": "auto", "mixed_precision": "bf16"})
    config, best = auto_config(model, world_size=8, budget=parse_memory("80GB"), seq=4096, batch=2)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config import ParallelConfig, from_dict
from ..errors import HfScaleConfigError
from .choose import Candidate, choose
from .cost import H100, cpu_device
from .estimate import Workload
from .profile import model_facts

# ParallelConfig fields the chooser varies; a value given for one of them narrows its search.
_SPACE = {"mixed_precision": "precisions", "activation_checkpointing": "acs", "cpu_offload": "offloads",
          "loss_chunk_tokens": "chunks", "tp": "tps", "pp": "pps"}


def is_auto(config) -> bool:
    """True for ``"auto"`` or a mapping with ``strategy: auto``."""
    if isinstance(config, str):
        return config == "auto"
    return isinstance(config, Mapping) and config.get("strategy") == "auto"


def auto_config(model, *, world_size: int | None = None, budget: int | None = None, device_type: str | None = None,
                seq: int | None = None, batch: int = 1, fixed: Mapping | None = None,
                nodes: int | None = None) -> tuple[ParallelConfig, Candidate]:
    """The ``ParallelConfig`` of the fastest layout that fits, and the chosen candidate."""
    import torch

    fixed = dict(fixed or {})
    fixed.pop("strategy", None)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    nodes = nodes or max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if budget is None:
        budget = _device_memory(device_type)
    config = getattr(model, "config", None)
    seq = seq or min(getattr(config, "max_position_embeddings", 1024) or 1024, 1024)
    need = int(fixed.get("tp", 1)) * int(fixed.get("pp", 1))
    if world_size % need:
        raise HfScaleConfigError(
            f"strategy='auto' with tp={fixed.get('tp', 1)} x pp={fixed.get('pp', 1)} = {need} does not divide the "
            f"world size {world_size}: drop the fixed degrees (auto chooses them) or start a multiple of {need} "
            "processes."
        )
    space = {key: (fixed.pop(field),) for field, key in _SPACE.items() if field in fixed}
    if "precisions" not in space:
        space["precisions"] = (None,)  # precision changes the numerics: only when asked for
    device = cpu_device() if device_type == "cpu" else H100
    work = Workload(seq=seq, batch=batch, device=device_type)
    best, _ = choose(model_facts(model), work, world_size, budget, device, nodes, **space)
    lay = best.layout
    chosen = lay.parallel_config() if world_size > 1 else ParallelConfig(
        activation_checkpointing=lay.ac, mixed_precision=lay.precision, loss_chunk_tokens=lay.loss_chunk_tokens)
    values = {k: v for k, v in vars(chosen).items()} | fixed
    return from_dict(ParallelConfig, values), best


def _device_memory(device_type: str) -> int:
    import torch

    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return psutil.virtual_memory().total // local
