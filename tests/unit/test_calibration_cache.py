"""The planner's calibration cache: read when it is this hf_scale's, measured again when it is
missing, unreadable or written by an older hf_scale (whose figures lack costs the planner adds
now: they would read as 0), or taken on a busy machine that is quiet now, and replaced atomically."""

from __future__ import annotations

import json
import logging

import pytest

from hf_scale.layout_search import calibrate as calibrate_module
from hf_scale.layout_search import machine
from hf_scale.layout_search.machine import CALIBRATION_VERSION, calibration_path, cpu_device
from tests.harness import STAND_IN_CALIBRATION, stand_in_calibration


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Calls of a stand-in ``calibrate`` (it returns fixed figures at once), and hf_scale's log."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls, lines = [], []
    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda: calls.append(1) or {**STAND_IN_CALIBRATION, "optimizer_tensor_s": 2e-5})
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hf_scale").addHandler(handler)
    yield calls, lines
    logging.getLogger("hf_scale").removeHandler(handler)


def test_a_cache_of_this_version_is_read_not_measured(tmp_path, measured):
    calls, _ = measured
    stand_in_calibration(tmp_path)
    assert cpu_device().flops_fp32 == STAND_IN_CALIBRATION["flops_fp32"]
    assert calls == []


def test_no_cache_is_measured_once_and_kept(tmp_path, measured):
    calls, lines = measured
    assert cpu_device().optimizer_tensor == 2e-5
    assert cpu_device().optimizer_tensor == 2e-5
    assert calls == [1]
    assert json.loads(calibration_path().read_text())["version"] == CALIBRATION_VERSION
    assert any("measuring this machine for the planner" in line for line in lines)
    assert not list(calibration_path().parent.glob(".*.tmp"))  # the temporary file was renamed


@pytest.mark.parametrize("content", [json.dumps(STAND_IN_CALIBRATION), '{"flops_fp32": 3e1', "[]"])
def test_an_older_or_unreadable_cache_is_measured_again(tmp_path, measured, content):
    calls, lines = measured
    calibration_path().parent.mkdir(parents=True)
    calibration_path().write_text(content)  # no version: written before costs were added, or torn
    assert cpu_device().optimizer_tensor == 2e-5  # the figure the old cache lacked (it read as 0)
    assert calls == [1]
    assert any("re-measuring the planner's calibration" in line for line in lines)
    assert json.loads(calibration_path().read_text())["version"] == CALIBRATION_VERSION


def _cached_at(load_before: float | None, load_average: float = 0.5) -> None:
    """A cache of this version measured with ``load_before`` of other work (None: an older cache
    that recorded only the load at its end) on the stand-in's 2 cores."""
    data = {**STAND_IN_CALIBRATION, "version": CALIBRATION_VERSION, "load_average": load_average}
    if load_before is not None:
        data["load_before"] = load_before
    calibration_path().parent.mkdir(parents=True)
    calibration_path().write_text(json.dumps(data))


@pytest.mark.parametrize("load_before, load_average", [(10.6, 11.0), (None, 10.6)])
def test_a_busy_calibration_is_measured_again_once_the_machine_is_quiet(measured, monkeypatch,
                                                                        load_before, load_average):
    calls, lines = measured
    _cached_at(load_before, load_average)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (1.9, 1.0, 1.0))  # two ranks of ours running
    assert cpu_device().optimizer_tensor == 2e-5
    assert calls == [1]
    assert any("measured while other work kept the machine busy" in line for line in lines)


@pytest.mark.parametrize("load_before, now", [(10.6, 9.0), (1.5, 0.2), (None, 0.2)])
def test_a_calibration_is_kept_while_the_load_is_like_its_own(measured, monkeypatch, load_before, now):
    """Busy then and busy now (measuring again would be as noisy), or quiet when measured: kept.
    The older cache's end load of 3.5 is its own 2 processes plus 1.5 of other work."""
    calls, _ = measured
    _cached_at(load_before, load_average=3.5)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (now, now, now))
    assert cpu_device().optimizer_tensor == 0.0  # the cached figures (the stand-in has no optimizer cost)
    assert calls == []


def test_a_calibration_measured_busy_warns(measured, monkeypatch):
    calls, lines = measured
    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda: calls.append(1) or {**STAND_IN_CALIBRATION, "load_before": 6.0})
    cpu_device()
    assert any("the machine was busy while measured (load average 6.0 on 2 cores)" in line for line in lines)
