"""``hf-scale plan``: plans and meshes without weights; the GPU recipes resolve on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from hf_scale.cli import main
from hf_scale.config import ParallelConfig
from hf_scale.layout_preview import plan_report
from hf_scale.train.config import load_job
from tests.tiny_models import CAUSAL, save_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA3 = {  # the published Llama-3 shapes (config.json of meta-llama/Meta-Llama-3-*)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}


@pytest.mark.parametrize(
    ("recipe", "size", "mesh", "units", "billions"),
    [
        ("llama3-8b-fsdp.yaml", "8b", "pp=1 x dp_replicate=1 x dp_shard=8 x tp=1", 32, 8.03),
        ("llama3-70b-hsdp-offload.yaml", "70b", "pp=1 x dp_replicate=2 x dp_shard=16 x tp=1", 80, 70.55),
    ],
)
def test_gpu_recipes_resolve_on_the_meta_device(tmp_path, recipe, size, mesh, units, billions):
    LlamaConfig(**LLAMA3[size]).save_pretrained(tmp_path)  # the Hub is out of reach here
    job = load_job(CONFIGS / recipe, ["--model.name_or_path", str(tmp_path / "config.json")])
    world = job.launch.nproc_per_node * job.launch.nnodes
    from hf_scale.train.model import load_config

    report = plan_report(load_config(job.model), job.parallel, world, job.launch.nnodes)
    assert report["mesh"] == mesh and report["units"] == units
    assert report["plan"].wrap_modules == ("LlamaDecoderLayer",)
    assert report["parameters"] / 1e9 == pytest.approx(billions, abs=0.01)
    assert "model.layers.*.self_attn.q_proj" in report["plan"].tp_plan  # names from the top model
    assert job.data.max_seq_len <= LLAMA3[size]["max_position_embeddings"]


def test_plan_command_on_a_folder_a_config_json_and_a_recipe(tmp_path, capsys):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL)
    assert main(["plan", folder, "--world-size", "4", "--strategy", "hsdp", "--nnodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (llama)" in out and "2 x LlamaDecoderLayer" in out
    assert "dp_replicate=2 x dp_shard=2" in out and "lm_head.weight = model.embed_tokens.weight" in out
    assert main(["plan", str(Path(folder) / "config.json")]) == 0
    assert "one process" in capsys.readouterr().out
    assert main(["plan", str(CONFIGS / "quickstart.yaml"), "--model.name_or_path", folder]) == 0
    assert "fsdp over 2 rank(s)" in capsys.readouterr().out


def test_plan_command_errors_name_the_problem(tmp_path, capsys):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL)
    assert main(["plan", folder, "--world-size", "3", "--strategy", "hsdp"]) == 2
    assert "hsdp' needs dp_replicate >= 2" in capsys.readouterr().err


def test_report_counts_sharded_state():
    report = plan_report(LlamaConfig(**LLAMA3["8b"]), ParallelConfig(strategy="ddp"), 8)
    assert report["params_per_rank"] == report["parameters"]  # ddp replicates
    sharded = plan_report(LlamaConfig(**LLAMA3["8b"]), ParallelConfig(), 8)
    assert sharded["params_per_rank"] == sharded["parameters"] // 8


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "m", "llama", CAUSAL)


@pytest.fixture
def cli_output(capsys, tiny_folder):
    """capsys, without the progress bar of saving the tiny model."""
    capsys.readouterr()
    return capsys


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--devices", "8", "--bogus", "3"],
         "unknown flag --devices: hf-scale plan takes --world-size, --nnodes, --task, --strategy, --tp, --ep, --cp, --cp-exchange, --pp, --pp-schedule, --pp-microbatches, --pp-grad-sync, --gpus, --gpu-memory, --seq, --batch, --intra-gbps, --inter-gbps, --latency-us, --simulate, --simulate-ranks, --candidates."),
        (["--world-siz", "8"], "unknown flag --world-siz: did you mean --world-size?"),
        (["--world", "8"], "unknown flag --world: did you mean --world-size?"),  # no abbreviations
        (["--world-size", "x"], "argument --world-size: invalid int value: 'x'. See hf-scale plan --help."),
        (["--train.lr", "1"], "--train.lr overrides a recipe field, but"),
        (["extra"], "unexpected argument 'extra'."),
    ],
)
def test_plan_refuses_what_it_does_not_take(tiny_folder, cli_output, extra, message):
    assert main(["plan", tiny_folder, *extra]) == 2
    captured = cli_output.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_plan_with_a_recipe_still_takes_overrides_and_refuses_bare_flags(tiny_folder, cli_output):
    folder = tiny_folder
    recipe = str(CONFIGS / "quickstart.yaml")
    assert main(["plan", recipe, "--model.name_or_path", folder, "--train.lr=1e-4", "--world-size", "4"]) == 0
    assert "fsdp over 4 rank(s)" in cli_output.readouterr().out
    assert main(["plan", recipe, "--model.name_or_path", folder, "--strategy=ddp", "--bogus"]) == 2
    assert "unknown flag --bogus" in cli_output.readouterr().err


def test_plan_of_a_model_that_is_nowhere_is_one_line(tmp_path, cli_output):
    assert main(["plan", "not-a-model-id-xyz"]) == 2  # offline (tests/conftest.py)
    err = cli_output.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("cannot find model 'not-a-model-id-xyz': it is not a local folder or config.json, and HF_HUB_OFFLINE "
            "is set and it is not in the local Hugging Face cache") in err
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in cli_output.readouterr().err


# The tiny Llama (tests/tiny_models.py): hidden 32, MLP 64, 4 query and 2 key/value heads of 8,
# vocabulary 128 tied to the head, 2 layers. Every Linear and the embedding are split by tp;
# only the RMSNorm weights (2 per layer + the final one) stay whole.
TINY_SHARDED = 128 * 32 + 2 * (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 64 * 32)
TINY_REPLICATED = 2 * 2 * 32 + 32


def test_tp_layout_styles_heads_and_bytes_per_rank(tiny_folder, cli_output):
    assert main(["plan", tiny_folder, "--tp", "2"]) == 0
    out = cli_output.readouterr().out
    per_rank = TINY_SHARDED // 2 + TINY_REPLICATED
    assert "mesh: fsdp over 2 rank(s) on 1 node(s): pp=1 x dp_replicate=1 x dp_shard=1 x tp=2" in out
    assert (f"tensor parallel over 2 ranks: per tp rank 2 of 4 query heads, 1 of 2 key/value heads; "
            f"{per_rank / 1e6:,.2f}M of {(TINY_SHARDED + TINY_REPLICATED) / 1e6:,.2f}M parameters") in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert ["model.layers.*.self_attn.q_proj", "colwise", "x2"] in rows
    assert ["model.layers.*.mlp.down_proj", "rowwise", "x2"] in rows
    assert ["model.embed_tokens", "embedding_rowwise", "x1"] in rows and ["lm_head", "colwise_gather_output", "x1"] in rows
    assert len(rows) == 9  # 7 per-layer patterns (layers.0/layers.1 collapsed), embedding, head

    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_config

    config = load_config(ModelConfig(name_or_path=tiny_folder))
    report = plan_report(config, ParallelConfig(tp=2), 4)
    tp = report["tp"]
    assert (tp["sharded_params"], tp["replicated_params"]) == (TINY_SHARDED, TINY_REPLICATED)
    assert tp["params_per_rank"] == per_rank and tp["bytes_per_rank"] == 4 * per_rank  # fp32
    assert report["params_per_rank"] == per_rank // 2  # fsdp over the 2 dp ranks shards it again
    assert plan_report(config, ParallelConfig(strategy="hsdp", tp=2), 4, 2)["params_per_rank"] == per_rank
    assert plan_report(config, ParallelConfig(), 4)["tp"] is None


def test_tp_layout_from_a_recipe_override(tiny_folder, cli_output):
    recipe = str(CONFIGS / "quickstart.yaml")
    assert main(["plan", recipe, "--model.name_or_path", tiny_folder, "--parallel.tp", "2", "--world-size", "4"]) == 0
    out = cli_output.readouterr().out
    assert "dp_shard=2 x tp=2" in out and "tensor parallel over 2 ranks: per tp rank 2 of 4 query heads" in out


def test_a_vocabulary_tp_does_not_divide_counts_the_largest_shard():
    from tests.tiny_models import tiny_config

    config = tiny_config("gpt2")
    config.vocab_size = 129  # rank 0 holds 65 rows of the embedding, rank 1 64
    tp = plan_report(config, ParallelConfig(tp=2), 2)["tp"]
    embedding = 129 * 32
    assert tp["params_per_rank"] - (tp["sharded_params"] - embedding) // 2 - tp["replicated_params"] == 65 * 32
    assert ("transformer.h.*.attn.c_attn", "packed_colwise:3", 2) in tp["styles"]
    # GPT-2's Conv1D: c_fc shards its bias; the rowwise c_proj biases and the packed c_attn bias
    # (3 x 32, whole on every rank, as the engine keeps it) stay whole
    assert tp["replicated_params"] == 64 * 32 + 2 * (4 * 32 + 32 + 32 + 3 * 32) + 2 * 32


def test_tp_layout_that_does_not_fit_is_the_engines_error(tmp_path, cli_output):
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    smollm2.save_pretrained(tmp_path)  # SmolLM2-135M's shapes
    assert main(["plan", str(tmp_path / "config.json"), "--tp", "2"]) == 2
    err = cli_output.readouterr().err
    assert "tp=2 does not divide the query heads (num_attention_heads=9), key/value heads (num_key_value_heads=3)" in err
    assert main(["plan", str(tmp_path / "config.json"), "--tp", "3"]) == 0
    out = cli_output.readouterr().out
    assert "per tp rank 3 of 9 query heads, 1 of 3 key/value heads" in out and "171.1 MiB in float32" in out
    # the shipped tp recipe (the real SmolLM2 is a zoo package: its shapes stand in here)
    recipe = str(CONFIGS / "quickstart-tp3.yaml")
    assert main(["plan", recipe, "--model.name_or_path", str(tmp_path / "config.json")]) == 0
    out = cli_output.readouterr().out
    assert "fsdp over 3 rank(s) on 1 node(s): pp=1 x dp_replicate=1 x dp_shard=1 x tp=3" in out
    assert "per tp rank 3 of 9 query heads" in out
    assert main(["plan", recipe, "--model.name_or_path", str(tmp_path / "config.json"), "--world-size", "6"]) == 0
    assert "dp_shard=2 x tp=3" in cli_output.readouterr().out


def test_a_replicated_style_keeps_the_whole_weight():
    """Qwen3's per-head q_norm / k_norm ("replicated_with_grad_allreduce") stay whole on every
    tp rank, as the RMSNorms do."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=128)
    tp = plan_report(config, ParallelConfig(tp=2), 2)["tp"]
    assert ("model.layers.*.self_attn.q_norm", "replicated_with_grad_allreduce", 2) in tp["styles"]
    assert tp["replicated_params"] == 2 * (8 + 8 + 32 + 32) + 32  # q/k norms, 2 RMSNorms a layer, the final one


@pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 8,
                    reason="a CUDA build of torch with fewer than 8 visible GPUs (see test_fake_cuda_build.py)")
def test_plan_simulate_runs_the_layout_as_its_first_and_last_rank(tiny_folder, cli_output):
    """--simulate: the real parallelize and a step as ranks 0 and 7 of 8 on fake CUDA devices."""
    assert main(["plan", tiny_folder, "--world-size", "8", "--strategy", "zero2", "--seq", "16", "--simulate"]) == 0
    out = cli_output.readouterr().out
    assert "rank 0 of 8 on cuda:0: zero2 1x8x1x1" in out and "rank 7 of 8 on cuda:7" in out
    assert "estimate / simulated" in out and "placement: every tensor on its rank's device" in out
