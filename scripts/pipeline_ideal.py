"""A pipeline schedule's ideal step time from its stages' compute times (pure arithmetic).

Inputs: each stage's time on one microbatch, forward ``F``, backward to the stage's input ``B``
and the weight gradients ``W`` (``t = F + B + W``); ``m`` microbatches, ``p`` pp ranks, ``v``
stages per rank, ``T_r`` = the sum of ``t`` over rank r's stages. Communication counts as free.

:func:`ideal_step`, the papers' formulas:

* gpipe, 1f1b: ``(m + p - 1) * max t``, i.e. ``(m + p - 1) / m`` x the slowest stage's time for
  the whole batch (GPipe, Huang et al. 2019, arXiv:1811.06965 sec. 2.3; 1F1B keeps GPipe's
  bubble, fraction ``(p - 1) / m``: Narayanan et al. 2021, arXiv:2104.04473 sec. 2.2.1).
* interleaved_1f1b: ``m * max T_r + (p - 1) * max t``: with equal stages the bubble shrinks by
  v, fraction ``(p - 1) / (v m)`` (Narayanan et al. 2021 sec. 2.2.2).
* zero_bubble (torch's ``ScheduleInterleavedZeroBubble``, the paper's ZB1P): ``m * max T_r +
  (p - 1) * max(F + B - W)``: ZB-H1's bubble ``(p - 1)(T_F + T_B - T_W)`` (Qi et al. 2024,
  "Zero Bubble Pipeline Parallelism", arXiv:2401.10241 sec. 2, table 2), with per-stage times.
* zbv: ``m * max T_r + (p - 1) * max(F + B - 2W, 0)``: ZB-H2's bubble ``(p - 1)(T_F + T_B -
  2 T_W)`` (same table), which ZB-V reaches with 1F1B's memory (sec. 6: no bubble when
  T_F = T_B = T_W).

:func:`simulate` replays a schedule's own action order (:func:`action_orders`: torch's
``pipeline_order`` for the multi-stage schedules, GPipe's and torch's 1F1B order for the
others) with given stage times: every action starts as soon as its rank is free and its inputs
exist. With equal stages it gives the formulas (zbv: torch's order keeps up to one stage's
forward of the bubble at m = 8, p = 2); with unequal ones it is exact where the formulas take
the slowest stage throughout.

Usage::

    ideal_step("1f1b", m=8, p=2, f=[.1, .1], b=[0, .1], w=[.2, .1])
    simulate(action_orders("zbv", m=8, p=2), f, b, w)      # 4 stages: lists of 4
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble"}


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI else 1


def stage_ranks(schedule: str, p: int) -> list[int]:
    """pp rank of each stage: a loop (stage s on rank s % p), a V for zbv (r and 2p - 1 - r)."""
    n = p * stages_per_rank(schedule)
    if schedule == "zbv":
        return [s if s < p else 2 * p - 1 - s for s in range(n)]
    return [s % p for s in range(n)]


def ideal_step(schedule: str, m: int, p: int, f: list[float], b: list[float], w: list[float]) -> float:
    """The schedule's step time with free communication, from each stage's per-microbatch
    forward ``f``, input-gradient ``b`` and weight-gradient ``w`` times (formulas: module doc)."""
    t = [x + y + z for x, y, z in zip(f, b, w)]
    if schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * max(t)
    per_rank = [0.0] * p
    for s, r in enumerate(stage_ranks(schedule, p)):
        per_rank[r] += t[s]
    if schedule == "interleaved_1f1b":
        bubble = max(t)
    elif schedule == "zero_bubble":
        bubble = max(x + y - z for x, y, z in zip(f, b, w))
    elif schedule == "zbv":
        bubble = max(x + y - 2 * z for x, y, z in zip(f, b, w))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; one of {SCHEDULES}")
    return m * max(per_rank) + (p - 1) * max(bubble, 0.0)


def action_orders(schedule: str, m: int, p: int) -> list[list[tuple[int, str, int]]]:
    """Each rank's compute actions ``(stage, kind, microbatch)`` in the order the schedule runs
    them; kind ``F`` forward, ``B`` full backward, ``I`` input gradient, ``W`` weight gradient."""
    if schedule == "gpipe":
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    if schedule == "1f1b":  # torch's Schedule1F1B: p - r forwards, then one backward, one forward
        orders = []
        for r in range(p):
            warm = min(m, p - r)
            ops = [(r, "F", i) for i in range(warm)]
            for i in range(m):
                ops.append((r, "B", i))
                if warm + i < m:
                    ops.append((r, "F", warm + i))
            orders.append(ops)
        return orders
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    orders = get_schedule_ops(getattr(schedules, MULTI[schedule]), p, m, stages_per_rank(schedule))
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index) for a in ops
             if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for ops in orders]


def simulate(orders: list[list[tuple[int, str, int]]], f: list[float], b: list[float],
             w: list[float]) -> float:
    """When the last rank finishes if each runs its actions in order, each as soon as its inputs
    exist (forward: the previous stage's forward; backward: this stage's forward and the next
    stage's backward; weights: this stage's input gradient) and communication is free."""
    last = len(f) - 1
    cost = {"F": f, "B": [x + y for x, y in zip(b, w)], "I": b, "W": w}
    done: dict[tuple[int, str, int], float] = {}
    clock, nxt = [0.0] * len(orders), [0] * len(orders)
    while any(n < len(ops) for n, ops in zip(nxt, orders)):
        moved = False
        for r, ops in enumerate(orders):
            while nxt[r] < len(ops):
                s, kind, i = ops[nxt[r]]
                if kind == "F":
                    needs = [(s - 1, "F", i)] if s > 0 else []
                elif kind == "W":
                    needs = [(s, "I", i)]
                else:
                    needs = [(s, "F", i)] + ([(s + 1, "I", i)] if s < last else [])
                if any(n not in done for n in needs):
                    break
                clock[r] = max([clock[r]] + [done[n] for n in needs]) + cost[kind][s]
                done[(s, "I" if kind in "BI" else kind, i)] = clock[r]
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"the action orders deadlock: {[ops[n:n + 1] for n, ops in zip(nxt, orders)]}")
    return max(clock)
