"""Checks of what each strategy does to a model, run inside one process group.

Each function returns plain facts (dtypes, placements, counts) for the tests to assert on.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from transformers import LlamaForCausalLM

import hf_scale
from tests.tiny_models import slice_batch, tiny_batch, tiny_model


def _rank_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _placements(model):
    return sorted({str(p.placements) if isinstance(p, DTensor) else "plain" for p in model.parameters()})


def state_facts(model) -> dict:
    """What :func:`hf_scale.get_state` reports about a parallelized model."""
    state = hf_scale.get_state(model)
    mesh, dp_mesh = state.mesh, state.dp_mesh
    return {
        "type": type(state).__name__,
        "config": {k: getattr(state.config, k) for k in ("strategy", "dp_replicate", "dp_shard", "cpu_offload")},
        "plan": (state.plan.model_type, tuple(state.plan.wrap_modules), tuple(map(tuple, state.plan.tied_weights))),
        "dims": None if state.dims is None else (state.dims.dp_replicate, state.dims.dp_shard, state.dims.world_size),
        "env": (state.env.rank, state.env.world_size),
        "mesh": None if mesh is None else (tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
        "dp_mesh_size": None if dp_mesh is None else dp_mesh.size(),
    }


def sharding_facts(strategy: str, extra: dict | None = None) -> dict:
    rank, world = _rank_world()
    model = hf_scale.parallelize(tiny_model("llama", "causal"), dict(strategy=strategy, **(extra or {})))
    parallel_state = state_facts(model)
    total = sum(p.numel() for p in model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    batch = slice_batch(tiny_batch("causal", 2 * world), rank, world)
    out = model(**batch)
    after_forward = type(model.model.layers[0].mlp.up_proj.weight).__name__
    out.loss.backward()
    optimizer = hf_scale.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    optimizer.step()
    local_optim = getattr(optimizer, "optim", optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        (g["weight_decay"], sorted(names[id(p)] for p in g["params"]), all(isinstance(p, DTensor) for p in g["params"]))
        for g in optimizer.param_groups
    ]
    state = getattr(model, "_get_fsdp_state", None)
    return {
        "class": type(model).__name__,
        "is_llama": isinstance(model, LlamaForCausalLM),
        "offload_policy": type(state()._fsdp_param_group.offload_policy).__name__ if state else None,
        "placements": _placements(model),
        "local_fraction": local / total,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "block_param_after_forward": after_forward,
        "optimizer": type(optimizer).__name__,
        "optimizer_states": len(local_optim.state),
        "params": len(list(model.parameters())),
        "groups": groups,
        "state": parallel_state,
    }


def precision_facts() -> dict:
    rank, world = _rank_world()
    model = hf_scale.parallelize(tiny_model("t5", "seq2seq"), {"mixed_precision": "bf16"})
    seen = {}
    ff = model.encoder.block[0].layer[-1].DenseReluDense
    ff.wi.register_forward_hook(lambda m, i, o: seen.update(wi=str(o.dtype)))
    ff.wo.register_forward_hook(lambda m, i, o: seen.update(wo_in=str(i[0].dtype), wo_out=str(o.dtype)))
    model(**slice_batch(tiny_batch("seq2seq", 2 * world), rank, world)).loss.backward()
    seen["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    seen["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return seen


def _count(mode: CommDebugMode, name: str) -> int:
    """Calls of collectives whose op name contains ``name`` (c10d spells allreduce_, the
    functional ops all_reduce: underscores are ignored)."""
    return sum(n for op, n in mode.get_comm_counts().items() if name in str(op).replace("_", ""))


def no_sync_facts(strategy: str, extra: dict | None = None) -> dict:
    """Communication inside and outside ``no_sync``; local gradient agreement across ranks."""
    rank, world = _rank_world()
    model = hf_scale.parallelize(tiny_model("llama", "causal"), dict(strategy=strategy, **(extra or {})))
    batch = slice_batch(tiny_batch("causal", 2 * world), rank, world)
    facts = {}
    for label, enabled in (("no_sync", True), ("sync", False)):
        with CommDebugMode() as comm, hf_scale.no_sync(model, enabled=enabled):
            model(**batch).loss.backward()
        # gradients reduce-scatter, or (hf_scale's on gloo) all-to-all then sum
        facts[f"{label}_reduce_scatter"] = _count(comm, "reducescatter") + _count(comm, "alltoall")
        facts[f"{label}_all_reduce"] = _count(comm, "allreduce")
        grad = model.model.layers[0].mlp.up_proj.weight.grad
        if grad is not None and not isinstance(grad, DTensor):  # replicated: equal iff all-reduced
            gathered = [torch.zeros_like(grad) for _ in range(world)]
            dist.all_gather(gathered, grad.contiguous())
            facts[f"{label}_grads_equal_across_ranks"] = all(torch.equal(gathered[0], g) for g in gathered)
    return facts


def _worst(got: dict, want: dict) -> float:
    """Largest |got - want| over every tensor, relative to that tensor's largest |want|."""
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)) for k in want)


