"""``hf-scale generate``: text from a pretrained causal LM split over ``--tp`` processes.

    hf-scale generate zoo:smollm2 --tp 3 --prompt "What is 12 + 30?" --max-new-tokens 32
    hf-scale generate out/ --tp 2 --prompts-file prompts.txt --dtype bf16 --no-chat

The command checks its arguments, that the model exists and that its sizes divide by ``--tp``
(on the meta device, no weights read), then starts ``--tp`` workers with torchrun, as
``hf-scale finetune`` does. Each worker loads only its slices of the safetensors files
(:func:`hf_scale.from_pretrained` with ``tp``; a GGUF zoo model is loaded whole, then
parallelized), and every rank runs the same ``generate`` calls: the vocabulary-parallel head
gathers the logits, so each rank picks the same next token, and with ``--do-sample`` every rank
seeds its generator with ``--seed`` before each prompt batch, so they draw the same tokens.
The KV cache holds each rank's own heads. Rank 0 prints the completions and tokens/s.

Each prompt is plain text: when the tokenizer has a chat template, the prompt becomes the user's
turn of a chat and the model answers it (an instruct model sent the raw text often ends its turn
at once); ``--no-chat`` sends the raw text, and ``--chat`` refuses a tokenizer without a template.
A completion that decodes to nothing is said so, with the tokens that made it empty.

Application layer (next to ``cli.py``): the library never imports it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import HfScaleConfigError, HfScaleError
from .strict_args import ArgumentParser

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # flag -> ModelConfig.dtype


@dataclass
class GenerateArgs:
    """What ``hf-scale generate`` was asked for (see :func:`parse_args`)."""

    model: str
    tp: int
    prompts: list[str]
    max_new_tokens: int
    dtype: str
    batch_size: int
    chat: bool | None  # --chat True, --no-chat False, neither None: the chat template when there is one
    do_sample: bool
    seed: int
    temperature: float
    top_p: float


def parse_args(args: list[str]) -> GenerateArgs:
    """Strict parsing (one-line errors naming the closest flag) and value checks."""
    p = ArgumentParser(prog="hf-scale generate", description="Generate text with a model split over --tp processes.")
    p.add_argument("model", help="a model folder, a Hub id, or zoo:smollm2")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree = worker processes (default 1)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="weights and compute dtype")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (left padded)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt in the tokenizer's chat template (default: when it has one); "
                        "--no-chat sends the raw text")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same on every rank")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    ns = p.parse_strict(args)
    prompts = list(ns.prompt)
    if ns.prompts_file:
        path = Path(ns.prompts_file)
        if not path.is_file():
            raise HfScaleConfigError(f"--prompts-file {ns.prompts_file}: no such file; give a text file with one prompt per line.")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise HfScaleConfigError("hf-scale generate needs a prompt: --prompt TEXT or --prompts-file FILE (one per line).")
    for flag, value, low in (("--tp", ns.tp, 1), ("--max-new-tokens", ns.max_new_tokens, 1), ("--batch-size", ns.batch_size, 1)):
        if value < low:
            raise HfScaleConfigError(f"{flag} {value}: must be >= {low}.")
    if not ns.temperature > 0 or not 0 < ns.top_p <= 1:
        raise HfScaleConfigError(f"--temperature {ns.temperature} --top-p {ns.top_p}: need temperature > 0 and 0 < top-p <= 1.")
    if not ns.do_sample and (ns.temperature != 1.0 or ns.top_p != 1.0):
        raise HfScaleConfigError("--temperature and --top-p apply to sampling: add --do-sample, or drop them for greedy decoding.")
    return GenerateArgs(ns.model, ns.tp, prompts, ns.max_new_tokens, ns.dtype, ns.batch_size, ns.chat,
                        ns.do_sample, ns.seed, ns.temperature, ns.top_p)


def model_config(opts: GenerateArgs):
    """The job's :class:`ModelConfig` (task causal_lm, dtype from ``--dtype``)."""
    from .train.config import ModelConfig

    return ModelConfig(name_or_path=opts.model, task="causal_lm", dtype=DTYPES[opts.dtype])


