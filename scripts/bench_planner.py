"""Benchmark: the auto-planner's predictions (hf_scale.layout_search) against measured runs on this machine.

Run (one machine, gloo on CPU; each leg its own ``torchrun``, OMP_NUM_THREADS=1 per rank)::

    python scripts/bench_planner.py                       # every leg (tens of minutes on 2 cores)
    python scripts/bench_planner.py --legs tiny_w1,tiny_fsdp_w2 --no-calibrate   # a quick check
    python scripts/bench_planner.py --write docs/benchmarks.md            # the table into the docs
    python scripts/bench_planner.py --legs tiny_full_w1 --no-calibrate --peak-module  # where the peak is

Each leg trains a randomly initialised Llama-shaped model (tiny, small, or SmolLM2-135M's shape
from its config: the same memory and FLOPs as the real weights) with AdamW on fixed random token
ids, ``--warmup`` untimed steps then ``--steps`` timed ones, and measures per rank:

* with allocations of 64 KiB or more served by their own mappings (``MALLOC_MMAP_THRESHOLD_``:
  glibc's default keeps freed memory resident, so RSS would follow the allocator, not what is in
  use): peak tracked tensor bytes in one step (``torch.distributed._tools.MemTracker``'s device
  peak, its per-module statistics off: parameters, gradients, optimizer state
  (ZeroRedundancyOptimizer's inner one included), activations, temporaries; FSDP's buffers
  included), then peak RSS over ``--steps`` steps (``bench_common.RssSampler``, every 5 ms);
* then, allocations up to 32 MiB served from the heap again (``mallopt``: the mappings slow small
  models' steps by a third here), one untimed step and ``--steps`` timed ones (at least
  ``MIN_TIMED`` for a model whose steps take milliseconds: a few of them would time the machine's
  jitter): the step time (the slowest rank's per step, their median).

The prediction for the same layout comes from the config alone: ``estimate_memory`` (device total
less the process overhead against tracked bytes; device total plus host bytes against RSS) and
``step_cost`` on ``gloo-cpu-here``, calibrated at the start of the run (``--no-calibrate`` reuses
the cached calibration) so the calibration and the legs share the machine's load, and taken again
after the legs: a ``recheck`` line gives the step-time target under that second calibration (on
this shared machine, where the rates a calibration measures drift by about 20% within an hour,
it shows how much of a step-time error is the moment the calibration was taken). The legs the
ranking target compares (one model, world, sequence and batch) are timed in ``--rounds`` launches
each, the later ones alternating their order, and their step time is the rounds' median: a
near-tied pair timed once each, minutes apart, ranks by the machine's load. Rows print the
ratios first (predicted / measured), the issue's targets being +/-5% tracked, +/-10% RSS,
+/-25% step time.
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
from bench_common import (
    RssSampler,
    add_write_arg,
    check_doc,
    launch_ranks,
    markdown_table,
    torchrun,
    write_doc,
)

MODELS = {  # LlamaConfig keyword arguments
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True},
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "vocab_size": 8192, "tie_word_embeddings": True},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                    "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
}
# name: (model, world, seq, batch per dp rank, layout fields); micro_batch = batch (no accumulation)
LEGS = {
    "tiny_w1": ("tiny", 1, 64, 2, {}),
    "tiny_full_w1": ("tiny", 1, 64, 2, {"ac": "full"}),
    "tiny_fsdp_w2": ("tiny", 2, 64, 2, {"strategy": "fsdp", "dp_shard": 2}),
    "tiny_ddp_w2": ("tiny", 2, 64, 2, {"strategy": "ddp", "dp_replicate": 2}),
    "tiny_fsdp_u2_w2": ("tiny", 2, 64, 2, {"strategy": "fsdp", "dp_shard": 2, "blocks_per_unit": 2}),
    "small_zero2_w2": ("small", 2, 256, 2, {"strategy": "zero2", "dp_shard": 2}),
    "small_zero1_w2": ("small", 2, 256, 2, {"strategy": "zero1", "dp_replicate": 2}),
    "small_hsdp_w4": ("small", 4, 256, 1, {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}),
    "small_fsdp_w4": ("small", 4, 256, 1, {"strategy": "fsdp", "dp_shard": 4}),
    "small_fsdp_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2}),
    "small_fsdp_pf2_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "prefetch": 2}),
    "small_fsdp_full_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "ac": "full"}),
    "small_fsdp_sel_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "ac": "selective"}),
    "small_fsdp_offload_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "cpu_offload": True}),
    "small_fsdp_chunk_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "loss_chunk_tokens": 128}),
    "small_tp2_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "tp": 2}),
    "small_pp2_w2": ("small", 2, 256, 2, {"strategy": "fsdp", "pp": 2}),
    # the pipeline's schedule and microbatch count, which the chooser searches: one ranking group
    "small_pp2_b4_w2": ("small", 2, 128, 4, {"strategy": "fsdp", "pp": 2}),
    "small_pp2_m4_w2": ("small", 2, 128, 4, {"strategy": "fsdp", "pp": 2, "pp_microbatches": 4}),
    "small_pp2_gpipe_w2": ("small", 2, 128, 4, {"strategy": "fsdp", "pp": 2, "pp_schedule": "gpipe"}),
    "small_pp2_i1f1b_w2": ("small", 2, 128, 4, {"strategy": "fsdp", "pp": 2, "pp_schedule": "interleaved_1f1b"}),
    "small_pp2_zbv_w2": ("small", 2, 128, 4, {"strategy": "fsdp", "pp": 2, "pp_schedule": "zbv"}),
    "smollm2_w1": ("smollm2", 1, 256, 1, {}),
    "smollm2_fsdp_w2": ("smollm2", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2}),
    "smollm2_fsdp_u8_w2": ("smollm2", 2, 256, 2, {"strategy": "fsdp", "dp_shard": 2, "blocks_per_unit": 8}),
    "smollm2_fsdp_ac_chunk_w2": ("smollm2", 2, 512, 2, {"strategy": "fsdp", "dp_shard": 2, "ac": "full",
                                                        "loss_chunk_tokens": 256}),
    "smollm2_fsdp_w4": ("smollm2", 4, 256, 1, {"strategy": "fsdp", "dp_shard": 4}),
}
GiB = 2**30
MIN_TIMED = {"tiny": 20}  # timed steps at least, per model
# schedules that split a stage's backward (its input's gradient, later its weights'): torch's
# MemTracker cannot follow them (its hooks raise under that autograd.grad), so no tracked bytes
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def leg_layout(name: str):
    from hf_scale.layout_search.estimate import Layout

    _, _, _, batch, fields = LEGS[name]
    return Layout(**{"micro_batch": batch, **fields})


def config_of(name: str):
    import transformers

    config = transformers.LlamaConfig(**MODELS[LEGS[name][0]])
    config._attn_implementation = "sdpa"
    return config


# ------------------------------------------------------------------ one leg (on each rank)


def worker(args) -> None:
    import torch
    import transformers

    import hf_scale

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"{args.worker}.rank{rank}.json"
    model_name, world, seq, batch, _ = LEGS[args.worker]
    timed = max(args.steps, MIN_TIMED.get(model_name, 0))
    layout = leg_layout(args.worker)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of(args.worker))
    parallel = layout.parallel_config() if world > 1 else hf_scale.ParallelConfig(
        activation_checkpointing=layout.ac, loss_chunk_tokens=layout.loss_chunk_tokens)
    model = hf_scale.parallelize(model, parallel)
    optimizer = hf_scale.build_optimizer(model, lr=1e-5)
    dp_rank, dp = _dp(model)
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(model.config.vocab_size, (args.warmup + args.steps + timed + 2, batch * dp, seq), generator=g)
    data = data[:, dp_rank * batch : (dp_rank + 1) * batch]

    def step(ids):
        model.train_step({"input_ids": ids, "labels": ids})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    for ids in data[: args.warmup]:
        step(ids)
    if args.time_only:  # a later round of the leg's group: its step time only
        return _timed(args, step, data[args.warmup + 1 + args.steps :], out, {"status": "ok", "tracked": None,
                                                                             "parts": None, "rss": None})
    # memory first, while big allocations are their own mappings (MALLOC_MMAP_THRESHOLD_ from the
    # launcher: RSS then follows what is in use; glibc's default keeps freed memory resident)
    if layout.pp > 1 and layout.pp_schedule in SPLIT_BACKWARD:
        step(data[args.warmup])  # MemTracker's hooks refuse autograd.grad of a stage's inputs alone
        parts = {"Total": None}
    else:
        from hf_scale.layout_search.simulate import device_tracker, inner_optimizers

        tracker = device_tracker()
        tracker.track_external(model, optimizer, *inner_optimizers(optimizer))
        with tracker:
            step(data[args.warmup])
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        parts = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    where = peak_module(model, optimizer, step, data[args.warmup]) if args.peak_module and layout.pp == 1 else None
    sampler = RssSampler()
    sampler.start()
    for ids in data[args.warmup + 1 : args.warmup + 1 + args.steps]:
        step(ids)
    rss = sampler.stop()
    _timed(args, step, data[args.warmup + 1 + args.steps :], out,
           {"status": "ok", "tracked": parts["Total"], "parts": parts, "rss": rss, "peak_module": where})


def _timed(args, step, batches, out: Path, result: dict) -> None:
    """Time on heap allocations, as a real run allocates (the mappings slow small models' steps
    by a third here): one untimed step, then the timed ones; write ``result`` with the times."""
    import torch.distributed as dist

    import hf_scale

    _heap_allocations()
    times = []
    for ids in batches:
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - start)
    out.write_text(json.dumps({**result, "step_times": times[1:]}))
    if dist.is_initialized():
        dist.barrier()
        hf_scale.shutdown_distributed()


def peak_module(model, optimizer, step, ids) -> str:
    """Where one more step's tracked peak happens: the innermost module holding it whose
    enclosing modules all hold it too (a checkpointed block's submodule can keep its backward
    state open after it ends), and in which pass, by MemTracker's per-module statistics."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from hf_scale.layout_search.simulate import inner_optimizers

    tracker = MemTracker()
    tracker.track_external(model, optimizer, *inner_optimizers(optimizer))
    with tracker:
        step(ids)
    cpu = torch.device("cpu")
    total = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    for state in (_ModState.PEAK_BW, _ModState.PEAK_FW):
        seen, holding = set(), set()
        for stats in tracker.memory_tracking.values():
            snaps = stats.snapshots.get(state, [])
            seen.update([stats.mod_fqn] if snaps else [])
            if any(snap.get(cpu, {}).get("Total") == total for snap in snaps):
                holding.add(stats.mod_fqn)

        chain = [fqn for fqn in holding if _enclosed(fqn, holding, seen)]
        if chain:
            return f"{max(chain, key=lambda f: f.count('.'))} ({state.value})"
    return "outside every module's forward and backward (the optimizer step)"