def reduce_scatter_collective_facts() -> dict:
    """:class:`AllToAllReduceScatter` against gloo's own ``reduce_scatter_tensor`` on rank-distinct
    data (fp32 and bf16, ``SUM``, ``AVG``; ``PREMUL_SUM``, which gloo lacks, against the sum
    times the factor): the worst relative difference per case."""
    from hf_scale.distributed import init_distributed
    from hf_scale.parallel.reduce_scatter import AllToAllReduceScatter

    init_distributed()
    rank, world = _rank_world()
    group, comm, facts = dist.distributed_c10d._get_default_group(), AllToAllReduceScatter(), {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(100 + rank)
        flat = torch.randn(world * 37, generator=g).to(dtype)  # 37: every chunk a different size than a tidy one
        for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG),
                         ("premul", dist.ReduceOp.PREMUL_SUM(1 / 3))):
            got, want, exact = torch.empty(37, dtype=dtype), torch.empty(37, dtype=dtype), torch.empty(37)
            comm(got, flat.clone(), group, op)
            native = dist.ReduceOp.SUM if name == "premul" else op
            dist.reduce_scatter_tensor(want, flat.clone(), op=native)
            dist.reduce_scatter_tensor(exact, flat.float(), op=native)  # the same data summed in fp32
            if name == "premul":
                want, exact = want * (1 / 3), exact * (1 / 3)
            facts[f"{name}_{str(dtype)[6:]}"] = _worst({0: got.float()}, {0: want.float()})
            facts[f"{name}_{str(dtype)[6:]}_vs_fp32"] = _worst({0: got.float()}, {0: exact})
    return facts


