"""Benchmark: hf_scale.parallelize against plain torch, transformers and accelerate on SmolLM2-135M.

Run (one machine; the script launches every contender itself, 2 ranks each, gloo on CPU)::

    python scripts/bench_parallelize.py --steps 3        # the 2 x 256 table, ~15 min on 2 CPU cores
    python scripts/bench_parallelize.py --steps 1 --legs hf_fsdp,torch_fsdp     # a quick check
    python scripts/bench_parallelize.py --steps 1 --legs hf_fsdp_ac_2k,hf_fsdp_ac_chunk_2k \
        --write docs/benchmarks.md --section parallelize-2k   # chunked loss at 1 x 2048 tokens
    python scripts/bench_parallelize.py --steps 2 --legs hf_fsdp,torch_fsdp,hf_fsdp,torch_fsdp --bounds \
        --write docs/benchmarks.md --section parallelize-gloo  # issue 42's rounds and what any FSDP reaches

Every contender trains the real SmolLM2-135M (fp32) with AdamW (lr 1e-5, no weight decay) on the
same fixed random token ids (labels = input_ids), 4 x 256 tokens per step (2 x 256 per rank;
the ``_2k`` legs 1 x 2048 per rank, where SmolLM2's 49,152-wide logits dominate the memory),
``--warmup`` untimed steps then ``--steps`` timed ones, each contender in its own fresh
``torchrun --nproc_per_node 2`` (OMP_NUM_THREADS=1 per rank). Reported per contender:

* tokens/s: global tokens per step / mean time of the timed steps (per step, the slowest rank);
* peak RSS per rank: max over ranks of ``getrusage(RUSAGE_SELF).ru_maxrss`` (includes loading);
* train-phase peak RSS per rank: max over ranks of the RSS sampled every 5 ms from just before
  the first (warm-up) step to the end;
* load and parallelize (s): max over ranks of the wall time to load the model and of the call
  that shards it (``hf_scale.parallelize``, the ``fully_shard`` loop, ``accelerator.prepare``;
  transformers shards inside ``from_pretrained``, so its whole call is under load);
* what it really ran (FSDP2 units, DTensor parameters, DDP, optimizer) and the last step's loss
  averaged over ranks, to show every contender trains the same thing;
* other load: CPU cores used by other processes in the timed steps; above ~0.1 the machine was
  shared and tokens/s is not trustworthy.

``--bounds`` adds two legs that are not ways to train (scripts/bench_fsdp_bounds.py): every rank
computing the whole model on its tokens with no collective (the ceiling of any FSDP step here),
and the fsdp step's collectives alone; line (g) reads the fsdp legs against them.

Ratios are against the FSDP anchors (torch ``fully_shard``, transformers
``DistributedConfig(fsdp_size=2)``, accelerate's FSDP2 plugin) that really ran FSDP; for the
``_2k`` legs against hf_scale fsdp + full AC at the same 1 x 2048 tokens. ``--write DOC`` puts
the printed table into DOC between ``<!-- bench:SECTION:start/end -->`` markers.

glibc's malloc keeps freed memory resident and fragmented: RSS grows over steps at a constant
0.8 GB of live tensors, by up to 1 GB, in an order that depends on allocation patterns. The ranks
thus run with ``MALLOC_MMAP_THRESHOLD_=65536`` (allocations >= 64 KiB are mappings given back when
freed), so RSS follows what is in use; ``--default-malloc`` keeps glibc's default.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    RssSampler,
    add_write_arg,
    busy_cpu_seconds,
    check_doc,
    launch_ranks,
    markdown_table,
    ran_as,
    revision,
    torchrun,
    write_doc,
)
from bench_fsdp_bounds import BOUNDS, bound_collectives, bound_compute, bounds_line

WORLD, LR = 2, 1e-5
SHORT, LONG = (2, 256), (1, 2048)  # (sequences, tokens each) per rank
ANCHORS = {SHORT: ("torch_fsdp", "transformers", "accelerate"), LONG: ("hf_fsdp_ac_2k",)}


class Unavailable(Exception):
    """A contender that cannot run in this environment; the message is printed in its row."""


# ------------------------------------------------------------------ contenders (run on each rank)


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - start


def hf_scale_run(config: dict):
    import hf_scale
    from hf_scale.zoo import load_smollm2

    missing = set(config) - set(hf_scale.ParallelConfig.__dataclass_fields__)
    if missing:
        raise Unavailable(f"n/a (option missing: {', '.join(sorted(missing))})")
    (model, _), load_s = _timed(load_smollm2)
    model, parallelize_s = _timed(hf_scale.parallelize, model, config)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0)
    return model, optimizer, f"hf_scale {config}", load_s, parallelize_s


def hf_scale_auto():
    """``strategy: auto`` planned for this benchmark's workload (2 x 256 tokens per rank): the
    planner's choice, then ``parallelize`` with it (the planning time counts as parallelize's)."""
    import hf_scale
    from hf_scale.layout_search.auto import resolve_auto
    from hf_scale.zoo import load_smollm2

    (model, _), load_s = _timed(load_smollm2)
    per_rank, seq = SHORT
    config, plan_s = _timed(resolve_auto, model, "auto", seq=seq, batch=per_rank, micro_batch=per_rank)
    model, parallelize_s = _timed(hf_scale.parallelize, model, config)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0)
    chosen = {"strategy": config.strategy, **config.fixed_fields()}
    return model, optimizer, f"hf_scale auto chose {chosen}", load_s, plan_s + parallelize_s


def torch_fsdp(checkpoint: bool = False):
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_scale.zoo import load_smollm2

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    (model, _), load_s = _timed(load_smollm2)

    def wrap():
        layers = model.model.layers
        for i in range(len(layers)):
            if checkpoint:
                impl = ckpt.CheckpointImpl.NO_REENTRANT
                layers[i] = ckpt.checkpoint_wrapper(layers[i], checkpoint_impl=impl)
            fully_shard(layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)

    _, wrap_s = _timed(wrap)
    note = "checkpoint_wrapper(NO_REENTRANT) + " if checkpoint else ""
    return model, _adamw(model), f"torch {note}fully_shard", load_s, wrap_s


def transformers_fsdp():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from hf_scale.zoo import SMOLLM2_GGUF, smollm2_dir

    folder, how = smollm2_dir(), "from_pretrained(gguf, DistributedConfig(fsdp_size=2))"
    # GGUF loads with distributed_config (checked), so no re-save to safetensors is needed.
    model, load_s = _timed(
        AutoModelForCausalLM.from_pretrained, folder, gguf_file=SMOLLM2_GGUF,
        dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=WORLD),
    )
    AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)  # as load_smollm2 does
    return model, _adamw(model), f"transformers {how}", load_s, None


def accelerate_fsdp2():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from hf_scale.zoo import load_smollm2

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    (model, _), load_s = _timed(load_smollm2)
    (model, optimizer), prepare_s = _timed(accelerator.prepare, model, _adamw(model))
    kept = "kept" if getattr(accelerator.state, "fsdp_plugin", None) is not None else "dropped"
    return model, optimizer, (
        f"accelerate distributed_type={accelerator.distributed_type.value}, FSDP plugin {kept}"
    ), load_s, prepare_s


def _hf(**config):
    return functools.partial(hf_scale_run, config)


FULL_AC = {"strategy": "fsdp", "activation_checkpointing": "full"}
CONTENDERS = {  # name: (row label, builder returning (model, optimizer, note, load_s, par_s), shape)
    "hf_fsdp": ("1 hf_scale fsdp", _hf(strategy="fsdp"), SHORT),
    "hf_zero2": ("2 hf_scale zero2", _hf(strategy="zero2"), SHORT),
    "hf_zero1": ("3 hf_scale zero1", _hf(strategy="zero1"), SHORT),
    "hf_ddp": ("4 hf_scale ddp", _hf(strategy="ddp"), SHORT),
    "torch_fsdp": ("5 torch fully_shard", torch_fsdp, SHORT),
    "transformers": ("6 transformers DistributedConfig", transformers_fsdp, SHORT),
    "accelerate": ("7 accelerate FSDP2 plugin", accelerate_fsdp2, SHORT),
    "hf_fsdp_ac": ("8a hf_scale fsdp + full AC", _hf(**FULL_AC), SHORT),
    "torch_fsdp_ac": ("8b torch checkpoint_wrapper + fully_shard",
                      functools.partial(torch_fsdp, checkpoint=True), SHORT),
    "hf_fsdp_ac_chunk": ("9 hf_scale fsdp + full AC + chunked loss",
                         _hf(**FULL_AC, loss_chunk_tokens=128), SHORT),
    "hf_fsdp_ac_2k": ("10a hf_scale fsdp + full AC, 1x2048/rank", _hf(**FULL_AC), LONG),
    "hf_fsdp_ac_chunk_2k": ("10b hf_scale fsdp + full AC + chunked loss (256), 1x2048/rank",
                            _hf(**FULL_AC, loss_chunk_tokens=256), LONG),
    "hf_auto": ("11 hf_scale strategy auto", hf_scale_auto, SHORT),
    # --bounds (scripts/bench_fsdp_bounds.py): what any FSDP reaches here, not ways to train
    "bound_compute": ("B1 bound: compute alone (whole model, 1/2 of AdamW, no collective)",
                      functools.partial(bound_compute, LR, WORLD), SHORT),
    "bound_collectives": ("B2 bound: the fsdp step's collectives alone (tok/s: tokens / their time)",
                          bound_collectives, SHORT),
}


# ------------------------------------------------------------------ the shared worker entry
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"{args.worker}.rank{rank}.json"
    _, build, (per_rank, seq_len) = CONTENDERS[args.worker]
    try:
        model, optimizer, note, load_s, parallelize_s = build()
    except Unavailable as e:
        out.write_text(json.dumps({"status": str(e)}))
        return
    description, is_fsdp = ran_as(model, f"{note}; optimizer {type(optimizer).__name__}")
    if rank == 0:
        print(f"[{args.worker}] {description}", flush=True)
    vocab = getattr(model, "module", model).config.vocab_size  # accelerate may return a DDP wrapper
    shape = (args.warmup + args.steps, per_rank * WORLD, seq_len)
    data = torch.randint(vocab, shape, generator=torch.Generator().manual_seed(1234))
    data = data[:, rank * per_rank : (rank + 1) * per_rank]

    model.train()
    sampler = RssSampler()
    sampler.start()
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        if i == args.warmup:  # the timed phase starts: note the CPU used so far, ours and all
            timed = (start, time.process_time(), busy_cpu_seconds())
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    wall, own_cpu = time.perf_counter() - timed[0], time.process_time() - timed[1]
    all_cpu = busy_cpu_seconds() - timed[2]
    train_peak = sampler.stop()
    totals = torch.tensor([float(loss.detach()), own_cpu], dtype=torch.float64)
    dist.all_reduce(totals)  # the loss and the CPU time of both ranks
    result = {
        "status": "ok", "ran_as": description, "is_fsdp": is_fsdp,
        "step_times": times[args.warmup :], "load_s": load_s, "parallelize_s": parallelize_s,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "train_peak_rss": train_peak,
        "last_loss": float(totals[0]) / WORLD,
        "other_load": max(0.0, all_cpu - float(totals[1])) / wall,
    }
    out.write_text(json.dumps(result))
    dist.barrier()
    from hf_scale.distributed import shutdown_distributed

    shutdown_distributed()


# ------------------------------------------------------------------ the launcher


def launch(name: str, args, out_dir: Path) -> dict:
    """Run one contender as its own torchrun (2 ranks); merge the ranks' results into one row."""
    cmd = torchrun(os.path.abspath(__file__), WORLD, "--worker", name, "--out", str(out_dir),
                   "--steps", str(args.steps), "--warmup", str(args.warmup))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    start = time.perf_counter()
    results, error = launch_ranks(cmd, out_dir, name, WORLD, args.timeout, env)
    wall = time.perf_counter() - start
    if error:
        return {"status": error, "wall": wall}
    per_rank, seq_len = CONTENDERS[name][2]
    slowest = [max(step) for step in zip(*(r["step_times"] for r in results))]
    most = lambda key: None if results[0][key] is None else max(r[key] for r in results)
    first = results[0]
    return {
        "status": "ok", "wall": wall,
        "tok_s": WORLD * per_rank * seq_len * len(slowest) / sum(slowest),
        "peak": max(r["peak_rss"] for r in results) / 1e9,
        "train_peak": max(r["train_peak_rss"] for r in results) / 1e9,
        "load_s": most("load_s"), "parallelize_s": most("parallelize_s"),
        "ran_as": first["ran_as"], "is_fsdp": first["is_fsdp"], "loss": first["last_loss"],
        "other_load": first["other_load"],
    }