def _enclosed(fqn: str, holding: set[str], seen: set[str]) -> bool:
    """Whether every enclosing module of ``fqn`` that has statistics is in ``holding``."""
    parts = fqn.split(".")
    prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
    return all(p in holding for p in prefixes if p in seen)


def _heap_allocations() -> None:
    """glibc: serve allocations up to 32 MiB from the heap (``mallopt(M_MMAP_THRESHOLD)``: the
    largest threshold glibc's default grows to by itself)."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD


def _dp(model) -> tuple[int, int]:
    from hf_scale.parallel_state import get_state

    state = get_state(model)
    if state is None or state.dims is None:
        return 0, 1
    return state.dims.dp_rank(state.mesh), state.dims.dp_degree


# ------------------------------------------------------------------ the launcher


def predict(name: str, device) -> dict:
    from hf_scale.layout_search.cost import step_cost
    from hf_scale.layout_search.estimate import Workload, estimate_memory
    from hf_scale.layout_search.profile import model_facts

    _, _world, seq, batch, _ = LEGS[name]
    facts = model_facts(config_of(name))
    layout, work = leg_layout(name), Workload(seq=seq, batch=batch, device="cpu")
    memory = estimate_memory(facts, layout, work)
    return {"parts": memory.as_dict(), "tracked": memory.device_total - memory.overhead + memory.host,
            "rss": memory.device_total + memory.host, "step": step_cost(facts, layout, work, device).total}


def launch(name: str, args, out_dir: Path, time_only: bool = False) -> dict:
    """One ``torchrun`` of leg ``name``: its memory and step time, or (``time_only``, a later
    round) its step time alone."""
    world = LEGS[name][1]
    cmd = torchrun(os.path.abspath(__file__), world, "--worker", name, "--out", str(out_dir),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *(["--peak-module"] if args.peak_module and not time_only else []),
                   *(["--time-only"] if time_only else []))
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", TOKENIZERS_PARALLELISM="false")
    results, error = launch_ranks(cmd, out_dir, name, world, args.timeout, env)
    if error:
        return {"status": error}
    slowest = [max(s) for s in zip(*(r["step_times"] for r in results))]
    if time_only:
        return {"status": "ok", "step": statistics.median(slowest)}
    tracked = [r["tracked"] for r in results]
    step = statistics.median(slowest)
    return {"status": "ok", "parts": results[0]["parts"], "tracked": None if None in tracked else max(tracked),
            "rss": max(r["rss"] for r in results), "step": step, "rounds": [step],
            "peak_module": results[0].get("peak_module")}


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order a ranking group's legs are timed in after the first pass, for rounds 2 to
    ``rounds``: reversed, then as listed, and so on, so that no leg always runs first or last
    (separate launches minutes apart follow the machine's load, and a near-tied pair's ranking
    with them)."""
    return [list(reversed(names)) if r % 2 == 0 else list(names) for r in range(2, rounds + 1)]


