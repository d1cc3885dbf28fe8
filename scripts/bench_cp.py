"""Context parallel on CPU: training throughput and memory per rank at cp=1, 2, 4 and a few
sequence lengths, and the longest sequence that trains under a fixed per-rank memory budget.

Each leg trains one random-init Llama (``--model tiny``: 4 layers, hidden 256, 8 heads / 2 key-value
heads; ``smollm2``: SmolLM2-135M's shape) on ONE sequence of ``LENGTH`` tokens per step, fp32,
gloo, every rank of the cp group fed the same batch. cp=1 is one process running plain
transformers (SDPA); cp>1 is ``hf_scale.parallelize(model, {"strategy": "ddp", "cp": N})`` over
N processes (``--attention masked`` for the masked attention instead of the blocks;
``--exchange allgather,alltoall`` for a leg per exchange: K / V all-gathered, or the all-to-all of
heads for sequence). The anchor, ``--exchange deepspeed-ulysses`` (``cp_anchor_ulysses.py``):
DeepSpeed's Ulysses ``DistributedAttention`` around SDPA in the same plain transformers model, each
rank its contiguous part of the sequence, trained by torch DDP over the group (DeepSpeed is not a
dependency: ``--deepspeed DIR`` names a folder it was installed into, ``pip install --target DIR
--no-deps deepspeed hjson py-cpuinfo msgpack einops ninja``; its pure-Python parts run on the CPU).
Per leg:

* tokens/s: the sequence's tokens per measured AdamW step (forward, backward, step), the
  group's throughput (not per rank);
* saved bytes per rank: the activation bytes autograd keeps for backward in one training forward
  (``hf_scale.parallel.saved_bytes.SavedBytes``, parameters left out), the largest over the ranks,
  and its ratio to cp=1 at the same length (the issue's targets: <= 0.55x at cp=2, <= 0.30x at
  cp=4);
* peak RSS per rank: the process's resident set, sampled every 5 ms from before the model is
  built to the end (the largest over the ranks), and the part of it above the RSS after the
  model and optimizer were built (``step RSS``: activations, gradients, optimizer state and the
  transient buffers of the step).

``--longest BUDGET_MB``: for each cp, the longest length (doubling from ``--start``) whose step RSS
(peak minus after-build, so the model's own weights are left out) stays under BUDGET_MB on every
rank, with full activation checkpointing and the chunked loss (the long-context setting), for
each cp > 1 and exchange.

    python scripts/bench_cp.py                                   # cp 1, 2, 4 at 1k, 2k, 4k tokens
    python scripts/bench_cp.py --lengths 2048 --cps 1,2 --attention masked
    python scripts/bench_cp.py --longest 300 --start 1024        # longest length under 300 MB/rank
    python scripts/bench_cp.py --longest 300 --exchange allgather,alltoall   # both exchanges, one table
    python scripts/bench_cp.py --exchange allgather,alltoall,deepspeed-ulysses --deepspeed DIR --rounds 2
    python scripts/bench_cp.py --write docs/benchmarks.md        # into its section (bench:cp;
                                                                 # --longest: bench:cp-longest)
    python scripts/bench_cp.py --worker JSON OUT                 # one leg's rank (run by torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    ROOT,
    RssSampler,
    add_write_arg,
    check_doc,
    launch_ranks,
    markdown_table,
    torchrun,
    write_doc,
)

MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=8192),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
}
LR = 1e-4
ANCHOR = "deepspeed-ulysses"  # the --exchange of the anchor leg (cp_anchor_ulysses.py)


def worker(spec: dict, out: Path) -> None:
    """One rank of one leg: build, train ``steps`` measured steps after one warm-up, count the
    bytes saved for backward in one more forward, write ``out/NAME.rankR.json``."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    record = {"status": "ok", **spec}
    sampler = RssSampler()
    sampler.start()
    try:
        import transformers as tf

        from hf_scale.parallel.saved_bytes import SavedBytes

        torch.manual_seed(0)
        config = tf.LlamaConfig(**MODELS[spec["model"]], max_position_embeddings=max(spec["length"], 2048),
                                use_cache=False)
        model = tf.LlamaForCausalLM(config).float()
        train_part = None  # the anchor's: it trains on this rank's part of the sequence itself
        if spec.get("exchange") == ANCHOR:
            import cp_anchor_ulysses

            dist.init_process_group("gloo")
            model, train_part = cp_anchor_ulysses.build(model, spec["cp"])
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        elif spec["cp"] > 1 or spec.get("long"):  # cp=1 long: one process, AC and chunked loss alone
            import hf_scale

            if spec["cp"] > 1:
                dist.init_process_group("gloo")
            parallel = {"strategy": "ddp", "cp": spec["cp"], "cp_attention": spec["attention"],
                        "cp_exchange": spec["exchange"] if spec["cp"] > 1 else "allgather"}
            if spec.get("long"):
                parallel.update(activation_checkpointing="full", loss_chunk_tokens=1024)
            model = hf_scale.parallelize(model, parallel)
            optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0)
        else:  # one process, plain transformers
            model.config._attn_implementation = "sdpa"
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        model.train()
        g = torch.Generator().manual_seed(spec["length"])
        ids = torch.randint(2, config.vocab_size, (1, spec["length"]), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        built = sampler.process.memory_info().rss
        times, losses = [], []
        for step in range(1 + spec["steps"]):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            if train_part is not None:
                loss = train_part(ids)
            else:
                loss = model(**batch).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            losses.append(float(loss.detach()))
            times.append(time.perf_counter() - start)
        with SavedBytes(model) as saved:
            loss = train_part(ids) if train_part is not None else model(**batch).loss
        if train_part is None:
            loss.backward()
        optimizer.zero_grad(set_to_none=False)
        step_time = sum(times[1:]) / max(len(times) - 1, 1)
        peak = sampler.stop()
        record.update(tokens_per_s=spec["length"] / step_time, step_s=step_time, saved_bytes=saved.total,
                      peak_rss=peak, step_rss=peak - built, losses=losses)
    except Exception as e:  # noqa: BLE001 - one reason per leg
        import traceback

        record["status"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["traceback"] = traceback.format_exc()[-3000:]
        if "Out of memory" in str(e) or isinstance(e, MemoryError):
            record["status"] = "out of memory"
    (out / f"{spec['name']}.rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_leg(spec: dict, out: Path, timeout: float) -> tuple[dict | None, str | None]:
    """Launch one leg (torchrun for cp > 1); the worst rank's numbers, or why not."""
    spec = {**spec, "name": f"cp{spec['cp']}-{spec.get('exchange', 'allgather')}-{spec['attention']}-{spec['length']}"
                            f"{'-long' if spec.get('long') else ''}"}
    cmd = (torchrun(__file__, spec["cp"], "--worker", json.dumps(spec), str(out)) if spec["cp"] > 1 else
           [sys.executable, __file__, "--worker", json.dumps(spec), str(out)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if spec.get("exchange") == ANCHOR:  # DeepSpeed from its own folder; its CPU accelerator
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *([spec["deepspeed"]] if spec.get("deepspeed") else [])]),
                   DS_ACCELERATOR="cpu")
    results, error = launch_ranks(cmd, out, spec["name"], spec["cp"], timeout, env)
    if error:
        return None, error
    worst = {key: max(r[key] for r in results) for key in ("saved_bytes", "peak_rss", "step_rss")}
    return {**results[0], **worst, "tokens_per_s": min(r["tokens_per_s"] for r in results)}, None


def table(args, out: Path) -> str:
    """One row per length and leg; with ``--rounds`` > 1 the legs of a length run in turn that many
    times (A B C A B C) and the row shows the rounds' mean tokens/s."""
    rows, speed = [], {}  # speed: (length, cp, exchange) -> each round's tokens/s
    for length in args.lengths:
        results: dict[tuple, list] = {}
        for _ in range(args.rounds):
            for cp, exchange, attention in _legs(args):
                spec = dict(model=args.model, length=length, cp=cp, attention=attention, steps=args.steps,
                            exchange=exchange, deepspeed=args.deepspeed)
                results.setdefault((cp, exchange, attention), []).append(run_leg(spec, out, args.timeout))
                print(length, cp, exchange, attention, results[cp, exchange, attention][-1][1] or
                      f"{results[cp, exchange, attention][-1][0]['tokens_per_s']:.0f} tokens/s", flush=True)
        ref = next((r for r, e in results.get((1, "-", "-"), []) if not e), None)
        for (cp, exchange, attention), runs in results.items():
            name = [str(length), str(cp), exchange, attention]
            error = next((e for _, e in runs if e), None)
            if error:
                rows.append(name + [f"failed: {error}"])
                continue
            result = runs[-1][0]
            speed[length, cp, exchange] = [r["tokens_per_s"] for r, _ in runs]
            ratio = f"{result['saved_bytes'] / ref['saved_bytes']:.3f}x" if ref else "-"
            rss_ratio = f"{result['step_rss'] / ref['step_rss']:.2f}x" if ref else "-"
            loss = (f"{max(abs(a - b) / b for a, b in zip(result['losses'], ref['losses'])):.1e}" if ref else "-")
            rows.append(name + [f"{statistics.mean(speed[length, cp, exchange]):.0f}",
                                f"{result['saved_bytes'] / 2**20:.1f}", ratio,
                                f"{result['peak_rss'] / 2**20:.0f}", f"{result['step_rss'] / 2**20:.0f}",
                                rss_ratio, loss])
    header = ["tokens", "cp", "exchange", "attention", "tokens/s (group)", "saved MB/rank", "saved vs cp=1",
              "peak RSS MB/rank", "step RSS MB/rank", "step RSS vs cp=1", "loss vs cp=1 (worst step)"]
    return markdown_table(header, rows) + anchor_verdicts(speed)


def anchor_verdicts(speed: dict) -> str:
    """Issue 39's throughput target against the anchor: each hf_scale exchange's tokens/s >= 1.1x
    DeepSpeed-Ulysses' at the same length and cp (the legs of one run; their rounds' means, each
    round's ratio beside)."""
    lines = []
    for (length, cp, exchange), anchor in sorted(speed.items()):
        if exchange != ANCHOR:
            continue
        for ours in ("alltoall", "allgather"):
            mine = speed.get((length, cp, ours))
            if mine is not None:
                ratio = statistics.mean(mine) / statistics.mean(anchor)
                each = ", ".join(f"{m / a:.2f}x" for m, a in zip(mine, anchor))
                lines.append(f"{'PASS' if ratio >= 1.1 else 'FAIL'}: cp={cp}, {length} tokens: hf_scale {ours} "
                             f"tokens/s {ratio:.2f}x DeepSpeed-Ulysses ({statistics.mean(mine):.0f} vs "
                             f"{statistics.mean(anchor):.0f}; rounds {each}; need >= 1.1x)")
    return "\n\n```\n" + "\n".join(lines) + "\n```" if lines else ""


def _legs(args) -> list[tuple[int, str, str]]:
    """(cp, exchange, attention) of each leg: cp=1 once, every cp > 1 per exchange and attention."""
    return [(cp, exchange, attention) for cp in args.cps
            for exchange in (args.exchange if cp > 1 else ["-"])
            for attention in (args.attention if cp > 1 and exchange != ANCHOR else ["-"])]


def longest(args, out: Path) -> str:
    rows, base = [], None
    for cp, exchange, _ in _legs(args):
        length, best, why = args.start, None, ""
        while length <= args.max_length:
            spec = dict(model=args.model, length=length, cp=cp, attention="auto", steps=1, long=True,
                        exchange=exchange)
            result, error = run_leg(spec, out, args.timeout)
            if error or result["step_rss"] > args.longest * 2**20:
                why = error or f"{length} tokens: step RSS {result['step_rss'] / 2**20:.0f} MB"
                break
            best = (length, result)
            length *= 2
        else:
            why = f"--max-length {args.max_length} reached"
        if best is None:
            rows.append([str(cp), exchange, "none", "", "", "", why])
        else:
            base = base if cp > 1 else best[0]
            ratio = f"{best[0] / base:.1f}x" if base else "-"
            rows.append([str(cp), exchange, str(best[0]), ratio, f"{best[1]['step_rss'] / 2**20:.0f}",
                         f"{best[1]['tokens_per_s']:.0f}", why])
        print(rows[-1], flush=True)
    return markdown_table(["cp", "exchange", "longest tokens", "vs cp=1", "its step RSS MB/rank", "tokens/s",
                           "next length"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    parser.add_argument("--cps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--attention", type=lambda s: s.split(","), default=["auto"],
                        help="cp_attention of the cp>1 legs, comma-separated: auto (blocks), masked")
    parser.add_argument("--exchange", type=lambda s: s.split(","), default=["allgather"],
                        help="cp_exchange of the cp>1 legs, comma-separated: allgather, alltoall; "
                        f"{ANCHOR}: the anchor (DeepSpeed's DistributedAttention, cp_anchor_ulysses.py)")
    parser.add_argument("--deepspeed", metavar="DIR", help=f"a folder holding deepspeed for the {ANCHOR} "
                        "legs (pip install --target DIR --no-deps deepspeed hjson py-cpuinfo msgpack einops "
                        "ninja), put on their PYTHONPATH only")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="run each length's legs this many times, in turn")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--longest", type=float, metavar="BUDGET_MB", help="find the longest length per cp instead")
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=65536)
    add_write_arg(parser, "cp")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker[0]), Path(args.worker[1]))
        return
    if args.longest and ANCHOR in args.exchange:
        parser.error(f"--longest runs hf_scale's exchanges only (with checkpointing and the chunked loss): "
                     f"leave {ANCHOR} out of --exchange")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.longest and args.section == "cp":
        args.section = "cp-longest"  # its own table
    check_doc(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if args.longest:
            body = longest(args, out)
            title = (f"Longest sequence per cp whose training step stays under {args.longest:.0f} MB of RSS per "
                     f"rank above the built model ({args.model} Llama, fp32, full activation checkpointing, "
                     f"chunked loss, lengths doubling from {args.start})")
        else:
            body = table(args, out)
            title = (f"{args.model} Llama ({MODELS[args.model]}), fp32, one sequence per step, gloo on CPU "
                     f"(OMP_NUM_THREADS=1 per rank), 1 warm-up + {args.steps} AdamW steps per leg")
    print(body)
    write_doc(args, f"{title}.\n\n{body}")


if __name__ == "__main__":
    main()
