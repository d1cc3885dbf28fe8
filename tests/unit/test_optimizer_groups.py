"""Optimizer param groups in training checkpoints: saved merged by equal settings, mapped back to
the optimizer's own groups by parameter name (so a run resumes at a layout that splits its
groups differently), and checkpoints written before the merge still load."""

from __future__ import annotations

from hf_scale.checkpoint.dcp_boxes import _merge
from hf_scale.checkpoint.param_groups import merge_equal_groups, regroup


def _group(names, lr=1e-3, wd=0.0):
    return {"lr": lr, "weight_decay": wd, "params": list(names)}


def test_groups_of_equal_settings_merge_and_split_back():
    current = [_group("ab"), _group("c", wd=0.1), _group("de")]  # tp: sharded and whole apart
    merged = merge_equal_groups({"param_groups": current, "state": {}})["param_groups"]
    assert [g["params"] for g in merged] == [list("abde"), ["c"]]
    loaded = [_group("abde", lr=5e-4), _group("c", lr=5e-4, wd=0.1)]  # what the checkpoint held
    back = regroup(loaded, current)
    assert [g["params"] for g in back] == [list("ab"), ["c"], list("de")]
    assert [g["lr"] for g in back] == [5e-4] * 3 and [g["weight_decay"] for g in back] == [0.0, 0.1, 0.0]


def test_a_checkpoint_saved_before_groups_were_merged_still_loads():
    """Two groups of equal settings saved apart: the merged target takes the first (DCP loads
    its name list whole: a shorter list must not fail element by element), whose settings the
    second shared, and every current group gets them."""
    current = [_group("ab"), _group("cd")]
    target = merge_equal_groups({"param_groups": current, "state": {}})
    saved = {"param_groups": [_group("ab", lr=2e-4), _group("cd", lr=2e-4)], "state": {}}
    _merge(target, saved)
    assert target["param_groups"][0]["params"] == list("ab") and target["param_groups"][0]["lr"] == 2e-4
    back = regroup(target["param_groups"], current)
    assert [g["lr"] for g in back] == [2e-4, 2e-4] and [g["params"] for g in back] == [list("ab"), list("cd")]