def add_round(meas: dict, step: float) -> None:
    """Fold one more round's step time into a leg's measurement: its step is the median of its
    rounds' (each the median of that launch's steps)."""
    meas["rounds"].append(step)
    meas["step"] = statistics.median(meas["rounds"])


def table(rows: dict) -> str:
    header = ["leg", "layout", "tracked pred/meas", "RSS pred/meas", "step pred/meas", "tracked pred (GiB)",
              "tracked meas (GiB)", "RSS pred (GiB)", "RSS meas (GiB)", "step pred (s)", "step meas (s)"]
    cells = []
    for name, (pred, meas) in rows.items():
        model, world, seq, batch, _ = LEGS[name]
        label = f"{leg_layout(name).describe()}, {model}, {batch}x{seq}/dp rank, world {world}"
        if meas["status"] != "ok":
            cells.append([name, label, meas["status"]])
            continue
        ratios = [f"{pred[k] / meas[k]:.2f}" if meas[k] is not None else "n/a" for k in ("tracked", "rss", "step")]
        tracked = f"{meas['tracked'] / GiB:.3f}" if meas["tracked"] is not None else "n/a (split backward)"
        cells.append([name, label] + ratios
                     + [f"{pred['tracked'] / GiB:.3f}", tracked, f"{pred['rss'] / GiB:.3f}",
                        f"{meas['rss'] / GiB:.3f}", f"{pred['step']:.2f}", f"{meas['step']:.2f}"])
    return markdown_table(header, cells)