def reduce_scatter_facts(extra: dict | None = None, divide: float | None = None) -> dict:
    """One backward of the same tiny Llama (a 129-token vocabulary: its embedding's dim 0 is
    uneven over 2 ranks, so FSDP pads it) under hf_scale's fsdp twice: with the all-to-all
    reduce-scatter it installs on gloo, and with FSDP's own ``DefaultReduceScatter`` put back.
    ``divide``: a gradient divide factor on every unit (the all-to-all run takes FSDP's
    ``PREMUL_SUM``; gloo's own, which has none, sums then divides). Returns the worst relative
    gradient difference and the collectives each backward called."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    rank, world = _rank_world()
    batch = slice_batch(tiny_batch("causal", 2 * world), rank, world)
    grads, facts = {}, {}
    for label in ("all_to_all", "native"):
        model = hf_scale.parallelize(tiny_model("llama_vocab129", "causal"), dict(strategy="fsdp", **(extra or {})))
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            if label == "native":
                unit.set_custom_reduce_scatter(DefaultReduceScatter())
            if divide is not None:
                unit.set_gradient_divide_factor(divide)
                unit.set_force_sum_reduction_for_comms(label == "native")
        with CommDebugMode() as comm:
            model(**batch).loss.backward()
        facts[f"{label}_calls"] = {"all_to_all": _count(comm, "alltoall"), "reduce_scatter": _count(comm, "reducescatter")}
        grads[label] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    facts["units"] = len(units)
    facts["worst"] = _worst(grads["all_to_all"], grads["native"])
    facts["exact"] = all(torch.equal(grads["all_to_all"][k], grads["native"][k]) for k in grads["native"])
    return facts


def bad_layout_error() -> str:
    """An impossible layout must fail on every rank before any collective, not hang."""
    try:
        hf_scale.parallelize(tiny_model("gpt2", "causal"), {"strategy": "hsdp", "dp_replicate": 3})
    except hf_scale.HfScaleConfigError as e:
        return str(e)
    return "no error"


def generate_facts() -> list[int]:
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"strategy": "fsdp", "activation_checkpointing": "full"})
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    return out[0].tolist()


def fp16_grad_scaler_facts(strategy: str) -> dict:
    """fp16 training with torch's own GradScaler over (sharded) gradients: a few steps run,
    the scale survives, the loss falls."""
    rank, world = _rank_world()
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"strategy": strategy, "mixed_precision": "fp16"})
    optimizer = hf_scale.build_optimizer(model, lr=1e-2)
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", init_scale=2.0**10)
    batch = slice_batch(tiny_batch("causal", 2 * world), rank, world)
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        hf_scale.clip_grad_norm_(model, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "scale": float(scaler.get_scale())}


def mixed_clip_facts() -> dict:
    """clip_grad_norm_ over a sharded DTensor gradient and a plain one together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = _rank_world()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).reshape(4, 2)
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.tensor([1.0, 2.0, 2.0])
    norm = hf_scale.clip_grad_norm_([sharded, plain], max_norm=1.0)
    return {
        "norm": float(norm),
        "expected": float(torch.sqrt(full.pow(2).sum() + 9.0)),
        "clipped_norm": float(torch.sqrt(sharded.grad.full_tensor().pow(2).sum() + plain.grad.pow(2).sum())),
    }


def world2_checks() -> dict:
    return {
        "fsdp": sharding_facts("fsdp"),
        "zero2": sharding_facts("zero2"),
        "zero1": sharding_facts("zero1"),
        "ddp": sharding_facts("ddp"),
        "offload": sharding_facts("fsdp", {"cpu_offload": True}),
        "precision": precision_facts(),
        "no_sync_fsdp": no_sync_facts("fsdp"),
        "no_sync_ddp": no_sync_facts("ddp"),
        "bad_layout": bad_layout_error(),
        "generate": generate_facts(),
        "mixed_clip": mixed_clip_facts(),
        "fp16_fsdp": fp16_grad_scaler_facts("fsdp"),
        "fp16_ddp": fp16_grad_scaler_facts("ddp"),
        "rs_collective": reduce_scatter_collective_facts(),
        "rs_fp32": reduce_scatter_facts(),
        "rs_bf16": reduce_scatter_facts({"mixed_precision": "bf16"}),
        "rs_divide": reduce_scatter_facts(divide=3.0),
    }


def world4_checks() -> dict:
    return {"hsdp": sharding_facts("hsdp", {"dp_replicate": 2}), "no_sync_hsdp": no_sync_facts("hsdp", {"dp_replicate": 2}),
            "rs_collective": reduce_scatter_collective_facts(), "rs_fp32": reduce_scatter_facts()}


def hang() -> None:
    """Rank 0 waits in a collective that rank 1, stuck elsewhere, never joins."""
    import datetime
    import time

    rank, _ = _rank_world()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def unpicklable():
    """A result the harness cannot send back (a local function)."""
    return {"fn": lambda: None}
