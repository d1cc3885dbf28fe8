"""``hf-scale generate`` (issue 12, item 7): the command on a saved tiny Llama folder prints the
same greedy text at --tp 2 (two torchrun workers, each loading its slices) as in one process,
and bad input fails in one line before any worker starts."""

from __future__ import annotations

import re

import pytest

from tests.harness import run_cli
from tests.tiny_models import save_tiny_checkpoint

PROMPTS = ["What is 12 + 30?", "hello"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama whose weights make greedy text vary (default init repeats one token)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("generate") / "tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


def completions(out: str) -> list[str]:
    """The completions rank 0 printed, in prompt order."""
    found = re.findall(r"=== completion (\d+)/(\d+) ===\n(.*?)\n(?====)", out, flags=re.DOTALL)
    return [text for _, _, text in found]


def generate(folder, *flags: str):
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    return run_cli("generate", folder, *prompts, "--max-new-tokens", "10", "--batch-size", "2", *flags, timeout=300)


def test_tp2_prints_the_text_of_one_process(folder):
    one, two = generate(folder), generate(folder, "--tp", "2")
    assert "launching: torchrun" in two.stdout and "launching" not in one.stdout
    texts = completions(one.stdout)
    assert len(texts) == 2 and all(texts), one.stdout
    assert completions(two.stdout) == texts, two.stdout
    assert two.stdout.count("=== completion 1/2 ===") == 1  # rank 0 alone prints
    speed = re.search(r"=== (\d+) new tokens in [\d.]+ s: ([\d.]+) tokens/s \(tp 2, fp32, greedy, batch 2\) ===", two.stdout)
    assert speed and int(speed.group(1)) == 20 and float(speed.group(2)) > 0, two.stdout


@pytest.mark.parametrize("flags, message", [
    (("--tp", "2", "--prompt", "x"), "cannot find model '{missing}': it is not a local folder"),
    (("--prompt", "x"), "cannot find model '{missing}'"),
    (("--tp", "3", "--prompt", "x", "--model-folder"), "unknown flag --model-folder"),
])
def test_a_model_that_does_not_exist_is_one_line_before_any_worker(tmp_path, flags, message):
    missing = str(tmp_path / "nope")
    result = run_cli("generate", missing, *flags, check=False, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("\n") == 1, result.stdout
    assert result.stdout.startswith("hf-scale generate: error: " + message.format(missing=missing)), result.stdout
    assert "Traceback" not in result.stdout and "launching" not in result.stdout


def test_other_bad_input_is_one_line(folder, tmp_path):
    (tmp_path / "empty").mkdir()
    for args, message in [
        ((str(tmp_path / "empty"), "--prompt", "x"), "has no config.json"),
        ((folder, "--tp", "3", "--prompt", "x"), "tp=3 does not divide the query heads (num_attention_heads=4)"),
        ((folder,), "needs a prompt: --prompt TEXT or --prompts-file FILE"),
        ((folder, "--prompts-file", str(tmp_path / "no.txt")), "no such file"),
        ((folder, "--prompt", "x", "--temperature", "0.5"), "add --do-sample"),
        (("zoo:minilm", "--prompt", "x"), "zoo:minilm serves sequence_classification, not task 'causal_lm'"),
    ]:
        result = run_cli("generate", *args, check=False, timeout=120)
        assert result.returncode == 2 and result.stdout.count("\n") == 1, (args, result.stdout)
        assert message in result.stdout, (args, result.stdout)


def test_prompts_file_and_flags(tmp_path, monkeypatch):
    """In-process: a prompts file gives one prompt per non-blank line after the --prompt ones;
    a worker started with another world size than --tp is refused before loading anything."""
    from hf_scale.errors import HfScaleConfigError
    from hf_scale.generate import parse_args, run

    path = tmp_path / "prompts.txt"
    path.write_text("first line\n\n  \nsecond: 2 + 2?\n")
    opts = parse_args(["m", "--prompt", "zero", "--prompts-file", str(path), "--tp", "2", "--dtype", "bf16",
                       "--do-sample", "--seed", "3", "--temperature", "0.7", "--top-p", "0.9"])
    assert opts.prompts == ["zero", "first line", "second: 2 + 2?"]
    assert (opts.tp, opts.dtype, opts.do_sample, opts.seed, opts.temperature, opts.top_p) == (2, "bf16", True, 3, 0.7, 0.9)
    for bad, message in [(["m", "--prompt", "x", "--tp", "0"], "--tp 0: must be >= 1"),
                         (["m", "--prompt", "x", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
                         (["m", "--prompt", "x", "--do-sample", "--top-p", "0"], "need temperature > 0 and 0 < top-p <= 1")]:
        with pytest.raises(HfScaleConfigError, match=re.escape(message)):
            parse_args(bad)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(HfScaleConfigError, match=re.escape("--tp 2 runs 2 processes, but WORLD_SIZE=4")):
        run(opts)