def check_before_launch(opts: GenerateArgs) -> None:
    """Fail in this process, before any worker starts: a model that does not exist, a zoo model
    that is not a causal LM, sizes ``--tp`` does not divide, more workers than the machine has."""
    from .launch import check_local_processes
    from .layout_preview import meta_model
    from .model_plans import resolve_plan
    from .model_plans.tp import tp_layout
    from .train.model import read_model_config
    from .zoo import check_zoo_task, is_zoo

    cfg = model_config(opts)
    if is_zoo(cfg.name_or_path):
        check_zoo_task(cfg.name_or_path, cfg.task)
    config = read_model_config(cfg, "a model folder, a Hub id, or a zoo name (zoo:smollm2)")
    if opts.tp > 1:
        model = meta_model(config)
        tp_layout(model, resolve_plan(model), opts.tp)
    check_local_processes(opts.tp, "--tp", "--tp")  # --tp N starts N processes


def main(args: list[str]) -> int:
    """``hf-scale generate``: check, then run here (``--tp 1``, or a torchrun worker) or launch."""
    import subprocess

    from .launch import torchrun_argv, under_torchrun
    from .train.config import LaunchConfig

    opts = parse_args(args)
    if under_torchrun():
        return run(opts)
    check_before_launch(opts)
    if opts.tp == 1:
        return run(opts)
    argv = torchrun_argv(LaunchConfig(nproc_per_node=opts.tp), ["-m", "hf_scale.cli", "generate", *args])
    print(f"[hf_scale] launching: torchrun {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(argv)
    except KeyboardInterrupt:  # Ctrl-C reached torchrun and its workers too: they stop
        return 130


def run(opts: GenerateArgs) -> int:
    """Load the model at ``tp`` = world size, generate on every rank, print on rank 0."""
    from .config import ParallelConfig
    from .distributed import shutdown_distributed
    from .ranks import rank
    from .torchrun import filing_errors
    from .train.model import load_model, load_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != opts.tp:
        raise HfScaleConfigError(
            f"hf-scale generate --tp {opts.tp} runs {opts.tp} processes, but WORLD_SIZE={world}: "
            f"start it with --nproc-per-node {opts.tp}, or pass --tp {world}."
        )
    try:
        with filing_errors("generate"):  # filed before the group closes under the other ranks
            cfg = model_config(opts)
            tokenizer = load_tokenizer(cfg)
            chat = uses_chat_template(tokenizer, opts.chat)  # before loading: --chat without a template fails fast
            model = load_model(cfg, ParallelConfig(tp=opts.tp))
            model.eval()
            started = time.perf_counter()
            texts, rows = generate_texts(model, tokenizer, opts.prompts, opts)
            seconds = time.perf_counter() - started
            if rank() == 0:
                notes = [empty_completion_note(tokenizer, row, eos_ids(model), chat, opts) if not text.strip() else None
                         for text, row in zip(texts, rows)]
                print_completions(opts, texts, notes, sum(map(len, rows)), seconds, chat)
    finally:
        shutdown_distributed()
    return 0


def generate_texts(model, tokenizer, prompts: list[str], opts: GenerateArgs) -> tuple[list[str], list[list[int]]]:
    """(each prompt's completion, its new token ids), ``opts.batch_size`` prompts at a time, each
    prompt in the chat template or not as :func:`uses_chat_template` says.

    Call it on every rank of the model's tp group with the same arguments: each ``generate``
    call runs the collectives of every forward, and sampling draws from a generator seeded
    with ``opts.seed`` on every rank, so all ranks produce the same tokens.
    """
    chat = uses_chat_template(tokenizer, opts.chat)
    texts, rows = [], []
    for start in range(0, len(prompts), opts.batch_size):
        batch = [format_prompt(tokenizer, p, chat) for p in prompts[start : start + opts.batch_size]]
        ids = generate_ids(model, tokenizer, batch, opts, templated=chat)
        texts += [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        rows += ids
    return texts, rows


def generate_ids(model, tokenizer, texts: list[str], opts: GenerateArgs, *, templated: bool = False) -> list[list[int]]:
    """The new token ids for each of ``texts`` (one left-padded batch), up to and including EOS.

    ``templated``: the texts went through the chat template, which wrote the special tokens
    itself (the tokenizer adds none then).
    """
    import torch
    import torch.distributed as dist

    from .parallel_state import get_state

    state = get_state(model)
    device = state.env.device if state is not None else torch.device("cpu")
    tokenizer.padding_side = "left"  # decoder-only models continue from the last position
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated).to(device)
    # no top-k; temperature and top-p only when sampling (greedy decoding takes neither)
    sampling = {"do_sample": opts.do_sample, "top_k": None,
                "temperature": opts.temperature if opts.do_sample else None,
                "top_p": opts.top_p if opts.do_sample else None}
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if opts.do_sample:
        torch.manual_seed(opts.seed)  # the same draws on every rank: the same tokens
        # Should draws still differ (another library drew from the generator on one rank), a
        # rank that reached EOS first keeps stepping with the others instead of leaving them
        # waiting in a collective; the check below then names the problem.
        sampling["synced_gpus"] = distributed
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=opts.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    eos = eos_ids(model)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    if distributed:
        _check_same_tokens(rows)
    return rows


def _check_same_tokens(rows: list[list[int]]) -> None:
    """Raise on every rank when the ranks generated different tokens (one small all-gather)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    differ = [r for r, theirs in enumerate(every) if theirs != every[0]]
    if differ:
        raise HfScaleError(
            f"ranks {differ} generated other tokens than rank 0: the ranks of a tensor-parallel "
            "model must draw the same samples. Seed every rank alike (--seed) and draw no other "
            "random numbers on one rank only between seeding and generate."
        )


def eos_ids(model) -> set[int]:
    """The token ids that end generation (``model.generation_config.eos_token_id``, one or several)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer, chat: bool | None) -> bool:
    """Whether the prompts go through the tokenizer's chat template: ``chat`` (``--chat`` /
    ``--no-chat``) when given, else whenever the tokenizer has one."""
    if chat is None:
        return has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise HfScaleConfigError("--chat: this model's tokenizer has no chat template; drop --chat to send the raw prompt.")
    return chat