def _ok(rows: dict, *names: str) -> bool:
    return all(rows.get(n, {}).get("status") == "ok" for n in names)


def _anchors(rows: dict, shape: tuple) -> list[dict]:
    return [rows[a] for a in ANCHORS[shape] if _ok(rows, a) and rows[a]["is_fsdp"]]


def table(rows: dict) -> str:
    header = ["contender", "ratio tok/s vs best anchor", "ratio peak RSS vs lowest anchor",
              "tokens/rank", "tok/s", "peak RSS/rank (GB)", "train-phase peak RSS/rank (GB)",
              "load (s)", "parallelize (s)", "ran as", "last loss", "other load (cores)"]
    cells = []
    for name, row in rows.items():
        label, _, shape = CONTENDERS[name]
        if name in ANCHORS[shape] and _ok(rows, name):
            label += " (anchor)" if row["is_fsdp"] else " (not an anchor: not FSDP)"
        if not _ok(rows, name):
            cells.append([label, row["status"]])
            continue
        anchors = _anchors(rows, shape)
        best_tok = max((a["tok_s"] for a in anchors), default=None)
        low_peak = min((a["peak"] for a in anchors), default=None)
        par = row["parallelize_s"]
        cells.append([
            label, f"{row['tok_s'] / best_tok:.2f}" if best_tok else "n/a",
            f"{row['peak'] / low_peak:.2f}" if low_peak else "n/a", f"{shape[0]}x{shape[1]}",
            f"{row['tok_s']:.0f}", f"{row['peak']:.3f}", f"{row['train_peak']:.3f}",
            f"{row['load_s']:.2f}", "in load" if par is None else f"{par:.2f}",
            row["ran_as"], f"{row['loss']:.5f}", f"{row['other_load']:.2f}",
        ])
    return markdown_table(header, cells)


