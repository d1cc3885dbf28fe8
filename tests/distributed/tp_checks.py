"""Tensor-parallel checks run inside one process group per world size (2: tp=2; 4: tp=2 x fsdp2).

Training parity reuses :func:`tests.distributed.training.run_cases` (its data goes by the
data-parallel coordinate, so both ranks of a tp group see the same batch); this module adds
greedy generation, parameter placements, collectives per forward and bad input.
"""

from __future__ import annotations

import copy
import os

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import hf_scale
from tests.distributed.training import run_cases
from tests.tiny_models import ARCHS, tiny_batch, tiny_model

GEN_PROMPT = [[5, 6, 7, 8], [9, 10, 11, 12]]
GEN_NEW_TOKENS = 6


def greedy_tokens(model) -> list[list[int]]:
    """Greedy continuation of :data:`GEN_PROMPT` (no eos stop, so every token is compared)."""
    ids = torch.tensor(GEN_PROMPT)
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN_NEW_TOKENS,
                             min_new_tokens=GEN_NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out.tolist()


def generate_case(case: dict) -> list[list[int]]:
    """Every rank's greedy tokens for ``case["arch"]`` under ``case["config"]``."""
    return greedy_tokens(hf_scale.parallelize(tiny_model(case["arch"], "causal"), case["config"]))


def placements(model) -> dict[str, str]:
    """Parameter name -> its DTensor placements (``"plain"`` for a whole tensor on each rank)."""
    return {n: str(tuple(p.placements)) if isinstance(p, DTensor) else "plain" for n, p in model.named_parameters()}


def tp_placements(model) -> dict[str, str]:
    """Parameter name -> its placement on the ``tp`` mesh dimension (``"none"``: not on it)."""
    out = {}
    for name, p in model.named_parameters():
        dims = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        out[name] = repr(p.placements[dims.index("tp")]) if "tp" in dims else "none"
    return out


