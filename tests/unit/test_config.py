"""ParallelConfig validation, the generic dict/YAML loader and --section.field overrides."""

import dataclasses

import pytest

from hf_scale import HfScaleConfigError, ParallelConfig
from hf_scale.config import apply_overrides, from_dict, load_yaml


def test_defaults_are_fsdp_fp32():
    cfg = ParallelConfig()
    assert (cfg.strategy, cfg.mixed_precision, cfg.activation_checkpointing) == ("fsdp", None, None)
    assert cfg.sharded


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="zero3"), "strategy='zero3' is not one of"),
        (dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
        (dict(activation_checkpointing="some"), "activation_checkpointing='some'"),
        (dict(dp_shard=0), "dp_shard=0"),
        (dict(dp_replicate=True), r"dp_replicate=True: must be a positive integer or None \(derive it"),
        (dict(tp=None), r"tp=None: must be a positive integer \(1 = no tensor parallel\)"),
        (dict(ac_every=0), r"ac_every=0: must be a positive integer \(1 = every block\)"),
        (dict(ac_every=2), "ac_every=2 only applies"),
        (dict(strategy="ddp", cpu_offload=True), "cpu_offload=True needs a sharded strategy"),
        (dict(strategy="zero2", reshard_after_forward=True), "use strategy='fsdp'"),
        (dict(strategy="zero1", dp_shard=2), "dp_shard=2 needs strategy"),
        (dict(loss_chunk_tokens=0), "loss_chunk_tokens=0"),
        (dict(blocks_per_unit=0), "blocks_per_unit=0: must be a positive integer"),
        (dict(strategy="ddp", blocks_per_unit=2), "strategy='ddp' has none"),
        (dict(fsdp_prefetch=0), "fsdp_prefetch=0: must be a positive integer"),
        (dict(strategy="zero1", fsdp_prefetch=1), "strategy='zero1' gathers nothing"),
    ],
)
def test_invalid_values_name_value_and_fix(kwargs, message):
    with pytest.raises(HfScaleConfigError, match=message):
        ParallelConfig(**kwargs)


def test_from_dict_rejects_unknown_key_with_suggestion():
    with pytest.raises(HfScaleConfigError, match="unknown config key 'stratgy'.*Did you mean 'strategy'"):
        from_dict(ParallelConfig, {"stratgy": "ddp"})


def test_from_dict_rejects_wrong_type_naming_key():
    with pytest.raises(HfScaleConfigError, match="cpu_offload: expected bool, got str"):
        from_dict(ParallelConfig, {"cpu_offload": "yes"})
    with pytest.raises(HfScaleConfigError, match="dp_shard: expected int, got bool"):
        from_dict(ParallelConfig, {"dp_shard": True})


@dataclasses.dataclass
class _Train:
    lr: float = 1e-3
    steps: int = 1


@dataclasses.dataclass
class _Job:
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: _Train = dataclasses.field(default_factory=_Train)


def test_nested_yaml_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("parallel:\n  strategy: zero2\ntrain:\n  lr: 2.0e-5\n")
    job = load_yaml(_Job, path, ["--parallel.mixed_precision", "bf16", "--train.steps=7", "--train.lr", "1"])
    assert job.parallel.strategy == "zero2" and job.parallel.mixed_precision == "bf16"
    assert job.train.steps == 7 and job.train.lr == 1.0 and isinstance(job.train.lr, float)


def test_nested_error_names_full_path(tmp_path):
    with pytest.raises(HfScaleConfigError, match="unknown config key 'train.lrr'"):
        from_dict(_Job, {"train": {"lrr": 1.0}})


def test_overrides_need_values_and_dashes():
    with pytest.raises(HfScaleConfigError, match="has no value"):
        apply_overrides({}, ["--train.lr"])
    with pytest.raises(HfScaleConfigError, match="expected a --section.field flag"):
        apply_overrides({}, ["train.lr", "1"])
    assert apply_overrides({}, ["--parallel.mixed_precision", "null"]) == {"parallel": {"mixed_precision": None}}


def test_missing_yaml_file(tmp_path):
    with pytest.raises(HfScaleConfigError, match="does not exist"):
        load_yaml(ParallelConfig, tmp_path / "nope.yaml")


def test_shipped_parallel_recipes_load():
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[2] / "configs" / "parallel").glob("*.yaml"))
    assert len(recipes) >= 6
    strategies = {load_yaml(ParallelConfig, path).strategy for path in recipes}
    assert strategies == {"fsdp", "zero2", "zero1", "ddp", "hsdp"}


@pytest.mark.parametrize("fields, message", [
    ({"pp": 2, "pp_microbatches": 1}, r"pp_microbatches=1 .*1F1B needs at least one microbatch per stage \(>= 2\)"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 5}, r"pp_microbatches=5 .*multiple of 2"),
    ({"pp": 2, "pp_schedule": "gpipe", "pp_stages_per_rank": 2}, r"runs one stage per rank"),
    ({"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 3}, r"exactly 2 stages"),
    ({"pp_split_points": [2]}, r"pp_split_points is set but pp=1"),
    ({"pp": 0}, r"pp=0: must be a positive integer"),
    ({"pp": None}, r"pp=None: must be a positive integer \(1 = no pipeline parallel\)"),
    ({"pp_microbatches": 2.0}, r"pp_microbatches=2.0: must be a positive integer or None \(the default\)"),
    ({"pp": 2, "pp_grad_sync": "every"}, r"pp_grad_sync='every'.*'auto', 'last', 'each'"),
    ({"pp_grad_sync": "each"}, r"pp_grad_sync='each' with pp=1 .*needs pp > 1"),
    ({"pp": 2, "strategy": "ddp", "pp_grad_sync": "each"}, r"pp_grad_sync='each' .*strategy='ddp'.*'fsdp'"),
    ({"pp": 2, "pp_schedule": "zbv", "pp_grad_sync": "each"}, r"pp_grad_sync='each' with pp_schedule='zbv': supported under 'gpipe', '1f1b'"),
])
def test_pipeline_settings_torch_would_reject_are_refused_here(fields, message):
    with pytest.raises(HfScaleConfigError, match=message):
        ParallelConfig(**fields)
