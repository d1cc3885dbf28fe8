"""Rank-side checks for checkpoints of pipeline-parallel layouts (run by test_pp_checkpoint.py).

Each function runs on every rank of one spawn and returns plain data for the test to judge.
Under pp a rank holds only its stages' parameters, so every collective here runs over a
tensor's own mesh (``full_tensor`` over the stage's data-parallel ranks), never over names
that differ between ranks. Data is sharded by the data-parallel coordinate: the ranks of one
pipeline see the same batch.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
import torch.distributed as dist

import hf_scale
from tests.distributed.write_observer import observed_pwrites
from tests.tiny_models import AUTO, slice_batch, tiny_batch, tiny_config, tiny_model

PP2 = {"pp": 2}
PP2_FSDP2 = {"pp": 2, "strategy": "fsdp"}
ZBV = {"pp": 2, "pp_schedule": "zbv"}  # 4 stages as a V: rank 0 holds the first and the last
ARCHS = ("llama", "gpt2")  # tied embeddings both: the head on the last stage, its source on the first
TOTAL = 4  # training steps of the resume checks; the checkpoint is taken after TOTAL // 2


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny causal LM of ``arch``; ``llama4``: tiny Llama with 4 blocks (room for 4 stages)."""
    if arch != "llama4":
        return tiny_model(arch, "causal", seed=seed)
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(seed)
    return AUTO["causal"].from_config(config)


