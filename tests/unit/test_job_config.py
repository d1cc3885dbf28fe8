"""Job recipes: parsing, overrides, errors that name the key; launch checks; every recipe in configs/."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_scale.cli import split_overrides
from hf_scale.errors import HfScaleConfigError
from hf_scale.launch import check_launch, max_local_processes, torchrun_argv
from hf_scale.train.config import JobConfig, LaunchConfig, load_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(p for p in CONFIGS.glob("*.yaml"))


def test_quickstart_recipe_and_overrides():
    job = load_job(CONFIGS / "quickstart.yaml", ["--parallel.strategy", "zero2", "--train.lr", "1e-4",
                                                 "--parallel.mixed_precision=null", "--train.betas", "[0.9, 0.95]"])
    assert isinstance(job, JobConfig)
    assert job.model.name_or_path == "zoo:smollm2" and job.launch.nproc_per_node == 2
    assert job.parallel.strategy == "zero2" and job.train.lr == 1e-4
    assert job.parallel.mixed_precision is None and job.train.betas == [0.9, 0.95]
    assert job.checkpoint_dir == Path(job.train.output_dir) / "checkpoints"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe):
    job = load_job(recipe)
    assert job.train.output_dir and job.model.name_or_path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.lrr", "1"], "unknown config key 'train.lrr'. Did you mean 'lr'?"),
        (["--trian.lr", "1"], "unknown config key 'trian'. Did you mean 'train'?"),
        # other stacks' names of the degrees, which no spelling distance finds
        (["--parallel.expert_parallel", "2"], "unknown config key 'parallel.expert_parallel'. Did you mean 'ep'?"),
        (["--parallel.tp_size", "2"], "unknown config key 'parallel.tp_size'. Did you mean 'tp'?"),
        (["--train.batch_size", "eight"], "train.batch_size: expected int, got str 'eight'"),
        (["--train.batch_size", "0"], "train.batch_size=0: must be >= 1"),
        (["--parallel.strategy", "zero4"], "strategy='zero4' is not one of"),
        (["--model.task", "translation"], "model.task='translation' is not one of"),
        (["--hub.push", "true"], "hub.repo_id is not set"),
        (["--train.scheduler", "cosin"], "train.scheduler='cosin' is not one of"),
        (["--train.lr"], "flag --train.lr has no value"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(HfScaleConfigError, match=_escape(message)):
        load_job(CONFIGS / "quickstart.yaml", overrides)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(HfScaleConfigError, match="does not exist"):
        load_job(tmp_path / "nope.yaml")


def test_cli_flags_become_config_fields():
    config, overrides = split_overrides(
        ["r.yaml", "--nproc-per-node", "4", "--nnodes=2", "--rdzv-endpoint", "h:1", "--resume", "latest", "--train.lr", "1"]
    )
    assert config == "r.yaml"
    assert overrides == ["--launch.nproc_per_node", "4", "--launch.nnodes", "2", "--launch.rdzv_endpoint", "h:1",
                         "--checkpoint.resume", "latest", "--train.lr", "1"]
    assert split_overrides(["--config", "x.yaml", "--a.b", "c"]) == ("x.yaml", ["--a.b", "c"])


def test_launch_checks():
    limit, what = max_local_processes()
    with pytest.raises(HfScaleConfigError, match=f"this machine has {limit} {_escape(what)}"):
        check_launch(LaunchConfig(nproc_per_node=limit + 1))
    with pytest.raises(HfScaleConfigError, match="needs launch.rdzv_endpoint"):
        check_launch(LaunchConfig(nnodes=2))
    with pytest.raises(HfScaleConfigError, match="expected host:port"):
        check_launch(LaunchConfig(nnodes=2, rdzv_endpoint="localhost"))
    with pytest.raises(HfScaleConfigError, match="node_rank=2 is outside 0..1"):
        check_launch(LaunchConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1", rdzv_backend="static"))


def test_torchrun_command_lines():
    one = torchrun_argv(LaunchConfig(nproc_per_node=1), ["-m", "x"])
    assert "--standalone" in one and one[-2:] == ["-m", "x"]
    multi = torchrun_argv(LaunchConfig(nproc_per_node=1, nnodes=2, rdzv_endpoint="127.0.0.1:29400"), ["-m", "x"])
    assert "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=127.0.0.1:29400" in multi and "--nnodes=2" in multi
    static = torchrun_argv(LaunchConfig(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", rdzv_backend="static"), [])
    assert "--node-rank=1" in static and "--master-addr=10.0.0.1" in static and "--master-port=29500" in static


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_cli_usage(capsys):
    from hf_scale.cli import main

    assert main(["--help"]) == 0 and "hf-scale finetune configs/quickstart.yaml" in capsys.readouterr().out
    assert main(["finetune", "-h"]) == 0 and "hf-scale push" in capsys.readouterr().out
    assert main([]) == 2 and "usage:" in capsys.readouterr().err
    assert main(["finetune"]) == 2 and "finetune needs a recipe" in capsys.readouterr().err


def test_unknown_zoo_model():
    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_tokenizer

    with pytest.raises(HfScaleConfigError, match="'zoo:nope': the zoo has zoo:smollm2 and zoo:minilm"):
        load_tokenizer(ModelConfig(name_or_path="zoo:nope"))


def test_a_model_folder_without_tokenizer_files_is_refused_as_such(tmp_path):
    """transformers makes an empty tokenizer for such a folder: the run failed later, saying the
    dataset was empty after filtering."""
    from transformers import AutoModelForCausalLM

    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_tokenizer
    from tests.distributed.moe_checks import moe_config
    from tests.tiny_models import save_tiny_checkpoint, tiny_config

    # Llama's tokenizer class refuses to build without files, Qwen2's builds an empty one
    for name, config in (("llama", tiny_config("llama")), ("qwen3_moe", moe_config("qwen3_moe", False))):
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
        with pytest.raises(HfScaleConfigError, match="the folder has no tokenizer files; training needs"):
            load_tokenizer(ModelConfig(name_or_path=str(tmp_path / name)))
    assert len(load_tokenizer(ModelConfig(name_or_path=save_tiny_checkpoint(tmp_path / "full")))) > 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.lr", "-1"], "train.lr=-1.0: the learning rate must be > 0"),
        (["--train.lr", "0"], "train.lr=0.0: the learning rate must be > 0"),
        (["--train.lr", ".nan"], "train.lr=nan: the learning rate must be > 0"),
        (["--train.betas", "[0.9, 1.0]"], "betas[1]=1.0 must be in [0, 1)"),
        (["--train.betas", "[-0.1, 0.999]"], "betas[0]=-0.1 must be in [0, 1)"),
        (["--train.weight_decay", "-0.01"], "train.weight_decay=-0.01: must be >= 0"),
        (["--train.warmup_steps", "-1"], "train.warmup_steps=-1: must be >= 0"),
        (["--train.max_grad_norm", "-1"], "train.max_grad_norm=-1.0: must be > 0 (the norm to clip to), or null / 0"),
        (["--train.lr", "[1"], "--train.lr '[1': not a YAML value"),
    ],
)
def test_bad_optimizer_settings_fail_when_the_recipe_loads(overrides, message):
    with pytest.raises(HfScaleConfigError, match=_escape(message)):
        load_job(CONFIGS / "quickstart.yaml", overrides)


def test_optimizer_settings_at_their_limits_load():
    job = load_job(CONFIGS / "quickstart.yaml", ["--train.max_grad_norm", "0", "--train.betas", "[0.0, 0.5]",
                                                 "--train.max_steps", "3", "--train.warmup_steps", "5"])
    assert job.train.max_grad_norm == 0 and job.train.betas == [0.0, 0.5] and job.train.warmup_steps == 5
    assert load_job(CONFIGS / "quickstart.yaml", ["--train.max_grad_norm", "null"]).train.max_grad_norm is None


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("train:\n  lr: 1e-4\n   batch_size: 4\n", ":3:14: YAML syntax error", "mapping values are not allowed here"),
        ("train:\n  betas: [0.9, 0.95\n", ":3:1: YAML syntax error", "expected ',' or ']'"),
        ("train:\n\tlr: 1\n", ":2:1: YAML syntax error", "found character '\\t' that cannot start any token"),
    ],
)
def test_yaml_syntax_error_names_file_line_and_column(tmp_path, text, where, problem):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(HfScaleConfigError, match=_escape(str(recipe) + where) + ".*" + _escape(problem)):
        load_job(recipe)


def test_recipe_names_its_own_card_template(tmp_path):
    template = tmp_path / "card.md"
    template.write_text("---\n{{ card_data }}\n---\n# {{ model_name }} by my lab\n")
    job = load_job(CONFIGS / "quickstart.yaml", ["--hub.card_template", str(template)])
    assert job.hub.card_template == str(template)
    with pytest.raises(HfScaleConfigError, match=_escape(f"model card template '{tmp_path / 'nope.md'}' "
                                                         "(hub.card_template) does not exist")):
        load_job(CONFIGS / "quickstart.yaml", ["--hub.card_template", str(tmp_path / "nope.md")])
    template.write_text("# {{ model_name }\n")
    with pytest.raises(HfScaleConfigError, match="hub.card_template.*Jinja syntax error on line 1"):
        load_job(CONFIGS / "quickstart.yaml", ["--hub.card_template", str(template)])


def test_every_command_refuses_unknown_flags_in_one_line(tmp_path, capsys, monkeypatch):
    import subprocess

    from hf_scale.cli import main

    def no_launch(*args, **kwargs):
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(subprocess, "call", no_launch)

    quickstart = str(CONFIGS / "quickstart.yaml")
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("train:\n  lr: 1e-4\n   batch_size: 4\n")
    for argv, message in [
        (["finetune", quickstart, "--train.lr", "-1"], "train.lr=-1.0: the learning rate must be > 0"),
        (["finetune", str(recipe)], f"{recipe}:3:14: YAML syntax error: mapping values are not allowed here"),
        (["finetune", quickstart, "--nproc-per-nod", "2"],
         "unknown flag --nproc-per-nod: did you mean --nproc-per-node?"),
        (["finetune", quickstart, "-x"], "unknown flag -x: hf-scale finetune takes --config, --nproc-per-node"),
        (["finetune", quickstart, "other.yaml"], "unexpected argument 'other.yaml'"),
        # degrees the processes cannot take: refused before torchrun starts any
        (["finetune", quickstart, "--parallel.ep", "3", "--nproc-per-node", "2"], "ep=3 does not divide dp_shard=2"),
        (["export", "ckpt", "out", "--tokeniser", "gpt2"], "unknown flag --tokeniser: did you mean --tokenizer?"),
        (["export", "ckpt"], "the following arguments are required: out. See hf-scale export --help."),
        (["push", str(tmp_path), "org/x", "--privat"], "unknown flag --privat: did you mean --private?"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