def format_prompt(tokenizer, prompt: str, chat: bool | None) -> str:
    """``prompt`` as the model is sent it: the user's turn of a chat with the assistant's turn
    opened, or the raw text (``chat`` as in :func:`uses_chat_template`)."""
    if not uses_chat_template(tokenizer, chat):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def empty_completion_note(tokenizer, row: list[int], eos: set[int], templated: bool, opts: GenerateArgs) -> str:
    """The line rank 0 prints for a completion that decodes to nothing (or whitespace only):
    which new tokens ``row`` made it empty, how the prompt was sent, and what to try."""
    tokens = [str(t) for t in tokenizer.convert_ids_to_tokens(row)]
    ended = bool(row) and row[-1] in eos
    if templated:
        sent = "the prompt went in the chat template (--no-chat sends the raw text)"
    elif has_chat_template(tokenizer):
        sent = "the prompt went as raw text: without --no-chat it goes in the tokenizer's chat template"
    else:
        sent = "the prompt went as raw text (the tokenizer has no chat template)"
    if ended and len(row) == 1:
        why = f"the model's first token was its end-of-sequence token {tokens[0]}"
    else:
        shown = ", ".join(map(repr, tokens[:8])) + (f", ... ({len(row)} tokens)" if len(row) > 8 else "")
        why = f"its new tokens are special tokens or whitespace only: {shown}"
        if not ended:
            why += f", and --max-new-tokens {opts.max_new_tokens} stopped it before its end-of-sequence token"
    return f"(empty completion: {why}; {sent})"


def print_completions(opts: GenerateArgs, texts: list[str], notes: list[str | None], new_tokens: int, seconds: float,
                      chat: bool) -> None:
    """Each prompt and its completion between markers (a completion that is empty: the note that
    says why), then the throughput (rank 0's stdout)."""
    n = len(texts)
    for i, (prompt, text, note) in enumerate(zip(opts.prompts, texts, notes), 1):
        print(f"=== prompt {i}/{n} ===\n{prompt}\n=== completion {i}/{n} ===\n{text if note is None else note}")
    mode = f"sampling, seed {opts.seed}" if opts.do_sample else "greedy"
    prompts = "chat template" if chat else "raw prompts"
    print(f"=== {new_tokens} new tokens in {seconds:.2f} s: {new_tokens / max(seconds, 1e-9):.1f} tokens/s "
          f"(tp {opts.tp}, {opts.dtype}, {mode}, batch {opts.batch_size}, {prompts}) ===", flush=True)
