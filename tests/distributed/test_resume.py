"""save_state / load_state: exact resume, and resharding across layouts and world sizes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hf_scale.distributed import LAUNCHER_VARS
from tests.distributed import resume_checks
from tests.harness import run_ranks, to_plain


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    saved4 = run_ranks(resume_checks.world4_saves, 4, root, timeout=600)[0]  # whole state, gathered on every rank
    world2 = run_ranks(resume_checks.world2_runs, 2, root, timeout=600)
    return root, saved4, world2


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_stop_save_load_continue_gives_the_same_losses(runs, strategy):
    _, _, world2 = runs
    for rank, result in enumerate(world2):  # each rank resumed its own loader and step
        straight = result[f"{strategy}_straight"]
        first, second = result[f"{strategy}_first"], result[f"{strategy}_second"]
        assert second["step"] == 3 and second["position"] == 6, rank
        assert first + second["losses"] == straight, rank  # bit for bit


def _assert_same_state(got, want):
    assert set(got["params"]) == set(want["params"])
    for name, value in want["params"].items():
        assert np.array_equal(got["params"][name], value), name
    assert set(got["optim"]) == set(want["optim"]) and want["optim"]
    for name, values in want["optim"].items():
        for key, value in values.items():
            assert np.array_equal(np.asarray(got["optim"][name][key]), np.asarray(value)), f"{name}.{key}"


@pytest.mark.parametrize(
    "loaded, saved",
    [("fsdp2_into_zero1", ("world2", "saved_fsdp")), ("zero1_into_fsdp", ("world2", "saved_zero1")),
     ("hsdp4_into_fsdp2", ("world4", "hsdp")), ("fsdp4_into_fsdp2", ("world4", "fsdp4"))],
)
def test_state_reshards_across_layouts(runs, loaded, saved):
    _, saved4, world2 = runs
    want = saved4[saved[1]] if saved[0] == "world4" else world2[0][saved[1]]
    got = world2[0][loaded]
    _assert_same_state(got, want)  # whole, gathered: the same on every rank
    for rank, result in enumerate(world2):  # each rank's schedule resumed
        assert result[loaded]["step"] == 2 and result[loaded]["lr"] == pytest.approx(1e-3 / 3), rank
    if loaded.startswith(("hsdp4", "fsdp4")):
        assert any("saved by 4 ranks" in w for w in got["warned"])


def test_any_layout_into_one_process(runs, monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    root, saved4, _ = runs
    got = resume_checks.load_and_snapshot({"strategy": "fsdp"}, os.path.join(root, "hsdp4"))
    _assert_same_state(to_plain(got), saved4["hsdp"])


def test_keep_last_and_latest_pointer(runs):
    root, _, _ = runs
    names = sorted(p.name for p in (Path(root) / "fsdp").iterdir())
    assert names == ["latest", "step_00000003"]
    assert (Path(root) / "fsdp" / "latest").read_text().strip() == "step_00000003"

