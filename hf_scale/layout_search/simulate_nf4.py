"""QLoRA in the simulation: a model's NF4 base on fake tensors, placed as the loader places it.

``from_pretrained(..., quantize="nf4")`` (:mod:`hf_scale.checkpoint.quantized`) replaces the
chosen LoRA base weights by meta ``NF4Tensor`` placeholders, applies the layout (FSDP2 shards
them through their all-gather hooks; tp splits them into local slices), then assigns each
rank's quantized slice with ``load_state_dict(assign=True)``. A fake tensor has no values to
quantize, so the simulation does the same with the quantization left out: the same placeholders
(:func:`hf_scale.checkpoint.quantized.place_nf4`), the same ``parallelize``, then each rank's slice
assigned as an ``NF4Tensor`` built from fake inner tensors of the shapes and dtypes the
quantization makes (:func:`hf_scale.quantize.nf4.nf4_placeholder`: codes, scalers, factors). FSDP's
4-bit all-gather, the dequantization in forward and the LoRA backward then run as in a QLoRA run.

A layout that keeps its parameters whole (ddp) is loaded before it is applied: its NF4 weights
are placed whole on the host, as the other fake weights are, and move with them. Under a layout
that splits them but that FSDP does not move to the device (one process, tp or pp without data
parallel sharding), ``parallelize`` leaves a model with meta parameters where it is (the loader
reads every weight onto the device): the simulation's other weights, fake host tensors, are
moved after the assignment.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ParallelConfig


def layout_sharded(config: ParallelConfig) -> bool:
    """Whether ``from_pretrained`` applies ``config`` before the load (its parameters split)."""
    return config.sharded or config.tp > 1 or config.pp > 1


def place_fake_nf4(model: nn.Module, config: ParallelConfig, world_size: int, quantize: str | None) -> list[str]:
    """The loader's checks and NF4 placeholders for ``quantize`` on ``model`` (fake host tensors,
    before ``parallelize``): meta under a layout that splits the parameters (assigned by
    :func:`assign_fake_nf4` after it), fake host tensors otherwise. Returns their names."""
    if quantize is None:
        return []
    from ..checkpoint.quantized import place_nf4, shard_parts
    from ..model_plans.adapters import adapter_host
    from ..model_plans.quantize import check_quantize

    check_quantize(quantize, config, adapter=getattr(model, "peft_config", None))
    device = "meta" if layout_sharded(config) else "cpu"
    return place_nf4(adapter_host(model), shard_parts(config, world_size), config.tp, None, device=device)


@torch.no_grad()
def assign_fake_nf4(model: nn.Module, state) -> int:
    """Each NF4 placeholder still on the meta device after ``parallelize`` given this rank's slice
    on its device (``state``: the model's ``ParallelState``), as
    :func:`hf_scale.checkpoint.quantized.quantize_loaded` assigns the quantized ones (a DTensor
    keeps its mesh and placements); then the host weights FSDP did not move, moved (module doc).
    Returns how many NF4 weights were assigned."""
    from ..checkpoint.quantized import tp_slice
    from ..model_plans.adapters import adapter_host
    from ..quantize.nf4 import is_nf4, nf4_placeholder

    device = state.env.device
    host = adapter_host(model)
    new = {}
    for name, target in host.named_parameters():
        local = target._local_tensor if isinstance(target, DTensor) else target
        if not (is_nf4(target) and local.is_meta):
            continue
        nf4 = nf4_placeholder(tuple(local.shape), local.dtype, device, tp_slice(target)[2], local.scaler_block_size)
        if isinstance(target, DTensor):
            nf4 = DTensor.from_local(nf4, target.device_mesh, target.placements, run_check=False,
                                     shape=target.shape, stride=target.stride())
        new[name] = nf4
    host.load_state_dict(new, strict=False, assign=True)
    fsdp_moved = state.dims is not None and state.dims.dp_cp_degree > 1 and state.config.sharded
    if new and device.type != "cpu" and not fsdp_moved:
        model.to(device)
    return len(new)


@contextlib.contextmanager
def quiet_storage_checks() -> Iterator[None]:
    """torchao's ``fsdp_post_all_gather`` checks by ``data_ptr`` that an NF4 weight gathered again
    (backward, after resharding) still lies in FSDP's all-gather output; a fake tensor's storage
    answers with a deprecation warning, once per weight and step. Silenced while entered."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield
