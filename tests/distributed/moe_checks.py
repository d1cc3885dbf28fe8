"""Mixture-of-experts runs for the expert-parallel tests: tiny MoE models of five families trained
in one process and on N ranks under ep / tp / ep x fsdp, with the routing counted. Each function
runs on every rank (tests.harness.run_ranks) unless it says so.

The reference is data parallel done by hand in one process: each data-parallel rank's slice of
the batch is run on its own and the gradients are averaged (loss / dp per slice). That is what
any data-parallel layout computes, and the only fair reference once the load-balancing loss is
on: it is a function of a batch's routing as a whole, so one pass over the whole batch gives a
different (not a wrong) loss.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_scale
from tests.distributed.training import full_params
from tests.tiny_models import slice_batch

STEPS = 2
LR = 1e-3
# AdamW's eps above rounding: an element whose true gradient is 0 but comes out at rounding level
# (another summation order under ep) would otherwise get a full +-lr step of either sign
# (Qwen3-MoE with the aux loss at world 4: one embedding element, 1.3e-3 of the update's norm)
EPS = 1e-6
GLOBAL_BATCH = 8
SEQ = 12
VOCAB = 256
MAX_NORM = 1.0
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=64, router_aux_loss_coef=0.02)


def moe_config(arch: str, aux: bool, layers: int = 2):
    """A tiny fp32 config of ``arch`` with 4 experts, top-2 and ``layers`` layers; ``aux``: the
    load-balancing loss on."""
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen3MoeConfig,
    )

    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True)
    elif arch == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    elif arch == "olmoe":
        config = OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    elif arch == "deepseek_v3":  # one dense layer, then MoE with a shared expert
        config = DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32,
                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    elif arch == "olmoe_48687":  # transformers#48687's config: 8 experts, top-2, no normalisation
        config = OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    elif arch == "gpt_oss":
        config = GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              head_dim=16, sliding_window=8)
    else:
        raise ValueError(arch)
    config.output_router_logits = aux
    config.num_hidden_layers = layers
    for key in list(config.to_dict()):
        if "dropout" in key:
            setattr(config, key, 0.0)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 1
    return config


def moe_model(arch: str, aux: bool = False, seed: int = 0, impl: str | None = None, layers: int = 2):
    """The tiny ``arch`` model, seeded; ``impl``: transformers' experts implementation
    (``"batched_mm"``, ``"grouped_mm"``; None: the default)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, aux, layers))
    if impl is not None:
        model.set_experts_implementation(impl)
    # transformers initialises routers to zero for some families: give them a real routing
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.5)
    return model


def batches(steps: int = STEPS):
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(400 + s)
        ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def watched(name: str) -> bool:
    """The gradients compared: routers and experts (and one dense weight)."""
    return ".mlp.gate." in name or ".mlp.router." in name or ".experts." in name or name.endswith("embed_tokens.weight")


def reference_run(arch: str, aux: bool, dp: int, impl: str | None = None, layers: int = 2) -> dict:
    """One process: each of ``dp`` slices of every batch on its own, gradients averaged; AdamW."""
    model = moe_model(arch, aux, impl=impl, layers=layers)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS)
    losses, norms, grads, counts = [], [], None, None
    for step, batch in enumerate(batches()):
        total = 0.0
        for r in range(dp):
            with count_routing(model) as routed:
                loss = model(**slice_batch(batch, r, dp)).loss / dp
            loss.backward()
            total += float(loss.detach())
            if step == 0:
                counts = routed if counts is None else {k: counts[k] + v for k, v in routed.items()}
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if watched(n) and p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "counts": counts, "initial": initial}


