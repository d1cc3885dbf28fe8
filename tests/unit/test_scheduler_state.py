"""A scheduler saved over one grouping of the parameters resumes over another (the groups
build_optimizer makes depend on the layout: split by kind in place), each group on its own
schedule; a grouping it cannot map is refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_scale.checkpoint.scheduler_state import load_scheduler_state, scheduler_state
from hf_scale.errors import HfScaleCheckpointError


def _params():
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3)) for _ in range(3)]


def _optimizer(groups):
    return torch.optim.AdamW(groups)


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1 / (1 + s)] * len(optimizer.param_groups))


def _restore_settings(target, source):
    """What load_state's optimizer restore does first: each group takes the saved settings of
    the group its parameters were in."""
    by_param = {id(p): g for g in source.param_groups for p in g["params"]}
    for group in target.param_groups:
        group.update({k: v for k, v in by_param[id(group["params"][0])].items() if k != "params"})


def _saved(params, steps=3):
    """Two groups of distinct settings (as decay / no decay), stepped ``steps`` times."""
    a = _optimizer([{"params": params[:2], "lr": 1.0, "weight_decay": 0.1},
                    {"params": params[2:], "lr": 0.5, "weight_decay": 0.0}])
    schedule = _schedule(a)
    for _ in range(steps):
        a.step()
        schedule.step()
    return a, schedule, json.loads(json.dumps(scheduler_state(schedule, a)))  # as trainer_state.json holds it


def test_resumes_over_groups_split_by_kind():
    params = _params()
    a, schedule, saved = _saved(params)
    # the first group split in two in place (as build_optimizer splits DTensors from plain tensors)
    b = _optimizer([{"params": params[:1], "lr": 1.0, "weight_decay": 0.1},
                    {"params": params[1:2], "lr": 1.0, "weight_decay": 0.1},
                    {"params": params[2:], "lr": 0.5, "weight_decay": 0.0}])
    resumed = _schedule(b)
    _restore_settings(b, a)
    load_scheduler_state(resumed, b, saved)
    assert resumed.last_epoch == schedule.last_epoch == 3
    assert resumed.base_lrs == [1.0, 1.0, 0.5]
    assert resumed.get_last_lr() == pytest.approx([1.0 / 4, 1.0 / 4, 0.5 / 4])
    b.step()
    resumed.step()
    a.step()
    schedule.step()
    want = {id(p): g["lr"] for g in a.param_groups for p in g["params"]}
    assert [g["lr"] for g in b.param_groups] == pytest.approx([want[id(g["params"][0])] for g in b.param_groups])
    assert b.param_groups[0]["lr"] == pytest.approx(1.0 / 5)

    # and back: saved over 3 groups, resumed over the 2 merged ones
    again = json.loads(json.dumps(scheduler_state(resumed, b)))
    c = _optimizer([{"params": params[:2], "lr": 1.0, "weight_decay": 0.1},
                    {"params": params[2:], "lr": 0.5, "weight_decay": 0.0}])
    last = _schedule(c)
    _restore_settings(c, b)
    load_scheduler_state(last, c, again)
    assert last.get_last_lr() == pytest.approx([1.0 / 5, 0.5 / 5]) and last.last_epoch == 4


def test_groups_it_cannot_map_are_refused_clearly():
    params = _params()
    a, _, saved = _saved(params)
    # the same groups in another order: each would take the other's schedule
    swapped = _optimizer([{"params": params[2:], "lr": 0.5, "weight_decay": 0.0},
                          {"params": params[:2], "lr": 1.0, "weight_decay": 0.1}])
    schedule = _schedule(swapped)
    _restore_settings(swapped, a)
    with pytest.raises(HfScaleCheckpointError, match="another order than when saved"):
        load_scheduler_state(schedule, swapped, saved)
    # one group of settings fewer
    one = _optimizer([{"params": params, "lr": 1.0, "weight_decay": 0.1}])
    with pytest.raises(HfScaleCheckpointError, match="saved for 2 parameter group"):
        load_scheduler_state(_schedule(one), one, saved)


def test_a_raw_state_of_an_older_checkpoint_still_loads_and_a_misfit_one_is_refused():
    params = _params()
    a, schedule, _ = _saved(params)
    raw = schedule.state_dict()
    b = _optimizer([{"params": params[:2], "lr": 1.0, "weight_decay": 0.1},
                    {"params": params[2:], "lr": 0.5, "weight_decay": 0.0}])
    same = _schedule(b)
    load_scheduler_state(same, b, raw)
    assert same.last_epoch == 3
    three = _optimizer([{"params": [p], "lr": 1.0} for p in params])
    with pytest.raises(HfScaleCheckpointError, match="does not fit LambdaLR over 3 parameter group"):
        load_scheduler_state(_schedule(three), three, raw)
