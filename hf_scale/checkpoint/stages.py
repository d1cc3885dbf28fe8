"""Checkpoints of a pipeline-parallel model: each rank holds only its stages' tensors.

Under pipeline parallel (``pp > 1``) a rank's ``state_dict()`` names only the parameters of its
own stages (names unchanged: ``model.layers.17.mlp.up_proj.weight``). Saving and loading need
three things the other layouts get for free:

* one list of the checkpoint's tensors on every rank: each rank's names, shapes and dtypes are
  all-gathered once (:func:`global_specs`) and merged in the model's order, with the ranks that
  hold each tensor (a replicated tensor is written by one of its holders);
* the tied head: ``plan.tied_weights`` (from the unpruned model) still names it, but on the last
  stage it is a parameter of its own (or an untied copy where one rank holds both ends). The
  tie target is never written (the rank holding the source writes it) and is read back from
  the source's key (:func:`tie_aliases`), in the safetensors and in the optimizer state;
* optimizer param groups: DCP keeps one rank's copy of a non-tensor value, so each group's
  ``params`` list is saved as the union over all ranks (:func:`union_param_groups`); otherwise
  a stage resumed from another stage's list would find none of its parameters in it.

Usage (inside save / load; every function is a no-op without pp)::

    specs, holders = global_specs(model, local_specs, sharded_names)   # collective, pp only
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import HfScaleCheckpointError
from ..parallel_state import get_state
from ..ranks import gather, rank_world
from .shard_layout import TensorSpec


def pipelined(model: nn.Module) -> bool:
    """True for a model parallelized with ``pp > 1`` (its ranks hold different tensors)."""
    state = get_state(model)
    return state is not None and state.pp_degree > 1


def tie_aliases(model: nn.Module) -> dict[str, str]:
    """``{tie target: source}`` from the plan (e.g. ``lm_head.weight -> model.embed_tokens.weight``).

    Names come from the unpruned model, so they hold under pp where the two ends are separate
    parameters on separate ranks. Empty for a model that was not parallelized."""
    state = get_state(model)
    return dict(state.plan.tied_weights) if state is not None else {}


def global_specs(
    model: nn.Module, local: list[TensorSpec], sharded: set[str]
) -> tuple[list[TensorSpec], dict[str, list[int]]]:
    """Collective (one ``all_gather_object``): every rank's tensors -> the checkpoint's tensors,
    identical on every rank, and ``{name: ranks holding it whole}`` for the tensors that are not
    sharded (DTensor shards say themselves which rank writes which bytes).

    The order is the model's: by pipeline stage, then by the holding rank's module order
    (embeddings, blocks by index, final norm, head). Two ranks naming one tensor with different
    shapes or dtypes is an error.
    """
    rank = rank_world()[0]
    keys = stage_keys(model, [s.name for s in local])
    mine = [(s.name, tuple(s.shape), s.dtype, s.name in sharded, key) for s, key in zip(local, keys)]
    specs: dict[str, TensorSpec] = {}
    order: dict[str, tuple[int, int]] = {}
    holders: dict[str, list[int]] = {}
    for r, entries in gather([(rank, mine)]):
        for name, shape, dtype, is_sharded, key in entries:
            spec = TensorSpec(name, shape, dtype)
            if specs.setdefault(name, spec) != spec:
                raise HfScaleCheckpointError(
                    f"ranks disagree on {name!r}: {specs[name].shape} {specs[name].dtype} vs "
                    f"{spec.shape} {spec.dtype} on rank {r}. Every rank must save the same model."
                )
            order.setdefault(name, key)
            if not is_sharded:
                holders.setdefault(name, []).append(r)
    return [specs[n] for n in sorted(specs, key=order.__getitem__)], holders


def stage_keys(model: nn.Module, names: list[str]) -> list[tuple[int, int]]:
    """``(stage, position)`` of each of this rank's checkpoint names (in module order): a block's
    stage from the layout; a name before this rank's first block is the first stage's
    (embeddings), one after a block the last stage's (final norm, head)."""
    layout = get_state(model).pipeline.layout
    stage_of = {b: s for s, blocks in enumerate(layout.stage_blocks) for b in blocks}
    prefix, last = layout.blocks + ".", len(layout.stage_blocks) - 1
    keys, seen_block = [], False
    for position, name in enumerate(names):
        if name.startswith(prefix):
            seen_block = True
            keys.append((stage_of[int(name[len(prefix):].split(".", 1)[0])], position))
        else:
            keys.append((last if seen_block else 0, position))
    return keys


def owners(specs: list[TensorSpec], holders: dict[str, list[int]]) -> dict[str, int]:
    """Owner rank of each whole (unsharded) tensor, among the ranks that hold it, balancing
    the bytes each rank writes. Identical on every rank (computed from gathered data)."""
    load: dict[int, int] = {}
    out = {}
    for spec in sorted((s for s in specs if s.name in holders), key=lambda s: -s.nbytes):
        owner = min(holders[spec.name], key=lambda r: (load.get(r, 0), r))
        out[spec.name] = owner
        load[owner] = load.get(owner, 0) + spec.nbytes
    return out


def union_param_groups(state: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    """Collective under pp: ``state`` (a name-keyed optimizer state dict) whose param groups
    list, each, the names of that group on every rank (less ``dropped``, the tie targets, which
    a one-process optimizer does not name). The groups' other values must agree across ranks
    (they are saved once)."""
    mine = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    parts = gather([(mine, [list(g["params"]) for g in state["param_groups"]])])
    longest = max(parts, key=lambda p: len(p[0]))[0]
    for values, _ in parts:
        if any(_comparable(a) != _comparable(b) for a, b in zip(values, longest)):
            raise HfScaleCheckpointError(
                "the optimizer's param groups differ between pipeline stages (group "
                f"settings {values} vs {longest}): build the optimizer with the same groups "
                "and settings on every rank (hf_scale.build_optimizer does)."
            )
    groups = []
    for i, group in enumerate(state["param_groups"]):
        names = dict.fromkeys(n for _, lists in parts if i < len(lists) for n in lists[i] if n not in dropped)
        groups.append({**group, "params": list(names)})
    return {**state, "param_groups": groups}


def _comparable(values: dict) -> dict:
    return {k: v for k, v in values.items() if not hasattr(v, "shape")}


def borrow_tied_state(model: nn.Module, optim_state: dict[str, Any], saved_keys: set[str]) -> Callable[[], None]:
    """Prepare ``optim_state`` (a name-keyed optimizer state, the target of a DCP load) for a
    checkpoint that has no entries for a tie target this rank holds: one saved without pipeline
    parallel, where the head *is* the embedding and only the source's state was saved. The
    target's entries are requested under the source's name (or, where this rank holds the
    source too, copied from it after loading). Returns the function to call after the load,
    which puts the entries back under the target's name."""
    states, after = optim_state["state"], []
    for target, source in tie_aliases(model).items():
        values = states.get(target)
        if values is None or all(f"optimizer.state.{target}.{k}" in saved_keys for k in values):
            continue
        del states[target]
        if source in states:
            after.append(lambda t=target, s=source, v=values: states.__setitem__(t, _copied(v, states[s])))
        else:
            states[source] = values
            after.append(lambda t=target, s=source: states.__setitem__(t, states.pop(s)))

    def restore() -> None:
        for step in after:
            step()

    return restore


def _copied(into: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    for key, value in source.items():
        if hasattr(into.get(key), "copy_"):
            into[key].copy_(value)
        else:
            into[key] = value
    return into
