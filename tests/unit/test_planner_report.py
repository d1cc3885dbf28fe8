"""``hf-scale plan --gpus``'s candidate table and ``parallelize(model, "auto")``'s choice."""

import pytest

from hf_scale.config import ParallelConfig
from hf_scale.errors import HfScaleConfigError
from hf_scale.planner.auto import auto_config, is_auto
from hf_scale.planner.report import format_candidates, plan_candidates
from tests.tiny_models import CAUSAL, tiny_config, tiny_model


def test_candidates_table_and_recommendation():
    facts, best, ranked, budget, work = plan_candidates(tiny_config("llama"), 4, "1GiB", 16, 2)
    text = format_candidates(facts, best, ranked, budget, work)
    assert text.splitlines()[2].startswith(" *  1 ")  # the recommendation is the first row
    assert f"recommended: {best.layout.describe()}" in text
    assert "rejected:" in text and "does not split into the pipeline" in text
    assert "4 rank(s) of 1.0 GiB" in text


def test_auto_config_is_a_valid_parallel_config():
    model = tiny_model("llama", CAUSAL)
    config, best = auto_config(model, world_size=2, budget=2**30, device_type="cuda", seq=16)
    assert isinstance(config, ParallelConfig) and best.fits
    assert config.strategy == best.layout.strategy and config.mixed_precision is None  # not asked for
    fixed, _ = auto_config(model, world_size=2, budget=2**30, device_type="cuda", seq=16,
                           fixed={"strategy": "auto", "activation_checkpointing": "full", "mixed_precision": "bf16"})
    assert fixed.activation_checkpointing == "full" and fixed.mixed_precision == "bf16"
    assert next(model.parameters()).device.type == "cpu"  # the real model was not touched


def test_auto_refuses_degrees_that_contradict_the_world_size():
    with pytest.raises(HfScaleConfigError, match="does not divide the world size 2"):
        auto_config(tiny_model("llama", CAUSAL), world_size=2, budget=2**30, device_type="cuda", seq=16,
                    fixed={"strategy": "auto", "tp": 3})


def test_is_auto():
    assert is_auto("auto") and is_auto({"strategy": "auto", "tp": 2})
    assert not is_auto({"strategy": "fsdp"}) and not is_auto(None) and not is_auto(ParallelConfig())


def test_parallelize_auto_in_one_process(tmp_path, monkeypatch):
    """``parallelize(model, "auto")`` without torchrun: the planner's choice for one CPU process
    (a calibration file stands in for this machine's measurement)."""
    import json

    import hf_scale

    (tmp_path / "hf_scale").mkdir()
    (tmp_path / "hf_scale" / "calibration.json").write_text(json.dumps({
        "flops_fp32": 3e10, "flops_bf16": 1e9, "mem_bandwidth": 5e9, "allreduce_bus_bytes_per_s": 5e8,
        "allreduce_latency_s": 4e-4, "threads": 1, "cpus": 2}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = hf_scale.parallelize(tiny_model("llama", CAUSAL), "auto")
    state = hf_scale.get_state(model)
    assert state.config.strategy == "fsdp" and state.config.mixed_precision is None
    assert state.config.cpu_offload is False


def test_plan_text_for_gpus_from_a_config():
    from hf_scale.planner.report import plan_text

    text = plan_text(tiny_config("llama"), gpus=4, gpu_memory="80GB", seq=16, batch=2)
    assert "4 rank(s) of 74.5 GiB (cuda); seq 16 x batch 2" in text and "recommended:" in text


def test_plan_command_ranks_layouts_for_gpus(tmp_path, capsys):
    from hf_scale.cli import main

    tiny_config("llama").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path / "config.json"), "--gpus", "4", "--gpu-memory", "80 GB", "--seq", "16",
                 "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 rank(s) of 74.5 GiB (cuda); seq 16 x batch 2" in out and "recommended:" in out
    assert main(["plan", str(tmp_path), "--gpus", "4", "--gpu-memory", "eighty"]) == 2
    assert "memory 'eighty' is not a size" in capsys.readouterr().err