class count_routing:
    """Tokens per expert, per experts module, over the forwards inside the block: from the
    experts modules' inputs (``top_k_index``), so in one process and under ep alike."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.counts, self.handles = {}, []
        for name, module in self.model.named_modules():
            if name.endswith(".experts") and hasattr(module, "gate_up_proj"):
                self.handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self.counts

    def _hook(self, name):
        def hook(module, args):
            ids = args[1].reshape(-1)
            total = getattr(module, "_hf_scale_ep", None)
            n = module.num_experts * (total.ep if total is not None else 1)
            self.counts[name] = self.counts.get(name, 0) + torch.bincount(ids, minlength=n)
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class count_all_to_all:
    """Calls of ``torch.distributed.all_to_all_single`` inside the block: (count exchanges,
    token exchanges), told apart by dtype (counts are int64)."""

    def __enter__(self):
        self.original = dist.all_to_all_single
        self.calls = {"counts": 0, "tokens": 0}

        def counted(output, input, *args, **kwargs):
            self.calls["counts" if not input.is_floating_point() else "tokens"] += 1
            return self.original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted
        return self.calls

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original


def parallel_run(arch: str, aux: bool, config: dict, impl: str | None = None) -> dict:
    """The same training under ``config``; losses (mean over dp ranks), norms, step-1 gradients
    and final parameters whole, tokens per expert summed over ranks, all-to-alls of one forward."""
    model = hf_scale.parallelize(moe_model(arch, aux, impl=impl), config)
    state = hf_scale.get_state(model)
    seen = {}

    def step(index: int, batch: dict) -> torch.Tensor:
        with count_routing(model) as routed, count_all_to_all() as a2a:
            loss = model(**batch).loss
        if index == 0:
            seen["calls"], seen["counts"] = dict(a2a), {}
            for name, c in routed.items():
                if state.dims.tp > 1:  # tp ranks share a batch: count it once
                    c = c * (state.mesh["tp"].get_local_rank() == 0)
                dist.all_reduce(c)
                seen["counts"][name] = c
        loss.backward()
        return loss

    out = _train(model, step)[0]
    return {**out, "params": full_params(model), "counts": seen["counts"], "calls": seen["calls"],
            "moe_layers": len(seen["counts"]), "experts_held": experts_held(model)}


def _train(model, step) -> tuple[dict, torch.optim.Optimizer]:
    """AdamW (``build_optimizer``) over :func:`batches`, each rank its data-parallel slice;
    ``step(index, batch)`` runs forward and backward and returns the loss. The losses (mean over
    the dp ranks), the clipped gradient norms and the first step's gradients of the watched
    parameters this rank holds (whole), and the optimizer."""
    state = hf_scale.get_state(model)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0, eps=EPS)
    losses, norms, grads = [], [], None
    for index, batch in enumerate(batches()):
        loss = step(index, slice_batch(batch, state.dp_rank, state.dp_degree))
        if grads is None:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                     for n, p in model.named_parameters() if watched(n) and p.grad is not None}
        norms.append(float(hf_scale.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().reshape(1).clone()
        if state.dp_degree > 1:  # tp and pp ranks of one data-parallel rank hold the same loss
            dist.all_reduce(value, group=state.dp_group)
        losses.append(float(value) / state.dp_degree)
    return {"losses": losses, "norms": norms, "grads": grads}, optimizer


def experts_held(model) -> int:
    """The expert weights this rank holds between steps (its ep share, FSDP's shard of it, tp's
    slice; not the biases, some of which tp replicates)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()
               if ".experts." in n and not n.endswith("bias"))


def bad_input(case: dict) -> str:
    """The error (type: message) ``parallelize`` raises for the case's model and config, or ''."""
    if case["arch"] == "llama":
        model = _dense()
    else:
        from transformers import AutoModelForCausalLM

        config = moe_config(case["arch"], case.get("aux", False))
        if "num_experts" in case:
            config.num_experts = case["num_experts"]
        model = AutoModelForCausalLM.from_config(config)
    if case.get("plain_expert_param"):  # a parameter of the experts module that is not per expert
        import torch

        model.model.layers[0].mlp.experts.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    try:
        hf_scale.parallelize(model, case["config"])
    except Exception as e:  # noqa: BLE001 - the test reads type and message
        return f"{type(e).__name__}: {e}"
    return ""


