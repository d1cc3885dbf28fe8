"""``hf-scale generate`` (issue 12, item 7): the command on a saved tiny Llama folder prints the
same greedy text at --tp 2 (two torchrun workers, each loading its slices) as in one process,
and bad input fails in one line before any worker starts."""

from __future__ import annotations

import re
import sys

import pytest

from tests.harness import run_cli, run_commands
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


def generate(folder, *flags: str) -> list[str]:
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    return [sys.executable, "-m", "hf_scale.cli", "generate", str(folder), *prompts, "--max-new-tokens", "10",
            "--batch-size", "2", *flags]


def test_tp2_prints_the_text_of_one_process(folder):
    one, two = run_commands([generate(folder), generate(folder, "--tp", "2")], timeout=300, check=True)  # at once
    assert "launching: torchrun" in two.stdout and "launching" not in one.stdout
    texts = completions(one.stdout)
    assert len(texts) == 2 and all(texts) and "(empty completion" not in one.stdout, one.stdout
    assert completions(two.stdout) == texts, two.stdout
    assert two.stdout.count("=== completion 1/2 ===") == 1  # rank 0 alone prints
    # the folder's tokenizer has a chat template: the prompts went in it, without --chat
    speed = re.search(r"=== (\d+) new tokens in [\d.]+ s: ([\d.]+) tokens/s \(tp 2, fp32, greedy, batch 2, chat template\) ===",
                      two.stdout)
    assert speed and int(speed.group(1)) == 20 and float(speed.group(2)) > 0, two.stdout


def test_a_model_that_does_not_exist_is_one_line_before_any_worker(tmp_path):
    """As a process (what a fresh interpreter prints counts too), at --tp 2: found before
    torchrun starts. The same at --tp 1 and an unknown flag: in this process, below."""
    missing = str(tmp_path / "nope")
    result = run_cli("generate", missing, "--tp", "2", "--prompt", "x", check=False, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("\n") == 1, result.stdout
    assert result.stdout.startswith(f"hf-scale generate: error: cannot find model '{missing}': it is not a local folder"), \
        result.stdout
    assert "Traceback" not in result.stdout and "launching" not in result.stdout


def test_other_bad_input_is_one_line(folder, tmp_path, capfd):
    """In this process (``hf_scale.cli.main``, whose status is the command's; each is found
    before anything loads, so a process start would be most of its cost): the command as a
    process is held to one line above (a missing model at --tp 2)."""
    from hf_scale.cli import main

    (tmp_path / "empty").mkdir()
    for args, message in [
        ((str(tmp_path / "empty"), "--prompt", "x"), "has no config.json"),
        ((folder, "--tp", "3", "--prompt", "x"), "tp=3 does not divide the query heads (num_attention_heads=4)"),
        ((folder,), "needs a prompt: --prompt TEXT or --prompts-file FILE"),
        ((folder, "--prompts-file", str(tmp_path / "no.txt")), "no such file"),
        ((folder, "--prompt", "x", "--temperature", "0.5"), "add --do-sample"),
        (("zoo:minilm", "--prompt", "x"), "zoo:minilm serves sequence_classification, not task 'causal_lm'"),
        ((tmp_path / "nope", "--prompt", "x"), f"cannot find model '{tmp_path / 'nope'}'"),  # at --tp 1
        ((tmp_path / "nope", "--tp", "3", "--prompt", "x", "--model-folder"), "unknown flag --model-folder"),
    ]:
        capfd.readouterr()
        status = main(["generate", *map(str, args)])
        said = "".join(capfd.readouterr())
        assert status == 2 and said.count("\n") == 1 and said.startswith("hf-scale generate: error: "), (args, said)
        assert message in said, (args, said)


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


class _Echo:
    """A stand-in causal LM for ``generate_texts``: keeps the ids it is sent and answers ``answer``
    (token ids) after them. Its end-of-sequence tokens are ``<eos>`` and ``<|im_end|>`` (ids 1, 4)."""

    def __init__(self, answer: list[int]):
        from transformers import GenerationConfig

        self.answer, self.sent = answer, []
        self.generation_config = GenerationConfig(eos_token_id=[1, 4])

    def generate(self, input_ids, attention_mask, **kwargs):
        import torch

        self.sent.append(input_ids)
        return torch.cat([input_ids, torch.tensor([self.answer] * len(input_ids))], dim=1)


def test_a_plain_prompt_goes_in_the_chat_template_when_the_tokenizer_has_one():
    """Issue 26, item 3: by default a prompt goes in the tokenizer's chat template (the README's
    SmolLM2-Instruct example sent raw ended its turn at once); --no-chat, or a tokenizer without
    a template, sends the raw text; --chat on such a tokenizer is refused."""
    from hf_scale.errors import HfScaleConfigError
    from hf_scale.generate import generate_texts, parse_args
    from tests.tiny_models import tiny_tokenizer

    prompt = "What is 12 + 30?"
    chat, plain = tiny_tokenizer(), tiny_tokenizer(chat_template=False)
    answer = chat("42").input_ids + [4]  # then <|im_end|>
    templated = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    for tokenizer, flags, sent in [(chat, [], templated), (chat, ["--chat"], templated), (chat, ["--no-chat"], prompt),
                                   (plain, [], prompt), (plain, ["--no-chat"], prompt)]:
        model = _Echo(answer)
        texts = generate_texts(model, tokenizer, [prompt], parse_args(["m", "--prompt", prompt, *flags]))[0]
        assert tokenizer.decode(model.sent[0][0]) == sent, (flags, tokenizer.chat_template is not None)
        assert texts == ["42"], flags
    with pytest.raises(HfScaleConfigError, match=re.escape("--chat: this model's tokenizer has no chat template")):
        generate_texts(_Echo(answer), plain, [prompt], parse_args(["m", "--prompt", prompt, "--chat"]))


def test_an_empty_completion_says_why(capsys):
    """A completion that decodes to nothing prints a line naming the tokens that made it empty
    and how the prompt was sent, in place of the blank completion."""
    from hf_scale.generate import empty_completion_note, parse_args, print_completions
    from tests.tiny_models import tiny_tokenizer

    chat, plain = tiny_tokenizer(), tiny_tokenizer(chat_template=False)
    opts = parse_args(["m", "--prompt", "hi", "--prompt", "ho", "--max-new-tokens", "2"])
    first_eos = "(empty completion: the model's first token was its end-of-sequence token <|im_end|>; "
    assert empty_completion_note(chat, [4], {1, 4}, True, opts) == (
        first_eos + "the prompt went in the chat template (--no-chat sends the raw text))")
    assert empty_completion_note(chat, [4], {1, 4}, False, opts) == (
        first_eos + "the prompt went as raw text: without --no-chat it goes in the tokenizer's chat template)")
    assert empty_completion_note(plain, [1], {1, 4}, False, opts) == (
        "(empty completion: the model's first token was its end-of-sequence token <eos>; "
        "the prompt went as raw text (the tokenizer has no chat template))")
    assert empty_completion_note(chat, [3, 5], {1, 4}, True, opts) == (
        "(empty completion: its new tokens are special tokens or whitespace only: '<|im_start|>', ' ', and "
        "--max-new-tokens 2 stopped it before its end-of-sequence token; the prompt went in the chat template "
        "(--no-chat sends the raw text))")
    note = empty_completion_note(chat, [4], {1, 4}, True, opts)
    print_completions(opts, ["", "42"], [note, None], 3, 1.0, True)
    out = capsys.readouterr().out
    assert completions(out) == [note, "42"], out
    assert "(tp 1, fp32, greedy, batch 1, chat template) ===" in out, out
