"""Training checkpoints: model weights (Hub format) + optimizer, scheduler, RNG and data
position, saved so that a run resumes exactly, at the same or another parallel layout.

A checkpoint folder ``ckpt/step_00001200/`` holds:

* the model, as :func:`save_pretrained` writes it (so any checkpoint is also an export);
* ``optimizer/``: the optimizer state through ``torch.distributed.checkpoint`` (DCP), keyed by
  parameter name, so it reshards on load (fsdp 4 -> 2, hsdp -> fsdp, zero1 -> fsdp, any -> 1);
* ``rank_<r>.pt``: each rank's RNG states and data-loader position (``weights_only`` loadable);
* ``trainer_state.json``: step, layout, world size, scheduler state (its per-group lists per
  group of distinct settings, so it resumes where the layout groups the parameters otherwise:
  :mod:`.scheduler_state`).

Folders are written as ``<name>.partial`` and renamed when every rank is done; the file
``ckpt/latest`` then names the newest complete one (replaced atomically), and older folders
beyond ``keep_last`` are removed. A ``.partial`` folder left by a crash is ignored with a warning.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..api import get_state
from ..errors import HfScaleCheckpointError
from ..ranks import gather, rank_world, run_together, share_from_rank0
from .adapters import adapter_save_plan, is_adapter_model, write_adapter_folder
from .dcp_boxes import checkpointable
from .files import atomic_write_text, staged_folder
from .load import load_adapter, load_owned_slices, weight_map_of
from .param_groups import merge_equal_groups, regroup
from .safetensors_io import plan_save, write_model_folder
from .scheduler_state import load_scheduler_state, scheduler_state
from .stages import borrow_tied_state, pipelined, tie_aliases, union_param_groups

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"step_(\d+)$")


def save_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    root: str | os.PathLike = "ckpt",
    step: int,
    dataloader=None,
    keep_last: int | None = None,
) -> Path:
    """Save a resumable training checkpoint as ``root/step_<step>``; call on every rank.

    ``dataloader`` (optional) must offer ``state_dict()`` / ``load_state_dict()`` (e.g.
    torchdata's ``StatefulDataLoader``); its state is saved per rank. The free space is checked
    first; a save that does not fit (or fails) raises :class:`HfScaleCheckpointError`, removes
    its partial folder and leaves ``latest`` on the previous checkpoint.

    Usage::

        hf_scale.save_state(model, optimizer, scheduler=scheduler, root="ckpt", step=1200, keep_last=3)
    """
    rank, world = rank_world()
    root = Path(root).resolve()
    final = root / f"step_{step:08d}"
    adapter = is_adapter_model(model)  # a PeftModel: its adapter only (the base never changes)
    plan = adapter_save_plan(model) if adapter else plan_save(model)
    optim = optimizer_state(model, optimizer)
    layout = get_state(model)
    stages = layout.pp_degree if layout else 1
    needed = plan.nbytes + _state_nbytes(optim, sharded_plain=_zero_local(optimizer) is not None, stages=stages)
    with staged_folder(final, needed_bytes=needed) as partial:
        (write_adapter_folder if adapter else write_model_folder)(model, partial / "model", plan)
        _dcp_save(checkpointable(optim)[0], partial / "optimizer")
        run_together(torch.save, _rank_state(dataloader), partial / f"rank_{rank}.pt")
        info = {
            "step": step,
            "world_size": world,
            "strategy": layout.config.strategy if layout else None,
            "scheduler": scheduler_state(scheduler, optimizer) if scheduler is not None else None,
        }
        run_together((partial / TRAINER_STATE).write_text, json.dumps(info, indent=2), only_rank0=True)
    run_together(_point_latest, root, final.name, keep_last, only_rank0=True)
    return final


def _state_nbytes(state: dict[str, Any], sharded_plain: bool, stages: int = 1) -> int:
    """Bytes a checkpoint takes beside the model: the optimizer state's tensors (DTensors at
    their global size, stored once; plain tensors once, or summed over ranks when each rank
    holds its own, as zero1's), DCP's framing of each tensor a rank writes (about 2 KB each,
    measured with torch 2.13) and its metadata, the per-rank and trainer state files. Under
    pipeline parallel (``stages`` > 1) each pp rank's ranks hold other tensors: summed over
    ranks, divided by the ranks that hold one stage's tensors."""
    global_bytes = plain = items = 0
    for values in state["state"].values():
        for t in values.values():
            if isinstance(t, DTensor):
                global_bytes += t.numel() * t.element_size()
            elif isinstance(t, torch.Tensor):
                plain += t.numel() * t.element_size()
            items += isinstance(t, torch.Tensor)
    plain_all, items_all, global_all = (sum(x) for x in zip(*gather([(plain, items, global_bytes)])))
    if stages > 1:
        holders = rank_world()[1] // stages  # the ranks that hold one stage's tensors
        global_bytes, plain = global_all // holders, plain_all // holders
    return global_bytes + (plain_all if sharded_plain else plain) + items_all * 2560 + 32768


def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    """``dcp.save`` (collective; it raises on every rank when one fails), a full disk on any
    rank raised as ``OSError(ENOSPC)``, which :func:`staged_folder` reports clearly. A disk that
    fills inside ``torch.save`` (DCP writes non-tensor items, such as the param groups, with it)
    surfaces as its zip writer's ``RuntimeError: ... unexpected pos`` (a short write): with the
    disk full at that moment, that is the same ENOSPC."""
    try:
        dcp.save({"optimizer": state}, checkpoint_id=str(folder))
    except CheckpointException as e:
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            short_write = isinstance(cause, RuntimeError) and "unexpected pos" in str(cause)
            if (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or (
                    short_write and _disk_full(folder)):
                raise OSError(errno.ENOSPC, f"optimizer state: {cause}") from None
        raise


def _disk_full(folder: Path) -> bool:
    """Less than 64 KiB left where ``folder`` lives, as the file system reports it now."""
    probe = folder if folder.exists() else folder.parent
    stat = os.statvfs(probe)
    return stat.f_bavail * stat.f_frsize < 65536


def load_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    path: str | os.PathLike = "ckpt/latest",
    dataloader=None,
) -> int:
    """Restore a checkpoint saved by :func:`save_state` into an already parallelized model and
    its optimizer (any layout); returns the step to continue from.

    ``path`` is a ``step_*`` folder, or ``<root>/latest`` for the newest complete one.
    """
    # Every read of the files runs through run_together: a failure on one rank (a bad copy on its
    # node) raises on every rank, before any rank waits in a collective the failed one never enters.
    folder, info = share_from_rank0(_resolve_with_info, path)  # one folder for all: "latest" read once
    rank, world = rank_world()
    model_dir = folder / "model"
    if is_adapter_model(model):
        load_adapter(model, model_dir)
    else:
        run_together(lambda: load_owned_slices(model, model_dir, weight_map_of(model_dir)))
    target = {"optimizer": optimizer_state(model, optimizer)}
    restore_ties = lambda: None
    if pipelined(model):  # a head saved as the embedding (one process): its state is the embedding's
        saved = run_together(lambda: dcp.FileSystemReader(str(folder / "optimizer")).read_metadata().state_dict_metadata)
        restore_ties = borrow_tied_state(model, target["optimizer"], set(saved))
    boxed, copy_back = checkpointable(target)  # packed tp slices placed box by box
    try:
        dcp.load(boxed, checkpoint_id=str(folder / "optimizer"))
        copy_back()
        restore_ties()
    except (Exception, CheckpointException) as e:  # DCP's exception is not an Exception
        reason = re.findall(r"(?:RuntimeError|KeyError|ValueError): (.*)", str(e)) or [str(e)]
        raise HfScaleCheckpointError(
            f"the optimizer state in {folder.name} (saved by {info['world_size']} ranks with "
            f"strategy {info.get('strategy')!r}) does not fit this optimizer "
            f"({type(optimizer).__name__}): it is resharded by parameter name and state key, so "
            f"the model's parameters and the optimizer type must be the same. {reason[0][:300]}"
        ) from None
    set_optimizer_state(model, optimizer, target["optimizer"])
    if scheduler is not None and info.get("scheduler") is not None:
        load_scheduler_state(scheduler, optimizer, info["scheduler"])
    rank_file = folder / f"rank_{rank}.pt"
    saved_here = None
    if info["world_size"] == world:  # the same on every rank: all of them enter run_together
        saved_here = run_together(lambda: torch.load(rank_file, weights_only=True) if rank_file.exists() else None)
    if saved_here is not None:
        _restore_rank_state(saved_here, dataloader)
    else:
        warnings.warn(
            f"checkpoint {folder.name} was saved by {info['world_size']} ranks, this run has {world}: "
            "model and optimizer are resharded, but RNG streams and data-loader positions are "
            "per rank and start fresh.",
            stacklevel=2,
        )
    return int(info["step"])


def _resolve_with_info(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint folder ``path`` names and its ``trainer_state.json``."""
    folder = resolve_checkpoint(path)
    try:
        return folder, json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        raise HfScaleCheckpointError(f"{folder} has no readable {TRAINER_STATE} ({e}): not a complete "
                                     "checkpoint of save_state.") from None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete ``step_*`` folders under ``root``, oldest first."""
    root = Path(root)
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step_*`` folder, or ``<root>/latest`` -> the newest complete checkpoint."""
    path = Path(path)
    if path.name == LATEST:
        root = path.parent
        for stale in root.glob(".step_*.partial"):
            warnings.warn(f"ignoring {stale.name}: an incomplete checkpoint (a save was interrupted)", stacklevel=3)
        pointer = root / LATEST
        name = pointer.read_text().strip() if pointer.exists() else None
        complete = complete_checkpoints(root)
        if name and STEP_DIR.match(name) and (root / name).is_dir():
            path = root / name
        elif complete:
            path = complete[-1]
        else:
            raise HfScaleCheckpointError(
                f"no complete checkpoint in {root} to resume from (no step_* folder with {TRAINER_STATE}): "
                "give the folder a run saved its checkpoints in, or start without resuming."
            )
    if not (path / TRAINER_STATE).exists():
        raise HfScaleCheckpointError(
            f"{path} is not a complete training checkpoint (no {TRAINER_STATE}): give a step_* folder that a "
            "run saved, or its checkpoint root's latest."
        )
    return path


# ------------------------------------------------------------------ optimizer state by name


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name: DTensors where parameters are sharded.

    For ``ZeroRedundancyOptimizer`` (zero1) each rank contributes the state of the parameters
    it owns, as plain tensors; DCP stores each once and any layout can read it back.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    zero = _zero_local(optimizer)
    if zero is None:
        state = get_optimizer_state_dict(model, optimizer)
        # pipeline stages name different parameters; DCP saves one rank's group lists
        state = union_param_groups(state, set(tie_aliases(model))) if pipelined(model) else state
        return merge_equal_groups(state)
    _init_zero_state(zero)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: dict(s) for p, s in zero.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return merge_equal_groups({"state": state, "param_groups": groups})


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    zero = _zero_local(optimizer)
    if zero is None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        current = get_optimizer_state_dict(model, optimizer)["param_groups"]
        if pipelined(model):
            current = union_param_groups({"param_groups": current, "state": {}}, set(tie_aliases(model)))["param_groups"]
        set_optimizer_state_dict(model, optimizer, {**state, "param_groups": regroup(state["param_groups"], current)})
        return
    params = dict(model.named_parameters())
    for name, values in state["state"].items():
        zero.state[params[name]] = dict(values)
    names = {id(p): n for n, p in params.items()}
    by_name = {name: saved for saved in state["param_groups"] for name in saved["params"]}
    for group in optimizer.param_groups:  # lr as scheduled; groups found by their parameters
        saved = next((by_name[names[id(p)]] for p in group["params"] if names.get(id(p)) in by_name), None)
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})


def _zero_local(optimizer):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def _init_zero_state(local: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its (zero) state, so a target for loading has every key."""
    if local.state:
        return
    for group in local.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in local.param_groups]
    for g in local.param_groups:
        g["lr"] = 0.0
    local.step()
    for g, lr in zip(local.param_groups, lrs):
        g["lr"] = lr
    for group in local.param_groups:
        for p in group["params"]:
            p.grad = None


# ------------------------------------------------------------------ per-rank state


def _rank_state(dataloader) -> dict[str, Any]:
    import numpy as np

    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "numpy": torch.from_numpy(np_state[1].astype("int64")),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if dataloader is not None:
        if not hasattr(dataloader, "state_dict"):
            raise HfScaleCheckpointError(
                f"dataloader {type(dataloader).__name__} has no state_dict(): pass a stateful "
                "loader (e.g. torchdata's StatefulDataLoader) to resume at the right sample."
            )
        state["dataloader"] = dataloader.state_dict()
    return state


def _restore_rank_state(state: dict[str, Any], dataloader) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype("uint32"), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if dataloader is not None and "dataloader" in state:
        dataloader.load_state_dict(state["dataloader"])


def _point_latest(root: Path, name: str, keep_last: int | None) -> None:
    """``root/latest`` names ``name``; older folders beyond ``keep_last`` go.

    The pointer lies outside the staged folder, so it is replaced atomically: written in full
    to a temporary file, flushed to disk, renamed over the old one (``os.replace``) and the
    folder entry flushed. A crash at any point leaves ``latest`` naming either the previous
    checkpoint or this one, never a torn name (a stale temporary file is overwritten next time).
    """
    atomic_write_text(root / LATEST, name + "\n")
    if keep_last:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)