def summary(rows: dict) -> str:
    ok = [(p, m) for p, m in rows.values() if m["status"] == "ok"]
    if not ok:
        return "no leg ran"
    # the signed error farthest from 0, per measure, over the legs that measured it
    targets = {"tracked": 0.05, "rss": 0.10, "step": 0.25}
    lines = []
    for k, t in targets.items():
        errors = [p[k] / m[k] - 1 for p, m in ok if m[k] is not None]
        if not errors:  # e.g. only split-backward legs: no tracked bytes
            lines.append(f"n/a: {k}: no leg measured it")
            continue
        worst = max(errors, key=abs)
        lines.append(f"{'PASS' if abs(worst) <= t + 1e-9 else 'FAIL'}: {k} within +/-{t:.0%} on {len(errors)} "
                     f"leg(s) (worst {worst:+.1%})")
    return "\n".join(lines + ranking(rows))


def tokens_per_second(name: str, seconds: float) -> float:
    """Tokens of one step over every data-parallel rank, per second (what the chooser ranks by)."""
    _, _, seq, batch, _ = LEGS[name]
    return seq * batch * leg_layout(name).dp / seconds


def ranking(rows: dict) -> list[str]:
    """Issue 14's ranking target, per group of legs that train the same model on the same
    sequences and batch per data-parallel rank at one world size: the leg the planner ranks
    first is within 5% of the fastest measured. Ranked as the chooser ranks
    (``hf_scale.layout_search.choose.fastest_first``): by predicted tokens/s, those within 1% of the
    fastest a tie, broken toward less predicted memory."""
    from hf_scale.layout_search.choose import fastest_first

    lines = []
    for (model, world, seq, batch), names in ranking_groups([n for n, (_, m) in rows.items()
                                                             if m["status"] == "ok"]).items():
        pred = [tokens_per_second(n, rows[n][0]["step"]) for n in names]
        chosen = names[fastest_first(pred, [rows[n][0]["rss"] for n in names])[0]]
        meas = {n: tokens_per_second(n, rows[n][1]["step"]) for n in names}
        fastest = max(names, key=meas.get)
        ratio = meas[chosen] / meas[fastest]
        order = ", ".join(f"{n} {meas[n]:,.0f}" for n in sorted(names, key=meas.get, reverse=True))
        rounds = [rows[n][1].get("rounds", []) for n in names]
        if max(map(len, rounds)) > 1:  # each leg's tokens/s per round, as they were timed
            order += "; per round " + "; ".join(
                f"{n} " + "/".join(f"{tokens_per_second(n, s):,.0f}" for s in r) for n, r in zip(names, rounds))
        lines.append(f"{'PASS' if ratio >= 0.95 else 'FAIL'}: ranking, {model} {batch}x{seq}/dp rank at world {world}: "
                     f"ranked first {chosen} measures {ratio:.2f}x the fastest measured ({fastest}); measured "
                     f"tokens/s {order}")
    return lines


