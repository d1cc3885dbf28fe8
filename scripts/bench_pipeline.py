"""Benchmark: pipeline parallel schedules against their ideal step time, and against fsdp / ddp.

Run (each leg a fresh ``torchrun --nproc_per_node 2``, gloo on CPU, OMP_NUM_THREADS=1)::

    python scripts/bench_pipeline.py --write docs/benchmarks.md         # SmolLM2-135M, < 10 min
    python scripts/bench_pipeline.py --model tiny --steps 2             # a 4-layer Llama, ~2 min
    python scripts/bench_pipeline.py --legs 1f1b,fsdp --seq 32 --batch 8

Legs: pp=2 under each schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``,
``zbv``; the last three hold 2 stages per rank), ``--microbatches`` microbatches (8), the default
split; then ``fsdp`` and ``ddp`` over the same 2 processes at the same global batch (``--batch``
sequences of ``--seq`` tokens; each dp rank gets half of it, each pp rank all of it).

Per leg: 1 warm-up + ``--steps`` timed steps (AdamW lr 1e-5, no weight decay). The *step time*
is ``hf_scale.train_step`` (forward + backward over the whole batch: the schedule, its sends and
receives, the tied-embedding gradient sum; fsdp / ddp: their collectives) between barriers,
median over steps; *with AdamW* adds the optimizer step. Tokens/s count each batch token once.

Per pp leg, each stage's compute time is measured outside the schedule: each rank runs its own
stages' modules on one microbatch (forward ``F``; backward to the stage's input only ``B``; the
rest of a full backward, the weight gradients, ``W = full - B``), median of ``--repeats``, both
ranks at once as in the schedule. From them, the schedule's *ideal* step time with free
communication: the papers' formulas (``(m + p - 1) / m`` x the slowest stage's time for gpipe
and 1f1b; interleaved and zero-bubble ones cited in ``scripts/pipeline_ideal.py``), and
*simulated*, a replay of the schedule's own action order with the measured stage times. The
time of the tied-embedding gradient all-reduce inside ``train_step`` is shown apart.

Ratios first, as in the other benchmarks: measured / ideal, tokens/s against fsdp, stage balance
(slowest / fastest stage's ``t``; the default split).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    torchrun,
)
from bench_tensor_parallel import ensure_model
from pipeline_ideal import SCHEDULES, action_orders, ideal_step, simulate
from write_doc import write_section

LOAD_LIMIT = 2.5
LEGS = (*SCHEDULES, "fsdp", "ddp")
TARGET_IDEAL, TARGET_BALANCE = 1.15, 1.2
FULL = {"model": "smollm2", "batch": 8, "seq": 64, "microbatches": 8}  # the run


# ------------------------------------------------------------------ one leg (every rank)


def build_model(args):
    """The same model on every rank: SmolLM2-135M from its safetensors, or a tiny Llama."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model == "tiny":
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
        return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)


