"""LoRA adapter runs for the adapter tests: the same peft model trained in one process and on N
ranks under any layout, adapter checkpoints with rank-distinct values, resume across layouts,
and bad inputs. Each function runs on every rank (tests.harness.run_ranks) unless it says so.

The LoRA model: the tiny Llama, LoRA r=4 on every Linear but the head, ``init_lora_weights=False``
so that ``lora_B`` starts non-zero (peft's default zero ``B`` would give ``lora_A`` no gradient
in the first step, and tp's split of ``lora_B`` nothing to distinguish).
"""

from __future__ import annotations

import hashlib
import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import hf_scale
from tests.distributed.training import full_params
from tests.tiny_models import slice_batch, tiny_batch, tiny_model

STEPS = 3
LR = 1e-3
GLOBAL_BATCH = 8
MAX_NORM = 1.0
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "init_lora_weights": False}


def base_model(arch: str = "llama"):
    """The tiny causal ``arch`` model (tests.tiny_models; ``qwen3_moe``: the MoE tests' model)."""
    if arch == "qwen3_moe":
        from tests.distributed.moe_checks import moe_model

        return moe_model(arch)
    return tiny_model(arch, "causal")


def lora_model(base_dtype=torch.float32, arch: str = "llama", adapter_name: str = "default", **lora):
    """The tiny ``arch`` model with LoRA adapters (fp32 adapters on a ``base_dtype`` base), seeded.
    Archs beside Llama: ``phi3_mha`` (packed ``qkv_proj`` / ``gate_up_proj``), ``gpt2`` (Conv1D,
    packed ``c_attn``), ``qwen3_moe`` (frozen experts' parameters)."""
    from peft import LoraConfig, get_peft_model

    model = base_model(arch).to(base_dtype)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(**{**LORA, **lora}), adapter_name=adapter_name)


def batches(steps: int = STEPS):
    return [tiny_batch("causal", GLOBAL_BATCH, seed=300 + s) for s in range(steps)]


