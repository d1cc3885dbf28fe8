"""NF4 bases loaded slice-wise: each rank quantizes only the slice it holds (QLoRA under
data parallel), never the whole model on one rank.

Before the layout is applied, :func:`place_nf4` turns each chosen meta weight into a meta
``NF4Tensor`` of the whole shape, so that FSDP2 registers its 4-bit all-gather hooks and
shards its inner tensors (ddp: it stays whole). The load reads each such weight's local block
in the compute dtype and encodes it at once (:func:`hf_scale.checkpoint.load.assign_from_files`:
its 4-bit codes and block absmax, set aside);
:func:`quantize_loaded` then agrees each weight's mean block absmax (one all-reduce of every
weight's sum and count together) and quantizes each rank's slice with it, exactly as the whole
tensor quantized and split (:mod:`hf_scale.quantize.nf4`).

Under tensor parallel each rank's tp slice of a weight (rows for ``colwise``, columns for
``rowwise``) is quantized as a tensor of its own (torchao's ``to_nf4`` of that slice: its own
mean), then sharded by FSDP over the data-parallel ranks like any NF4 weight; the mean is
agreed among the ranks holding the same tp slice (:func:`tp_slice`).
"""

from __future__ import annotations

import json
import types
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import HfScaleConfigError
from ..log import log_rank0
from ..model_plans.adapters import adapter_host
from ..model_plans.quantize import nf4_targets
from ..ranks import run_together


def shard_parts(config, world_size: int) -> int:
    """Dim-0 slices each weight is split in under ``config`` (a resolved ParallelConfig)."""
    if not config.sharded or world_size == 1:
        return 1
    from ..mesh import ParallelDims

    return ParallelDims.resolve(config, world_size).dp_shard


@torch.no_grad()
def place_nf4(model: nn.Module, parts: int, tp: int = 1, plan=None, device="meta") -> list[str]:
    """Replace the weights :func:`nf4_targets` chooses (``model`` on the meta device; ``tp`` > 1:
    split by the tp styles of ``plan``, as ``parallelize`` will) by ``NF4Tensor`` placeholders on
    ``device`` (meta; a simulation's fake host tensors); say once which stay in the compute dtype
    and why. Returns their names."""
    from ..quantize.nf4 import nf4_placeholder, torchao_nf4

    torchao_nf4()  # a missing torchao fails here, before any work
    host = adapter_host(model)
    styles = None
    if tp > 1:
        from ..model_plans import resolve_plan
        from ..model_plans.tp import tp_layout

        styles = tp_layout(host, resolve_plan(host, plan), tp).styles
    chosen, kept = nf4_targets(host, parts, tp, styles)
    for name, scaler_block in chosen.items():
        owner, _, leaf = name.rpartition(".")
        module = host.get_submodule(owner)
        weight = getattr(module, leaf)
        placeholder = nf4_placeholder(tuple(weight.shape), weight.dtype, device, scaler_block=scaler_block)
        module.register_parameter(leaf, nn.Parameter(placeholder, requires_grad=False))
        lora_layer = host.get_submodule(owner.rpartition(".")[0])
        lora_layer.merge = types.MethodType(_refuse_merge, lora_layer)  # this instance only
    if kept:
        first = next(iter(kept.items()))
        log_rank0(f"quantize nf4: {len(kept)} LoRA base weight(s) stay in the compute dtype, their slices "
                  f"cannot hold whole NF4 blocks (e.g. {first[0]}: {first[1]})", once=True)
    split = f" of each tp={tp} slice" if tp > 1 else ""
    blocks = ", ".join(f"{n} x {b}" for b, n in sorted(Counter(chosen.values()).items(), reverse=True))
    log_rank0(f"quantize nf4: {len(chosen)} LoRA base weights in NF4 over {parts} slice(s){split} each "
              f"(scaler blocks: {blocks})", once=True)
    return list(chosen)


def _refuse_merge(self, *args, **kwargs) -> None:
    """peft's merge on a LoRA layer over an NF4 base: refused, with what to do instead."""
    raise HfScaleConfigError(
        "merging a LoRA adapter into an NF4 (4-bit) base weight is not supported: the merged weight "
        "would be quantized again, losing the update (peft's add_ on an NF4Tensor fails). Save the "
        "adapter (hf_scale.save_pretrained) and merge it into the base reloaded: hf-scale export --merge "
        "ADAPTER OUT (hf_scale.merge_adapter), with --dequantize to merge into the NF4 base as trained."
    )


@torch.no_grad()
def quantize_loaded(model: nn.Module, pending: dict[str, tuple]) -> None:
    """Collective (every rank holds the same NF4 weights, in the same order): ``pending`` (state
    key -> (this rank's block encoded: :func:`hf_scale.quantize.nf4.encode_rows`, the meta NF4
    target)) quantized and put in place. The mean block absmax of each weight (of each tp slice
    under tensor parallel): one all-reduce of every weight's (sum, count) per tp slice."""
    from ..quantize.nf4 import quantize_rows

    keys = sorted(pending)
    slices = {key: tp_slice(pending[key][1]) for key in keys}
    tp = max([n for _, n, _ in slices.values()], default=1)
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different weights
        from ..ranks import gather

        every = gather([(tuple(keys), tp)])
        keys, tp = sorted({k for held, _ in every for k in held}), max(n for _, n in every)
    stats = torch.zeros(len(keys), tp, 2, dtype=torch.float64)
    for i, key in enumerate(keys):
        if key not in pending:
            continue
        scalers = pending[key][0].absmax
        # fp64 throughout: torch.tensor of two Python floats would be fp32, and the mean one ulp off
        stats[i, slices[key][0], 0] = scalers.double().sum()
        stats[i, slices[key][0], 1] = scalers.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)  # replicas (hsdp, ddp) count their slices equally often: the mean holds

    def quantize() -> None:
        new = {}
        for i, key in enumerate(keys):
            if key not in pending:
                continue
            local, target = pending[key]
            index, _, whole = slices[key]
            held = target._local_tensor if isinstance(target, DTensor) else target  # place_nf4's scaler block
            nf4 = quantize_rows(local, stats[i, index, 0] / stats[i, index, 1], whole, held.scaler_block_size)
            if isinstance(target, DTensor):
                nf4 = DTensor.from_local(nf4, target.device_mesh, target.placements, run_check=False,
                                         shape=target.shape, stride=target.stride())
            new[key] = nf4
        model.load_state_dict(new, strict=False, assign=True)

    run_together(quantize)