def _chunk_check(rows: dict, tag: str, chunked: str, base: str, base_label: str) -> str:
    c, f = rows[chunked], rows[base]
    same = abs(c["loss"] - f["loss"]) <= 1e-3 * abs(f["loss"])
    passed = c["peak"] <= 0.7 * f["peak"] and same
    return (f"{tag} {'PASS' if passed else 'FAIL'}: {CONTENDERS[chunked][0]} peak RSS "
            f"{c['peak'] / f['peak']:.3f}x {base_label} (need <= 0.70x; train-phase "
            f"{c['train_peak'] / f['train_peak']:.3f}x); loss {c['loss']:.5f} vs {f['loss']:.5f} "
            f"({'same' if same else 'DIFFERENT'} within 1e-3 relative)")


def rounds(runs: list[tuple[str, dict]], a: str = "hf_fsdp", b: str = "torch_fsdp") -> list[str]:
    """Issue 42's target, per round of alternating legs (``--legs hf_fsdp,torch_fsdp,hf_fsdp,
    torch_fsdp``: the i-th ``a`` against the i-th ``b``, both under about the same load): (f)
    ``a`` >= 1.1x ``b`` in tokens/s with the same last loss (1e-4 relative) and peak RSS <= 1.0x,
    in every round."""
    pairs = list(zip(*([row for name, row in runs if name == leg and row["status"] == "ok"] for leg in (a, b))))
    if not pairs:
        return []
    lines, passed = [], True
    for i, (x, y) in enumerate(pairs, 1):
        tok, peak = x["tok_s"] / y["tok_s"], x["peak"] / y["peak"]
        same = abs(x["loss"] - y["loss"]) <= 1e-4 * abs(y["loss"])
        passed &= tok >= 1.1 and peak <= 1.0 and same
        lines.append(f"    round {i}: {x['tok_s']:.1f} / {y['tok_s']:.1f} tok/s = {tok:.3f}x, peak RSS {peak:.3f}x, "
                     f"last loss {x['loss']:.5f} / {y['loss']:.5f}, other load {x['other_load']:.2f} / "
                     f"{y['other_load']:.2f}")
    head = (f"(f) {'PASS' if passed else 'FAIL'}: {CONTENDERS[a][0]} against {CONTENDERS[b][0]} per round "
            "(need >= 1.1x tok/s, peak RSS <= 1.0x, same last loss, every round)")
    return [head + "\n" + "\n".join(lines)]


