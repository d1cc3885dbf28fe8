"""This machine, measured: the planner's :class:`Device` for the CPU it runs on.

:mod:`hf_scale.layout_search.calibrate` measures the machine once (about two minutes); the figures are
cached in :func:`calibration_path` and read by :func:`cpu_device`. Apart from
:mod:`hf_scale.layout_search.cost` so the cost model never imports the measurement that uses it.

Usage::

    device = cpu_device()              # cached, else measured now
    device = cpu_device(refresh=True)  # measured again
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..log import log_rank0
from .cost import Device, Link

# The figures a calibration holds; raised when calibrate() measures a new one, so a cache written
# by an older hf_scale (where a figure it lacks would read as 0, a cost left out) is measured again.
CALIBRATION_VERSION = 2


def calibration_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hf_scale" / "calibration.json"


def other_load(data: dict) -> float:
    """The load other work put on the machine while ``data`` was measured: the 1-minute load average
    before measuring, or, for a calibration that did not record it, the one at its end less the
    measurement's own processes (its last part keeps every core busy)."""
    if "load_before" in data:
        return float(data["load_before"])
    return float(data.get("load_average", 0.0)) - float(data.get("cpus") or 1)


def busy_calibration(data: dict) -> bool:
    """Whether ``data`` was measured while other work oversubscribed the machine (more runnable
    processes than cores, on average): its FLOP/s and bandwidths are then a fraction of what the
    run will get, and not the same fraction for compute and collectives, so the planner would choose
    for another machine (measured here: ``strategy: auto`` chose fsdp, 0.86x Trainer, where ddp
    ran 1.28x, from a calibration taken at load 10.6 on 2 cores)."""
    return other_load(data) > float(data.get("cpus") or 1)


def _cached_calibration(path: Path) -> dict | None:
    """The cached calibration, or None (with the reason logged) when it must be measured again: it is
    missing, unreadable, from an older hf_scale, or taken on a busy machine that is not busy now
    (one taken busy is kept while the machine still is: measuring again would be as noisy)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        reason = f"it could not be read ({e})"
    else:
        if not (isinstance(data, dict) and data.get("version") == CALIBRATION_VERSION):
            reason = "an older hf_scale wrote it, without some of the figures the planner reads now"
        elif busy_calibration(data) and (now := os.getloadavg()[0]) <= (data.get("cpus") or 1):
            reason = (f"it was measured while other work kept the machine busy (load average "
                      f"{other_load(data):.1f} on {data.get('cpus')} cores), which is quiet now (load {now:.1f})")
        else:
            return data
    log_rank0(f"re-measuring the planner's calibration {path}: {reason}")
    return None


def cpu_device(refresh: bool = False) -> Device:
    """``gloo-cpu-here``: this machine measured once (a small llama's training step for FLOP/s,
    a 2-process gloo all-reduce for bandwidth and latency), cached in ``calibration_path()``."""
    path = calibration_path()
    data = None if refresh else _cached_calibration(path)
    if data is None:
        from ..checkpoint.files import atomic_write_text
        from .calibrate import calibrate

        log_rank0(f"measuring this machine for the planner (about 2 minutes, once: cached in {path})")
        data = {**calibrate(), "version": CALIBRATION_VERSION}
        if busy_calibration(data):
            log_rank0(f"the machine was busy while measured (load average {other_load(data):.1f} on "
                      f"{data['cpus']} cores): the planner's choice may not suit a quiet machine; the "
                      f"calibration is measured again when a run finds the machine quiet", level=logging.WARNING)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1))
    def link(data: dict) -> Link:
        return Link(bandwidth=data["allreduce_bus_bytes_per_s"], latency=data["allreduce_latency_s"], overlap=0.0,
                    gather_bandwidth=data.get("allgather_bus_bytes_per_s"),
                    scatter_bandwidth=data.get("reducescatter_bus_bytes_per_s"))

    wider = tuple((4, link(w4), w4.get("fsdp_unit_overhead_s", 0.0), w4.get("ddp_overhead_s", 0.0),
                   w4.get("tp_module_overhead_s", 0.0))
                  for w4 in ([data["world4"]] if "world4" in data else []))
    intra = link(data)
    return Device("cpu", flops_fp32=data["flops_fp32"], flops_low=data["flops_bf16"],
                  mem_bandwidth=data["mem_bandwidth"], intra=intra, inter=intra, host_bandwidth=data["mem_bandwidth"],
                  cores=data["cpus"], threads=data["threads"], block_overhead=data.get("block_overhead_s", 0.0),
                  full_ac_overhead=data.get("full_ac_overhead_s", 0.0),
                  selective_ac_overhead=data.get("selective_ac_overhead_s", 0.0),
                  narrow=(256, data["flops_fp32_h256"]) if "flops_fp32_h256" in data else None,
                  fsdp_unit_overhead=data.get("fsdp_unit_overhead_s", 0.0),
                  ddp_overhead=data.get("ddp_overhead_s", 0.0), wider=wider,
                  tp_module_overhead=data.get("tp_module_overhead_s", 0.0),
                  optimizer_tensor=data.get("optimizer_tensor_s", 0.0),
                  optimizer_dtensor=data.get("optimizer_dtensor_s", 0.0),
                  busy=data.get("flops_busy_ratio", 1.0))