QUANTIZATION_FILE = "quantization.json"  # beside adapter_config.json: what the adapter was trained on


def quantization_record(model: nn.Module) -> dict | None:
    """What an adapter folder records of its NF4 base (None: no NF4 weight): the scheme, the dtype
    the base was quantized from, the base checkpoint's names of the weights that were NF4 (the
    others stayed in the compute dtype) and each one's scaler block (the layout's slices chose it),
    so that ``hf-scale export --merge --dequantize`` can merge into the base the adapter was
    trained against (:func:`hf_scale.checkpoint.merge.merge_adapter`)."""
    from ..quantize.nf4 import BLOCK, is_nf4

    host = adapter_host(model)
    names, dtype, split, scalers = [], None, {}, {}
    for name, p in host.named_parameters():
        if is_nf4(p):
            names.append(name.replace(".base_layer.", "."))
            local = p._local_tensor if isinstance(p, DTensor) else p
            dtype, scalers[names[-1]] = local.dtype, local.scaler_block_size
            if tp_dim(p) is not None:  # tensor parallel: each tp slice was quantized alone
                split[names[-1]] = list(tp_dim(p))
    if not names:
        return None
    record = {"quantize": "nf4", "block": BLOCK, "scaler_block": dict(sorted(scalers.items())),
              "dtype": str(dtype).removeprefix("torch."), "weights": sorted(names)}
    return {**record, "tp_split": split} if split else record


def write_quantization_record(model: nn.Module, folder: Path) -> None:
    """:func:`quantization_record` into ``folder`` (an adapter folder), when the base has NF4 weights."""
    record = quantization_record(model)
    if record is not None:
        (Path(folder) / QUANTIZATION_FILE).write_text(json.dumps(record, indent=1))


@torch.no_grad()
def dequantized_base(model: nn.Module, folder: Path) -> list[str]:
    """Replace, in the plain base ``model`` (one process, full precision), each weight ``folder``'s
    :data:`QUANTIZATION_FILE` names by its NF4 round trip: quantized whole as the training run
    quantized it (from the same dtype; slices quantize exactly as the whole, :mod:`hf_scale.quantize.nf4`)
    and dequantized. Returns the names; a clear error when the folder records none."""
    from ..quantize.nf4 import quantize_whole

    path = Path(folder) / QUANTIZATION_FILE
    if not path.is_file():
        raise HfScaleConfigError(
            f"--dequantize merges into the base as a QLoRA adapter was trained against it, but {folder} has no "
            f"{QUANTIZATION_FILE}: the adapter was not trained on an NF4 base (model.quantize), or was saved by an "
            "hf_scale before it recorded one. Merge without --dequantize."
        )
    record = json.loads(path.read_text())
    dtype = getattr(torch, record["dtype"])
    params = dict(model.named_parameters())
    missing = [n for n in record["weights"] if n not in params]
    if missing:
        raise HfScaleConfigError(
            f"{path} names {len(missing)} weight(s) the base model lacks (e.g. {missing[0]}): give the base the "
            "adapter was trained on (--base)."
        )
    split = record.get("tp_split", {})  # name -> [dim, tp]: trained under tp, each slice quantized alone
    scalers = record.get("scaler_block", 256)  # name -> scaler block (an int: every weight's, older records)
    for name in record["weights"]:
        weight = params[name]
        dim, tp = split.get(name, (0, 1))
        block = scalers[name] if isinstance(scalers, dict) else scalers
        slices = [quantize_whole(part.to(dtype).contiguous(), block).get_original_weight()
                  for part in weight.chunk(tp, dim)]
        weight.copy_(torch.cat(slices, dim).to(weight.dtype))
    return record["weights"]


def tp_dim(param) -> tuple[int, int] | None:
    """(the dim split, the tp degree) of a weight split on the ``tp`` dimension of its DTensor
    mesh; None for a weight whole on every tp rank."""
    _, tp, local = tp_slice(param)
    if tp == 1:
        return None
    return next(d for d, (a, b) in enumerate(zip(param.shape, local)) if a != b), tp


def tp_slice(target) -> tuple[int, int, tuple[int, ...]]:
    """(this rank's tp slice index, the tp degree, the slice's shape) of an NF4 placeholder: its
    shape and (0, 1) unless it is split on the ``tp`` dimension of its DTensor mesh."""
    shape = tuple(target.shape)
    if not isinstance(target, DTensor) or "tp" not in (target.device_mesh.mesh_dim_names or ()):
        return 0, 1, shape
    mesh_dim = target.device_mesh.mesh_dim_names.index("tp")
    placement = target.placements[mesh_dim]
    if not placement.is_shard():
        return 0, 1, shape
    tp = target.device_mesh.size(mesh_dim)
    local = tuple(n // tp if d == placement.dim else n for d, n in enumerate(shape))
    return target.device_mesh.get_local_rank(mesh_dim), tp, local
