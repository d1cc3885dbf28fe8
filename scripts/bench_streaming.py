"""Benchmark: peak RSS of a streaming fine-tune (``data.streaming: true``) over a JSONL file of N
rows and one of 10N rows, beside the in-memory path (``data.streaming: false``) on the same files
(issue 38).

Run (one machine; every leg is one process)::

    python scripts/bench_streaming.py                        # N = 15,000 rows (~5 MB) and 150,000
                                                             # (~52 MB), 2 rounds, ~15 min
    python scripts/bench_streaming.py --rows 2000 --rounds 1     # a quick look
    python scripts/bench_streaming.py --write docs/benchmarks.md # into its section (markers
                                                                 # <!-- bench:streaming:start/end -->)

The files hold ``bench_packing.py``'s generated multi-step arithmetic (prompt / response pairs, 1
to 10 steps, 47 to 483 tokens with SmolLM2's chat template). Every leg runs ``hf-scale finetune``
on one process (no torchrun: the CLI trains in its own process) for ``--steps`` steps, packing
bfd into rows of 512 tokens, 2 rows a step, on a tiny Llama (hidden 64, 2 layers, random weights,
SmolLM2's tokenizer and vocabulary; saved by this script) so that what the data costs is not
lost beside the weights:

* **streaming**: ``data.streaming: true``: the file read as training goes (``datasets``
  streaming JSON), shuffled through a buffer of 1,000 examples, tokenised and packed in groups
  of 1,000 examples; only what the steps need is read;
* **in memory**: ``data.streaming: false``: the whole file loaded, tokenised and packed with
  ``datasets`` (Arrow files, memory-mapped) before step 1, in a fresh cache folder per leg
  (``HF_DATASETS_CACHE``), so every leg does the whole work.

Peak RSS: the kernel's ``ru_maxrss`` of the CLI's process (``os.wait4``: the largest resident set
it had over its life, file-backed pages of memory-mapped Arrow files included), and the largest
psutil sample of the process tree's summed RSS (every 0.25 s) beside it.

Target (issue 38): streaming peak RSS on the 10N file within 5% of the N file's. The in-memory
path's growth is shown beside it (no target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_write_arg, check_doc, markdown_table, revision, run_sampled, write_doc
from bench_packing import SYSTEM_PROMPT, make_examples, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.05
SCALE = 10
PATHS = {"streaming": ["--data.streaming", "true"], "in memory": ["--data.streaming", "false"]}
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "tie_word_embeddings": True}

RECIPE = """\
# Written by scripts/bench_streaming.py: the recipe of its legs (each adds its overrides).
model:
  name_or_path: {model}
  task: causal_lm
data:
  system_prompt: {system}
  max_seq_len: 512
  packing: bfd
  eval_split: null
train:
  batch_size: 2
  lr: 1.0e-4
  max_steps: {steps}
  sample_generations: 0
  eval_every: 0
  exact_match: false
  progress: false
checkpoint:
  save_final: false
  every_steps: 0
launch:
  nproc_per_node: 1
"""


# ------------------------------------------------------------------ the arithmetic of the report


def relative_change(small: float, big: float) -> float:
    """(big - small) / small."""
    return (big - small) / small


def verdict_lines(peaks: dict[tuple[str, str], int], rows: dict[str, int]) -> list[str]:
    """The target line for the streaming path and the in-memory path's line beside it, from
    ``peaks[(path, file)]`` (bytes; file ``"N"`` or ``"10N"``) and ``rows[file]``."""
    small, big = (f"{rows[f]:,} rows" for f in ("N", "10N"))
    lines = []
    for path in PATHS:
        a, b = peaks.get((path, "N")), peaks.get((path, "10N"))
        if a is None or b is None:
            lines.append(f"n/a: {path}: a leg did not finish")
            continue
        change = relative_change(a, b)
        figures = f"{b / 2**30:.3f} GiB on {big} vs {a / 2**30:.3f} GiB on {small}: {change:+.1%}"
        if path == "streaming":
            lines.append(f"{'PASS' if abs(change) <= TOLERANCE else 'FAIL'}: streaming peak RSS on the "
                         f"{SCALE}x file within {TOLERANCE:.0%} of the small file's ({figures})")
        else:
            lines.append(f"beside it, in memory (data.streaming: false): {figures}")
    return lines


def merge(rounds: list[dict]) -> dict:
    """One leg's rounds: the largest peak over the rounds (each round's listed), the median wall time."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return rounds[-1]
    return {"status": "ok", "peak": max(r["peak"] for r in ok), "peaks": [r["peak"] for r in ok],
            "tree": max(r["tree"] for r in ok), "wall": statistics.median(r["wall"] for r in ok),
            "steps": ok[-1]["steps"], "cmd": ok[-1]["cmd"]}


# ------------------------------------------------------------------ the legs