def checks(rows: dict, runs: list[tuple[str, dict]] = ()) -> list[str]:
    """The targets whose rows ran as PASS/FAIL lines (n/a, with why, when one of them failed)."""
    verdict = lambda passed: "PASS" if passed else "FAIL"
    labels = {name: CONTENDERS[name][0] for name in CONTENDERS}
    tokens = WORLD * SHORT[0] * SHORT[1]
    anchors, out = _anchors(rows, SHORT), rounds(list(runs)) + bounds_line(list(runs), labels, tokens)
    if _ok(rows, "hf_fsdp") and anchors:
        tok = rows["hf_fsdp"]["tok_s"] / max(a["tok_s"] for a in anchors)
        peak = rows["hf_fsdp"]["peak"] / min(a["peak"] for a in anchors)
        out.append(f"(a) {verdict(tok >= 1 and peak <= 1)}: hf_scale fsdp tok/s {tok:.3f}x the "
                   f"best FSDP anchor (need >= 1.0x), peak RSS {peak:.3f}x the lowest anchor "
                   "(need <= 1.0x)")
    if _ok(rows, "hf_fsdp_ac", "torch_fsdp_ac"):
        h, t = rows["hf_fsdp_ac"], rows["torch_fsdp_ac"]
        out.append(f"(b) {verdict(h['peak'] <= t['peak'])}: hf_scale fsdp+full AC peak RSS "
                   f"{h['peak'] / t['peak']:.3f}x checkpoint_wrapper+fully_shard (need <= 1.0x; "
                   f"train-phase {h['train_peak'] / t['train_peak']:.3f}x)")
    if _ok(rows, "hf_fsdp_ac_chunk", "hf_fsdp"):
        out.append(_chunk_check(rows, "(c)", "hf_fsdp_ac_chunk", "hf_fsdp", "fsdp"))
    if _ok(rows, "hf_fsdp_ac_chunk_2k", "hf_fsdp_ac_2k"):
        out.append(_chunk_check(rows, "(d)", "hf_fsdp_ac_chunk_2k", "hf_fsdp_ac_2k",
                                "fsdp + full AC at 1x2048/rank"))
    if _ok(rows, "hf_auto", "torch_fsdp"):  # issue 14: auto >= 1.1x plain fully_shard, within its budget
        import psutil

        a, t = rows["hf_auto"], rows["torch_fsdp"]
        budget = psutil.virtual_memory().total / WORLD  # what strategy auto plans with on CPU
        out.append(f"(e) {verdict(a['tok_s'] / t['tok_s'] >= 1.1 and a['peak'] * 1e9 <= budget)}: hf_scale strategy "
                   f"auto tok/s {a['tok_s'] / t['tok_s']:.3f}x torch fully_shard per block (need >= 1.1x), peak RSS "
                   f"{a['peak']:.2f} GB per rank (its budget: {budget / 1e9:.2f} GB, the RAM over {WORLD} ranks)")
    needs = {"(a)": ("hf_fsdp", *ANCHORS[SHORT]), "(b)": ("hf_fsdp_ac", "torch_fsdp_ac"),
             "(c)": ("hf_fsdp_ac_chunk", "hf_fsdp"), "(d)": ("hf_fsdp_ac_chunk_2k", "hf_fsdp_ac_2k"),
             "(e)": ("hf_auto", "torch_fsdp")}
    for check, names in needs.items():
        if any(n in rows for n in names) and not any(line.startswith(check) for line in out):
            missing = [f"{n}: {rows.get(n, {}).get('status', 'not run')}"
                       for n in names if not _ok(rows, n)]
            out.append(f"{check} n/a ({'; '.join(missing) or 'no FSDP anchor ran'})")
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    short = [n for n, c in CONTENDERS.items() if c[2] == SHORT and n not in BOUNDS]
    parser.add_argument("--legs", "--only", dest="legs", default=",".join(short),
                        help=f"comma-separated contenders among {', '.join(CONTENDERS)} "
                        "(default: the 2 x 256 ones)")
    parser.add_argument("--bounds", action="store_true",
                        help="also run the bounds (scripts/bench_fsdp_bounds.py) after the legs, unless "
                        "--legs names them: what any FSDP implementation can reach here")
    parser.add_argument("--out", help="folder for per-rank results and logs (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per contender")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's default mmap threshold (RSS then includes freed memory)")
    add_write_arg(parser, "parallelize")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    names = [n.strip() for n in args.legs.split(",") if n.strip()]
    names += [b for b in BOUNDS if args.bounds and b not in names]
    if set(names) - set(CONTENDERS) or args.steps < 1:
        parser.error(f"--steps must be >= 1 and --legs names among {', '.join(CONTENDERS)}")
    check_doc(args)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="bench_parallelize_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    malloc = "default" if args.default_malloc else "MALLOC_MMAP_THRESHOLD_=65536"
    title = (f"SmolLM2-135M fp32, AdamW lr {LR}, {WORLD} gloo ranks, {args.warmup} warm-up + "
             f"{args.steps} timed steps, malloc {malloc}; hf_scale at {revision()}")
    print(f"{title}; logs in {out_dir}", flush=True)
    start, rows, runs = time.perf_counter(), {}, []
    for name in names:  # a leg named twice runs twice: the table shows its last run, (f) each round
        row = rows[name] = launch(name, args, out_dir)
        runs.append((name, row))
        shown = row["status"]
        if _ok(rows, name):
            shown = (f"{row['tok_s']:.0f} tok/s, peak {row['peak']:.3f} GB, "
                     f"other load {row['other_load']:.2f}")
        print(f"  {CONTENDERS[name][0]}: {shown} ({row['wall']:.0f} s)", flush=True)
    if revision() != title.rsplit(" at ", 1)[1]:  # a commit or an edit landed during the run
        title += f" at the start, {revision()} at the end"
    result = f"{table(rows)}\n\n```\n" + "\n".join(checks(rows, runs)) + "\n```"
    print(f"\n{result}\n\ntotal wall time {time.perf_counter() - start:.0f} s")
    shared = max((r["other_load"] for r in rows.values() if r["status"] == "ok"), default=0.0)
    note = (f"Other processes used up to {shared:.2f} CPU cores during the timed steps: tok/s and "
            "seconds are noisy, RSS is not." if shared > 0.1 else "")
    write_doc(args, f"{title}.\n\n{result}", note)


if __name__ == "__main__":
    main()