def layout_facts(arch: str, head: str, config: dict) -> dict:
    """Placements, local shapes and the per-rank attributes after ``parallelize``."""
    model = hf_scale.parallelize(tiny_model(arch, head), config)
    local = {n: list((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in model.named_parameters()}
    attrs = {}
    for name, module in model.named_modules():
        for attr in ("split_size", "num_heads", "n_heads", "num_key_value_heads", "num_attention_heads"):
            if isinstance(getattr(module, attr, None), int) and name:
                attrs[f"{name}.{attr}"] = getattr(module, attr)
        config_heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        if name.endswith("self_attn") and config_heads is not None:
            attrs[f"{name}.config.num_attention_heads"] = config_heads
    return {"placements": placements(model), "tp_placements": tp_placements(model), "local_shapes": local, "attrs": attrs,
            "model_config_heads": getattr(model.config, "num_attention_heads", None)}


# c10d's op names (the inference path's in-place collectives) -> the functional ones DTensor uses
_SAME = {"allreduce": "all_reduce", "_allgather_base": "all_gather_into_tensor", "allgather": "all_gather"}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective name (``all_reduce``, ``all_gather_into_tensor``, ...) -> calls."""
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_")
        name = _SAME.get(name, name)
        out[name] = out.get(name, 0) + n
    return out


def comm_facts(arch: str, config: dict) -> dict:
    """Collectives of one evaluation forward (no labels, no grad: full logits) and of one
    training forward (labels, grad: the loss on vocabulary shards)."""
    model = hf_scale.parallelize(tiny_model(arch, "causal"), config)
    batch = tiny_batch("causal", 2)
    with torch.no_grad(), CommDebugMode() as comm:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    facts = {"eval": _counts(comm), "eval_logits": list(out.logits.shape)}
    with CommDebugMode() as comm:
        out = model(**batch)
    facts["train"] = _counts(comm)
    facts["train_logits"] = None if out.logits is None else list(out.logits.shape)
    facts["train_loss"] = float(out.loss.detach())
    return facts


def zero_grad_keeps_zeros(arch: str, config: dict) -> dict:
    """``build_optimizer``'s AdamW under tp alone (sharded weights beside plain norms): one step,
    then ``zero_grad(set_to_none=False)`` (torch's own raises on the mix), then ``zero_grad()``."""
    model = hf_scale.parallelize(tiny_model(arch, "causal"), config)
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    model.train_step(tiny_batch("causal", 2))
    optimizer.step()
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    try:
        optimizer.zero_grad(set_to_none=False)
    except RuntimeError as e:  # one failed check, not a failed process group
        return {"kinds": kinds, "error": str(e)[:300]}
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    zeros = all(g is not None and not g.abs().sum().item() for g in local)
    optimizer.zero_grad()
    return {"kinds": kinds, "zeros": zeros, "none": all(p.grad is None for p in model.parameters())}


def bad_input_error(arch: str, config: dict, plan: dict | None = None, **config_changes) -> str:
    """The message of the error ``parallelize`` raises on this rank (it must raise on every
    rank before any collective: a rank that went on would hang the spawn)."""
    from transformers import AutoModelForCausalLM

    cls, kwargs, _ = ARCHS[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**kwargs, **config_changes}))
    try:
        hf_scale.parallelize(model, config, plan=plan)
    except hf_scale.HfScaleError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def probe_outcome(arch: str, source: str, changes: dict[str, str]) -> dict:
    """``parallelize`` at tp=2 of the tiny ``arch`` with the tp plan inferred from its modules
    (transformers' own plan set aside), ``changes`` made to it, passed as a whole plan whose
    tp plan is marked ``source``: ``"inferred"`` (a refused plan gives way to the next guess
    inferred from the modules) or ``"declared"`` (transformers' plan with entries dropped:
    checked the same way, refused with no other guess). The error, or the plan it runs with."""
    from hf_scale.model_plans import resolve_plan
    from hf_scale.model_plans.from_hf import PRUNED, with_inferred_tp

    model = tiny_model(arch, "causal")
    plan = with_inferred_tp(model, resolve_plan(model), 0)
    plan = plan.replace(tp_plan={**plan.tp_plan, **changes},
                        source={**plan.source, "tp_plan": PRUNED if source == "declared" else source})
    try:
        model = hf_scale.parallelize(model, {"tp": 2}, plan=plan)
    except hf_scale.HfScaleError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    used = hf_scale.get_state(model).plan
    return {"source": dict(used.source), "tp_plan": dict(used.tp_plan)}


class _InPlaceOutputs(torch.nn.Module):
    """Changes each sharded layer's output in place, as CTRL (``inputs_embeds *= sqrt(d)``) and
    Llama 4 (``out.add_(...)`` after a row-parallel ``down_proj``) do."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, ids):
        h = self.emb(ids)
        h *= 2.0
        u = self.up(h)
        u.mul_(0.5)
        d = self.down(u)
        d.add_(1.0)
        return d.square().sum()


class _MultiQuery(torch.nn.Module):
    """A fused ``[q (4 heads of 2); k (1 head); v (1 head)]`` projection, multi-query attention
    over the heads, and a row-parallel output projection: Falcon's / GPTBigCode's layout."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.o = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 12), torch.nn.Linear(8, 8)

    def forward(self, ids):
        h = self.qkv(self.emb(ids))
        q, k, v = h[..., :-4], h[..., -4:-2], h[..., -2:]
        heads = q.unflatten(-1, (-1, 2))
        att = (heads * k.unsqueeze(-2)).sum(-1, keepdim=True).sigmoid() * v.unsqueeze(-2)
        return self.o(att.flatten(-2)).square().sum()


MODULE_CHECKS = {
    "inplace": (_InPlaceOutputs, {"emb": "embedding_rowwise", "up": "colwise", "down": "rowwise"}),
    "multi_query": (_MultiQuery, {"qkv": "colwise_replicated_kv:4", "o": "rowwise"}),
}


def module_check(which: str) -> dict:
    """Loss and gradients of a small module of :data:`MODULE_CHECKS` sharded with its styles,
    against one process: :class:`_InPlaceOutputs` (a sharded layer's output may be changed in
    place), :class:`_MultiQuery` (k/v heads kept whole while q is split)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_scale.parallel.tp import apply_tp

    make, styles = MODULE_CHECKS[which]
    torch.manual_seed(0)
    whole = make()
    sharded = copy.deepcopy(whole)
    ids = torch.tensor([[1, 5, 9, 14], [2, 3, 11, 15]])
    whole(ids).backward()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    apply_tp(sharded, mesh, styles)
    try:
        loss = sharded(ids)
        loss.backward()
    except RuntimeError as e:
        return {"error": str(e)[:300]}
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    grads = {n: float((full(p.grad) - dict(whole.named_parameters())[n].grad).abs().max())
             for n, p in sharded.named_parameters()}
    return {"loss": float((full(loss) - whole(ids)).abs().detach()), "grads": grads}


def world_checks(parity_cases: list[dict], gen_cases: list[dict], extra: dict) -> dict:
    """All tp checks of one world size, in one process group."""
    out = {"parity": run_cases(parity_cases), "generate": [generate_case(c) for c in gen_cases]}
    for key, (fn, args, kwargs) in extra.items():  # name -> (function of this module, args, kwargs)
        out[key] = globals()[fn](*args, **kwargs)
    out["rank"] = int(os.environ["RANK"])
    return out

