"""A learning-rate scheduler's state in a form that does not depend on the layout.

torch's schedulers keep lists with one entry per optimizer param group (``base_lrs``,
``_last_lr``, ``lr_lambdas``, ...), and how many groups ``build_optimizer`` makes depends on the
layout: it splits each group by kind (sharded DTensors per mesh, plain tensors), so fsdp gives 2
where ep gives 3 and tp 4. Saved as is, a scheduler resumed at another layout failed inside
torch (``IndexError`` / ``zip() argument 2 is shorter``). Saved here, each list keeps one entry
per *merged* group (groups of equal settings, as the optimizer state is saved:
:func:`~.param_groups.merge_equal_groups`) and is spread back over the loading optimizer's
groups by the same merge. Merged groups are matched by position (``build_optimizer`` keeps its
groups' order at every layout, splitting each in place); a group whose loaded ``initial_lr``
is not the saved base rate of its position is refused rather than given another's schedule::

    info["scheduler"] = scheduler_state(scheduler, optimizer)       # save
    load_scheduler_state(scheduler, optimizer, info["scheduler"])   # load, at any layout
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import HfScaleCheckpointError
from .param_groups import merge_equal_groups

# torch's per-group scheduler fields (LambdaLR, MultiplicativeLR, CyclicLR, ReduceLROnPlateau,
# every LRScheduler's base and last rates); chained and sequential schedulers nest theirs
PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs")
NESTED = "_schedulers"
MARK = "hf_scale_merged_groups"


def scheduler_state(scheduler, optimizer) -> dict[str, Any]:
    """``scheduler.state_dict()`` with each per-group list cut to one entry per merged group."""
    index = _merged_index(optimizer)
    first = {}
    for group, merged in enumerate(index):
        first.setdefault(merged, group)
    firsts = [first[m] for m in range(len(first))]
    state = _per_group(scheduler.state_dict(), len(index), lambda values: [values[g] for g in firsts])
    return {**state, MARK: len(firsts)}


def load_scheduler_state(scheduler, optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved`` (from :func:`scheduler_state`, or a raw ``state_dict`` of an older
    checkpoint) into ``scheduler``, whose optimizer may group its parameters otherwise."""
    index = _merged_index(optimizer)
    if MARK not in saved:  # written before this module: as torch saved it, one entry per group
        state = saved
        lengths = {len(v) for k, v in saved.items() if k in PER_GROUP and isinstance(v, list)}
        if lengths - {len(optimizer.param_groups)}:
            _misfit(scheduler, optimizer, f"lists of {sorted(lengths)} entries")
    elif saved[MARK] != 1 + max(index, default=-1):
        raise HfScaleCheckpointError(
            f"the scheduler state was saved for {saved[MARK]} parameter group(s) of distinct settings, "
            f"this optimizer has {1 + max(index, default=-1)}: build the optimizer with the same groups "
            "(the same weight decay, learning rates), or resume without the scheduler and build a new one."
        )
    else:
        state = _per_group({k: v for k, v in saved.items() if k != MARK}, saved[MARK],
                           lambda values: [values[m] for m in index])
        _check_base_rates(optimizer, state.get("base_lrs"))
    try:
        scheduler.load_state_dict(state)
    except (IndexError, ValueError, KeyError) as e:
        _misfit(scheduler, optimizer, f"{type(e).__name__}: {e}")


def _misfit(scheduler, optimizer, why: str) -> NoReturn:
    raise HfScaleCheckpointError(
        f"the saved scheduler state does not fit {type(scheduler).__name__} over "
        f"{len(optimizer.param_groups)} parameter group(s) ({why}): resume with the optimizer "
        "and scheduler it was saved with, or without the scheduler."
    ) from None


def _check_base_rates(optimizer, base_lrs: list | None) -> None:
    """Each group's ``initial_lr`` (restored with the optimizer state) is the base rate the
    schedule resumes it from: otherwise the groups were matched to the wrong saved ones."""
    if not isinstance(base_lrs, list):
        return
    for i, (group, base) in enumerate(zip(optimizer.param_groups, base_lrs)):
        if "initial_lr" in group and group["initial_lr"] != base:
            raise HfScaleCheckpointError(
                f"param group {i} starts its schedule at initial_lr={group['initial_lr']}, but the saved "
                f"scheduler has base rate {base} at its position: the optimizer's groups are in another "
                "order than when saved. Build the optimizer as it was (hf_scale.build_optimizer keeps "
                "the order), or resume without the scheduler."
            )


def _merged_index(optimizer) -> list[int]:
    """For each of the optimizer's param groups, the index of its merged group."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]}
              for i, g in enumerate(optimizer.param_groups)]
    merged = merge_equal_groups({"param_groups": groups})["param_groups"]
    return [next(m for m, group in enumerate(merged) if i in group["params"]) for i in range(len(groups))]


def _per_group(state: dict[str, Any], groups: int, change: Callable[[list], list]) -> dict[str, Any]:
    """``state`` with ``change`` applied to each per-group list of ``groups`` entries (nested
    schedulers' too)."""
    out = {}
    for key, value in state.items():
        if key in PER_GROUP and isinstance(value, list) and len(value) == groups:
            value = change(value)
        elif key == NESTED and isinstance(value, list):
            value = [_per_group(v, groups, change) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out