def recheck(rows: dict, after: dict[str, float], device) -> str:
    """One line: the step-time target under the calibration taken again after the legs (predicted
    seconds per leg in ``after``). Not a verdict: the table's predictions use the calibration taken
    before them; this says how far the moment a calibration is taken moves them."""
    errors = [after[n] / rows[n][1]["step"] - 1 for n in after]
    if not errors:
        return "recheck: no leg ran"
    within = sum(abs(e) <= 0.25 + 1e-9 for e in errors)
    return (f"recheck: with the calibration taken again after the legs ({device.flops_fp32 / 1e9:.1f} GFLOP/s, "
            f"gloo {device.intra.bandwidth / 1e9:.2f} GB/s), step within +/-25% on {within} of {len(errors)} "
            f"leg(s) (errors {min(errors):+.1%} to {max(errors):+.1%})")


def ranking_groups(names: list[str]) -> dict[tuple, list[str]]:
    """The legs ranked against each other: same model, world, sequence and batch per
    data-parallel rank; groups of one leg left out."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        model, world, seq, batch, _ = LEGS[name]
        groups.setdefault((model, world, seq, batch), []).append(name)
    return {key: legs for key, legs in groups.items() if len(legs) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--legs", default=",".join(LEGS), help="comma-separated leg names")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--no-calibrate", action="store_true", help="reuse the cached calibration")
    parser.add_argument("--peak-module", action="store_true",
                        help="one more step per leg (not pp) under MemTracker's per-module statistics: "
                             "print the module and pass where rank 0's peak happens")
    parser.add_argument("--rounds", type=int, default=3,
                        help="launches that time each leg of a ranking group (the first also measures memory; "
                             "the later ones run the group's legs in alternating order); its step time is "
                             "their median")
    parser.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    add_write_arg(parser, "planner")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    check_doc(args)
    names = args.legs.split(",")
    unknown = [n for n in names if n not in LEGS]
    if unknown:
        parser.error(f"unknown legs {unknown}; known: {', '.join(LEGS)}")
    from hf_scale.layout_search.machine import calibration_path, cpu_device

    device = cpu_device(refresh=not args.no_calibrate)
    print(f"calibration ({calibration_path()}): {device}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_planner_") as tmp:
        for name in names:
            rows[name] = (predict(name, device), launch(name, args, Path(tmp)))
            pred, meas = rows[name]
            print(f"[{name}] {meas['status']}\n  predicted {pred['parts']}\n  measured {meas.get('parts')}", flush=True)
            if meas.get("peak_module"):
                print(f"  rank 0's peak: {meas['peak_module']}", flush=True)
        for group in ranking_groups([n for n in names if rows[n][1]["status"] == "ok"]).values():
            for r, order in enumerate(round_orders(group, args.rounds), start=2):
                for name in order:
                    if rows[name][1]["status"] != "ok":  # an earlier round failed: the leg reports why
                        continue
                    timed = launch(name, args, Path(tmp), time_only=True)
                    if timed["status"] != "ok":
                        rows[name] = (rows[name][0], {"status": f"round {r}: {timed['status']}"})
                        continue
                    add_round(rows[name][1], timed["step"])
                    print(f"[{name}] round {r}: {timed['step']:.3f} s/step", flush=True)
    verdict, note = summary(rows), f"Calibration: {device}."
    if not args.no_calibrate:  # the same calibration taken again, after the legs: how much the moment moves it
        after = cpu_device(refresh=True)
        verdict += "\n" + recheck(rows, {n: predict(n, after)["step"] for n, (_, m) in rows.items()
                                         if m["status"] == "ok"}, after)
        note += f" Re-taken after the legs: {after}."
    body = table(rows) + "\n\n```\n" + verdict + "\n```\n"
    print(body)
    write_doc(args, body, note=note)


if __name__ == "__main__":
    main()
