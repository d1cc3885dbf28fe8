"""scripts/pipeline_ideal.py, bench_pipeline.py's arithmetic: each schedule's ideal step time
(the papers' formulas) and the replay of its action order with given stage times agree where
they must."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from pipeline_ideal import (
    SCHEDULES,
    action_orders,
    ideal_step,
    simulate,
    stage_ranks,
    stages_per_rank,
)


def equal_stages(schedule: str, p: int, f: float, b: float, w: float):
    """Per-stage times when one rank's share of the model (f, b, w) is cut into v equal stages."""
    v = stages_per_rank(schedule)
    return [f / v] * (p * v), [b / v] * (p * v), [w / v] * (p * v)


def test_stage_placement():
    assert stage_ranks("1f1b", 4) == [0, 1, 2, 3]
    assert stage_ranks("interleaved_1f1b", 2) == [0, 1, 0, 1]
    assert stage_ranks("zero_bubble", 2) == [0, 1, 0, 1]
    assert stage_ranks("zbv", 2) == [0, 1, 1, 0]  # a V: rank 0 holds the first and the last stage


@pytest.mark.parametrize("m,p", [(8, 2), (4, 4), (12, 3)])
def test_gpipe_and_1f1b_bubble(m, p):
    """(m + p - 1) x the slowest stage's time per microbatch: bubble fraction (p - 1) / m."""
    f, b, w = [1.0] * p, [1.5] * p, [0.5] * p
    f[p // 2] = 2.0  # the slowest stage sets the pace
    for schedule in ("gpipe", "1f1b"):
        assert ideal_step(schedule, m, p, f, b, w) == pytest.approx((m + p - 1) * 4.0)
        assert ideal_step(schedule, m, p, f, b, w) / (m * 4.0) - 1 == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("m,p", [(8, 2), (8, 4)])
def test_interleaved_bubble_shrinks_by_v(m, p):
    f, b, w = equal_stages("interleaved_1f1b", p, 1.0, 1.5, 0.5)
    per_rank = 3.0  # every rank's stages per microbatch
    bubble = ideal_step("interleaved_1f1b", m, p, f, b, w) / (m * per_rank) - 1
    assert bubble == pytest.approx((p - 1) / (2 * m))  # Narayanan et al.: (p - 1) / (v m), v = 2


def test_zero_bubble_formulas():
    m, p = 8, 2
    f, b, w = equal_stages("zero_bubble", p, 1.0, 1.0, 1.0)  # T_F = T_B = T_W = 0.5 per stage
    # ZB-H1: (p - 1)(T_F + T_B - T_W) = 1 x 0.5 beyond m x 3
    assert ideal_step("zero_bubble", m, p, f, b, w) == pytest.approx(m * 3.0 + 0.5)
    assert ideal_step("zbv", m, p, f, b, w) == pytest.approx(m * 3.0)  # ZB-V: no bubble at all
    f, b, w = equal_stages("zbv", p, 1.0, 2.0, 0.4)  # F + B - 2W = 2.2 per rank: 1.1 per stage
    assert ideal_step("zbv", m, p, f, b, w) == pytest.approx(m * 3.4 + 1.1)
    f, b, w = equal_stages("zbv", p, 1.0, 1.0, 3.0)  # weight gradients longer than F + B: clipped
    assert ideal_step("zbv", m, p, f, b, w) == pytest.approx(m * 5.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        ideal_step("looped_bfs", m, p, f, b, w)


@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 0.2)])
def test_replaying_the_schedule_gives_the_formula_for_equal_stages(times):
    """Each schedule's own action order (torch's, for the multi-stage ones) run with equal stage
    times and free communication takes what the formula says (zbv: torch's order at m = 8,
    p = 2 keeps up to one stage's forward of the bubble that ZB-V removes)."""
    m, p = 8, 2
    for schedule in SCHEDULES:
        f, b, w = equal_stages(schedule, p, *times)
        replayed = simulate(action_orders(schedule, m, p), f, b, w)
        formula = ideal_step(schedule, m, p, f, b, w)
        if schedule == "zbv":
            assert formula - 1e-9 <= replayed <= formula + f[0] * (p - 1) + 1e-9
        else:
            assert replayed == pytest.approx(formula), schedule


def test_replay_by_hand():
    """GPipe, 2 stages, 2 microbatches; stage 1 twice as slow forward. Rank 0: F0 0-1, F1 1-2;
    rank 1: F0 1-3, F1 3-5, B0 5-6, B1 6-7; rank 0: B0 6-7, B1 7-8. The formula (slowest stage
    all along) gives 3 x 3 = 9."""
    f, b, w = [1.0, 2.0], [1.0, 1.0], [0.0, 0.0]
    assert simulate(action_orders("gpipe", 2, 2), f, b, w) == pytest.approx(8.0)
    assert ideal_step("gpipe", 2, 2, f, b, w) == pytest.approx(9.0)
    # weight gradients wait for their own stage's input gradient only
    orders = [[(0, "F", 0), (0, "I", 0), (0, "W", 0)], [(1, "F", 0), (1, "I", 0), (1, "W", 0)]]
    assert simulate(orders, [1.0, 1.0], [1.0, 1.0], [5.0, 5.0]) == pytest.approx(9.0)  # 0: F 0-1, I 3-4, W 4-9
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[(0, "I", 0), (0, "F", 0)], [(1, "F", 0), (1, "I", 0)]], [1.0] * 2, [1.0] * 2, [0.0] * 2)