def make_model(folder: Path) -> None:
    """The tiny Llama every leg trains: random weights (seed 0), SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_scale.train.config import ModelConfig
    from hf_scale.train.model import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path="zoo:smollm2"))
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, vocab_size=len(tokenizer),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run_leg(args, out: Path, path: str, file: str, tag: str) -> dict:
    data = out / f"{file}.jsonl"
    cache = out / "cache" / tag
    cmd = [sys.executable, "-m", "hf_scale.cli", "finetune", str(out / "recipe.yaml"), "--data.path", str(data),
           "--train.output_dir", str(out / tag), *PATHS[path]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    began = time.perf_counter()
    run = run_sampled(cmd, out / f"{tag}.log", args.timeout, env=env, cwd=ROOT)
    wall = time.perf_counter() - began
    shutil.rmtree(cache, ignore_errors=True)
    if run.error:
        return {"status": run.error}
    steps = [json.loads(line) for line in (out / tag / "metrics.jsonl").read_text().splitlines()]
    return {"status": "ok", "peak": run.maxrss, "tree": run.peak_tree_rss, "wall": wall, "steps": len(steps),
            "cmd": " ".join(["hf-scale", *cmd[3:]]).replace(str(out), "OUT")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=15000, help=f"N: rows of the small file (the big one: {SCALE}N)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per leg")
    parser.add_argument("--rounds", type=int, default=2, help="run the legs this many times, in turn")
    parser.add_argument("--out", help="folder for data, logs and results (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per leg")
    add_write_arg(parser, "streaming")
    args = parser.parse_args()
    check_doc(args)
    if min(args.rows, args.steps, args.rounds) < 1:
        parser.error("--rows, --steps and --rounds must be >= 1")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_streaming_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import datasets
    import torch

    versions = f"torch {torch.__version__}, datasets {datasets.__version__}"
    print(f"{versions}; hf_scale at {revision()}; logs in {out}", flush=True)
    examples = make_examples(SCALE * args.rows, seed=0)
    rows = {"N": args.rows, "10N": SCALE * args.rows}
    sizes = {f: write_jsonl(out / f"{f}.jsonl", examples[:n]) for f, n in rows.items()}
    make_model(out / "tiny")
    (out / "recipe.yaml").write_text(RECIPE.format(model=out / "tiny", system=SYSTEM_PROMPT, steps=args.steps))
    title = (f"hf-scale finetune, 1 process, a tiny Llama (hidden 64, 2 layers, SmolLM2's tokenizer), packing bfd, "
             f"rows of 512 tokens, 2 rows a step, {args.steps} steps; files of {rows['N']:,} rows "
             f"({sizes['N'] / 1e6:.1f} MB) and {rows['10N']:,} rows ({sizes['10N'] / 1e6:.1f} MB) of generated "
             f"multi-step arithmetic; {args.rounds} round(s); {versions}; hf_scale at {revision()}")
    print(title, flush=True)
    legs = [(path, file) for path in PATHS for file in rows]
    runs = {leg: [] for leg in legs}
    start = time.perf_counter()
    for i in range(args.rounds):
        for path, file in legs:
            load = os.getloadavg()[0]
            row = run_leg(args, out, path, file, f"{path.replace(' ', '_')}_{file}_{i}")
            runs[(path, file)].append(row)
            shown = (f"peak RSS {row['peak'] / 2**30:.3f} GiB (tree {row['tree'] / 2**30:.3f}), {row['wall']:.0f} s"
                     if row["status"] == "ok" else row["status"])
            print(f"  round {i} {path} {file}: {shown} (load average {load:.2f} before)", flush=True)
    merged = {leg: merge(r) for leg, r in runs.items()}
    header = ["leg", "file", "peak RSS vs the same path on the N file", "peak RSS (GiB; each round)",
              "tree RSS, largest sample (GiB)", "wall (s, median)", "steps"]
    table_rows = []
    for (path, file), leg in merged.items():
        label = f"{file} = {rows[file]:,} rows, {sizes[file] / 1e6:.1f} MB"
        if leg["status"] != "ok":
            table_rows.append([path, label, leg["status"]])
            continue
        base = merged[(path, "N")]
        ratio = f"{leg['peak'] / base['peak']:.3f}" if base["status"] == "ok" else "n/a"
        table_rows.append([path, label, ratio, f"{leg['peak'] / 2**30:.3f} ("
                           + ", ".join(f"{p / 2**30:.3f}" for p in leg["peaks"]) + ")",
                           f"{leg['tree'] / 2**30:.3f}", f"{leg['wall']:.0f}", str(leg["steps"])])
    table = markdown_table(header, table_rows)
    peaks = {leg: r["peak"] for leg, r in merged.items() if r["status"] == "ok"}
    text = "\n".join(verdict_lines(peaks, rows))
    ran = "\n".join(f"  {path} {file}: {leg['cmd']}" for (path, file), leg in merged.items() if leg["status"] == "ok")
    print(f"\nwhat each leg ran (OUT = {out}):\n{ran}\n\n{table}\n\n{text}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_doc(args, f"{title}.\n\nWhat each leg ran (OUT: the run's folder):\n\n```\n{ran}\n```\n\n{table}\n\n"
                    f"```\n{text}\n```", "Peak RSS depends little on what else the machine runs; wall times do.")


if __name__ == "__main__":
    main()
