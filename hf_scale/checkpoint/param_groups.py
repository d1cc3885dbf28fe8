"""Optimizer param groups in a form that does not depend on the layout.

``build_optimizer`` splits each param group by kind (sharded DTensors per mesh, plain tensors),
so how many groups an optimizer has depends on the layout. Checkpoints keep one group per set of
distinct settings (:func:`merge_equal_groups`); loading spreads them back over the optimizer's
own groups (:func:`regroup`). The optimizer state (:mod:`.training_state`) and the scheduler
state (:mod:`.scheduler_state`) both use them.
"""

from __future__ import annotations

from typing import Any


def merge_equal_groups(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with param groups of equal settings merged into one (their parameter names
    joined, in order). How many groups an optimizer has depends on the layout (tensor parallel
    keeps sharded and whole parameters in groups apart); the merged list does not, so a
    checkpoint resumes at any layout. Loading maps each group back by its parameters' names."""
    merged: list[dict] = []
    for group in state["param_groups"]:
        settings = {k: v for k, v in group.items() if k != "params"}
        same = next((g for g in merged if {k: v for k, v in g.items() if k != "params"} == settings), None)
        if same is None:
            merged.append({**settings, "params": list(group["params"])})
        else:
            same["params"] = same["params"] + [p for p in group["params"] if p not in same["params"]]
    return {**state, "param_groups": merged}


def regroup(loaded: list[dict], current: list[dict]) -> list[dict]:
    """The optimizer's own groups (``current``, parameter names), each with the settings loaded
    into the merged group it belongs to (``loaded`` has the shape of
    ``merge_equal_groups(current)``: the load target). A checkpoint written before groups were
    merged (two groups of equal settings saved apart) fills the merged group from its first
    such group, whose settings the others shared."""
    merged = merge_equal_groups({"param_groups": current})["param_groups"]
    out = []
    for group in current:
        index = next((i for i, m in enumerate(merged) if group["params"] and group["params"][0] in m["params"]), None)
        source = loaded[index] if index is not None and index < len(loaded) else group
        out.append({**{k: v for k, v in source.items() if k != "params"}, "params": group["params"]})
    return out
