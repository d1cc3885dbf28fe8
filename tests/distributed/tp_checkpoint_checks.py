"""Rank-side checks for checkpoints of tensor-parallel layouts (run by test_tp_checkpoint.py).

Each function runs on every rank of one spawn and returns plain data for the test to judge.
Data is sharded by the data-parallel coordinate (every rank of a tp group sees one batch).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.checkpoint.boxes import is_one_box, local_boxes
from tests.tiny_models import slice_batch, tiny_batch, tiny_model

TP2_FSDP2 = {"strategy": "fsdp", "tp": 2}
FUSED = ("gpt2", "gpt_neox", "phi3_mha")  # c_attn, query_key_value, qkv_proj + gate_up_proj
RESUME_ARCH = "phi3_mha"  # packed qkv and gate_up: the optimizer state has multi-box slices
TOTAL = 4


# ------------------------------------------------------------------ boxes against real data


def box_layouts() -> list[dict]:
    """DTensors built by torch (distribute_tensor, and fully_shard over tp-sharded Linears,
    packed ones included) on 4 ranks: each box of the local block must hold exactly the global
    values it claims, and the boxes must cover the local block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    flat = init_device_mesh("cpu", (4,))
    out = []

    def full(*shape):
        return torch.arange(float(torch.Size(shape).numel())).reshape(shape)

    made = {
        "tp4 packed rows": (full(12, 3), distribute_tensor(full(12, 3), flat, [_StridedShard(0, split_factor=3)])),
        "tp4 packed cols": (full(3, 24), distribute_tensor(full(3, 24), flat, [_StridedShard(1, split_factor=2)])),
        "2d shard rows cols": (full(6, 4), distribute_tensor(full(6, 4), mesh, [Shard(0), Shard(1)])),
        "replicate x packed": (full(10, 8), distribute_tensor(full(10, 8), mesh, [Replicate(), _StridedShard(1, split_factor=2)])),
    }
    for name, (tp_placement, rows) in {
        "fsdp x colwise": (Shard(0), 8), "fsdp x rowwise": (Shard(1), 8),
        "fsdp x packed:3": (_StridedShard(0, split_factor=3), 24), "fsdp x packed:3 uneven": (_StridedShard(0, split_factor=3), 18),
        "fsdp x packed:2": (_StridedShard(0, split_factor=2), 8),
    }.items():
        lin = torch.nn.Linear(4, rows)
        whole_w, whole_b = full(rows, 4), full(rows)
        with torch.no_grad():
            lin.weight.copy_(whole_w)
            lin.bias.copy_(whole_b)
        bias_placement = tp_placement if tp_placement.dim == 0 else Replicate()
        lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.data, mesh["tp"], [tp_placement]))
        lin.bias = torch.nn.Parameter(distribute_tensor(lin.bias.data, mesh["tp"], [bias_placement]))
        fully_shard(lin, mesh=mesh["dp_shard"])
        made[name + " weight"] = (whole_w, lin.weight)
        made[name + " bias"] = (whole_b, lin.bias)
    for name, (whole, t) in made.items():
        local, boxes = t.to_local(), local_boxes(t)
        ok = all(torch.equal(local[b.local], whole[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))])
                 for b in boxes)
        out.append({"name": name, "ok": ok, "covered": sum(b.numel for b in boxes) == local.numel(),
                    "boxes": [(b.offset, b.shape) for b in boxes], "numel": whole.numel(),
                    "replicas": math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                                          if isinstance(p, Replicate)),
                    "torch_one_box": is_one_box(t),
                    "placements": str(t.placements)})
    return out


# ------------------------------------------------------------------ save / from_pretrained


def _logits(model, seed: int = 7) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in tiny_batch("causal", 2, seed=seed).items() if k != "labels"}).logits


def _step(model, lr: float = 1e-2) -> None:
    """One AdamW step on this rank's data-parallel slice, so saved weights are not the loaded ones."""
    state = hf_scale.get_state(model)
    optimizer = hf_scale.build_optimizer(model, lr=lr)
    batch = slice_batch(tiny_batch("causal", 4, seed=3), state.dp_rank, state.dp_degree)
    model(**batch).loss.backward()
    optimizer.step()