def _dp(model) -> tuple[int, int]:
    state = hf_scale.get_state(model)
    return (state.dp_rank, state.dp_degree) if state else (0, 1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (a collective over the DTensor's own mesh: one stage's ranks)."""
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().float().cpu().clone()


def holding(model) -> dict:
    """What this rank holds: parameter names, their global element count, the blocks it holds
    and the blocks the layout gives its stages, and any parameter left on the meta device."""
    state = hf_scale.get_state(model)
    names = [n for n, _ in model.named_parameters()]
    out = {"names": names, "numel": sum(p.numel() for p in model.parameters()),
           "meta_left": [n for n, p in model.named_parameters() if p.is_meta],
           "pp_rank": state.pp_rank if state else 0}
    if state is not None and state.pipeline is not None:
        layout = state.pipeline.layout
        pattern = re.compile(re.escape(layout.blocks) + r"\.(\d+)\.")
        out["blocks"] = sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})
        out["layout_blocks"] = sorted(b for s in layout.stages_of(state.pp_rank) for b in layout.stage_blocks[s])
    return out


def params(model) -> dict:
    """This rank's parameters, whole, by name (collective over each stage's ranks)."""
    from hf_scale.checkpoint.safetensors_io import reshard_all

    reshard_all(model)
    return {n: _whole(p) for n, p in model.named_parameters()}


# ------------------------------------------------------------------ save / from_pretrained


def save_and_load(root: str, plain: dict[str, str], config: dict, archs=ARCHS) -> dict:
    """Per arch: save as built (writes observed), from_pretrained with ``config`` (what each rank
    holds, the loss of a batch), one AdamW step, save again (the parameters saved)."""
    out = {}
    for arch in archs:
        model = hf_scale.parallelize(build(arch), config)
        with observed_pwrites() as writes:
            folder = hf_scale.save_pretrained(model, os.path.join(root, f"{arch}-built"), max_shard_size=6000)
        result = {"built": str(folder), "writes": writes, "built_holding": holding(model)}
        loaded = hf_scale.from_pretrained(plain[arch], parallel=config)
        result["holding"] = holding(loaded)
        result["loaded"] = params(loaded)
        dp_rank, dp_degree = _dp(loaded)
        optimizer = hf_scale.build_optimizer(loaded, lr=1e-2)
        # the loss of the loaded weights (train_step: eval_step first under zbv fails in torch 2.13's
        # runtime schedule, which runs backward actions in eval)
        batch = slice_batch(tiny_batch("causal", 4, seed=7), dp_rank, dp_degree)
        result["loss"], result["dp"] = float(hf_scale.train_step(loaded, batch)), (dp_rank, dp_degree)
        optimizer.step()
        result["trained"] = params(loaded)
        result["saved"] = str(hf_scale.save_pretrained(loaded, os.path.join(root, f"{arch}-trained")))
        out[arch] = result
    return out


# ------------------------------------------------------------------ resume and reshard


def snapshot(model, optimizer) -> dict:
    """This rank's parameters and optimizer state, whole, by name (collective)."""
    from hf_scale.checkpoint.training_state import optimizer_state

    state = optimizer_state(model, optimizer)
    optim = {name: {k: _whole(v) for k, v in sorted(values.items()) if torch.is_tensor(v)}
             for name, values in state["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return {"params": params(model), "optim": optim, "groups": groups}


def _setup(arch: str, config, seed: int):
    model = hf_scale.parallelize(build(arch, seed), config)
    optimizer = hf_scale.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, first: int, last: int) -> list[float]:
    """Steps ``first`` .. ``last - 1``; step s trains on global batch s, sliced by dp rank; the
    loss of the global batch (every dp slice has as many label tokens)."""
    dp_rank, dp_degree = _dp(model)
    losses = []
    for step in range(first, last):
        loss = hf_scale.train_step(model, slice_batch(tiny_batch("causal", 4, seed=300 + step), dp_rank, dp_degree))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the ranks of one pipeline hold the same loss
        losses.append(float(loss))
    return losses


def straight(arch: str, config) -> list[float]:
    return _train(*_setup(arch, config, seed=0), 0, TOTAL)


def first_half(arch: str, config, root: str, through: int = TOTAL // 2) -> dict:
    """Train TOTAL // 2 steps, save the training state; go on ``through`` the given step."""
    from hf_scale.checkpoint.training_state import _state_nbytes, optimizer_state

    model, optimizer, scheduler = _setup(arch, config, seed=0)
    losses = _train(model, optimizer, scheduler, 0, TOTAL // 2)
    # the free-space check's estimate of what the save writes beside the model (rank 0's is used)
    estimate = _state_nbytes(optimizer_state(model, optimizer), sharded_plain=False,
                             stages=hf_scale.get_state(model).pp_degree)
    folder = hf_scale.save_state(model, optimizer, scheduler=scheduler, root=root, step=TOTAL // 2)
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "model" not in p.parts)
    state = snapshot(model, optimizer)
    return {"losses": losses + _train(model, optimizer, scheduler, TOTAL // 2, through), "state": state,
            "estimate": estimate, "written": written}


def second_half(arch: str, config, root: str) -> dict:
    model, optimizer, scheduler = _setup(arch, config, seed=99)  # another init: it must be overwritten
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saved by N ranks": RNG streams start fresh (unused here)
        step = hf_scale.load_state(model, optimizer, scheduler=scheduler, path=os.path.join(root, "latest"))
    state = snapshot(model, optimizer)
    return {"step": step, "state": state, "losses": _train(model, optimizer, scheduler, step, TOTAL)}


def world4(root: str, plain: dict[str, str]) -> dict:
    """pp2 x fsdp2: save / load of Llama and GPT-2; training state resumed at the same layout
    and resharded into fsdp4."""
    saved = os.path.join(root, "pp2-fsdp2")
    return {
        "save": save_and_load(root, plain, PP2_FSDP2),
        "straight_pp2_fsdp2": straight("llama", PP2_FSDP2),
        "straight_fsdp4": straight("llama", {"strategy": "fsdp"}),
        "first": first_half("llama", PP2_FSDP2, saved),
        "same": second_half("llama", PP2_FSDP2, saved),
        "fsdp4": second_half("llama", {"strategy": "fsdp"}, saved),
        "root": saved,
        "rank": int(os.environ["RANK"]),
    }


def world2(root: str, plain: dict[str, str]) -> dict:
    """pp2 alone (whole tensors, one owner each): save / load of Llama; GPT-2's training state
    resharded pp2 -> fsdp2 (and, in the test's process, pp2 -> one process) and fsdp2 -> pp2
    (a checkpoint without the head's own optimizer state: it is the embedding's). A 4-block
    Llama under zbv (rank 0 holds both ends of the tie): save / load, fsdp2 -> zbv."""
    saved, from_fsdp = os.path.join(root, "pp2"), os.path.join(root, "fsdp2")
    return {
        "save": {**save_and_load(root, plain, PP2, archs=("llama",)), **save_and_load(root, plain, ZBV, archs=("llama4",))},
        "fsdp2_llama4": first_half("llama4", {"strategy": "fsdp"}, os.path.join(root, "fsdp2-llama4"), through=TOTAL),
        "zbv_from_fsdp2": second_half("llama4", ZBV, os.path.join(root, "fsdp2-llama4")),
        "straight_pp2": straight("gpt2", PP2),
        "straight_fsdp2": straight("gpt2", {"strategy": "fsdp"}),
        "first": first_half("gpt2", PP2, saved),
        "fsdp2": second_half("gpt2", {"strategy": "fsdp"}, saved),
        "first_fsdp2": first_half("gpt2", {"strategy": "fsdp"}, from_fsdp),
        "pp2_from_fsdp2": second_half("gpt2", PP2, from_fsdp),
        "root": saved,
    }