def parallel_config(leg: str, args) -> dict:
    if leg in SCHEDULES:
        return {"pp": 2, "pp_schedule": leg, "pp_microbatches": args.microbatches}
    return {"strategy": leg}


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def timed_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stage_times(pipeline, batch: dict, microbatches: int, repeats: int) -> dict[int, dict[str, float]]:
    """Per local stage, median seconds of forward ``F``, input gradient ``B`` and weight gradient
    ``W`` (a full backward minus ``B``) on one microbatch, outside the schedule."""
    import torch

    size = batch["input_ids"].shape[0] // microbatches
    ids, labels = batch["input_ids"][:size], batch["labels"][:size]
    hidden = pipeline.model.config.hidden_size
    times = {}
    for stage, module in zip(pipeline.stages, pipeline.stage_modules):
        module.label_tokens = int((batch["labels"][:, 1:] != -100).sum())
        dtype = next(p.dtype for p in module.parameters())

        def forward():
            x = ids if module.first else torch.randn(*ids.shape, hidden, dtype=dtype, requires_grad=True)  # noqa: B023
            out = module(x, labels=labels if module.last else None)  # noqa: B023
            return x, out, torch.ones_like(out)

        runs = {"F": [], "full": [], "B": []}
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            x, out, grad = forward()
            runs["F"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out.backward(grad)
            runs["full"].append(time.perf_counter() - start)
            x, out, grad = forward()
            start = time.perf_counter()
            if x.requires_grad:
                torch.autograd.grad(out, x, grad)
            runs["B"].append(time.perf_counter() - start)
        f, full, b = (statistics.median(runs[k][1:]) for k in ("F", "full", "B"))
        times[stage] = {"F": f, "B": b, "W": max(full - b, 0.0)}
    return times


def worker(leg: str, out: Path, name: str, args) -> None:
    import torch
    import torch.distributed as dist

    import hf_scale
    from hf_scale.parallel_state import get_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"status": "ok"}
    try:
        model = hf_scale.parallelize(build_model(args), parallel_config(leg, args))
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]
        pipeline, tie_s = get_state(model).pipeline, []
        if pipeline is not None:  # time the tied-embedding gradient sum inside train_step
            sum_tied = pipeline._sum_tied_grads
            pipeline._sum_tied_grads = lambda *a, **k: tie_s.append(timed_call(lambda: sum_tied(*a, **k)))
        share = slice(None) if pipeline is not None else slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        fwd_bwd, whole, losses = [], [], []
        for ids in batches:
            batch = {"input_ids": ids[share], "labels": ids[share]}
            start = time.perf_counter()
            fwd_bwd.append(timed(lambda: losses.append(float(hf_scale.train_step(model, batch)))))  # noqa: B023
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            whole.append(time.perf_counter() - start)
        result.update(fwd_bwd=fwd_bwd[1:], whole=whole[1:], losses=losses, tokens=args.batch * args.seq,
                      tie=tie_s[1:] or [0.0] * args.steps)
        if pipeline is not None:
            dist.barrier()
            result["stages"] = stage_times(pipeline, batch, args.microbatches, args.repeats)
            result["layout"] = {"blocks": [len(b) for b in pipeline.layout.stage_blocks],
                                "costs": list(pipeline.layout.costs)}
            optimizer.zero_grad(set_to_none=True)
    except Exception as e:  # the leg's result says why; the launcher prints it
        result["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        raise
    finally:
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    hf_scale.shutdown_distributed()


# ------------------------------------------------------------------ the launcher


def run_legs(root: Path, args) -> dict[str, dict]:
    out = root / "results"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    options = ["--model", args.model, "--folder", str(args.folder), "--batch", str(args.batch),
               "--seq", str(args.seq), "--steps", str(args.steps), "--microbatches", str(args.microbatches),
               "--repeats", str(args.repeats)]
    rows = {}
    for leg in args.legs:
        for old in out.glob(f"{leg}.rank*.json"):
            old.unlink()
        t0 = time.perf_counter()
        cmd = torchrun(os.path.abspath(__file__), 2, "--worker", leg, "--out", str(out), "--name", leg, *options)
        ranks, error = launch_ranks(cmd, out, leg, 2, args.timeout, env)
        rows[leg] = merge(ranks, error, leg, args)
        print(f"  {leg}: {error or 'ok'} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return rows


def merge(ranks: list[dict], error: str | None, leg: str, args) -> dict:
    """One leg's numbers: per step the slowest rank (the steps end at a barrier), median over
    steps; the stage times of both ranks; the ideal step times from them."""
    if error:
        return {"status": error}
    # pp: every rank returns the batch loss; fsdp / ddp: each its half's (same token counts)
    row = {"status": "ok", "loss": statistics.mean(r["losses"][0] for r in ranks), "tokens": ranks[0]["tokens"]}
    for key in ("fwd_bwd", "whole"):
        row[key] = statistics.median(max(steps) for steps in zip(*(r[key] for r in ranks)))
    # the rank that reaches the tied-gradient all-reduce last measures the all-reduce alone
    row["tie"] = statistics.median(min(steps) for steps in zip(*(r["tie"] for r in ranks)))
    if leg in SCHEDULES:
        stages = {int(s): t for r in ranks for s, t in r["stages"].items()}
        f, b, w = ([stages[s][k] for s in sorted(stages)] for k in ("F", "B", "W"))
        row.update(f=f, b=b, w=w, layout=ranks[0]["layout"],
                   ideal=ideal_step(leg, args.microbatches, 2, f, b, w),
                   simulated=simulate(action_orders(leg, args.microbatches, 2), f, b, w))
    return row


def report(rows: dict, args) -> str:
    x = lambda v: f"{v:.2f}x"
    ms = lambda values: " / ".join(f"{v * 1e3:.0f}" for v in values)
    ref = rows.get("fsdp", {})
    header = ["leg", "measured / ideal", "tok/s vs fsdp", "stage balance", "fwd+bwd (s)", "ideal (s)",
              "ideal simulated (s)", "tied grads all-reduce (s)", "step with AdamW (s)", "tok/s",
              "per stage F+B+W (ms)", "per stage F / B / W (ms)", "blocks per stage", "first loss"]
    table = []
    for leg, row in rows.items():
        if row["status"] != "ok":
            table.append([leg, row["status"]])
            continue
        cell = dict.fromkeys(header, "")
        tok_s = row["tokens"] / row["whole"]
        if ref.get("status") == "ok":
            cell["tok/s vs fsdp"] = x(tok_s / (ref["tokens"] / ref["whole"]))
        cell.update({"leg": leg, "fwd+bwd (s)": f"{row['fwd_bwd']:.2f}", "step with AdamW (s)": f"{row['whole']:.2f}",
                     "tok/s": f"{tok_s:.0f}", "first loss": f"{row['loss']:.5f}"})
        if leg in SCHEDULES:
            t = [a + b + c for a, b, c in zip(row["f"], row["b"], row["w"])]
            cell.update({"measured / ideal": x(row["fwd_bwd"] / row["ideal"]), "stage balance": x(max(t) / min(t)),
                         "ideal (s)": f"{row['ideal']:.2f}", "ideal simulated (s)": f"{row['simulated']:.2f}",
                         "tied grads all-reduce (s)": f"{row['tie']:.2f}", "per stage F+B+W (ms)": ms(t),
                         "per stage F / B / W (ms)": ", ".join(ms(v) for v in zip(row["f"], row["b"], row["w"])),
                         "blocks per stage": "/".join(map(str, row["layout"]["blocks"]))})
        table.append([cell[h] for h in header])
    return markdown_table(header, table)


def verdicts(rows: dict) -> list[str]:
    lines = []
    for leg in ("1f1b", "gpipe"):
        row = rows.get(leg, {})
        if row.get("status") != "ok":
            continue
        t = [a + b + c for a, b, c in zip(row["f"], row["b"], row["w"])]
        ratio, balance = row["fwd_bwd"] / row["ideal"], max(t) / min(t)
        costs = row["layout"]["costs"]
        if leg == "1f1b":
            lines.append(f"{'PASS' if ratio <= TARGET_IDEAL else 'FAIL'} 1f1b measured / ideal <= "
                         f"{TARGET_IDEAL}: {row['fwd_bwd']:.2f} / {row['ideal']:.2f} s = {ratio:.3f}x (of the "
                         f"measured, {row['tie']:.2f} s is the tied-embedding gradient all-reduce; without it "
                         f"{(row['fwd_bwd'] - row['tie']) / row['ideal']:.3f}x)")
        lines.append(f"{'PASS' if balance <= TARGET_BALANCE else 'FAIL'} stage balance (slowest / fastest "
                     f"measured F+B+W, default split, {leg}) <= {TARGET_BALANCE}: {balance:.3f}x "
                     f"(the split's estimate from matmul parameters: {max(costs) / max(min(costs), 1):.3f}x)")
        break
    fsdp = rows.get("fsdp", {})
    for leg, row in rows.items():
        if leg in SCHEDULES and row["status"] == "ok" and fsdp.get("status") == "ok":
            ratio = fsdp["whole"] / row["whole"]
            verb = "beats" if ratio > 1 else "does not beat"
            lines.append(f"{leg} {verb} fsdp: step with AdamW {row['whole']:.2f} vs {fsdp['whole']:.2f} s "
                         f"({ratio:.2f}x tok/s); fwd+bwd {row['fwd_bwd']:.2f} vs {fsdp['fwd_bwd']:.2f} s")
    losses = {leg: row["loss"] for leg, row in rows.items() if row["status"] == "ok"}
    if len(losses) > 1:
        spread = (max(losses.values()) - min(losses.values())) / abs(min(losses.values()))
        lines.append(f"first loss over the legs: {min(losses.values()):.6f} .. {max(losses.values()):.6f} "
                     f"(relative spread {spread:.1e}; the same batch and weights in every leg)")
    return lines


def summary(rows: dict, args) -> str:
    full = all(getattr(args, k) == v for k, v in FULL.items())
    size = "" if full else f" REDUCED (not the issue's {FULL})."
    name = "SmolLM2-135M" if args.model == "smollm2" else "tiny Llama (8 layers, hidden 64)"
    title = (f"{name} fp32, 2 gloo ranks on CPU (OMP_NUM_THREADS=1), global batch {args.batch} x {args.seq} "
             f"tokens; pp=2 with {args.microbatches} microbatches of {args.batch // args.microbatches}; fsdp / ddp "
             f"{args.batch // 2} sequences per rank; 1 warm-up + {args.steps} timed steps (median, slowest rank); "
             f"stage times: median of {args.repeats} on one microbatch; 1-min load {args.start_load:.2f} at the "
             f"start.{size}")
    body = f"{title}\n\n{report(rows, args)}\n\n```\n" + "\n".join(verdicts(rows)) + "\n```\n"
    return body + (f"\n{args.note}\n" if args.note else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--root", default="/tmp/bench_pp", help="checkpoint, results and logs")
    parser.add_argument("--batch", type=int, default=FULL["batch"], help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=FULL["seq"])
    parser.add_argument("--microbatches", type=int, default=FULL["microbatches"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warm-up)")
    parser.add_argument("--repeats", type=int, default=5, help="stage timings per stage (median)")
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--wait", type=int, default=0, help=f"seconds to wait for 1-min load <= {LOAD_LIMIT}")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per leg")
    parser.add_argument("--note", default="", help="text written under the table (its reading)")
    parser.add_argument("--report-only", action="store_true",
                        help="no measuring: report (and --write, with --note) the last run's results in ROOT")
    for hidden in ("--worker", "--folder", "--out", "--name"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    add_write_arg(parser, "pipeline")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.out), args.name, args)
    check_doc(args)
    start, root = time.perf_counter(), Path(args.root).resolve()
    saved = root / "results" / "run.json"
    if args.report_only:
        run = json.loads(saved.read_text())
        vars(args).update(run["settings"])
    else:
        args.legs = [leg for leg in args.legs.split(",") if leg]
        args.folder = str(ensure_model(root)) if args.model == "smollm2" else ""
        waited = 0
        while (load := os.getloadavg()[0]) > LOAD_LIMIT and waited < args.wait:
            print(f"  1-min load {load:.2f} > {LOAD_LIMIT}: waited {waited} s", flush=True)
            time.sleep(30)
            waited += 30
        print(f"machine: 1-min load average {load:.2f} at the start (waited {waited} s)", flush=True)
        args.start_load = load
        rows = run_legs(root, args)
        settings = {k: getattr(args, k) for k in (*FULL, "steps", "repeats", "legs", "start_load")}
        run = {"command": command_line(), "machine": machine(), "settings": settings, "rows": rows}
        saved.write_text(json.dumps(run))
    body = summary(run["rows"], args)
    print(f"\n{body}\ntotal wall time {time.perf_counter() - start:.0f} s")
    if args.write:
        header = f"Written by `{run['command']}` on {run['machine']}."
        if args.report_only:
            header += " The reading under the table: `--report-only --note`, from that run's results."
        write_section(args.write, args.section, f"{header}\n\n{body}")
        print(f"wrote section {args.section!r} of {args.write}")


if __name__ == "__main__":
    main()