def _dense():
    from tests.tiny_models import tiny_model

    return tiny_model("llama", "causal")


def checkpoint_checks(root: str, save_config: dict, load_configs: list[dict]) -> dict:
    """Train one step under ``save_config``, save the model (Hub format) and the training state
    (DCP); load both into each of ``load_configs``. Returns, per load layout, the largest
    difference of any weight and of any optimizer state tensor from what was saved, and a
    second step's loss on both sides; rank 0 also returns the saved weights and its logits."""
    rank = int(os.environ["RANK"])
    arch = "qwen3_moe"
    model = hf_scale.parallelize(moe_model(arch), save_config)
    state = hf_scale.get_state(model)
    # weight decay: two groups of distinct settings, which each layout splits by kind otherwise
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.1)
    schedule = _schedule(optimizer)
    b1, b2 = batches(2)
    model(**slice_batch(b1, state.dp_rank, state.dp_degree)).loss.backward()
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    saved = full_params(model)
    saved_optim = _full_optimizer_state(model, optimizer)
    folder = f"{root}/hub_{'_'.join(f'{k}{v}' for k, v in save_config.items())}"
    hf_scale.save_pretrained(model, folder)
    hf_scale.save_state(model, optimizer, scheduler=schedule, root=f"{folder}_state", step=1)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=b2["input_ids"][:2]).logits  # every rank: the all-to-alls need them all
    out = {"folder": folder, "config": save_config, "loads": [], "groups": len(optimizer.param_groups),
           "rates": _rates(optimizer)}
    next_loss = _next_loss(model, optimizer, b2, state)
    saved_grads = _full_grads(model, b2, state)
    for config in load_configs:
        loaded = hf_scale.from_pretrained(folder, config)
        got = full_params(loaded)
        weights = max(float((got[n] - saved[n]).abs().max()) for n in saved)
        # the loaded model trains as the saved one did: every gradient of the next batch (AdamW's
        # update hides a gradient's scale, so the next losses alone would not tell)
        grads = _full_grads(loaded, b2, hf_scale.get_state(loaded))
        grad_diff = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in saved_grads.items())
        fresh = hf_scale.parallelize(moe_model(arch, seed=7), config)
        fresh_opt = hf_scale.build_optimizer(fresh, lr=LR, weight_decay=0.1)
        fresh_schedule = _schedule(fresh_opt)
        hf_scale.load_state(fresh, fresh_opt, scheduler=fresh_schedule, path=f"{folder}_state/latest")
        # every group's rate resumes on its schedule (the next step's too), whatever the groups here
        rates = _rates(fresh_opt)
        fresh_schedule.step()
        rates_next = _rates(fresh_opt)
        resumed = full_params(fresh)
        resumed_optim = _full_optimizer_state(fresh, fresh_opt)
        optim = max(float((resumed_optim[k] - v).abs().max()) for k, v in saved_optim.items())
        weights_resumed = max(float((resumed[n] - saved[n]).abs().max()) for n in saved)
        loss = _next_loss(fresh, fresh_opt, b2, hf_scale.get_state(fresh))
        out["loads"].append({"config": config, "weights": weights, "resumed_weights": weights_resumed,
                             "optimizer": optim, "optimizer_keys": len(resumed_optim) == len(saved_optim),
                             "next_loss": loss, "saved_next_loss": next_loss, "grads": grad_diff,
                             "rates": rates, "rates_next": rates_next, "groups": len(fresh_opt.param_groups),
                             "grad_keys": sorted(grads) == sorted(saved_grads)})
    if rank == 0:
        out["saved"], out["logits"] = saved, logits
    return out


def _schedule(optimizer):
    """A schedule whose rate differs per group: the no-decay group decays faster."""
    rules = [(lambda s: 1 / (1 + s)) if g["weight_decay"] else (lambda s: 1 / (1 + 3 * s)) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, rules)


