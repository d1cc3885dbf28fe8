"""Training runs that stop, save, and resume (maybe at another layout), for the resume tests."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.ranks import rank_world
from tests.tiny_models import slice_batch, tiny_batch, tiny_model

TOTAL = 6


class CountingLoader:
    """A stateful data source: the batch at each position is drawn with the global RNG, so an
    exact resume needs both the position and the RNG state restored."""

    def __init__(self):
        self.position = 0

    def next_batch(self, world: int, rank: int):
        seed = int(torch.randint(0, 10_000, (1,)))
        self.position += 1
        return slice_batch(tiny_batch("causal", 4, seed=seed), rank, world)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _setup(config, seed):
    torch.manual_seed(1234)
    model = hf_scale.parallelize(tiny_model("llama", "causal", seed=seed), config)
    torch.manual_seed(1234 + rank_world()[0])  # per-rank data RNG, as in real runs
    optimizer = hf_scale.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler, CountingLoader()


def _train(model, optimizer, scheduler, loader, steps):
    rank, world = rank_world()
    losses = []
    for _ in range(steps):
        loss = model(**loader.next_batch(world, rank)).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss))
    return losses


def straight(config) -> list[float]:
    return _train(*_setup(config, seed=0), TOTAL)


def first_half(config, root: str) -> list[float]:
    model, optimizer, scheduler, loader = _setup(config, seed=0)
    losses = _train(model, optimizer, scheduler, loader, TOTAL // 2)
    hf_scale.save_state(model, optimizer, scheduler=scheduler, root=root, step=TOTAL // 2, dataloader=loader, keep_last=2)
    return losses


def second_half(config, root: str) -> dict:
    model, optimizer, scheduler, loader = _setup(config, seed=99)  # different init: must be overwritten
    step = hf_scale.load_state(model, optimizer, scheduler=scheduler, path=os.path.join(root, "latest"), dataloader=loader)
    losses = _train(model, optimizer, scheduler, loader, TOTAL - step)
    return {"step": step, "position": loader.position, "losses": losses}


def snapshot(model, optimizer) -> dict:
    """Whole parameters and optimizer state by name, as rank 0 sees them (a collective)."""
    from torch.distributed.tensor import DTensor

    from hf_scale.checkpoint.training_state import optimizer_state
    from tests.distributed.training import full_params

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    optim = {name: {k: whole(v).detach().float().cpu().clone() for k, v in values.items() if torch.is_tensor(v)}
             for name, values in optimizer_state(model, optimizer)["state"].items()}
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, optim)
        optim = {k: v for part in parts for k, v in part.items()}
    return {"params": full_params(model), "optim": optim}


def save_and_snapshot(config, root: str) -> dict:
    model, optimizer, scheduler, loader = _setup(config, seed=0)
    _train(model, optimizer, scheduler, loader, 2)
    hf_scale.save_state(model, optimizer, scheduler=scheduler, root=root, step=2, dataloader=loader)
    return snapshot(model, optimizer)


def load_and_snapshot(config, root: str) -> dict:
    import warnings

    model, optimizer, scheduler, loader = _setup(config, seed=99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = hf_scale.load_state(model, optimizer, scheduler=scheduler, path=os.path.join(root, "latest"), dataloader=loader)
    out = snapshot(model, optimizer)
    out.update(step=step, lr=scheduler.get_last_lr()[0], warned=[str(w.message) for w in caught])
    return out


def world4_saves(root: str) -> dict:
    return {
        "hsdp": save_and_snapshot({"strategy": "hsdp", "dp_replicate": 2}, os.path.join(root, "hsdp4")),
        "fsdp4": save_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "fsdp4")),
    }


def world2_runs(root: str) -> dict:
    out = {}
    for strategy in ("fsdp", "zero1"):
        config = {"strategy": strategy}
        out[f"{strategy}_straight"] = straight(config)
        out[f"{strategy}_first"] = first_half(config, os.path.join(root, strategy))
        out[f"{strategy}_second"] = second_half(config, os.path.join(root, strategy))
    out["saved_fsdp"] = save_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "fsdp2"))
    out["saved_zero1"] = save_and_snapshot({"strategy": "zero1"}, os.path.join(root, "zero1_2"))
    out["fsdp2_into_zero1"] = load_and_snapshot({"strategy": "zero1"}, os.path.join(root, "fsdp2"))
    out["zero1_into_fsdp"] = load_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "zero1_2"))
    out["hsdp4_into_fsdp2"] = load_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "hsdp4"))
    out["fsdp4_into_fsdp2"] = load_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "fsdp4"))
    return out