def _share(model) -> float:
    from torch.distributed.tensor import DTensor

    total = sum(p.numel() for p in model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return local / total


def save_and_load(root: str, plain: dict[str, str]) -> dict:
    """On 4 ranks. ``plain``: arch -> a folder saved by plain transformers."""
    rank = int(os.environ["RANK"])
    out = {}
    # Llama saved from tp2 x fsdp2 as built (no step): plain transformers must read it bit for bit.
    model = hf_scale.parallelize(tiny_model("llama", "causal"), TP2_FSDP2)
    out["llama_saved"] = str(hf_scale.save_pretrained(model, os.path.join(root, "llama-tp2-fsdp2"), max_shard_size=6000))
    # from_pretrained at tp2 x fsdp2: each rank's slices only, the logits of one process.
    loaded = hf_scale.from_pretrained(plain["llama"], parallel=TP2_FSDP2)
    out["llama_logits"], out["llama_share"] = _logits(loaded), _share(loaded)
    out["llama_meta_left"] = [n for n, p in loaded.named_parameters() if p.is_meta]
    # Fused weights: load at tp2 x fsdp2, train a step, save; reload at fsdp4 and at tp4.
    for arch in FUSED:
        model = hf_scale.from_pretrained(plain[arch], parallel=TP2_FSDP2)
        _step(model)
        folder = str(hf_scale.save_pretrained(model, os.path.join(root, f"{arch}-tp2")))
        result = {"folder": folder, "tp2": _logits(model)}
        for name, config in (("fsdp4", {"strategy": "fsdp"}), ("tp4", {"tp": 4})):
            again = hf_scale.from_pretrained(folder, parallel=config)
            result[name] = _logits(again)
            if name == "tp4":  # and saved again from the tp-only (one-mesh-dim) packed layout
                result["tp4_folder"] = str(hf_scale.save_pretrained(again, os.path.join(root, f"{arch}-tp4")))
        out[arch] = result
    out["rank"] = rank
    return out


# ------------------------------------------------------------------ resume and reshard


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The global tensor, assembled from every rank's boxes (a collective for DTensors). Not
    ``full_tensor()``: FSDP2 over a packed tp weight describes its layout wrongly to torch."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach().float().cpu().clone()
    local = t.to_local().detach().float().cpu()
    parts = [(b.offset, b.shape, local[b.local].clone()) for b in local_boxes(t)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, parts)
    whole = torch.full(tuple(t.shape), float("nan"))
    for rank_parts in gathered:
        for offset, shape, data in rank_parts:
            whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))] = data
    return whole


def snapshot(model, optimizer) -> dict:
    """Whole parameters and optimizer state by name (a collective on every rank)."""
    from hf_scale.checkpoint.safetensors_io import reshard_all
    from hf_scale.checkpoint.training_state import optimizer_state

    reshard_all(model)
    params = {n: _whole(p) for n, p in model.named_parameters()}
    optim = {name: {k: _whole(v) for k, v in sorted(values.items()) if torch.is_tensor(v)}
             for name, values in sorted(optimizer_state(model, optimizer)["state"].items())}
    return {"params": params, "optim": optim}


def _setup(config, seed: int):
    model = hf_scale.parallelize(tiny_model(RESUME_ARCH, "causal", seed=seed), config)
    optimizer = hf_scale.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, first: int, last: int) -> list[float]:
    """Steps ``first`` .. ``last - 1``; step s trains on global batch s, sliced by dp rank."""
    state = hf_scale.get_state(model)
    dp_rank, dp_degree = (state.dp_rank, state.dp_degree) if state else (0, 1)
    losses = []
    for step in range(first, last):
        batch = slice_batch(tiny_batch("causal", 4, seed=300 + step), dp_rank, dp_degree)
        loss = model(**batch).loss
        loss.backward()
        hf_scale.clip_grad_norm_(model, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # tp ranks hold the same loss
        losses.append(float(loss))
    return losses


def straight(config) -> list[float]:
    return _train(*_setup(config, seed=0), 0, TOTAL)


def first_half(config, root: str) -> dict:
    model, optimizer, scheduler = _setup(config, seed=0)
    losses = _train(model, optimizer, scheduler, 0, TOTAL // 2)
    hf_scale.save_state(model, optimizer, scheduler=scheduler, root=root, step=TOTAL // 2)
    return {"losses": losses, "state": snapshot(model, optimizer)}


def second_half(config, root: str) -> dict:
    import warnings

    model, optimizer, scheduler = _setup(config, seed=99)  # another init: it must be overwritten
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saved by N ranks": RNG streams start fresh (unused here)
        step = hf_scale.load_state(model, optimizer, scheduler=scheduler, path=os.path.join(root, "latest"))
    state = snapshot(model, optimizer)
    return {"step": step, "state": state, "losses": _train(model, optimizer, scheduler, step, TOTAL)}


def resume_world4(root: str) -> dict:
    """tp2 x fsdp2: uninterrupted; stop + save; resume at the same layout and at fsdp4."""
    saved = os.path.join(root, "tp2-fsdp2")
    return {
        "straight_tp2_fsdp2": straight(TP2_FSDP2),
        "straight_fsdp4": straight({"strategy": "fsdp"}),
        "first": first_half(TP2_FSDP2, saved),
        "same": second_half(TP2_FSDP2, saved),
        "fsdp4": second_half({"strategy": "fsdp"}, saved),
        "root": saved,
    }


def resume_world2(root: str) -> dict:
    """fsdp2 -> tp2 (and tp2 -> fsdp2) on 2 ranks."""
    from_fsdp, from_tp = os.path.join(root, "fsdp2"), os.path.join(root, "tp2")
    return {
        "straight_fsdp2": straight({"strategy": "fsdp"}),
        "straight_tp2": straight({"tp": 2}),
        "first_fsdp2": first_half({"strategy": "fsdp"}, from_fsdp),
        "tp2_from_fsdp2": second_half({"tp": 2}, from_fsdp),
        "first_tp2": first_half({"tp": 2}, from_tp),
        "fsdp2_from_tp2": second_half({"strategy": "fsdp"}, from_tp),
    }