def _rates(optimizer) -> list[tuple[float, float]]:
    """The distinct (weight decay, learning rate / LR) pairs of the optimizer's groups."""
    return sorted({(g["weight_decay"], round(g["lr"] / LR, 9)) for g in optimizer.param_groups})


def _full_optimizer_state(model, optimizer) -> dict:
    """(parameter name, state key) -> the whole tensor (a collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[(names[id(p)], k)] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return dict(sorted(out.items()))


def _full_grads(model, batch, state) -> dict:
    """Name -> the whole gradient of a training forward and backward on ``batch`` (a collective);
    the model's gradients are cleared again."""
    model.train()
    model(**slice_batch(batch, state.dp_rank, state.dp_degree)).loss.backward()
    out = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
           for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _next_loss(model, optimizer, batch, state) -> float:
    """The mean loss of a training forward on ``batch`` (no step taken)."""
    model.train()
    with torch.no_grad():
        loss = model(**slice_batch(batch, state.dp_rank, state.dp_degree)).loss.detach().reshape(1)
    if state.dims.tp > 1:
        loss = loss * (state.mesh["tp"].get_local_rank() == 0)
    dist.all_reduce(loss)
    return float(loss) / state.dp_degree


def pipeline_run(arch: str, config: dict, layers: int, root: str | None = None) -> dict:
    """The same training under a pipeline-parallel ``config`` (``train_step``); the losses (mean
    over dp ranks), this rank's stages' final parameters whole, and the expert weights it holds.
    With ``root``: the model saved there (Hub format) and its training state (DCP), loaded into
    fsdp + ep2 without pp: the largest difference of this rank's parameters from each."""
    model = hf_scale.parallelize(moe_model(arch, layers=layers), config)
    out, optimizer = _train(model, lambda index, batch: hf_scale.train_step(model, batch))
    mine = full_params(model)
    out.update(params=mine, experts_held=experts_held(model))
    if root is not None:
        folder = f"{root}/{arch}_pp_ep"
        hf_scale.save_pretrained(model, folder)
        hf_scale.save_state(model, optimizer, root=f"{folder}_state", step=len(out["losses"]))
        loaded = full_params(hf_scale.from_pretrained(folder, {"ep": 2}))
        fresh = hf_scale.parallelize(moe_model(arch, layers=layers, seed=7), {"ep": 2})
        hf_scale.load_state(fresh, hf_scale.build_optimizer(fresh, lr=LR, eps=EPS), path=f"{folder}_state/latest")
        resumed = full_params(fresh)
        out["saved"] = {"weights": max(float((loaded[n] - p).abs().max()) for n, p in mine.items()),
                        "resumed": max(float((resumed[n] - p).abs().max()) for n, p in mine.items())}
    return out


def world_checks(cases: list[dict]) -> dict:
    """Every case on this rank: {"parity": [...], "errors": [...]} (rank-local values; the test
    compares rank 0's whole gradients and parameters, every rank's errors, losses, collectives and
    experts held)."""
    rank = int(os.environ["RANK"])
    out = {"parity": [], "errors": [], "checkpoints": [], "pipeline": []}
    for case in cases:
        try:
            if "checkpoint" in case:
                out["checkpoints"].append(checkpoint_checks(case["root"], case["config"], case["checkpoint"]))
                continue
            if "error" in case:
                out["errors"].append(bad_input(case))
                continue
            if "layers" in case:  # pipeline cases: every rank holds other parameters
                out["pipeline"].append(pipeline_run(case["arch"], case["config"], case["layers"], case.get("root")))
                continue
            result = parallel_run(case["arch"], case.get("aux", False), case["config"], case.get("impl"))
            out["parity"].append(result if rank == 0 else {k: result[k] for k in ("losses", "calls", "experts_held")})
        except Exception:  # keep the other cases' results: the test names the failing one
            kind = ("checkpoints" if "checkpoint" in case else "errors" if "error" in case
                    else "pipeline" if "layers" in case else "parity")
            out[kind].append({"traceback": traceback.format_exc()})
    return out
