"""Clipping and optimizer groups under pipeline parallel, run inside one process group.

Each rank trains one step of the tiny Llama (head tied to the input embedding) through
``model.train_step`` and reports: the norm :func:`hf_scale.clip_grad_norm_` gives for the model
(every stage, the tied weight once), the norm of this rank's gradients alone (what a stage sees
without the pp reduction), its gradients after clipping to half the norm, and the names in each
of :func:`hf_scale.build_optimizer`'s groups. Every data-parallel rank gets the whole batch, so
the averaged gradients are those of one process on that batch.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import hf_scale
from tests.tiny_models import CAUSAL, tiny_batch, tiny_config


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tiny_llama(layers: int) -> torch.nn.Module:
    """The tiny Llama (head tied to the embedding) with ``layers`` blocks."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def worker(config: dict, layers: int) -> dict:
    model = hf_scale.parallelize(tiny_llama(layers), config)
    state = hf_scale.get_state(model)
    batch = tiny_batch(CAUSAL, 4)
    batch["labels"][0, :5] = -100
    loss = model.train_step(batch)
    whole = float(hf_scale.clip_grad_norm_(model, float("inf")))  # no clipping: measures
    stage = float(hf_scale.clip_grad_norm_(list(model.parameters()), float("inf")))
    hf_scale.clip_grad_norm_(model, whole / 2)
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer = hf_scale.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {"decay": sorted(names[id(p)] for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]),
              "no_decay": sorted(names[id(p)] for g in optimizer.param_groups if not g["weight_decay"]
                                 for p in g["params"])}
    optimizer.step()  # a step on a pruned stage model runs
    return {"pp_rank": state.pp_rank, "dp_rank": state.dp_rank, "loss": float(loss), "whole": whole,
            "stage": stage, "grads": grads, "groups": groups}