def reference_run(base_dtype=torch.float32, arch: str = "llama", **lora) -> dict:
    """The ground truth: the peft model in one process, whole batches, AdamW on the adapters."""
    model = lora_model(base_dtype, arch, **lora)
    host = model.get_base_model()
    initial = {n: p.detach().float().clone() for n, p in host.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    final = {n: p.detach().float().clone() for n, p in host.named_parameters()}
    return {"losses": losses, "norms": norms, "initial": initial, "params": final}


def parallel_run(config: dict, base_dtype=torch.float32, arch: str = "llama", **lora) -> dict:
    """The same training under ``config``: losses (mean over data-parallel ranks), gradient
    norms, this rank's whole parameters (pp: its stages'), and what frozen weights carried."""
    model = hf_scale.parallelize(lora_model(base_dtype, arch, **lora), config)
    state = hf_scale.get_state(model)
    host = model.get_base_model()
    optimizer = hf_scale.build_optimizer(model, lr=LR)
    losses, norms, frozen_grads = [], [], set()
    for batch in batches():
        loss = model.train_step(slice_batch(batch, state.dp_rank, state.dp_degree))
        frozen_grads |= {n for n, p in host.named_parameters() if not p.requires_grad and p.grad is not None}
        norms.append(float(hf_scale.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        if state.dp_degree > 1:
            dist.all_reduce(loss, group=state.dp_group)
        losses.append(float(loss) / state.dp_degree)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    frozen_in_optimizer = [n for n, p in host.named_parameters() if not p.requires_grad and id(p) in in_optimizer]
    return {"losses": losses, "norms": norms, "params": full_params(host), "frozen_grads": sorted(frozen_grads),
            "frozen_in_optimizer": frozen_in_optimizer,
            "trainable": sum(p.requires_grad for p in host.parameters())}


def pattern(name: str, shape) -> torch.Tensor:
    """Distinct values for every element of every tensor: a rank's slice of it differs from
    every other rank's (the trap that reverted (N-1)/N of Trainer + FSDP2 adapters)."""
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32) * 1e-4 + seed % 1000).reshape(shape)


@torch.no_grad()
def set_adapters(host, fill) -> None:
    """Every LoRA tensor of ``host`` (this rank's part of it) <- ``fill(name, global shape)``."""
    for name, p in host.named_parameters():
        if "lora_" not in name:
            continue
        full = fill(name, p.shape).to(p.dtype)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def adapter_round_trip(config: dict, folder: str, adapter_name: str = "default") -> dict:
    """Save rank-distinct adapters under ``config``, zero them, read them back (hf_scale), and
    report every LoRA tensor that differs from what was saved (each rank its slices)."""
    model = hf_scale.parallelize(lora_model(adapter_name=adapter_name), config)
    host = model.get_base_model()
    set_adapters(host, pattern)
    hf_scale.save_pretrained(model, folder)
    set_adapters(host, lambda name, shape: torch.zeros(shape))
    hf_scale.load_adapter(model, folder)
    got = full_params(host)
    wrong = [n for n, v in got.items() if "lora_" in n and not torch.equal(v, pattern(n, v.shape))]
    return {"wrong": wrong, "lora_tensors": sum("lora_" in n for n in got), "files": sorted(os.listdir(folder))}


def resume_run(first: dict, second: dict, root: str) -> dict:
    """Two steps under ``first``, ``save_state``; a new model under ``second`` resumes and takes
    the third. Returns the three losses (the third from the resumed run) and final adapters."""
    model = hf_scale.parallelize(lora_model(), first)
    optimizer = hf_scale.build_optimizer(model, lr=LR)
    losses = _steps(model, optimizer, batches()[:2])
    hf_scale.save_state(model, optimizer, root=root, step=2)
    model = hf_scale.parallelize(lora_model(), second)
    set_adapters(model.get_base_model(), lambda name, shape: torch.zeros(shape))  # must come back from the files
    optimizer = hf_scale.build_optimizer(model, lr=LR)
    step = hf_scale.load_state(model, optimizer, path=f"{root}/latest")
    losses += _steps(model, optimizer, batches()[2:])
    return {"losses": losses, "step": step, "params": full_params(model.get_base_model())}


def _steps(model, optimizer, chunk) -> list[float]:
    state = hf_scale.get_state(model)
    losses = []
    for batch in chunk:
        loss = model.train_step(slice_batch(batch, state.dp_rank, state.dp_degree))
        hf_scale.clip_grad_norm_(model, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if state.dp_degree > 1:
            dist.all_reduce(loss, group=state.dp_group)
        losses.append(float(loss) / state.dp_degree)
    return losses


def expect_error(fn, *args) -> str:
    """The error ``fn`` raised on this rank (its type and message), or ``"no error"``."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks type and text
        return f"{type(e).__name__}: {e}"
    return "no error"


def bad_inputs(folder: str) -> dict:
    """Each bad input's error on this rank: an adapter of another r, modules_to_save under tp."""
    out = {}
    small = hf_scale.parallelize(lora_model(r=2), {"strategy": "fsdp"})
    out["other_r"] = expect_error(hf_scale.load_adapter, small, folder)
    out["modules_to_save_tp"] = expect_error(
        hf_scale.parallelize, lora_model(modules_to_save=["lm_head"]), {"strategy": "zero2", "tp": 2})
    out["not_an_adapter"] = expect_error(hf_scale.load_adapter, small, os.path.dirname(folder))
    out["lora_experts_ep"] = expect_error(hf_scale.parallelize, lora_model(arch="qwen3_moe"), {"ep": 2})
    dist.barrier()  # the group is still usable: every rank raised before any collective
    return out


# (folder name, layout, adapter name) saved, zeroed and read back, per world size
ROUND_TRIPS = {
    2: (("fsdp", {"strategy": "fsdp"}, "default"), ("tp2", {"strategy": "zero2", "tp": 2}, "default"),
        ("pp2", {"strategy": "ddp", "pp": 2}, "default"), ("ddp", {"strategy": "ddp"}, "default"),
        ("fsdp_named", {"strategy": "fsdp"}, "mine")),
    4: (("tp2_fsdp2", {"strategy": "fsdp", "tp": 2}, "default"),),
}


def world_checks(parity_cases: list[dict], root: str, extra: bool) -> dict:
    """Every check of one world size in one process group; a failing case reports its error."""
    out = {"parity": []}
    for case in parity_cases:
        try:
            out["parity"].append(parallel_run(case["config"], getattr(torch, case.get("base_dtype", "float32")),
                                              case.get("arch", "llama"), **case.get("lora", {})))
        except Exception:  # noqa: BLE001 - one case's failure is that test's, not the group's
            out["parity"].append({"error": traceback.format_exc()})
    out["round_trip"] = {}
    for name, config, adapter_name in ROUND_TRIPS[int(os.environ["WORLD_SIZE"])]:
        out["round_trip"][name] = adapter_round_trip(config, f"{root}/adapter_{name}", adapter_name)
    if extra:
        out["resume_fsdp_to_tp"] = resume_run({"strategy": "fsdp"}, {"strategy": "zero2", "tp": 2}, f"{root}/ckpt_a")
        out["resume_tp_to_pp"] = resume_run({"strategy": "zero2", "tp": 2}, {"strategy": "ddp", "pp": 2},
                                            f"{root}/ckpt_b")
        out["bad"] = bad_inputs(f"{root}/adapter_fsdp")
    return out
