"""Benchmark: hf_scale.parallelize against plain torch, transformers and accelerate on SmolLM2-135M.

Run (one machine; the script launches every contender itself, 2 ranks each, gloo on CPU)::

    python scripts/bench_parallelize.py --steps 3        # the full table, ~15 min on 2 CPU cores
    python scripts/bench_parallelize.py --steps 1 --only hf_fsdp,torch_fsdp     # a quick check

Every contender trains the real SmolLM2-135M (fp32) with AdamW (lr 1e-5, no weight decay) on the
same fixed random token ids (labels = input_ids), 4 x 256 tokens per step (2 x 256 per rank),
``--warmup`` untimed steps then ``--steps`` timed ones, each contender in its own fresh
``torchrun --nproc_per_node 2`` (OMP_NUM_THREADS=1 per rank). Reported per contender:

* tokens/s: global tokens per step / mean time of the timed steps (per step, the slowest rank);
* peak RSS per rank: max over ranks of ``getrusage(RUSAGE_SELF).ru_maxrss`` (includes loading);
* train-phase peak RSS per rank: max over ranks of the RSS sampled every 5 ms from just before
  the first (warm-up) step to the end;
* what it really ran (FSDP2 units, DTensor parameters, DDP, optimizer) and the last step's loss
  averaged over ranks, to show every contender trains the same thing;
* other load: CPU cores used by other processes in the timed steps; above ~0.1 the machine was
  shared and tokens/s is not trustworthy.

Ratios are against the FSDP anchors (torch ``fully_shard``, transformers
``DistributedConfig(fsdp_size=2)``, accelerate's FSDP2 plugin) that really ran FSDP.

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
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GLOBAL_BATCH, SEQ_LEN, WORLD, LR = 4, 256, 2, 1e-5
ANCHORS = ("torch_fsdp", "transformers", "accelerate")


class Unavailable(Exception):
    """A contender that cannot run in this environment; the message is printed in its row."""


# ------------------------------------------------------------------ contenders (run on each rank)


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def hf_scale_run(config: dict):
    import hf_scale
    from hf_scale.zoo import load_smollm2

    missing = set(config) - set(hf_scale.ParallelConfig.__dataclass_fields__)
    if missing:
        raise Unavailable(f"n/a (option missing: {', '.join(sorted(missing))})")
    model, _ = load_smollm2()
    model = hf_scale.parallelize(model, config)
    return model, hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0), f"hf_scale {config}"


def torch_fsdp(checkpoint: bool = False):
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_scale.zoo import load_smollm2

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    model, _ = load_smollm2()
    layers = model.model.layers
    for i in range(len(layers)):
        if checkpoint:
            impl = ckpt.CheckpointImpl.NO_REENTRANT
            layers[i] = ckpt.checkpoint_wrapper(layers[i], checkpoint_impl=impl)
        fully_shard(layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    note = "checkpoint_wrapper(NO_REENTRANT) + " if checkpoint else ""
    return model, _adamw(model), f"torch {note}fully_shard"


def transformers_fsdp():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from hf_scale.zoo import SMOLLM2_GGUF, smollm2_dir

    folder, how = smollm2_dir(), "from_pretrained(gguf, DistributedConfig(fsdp_size=2))"
    # GGUF loads with distributed_config (checked), so no re-save to safetensors is needed.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32,
        distributed_config=DistributedConfig(fsdp_size=WORLD),
    )
    AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)  # as load_smollm2 does
    return model, _adamw(model), f"transformers {how}"


def accelerate_fsdp2():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from hf_scale.zoo import load_smollm2

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model, _ = load_smollm2()
    model, optimizer = accelerator.prepare(model, _adamw(model))
    kept = "kept" if getattr(accelerator.state, "fsdp_plugin", None) is not None else "dropped"
    return model, optimizer, (
        f"accelerate distributed_type={accelerator.distributed_type.value}, FSDP plugin {kept}"
    )


def _hf(**config):
    return functools.partial(hf_scale_run, config)


FULL_AC = {"strategy": "fsdp", "activation_checkpointing": "full"}
CONTENDERS = {  # name: (row label, builder returning (model, optimizer, note))
    "hf_fsdp": ("1 hf_scale fsdp", _hf(strategy="fsdp")),
    "hf_zero2": ("2 hf_scale zero2", _hf(strategy="zero2")),
    "hf_zero1": ("3 hf_scale zero1", _hf(strategy="zero1")),
    "hf_ddp": ("4 hf_scale ddp", _hf(strategy="ddp")),
    "torch_fsdp": ("5 torch fully_shard", torch_fsdp),
    "transformers": ("6 transformers DistributedConfig", transformers_fsdp),
    "accelerate": ("7 accelerate FSDP2 plugin", accelerate_fsdp2),
    "hf_fsdp_ac": ("8a hf_scale fsdp + full AC", _hf(**FULL_AC)),
    "torch_fsdp_ac": ("8b torch checkpoint_wrapper + fully_shard",
                      functools.partial(torch_fsdp, checkpoint=True)),
    "hf_fsdp_ac_chunk": ("9 hf_scale fsdp + full AC + chunked loss",
                         _hf(**FULL_AC, loss_chunk_tokens=128)),
}


# ------------------------------------------------------------------ the shared worker entry


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, all cores)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class RssSampler(threading.Thread):
    """Samples this process's RSS every ``interval`` seconds; :meth:`stop` returns the peak."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, _rss_bytes(), threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _rss_bytes())


def ran_as(model, note: str) -> tuple[str, bool]:
    """What the prepared model really is, and whether it is a real FSDP run."""
    import torch
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        kind = "DDP (DistributedDataParallel wrapper)"
    elif n_dtensor:
        kind = f"FSDP2 ({units} fully_shard units, {n_dtensor}/{len(params)} params DTensor)"
    elif "replicate" in (_get_registry(model) or {}):
        kind = "DDP (composable replicate)"
    else:
        kind = f"{type(model).__name__}, plain params"
    return f"{kind}; {note}", n_dtensor == len(params) > 0


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"{args.worker}.rank{rank}.json"
    try:
        model, optimizer, note = CONTENDERS[args.worker][1]()
    except Unavailable as e:
        out.write_text(json.dumps({"status": str(e)}))
        return
    description, is_fsdp = ran_as(model, f"{note}; optimizer {type(optimizer).__name__}")
    if rank == 0:
        print(f"[{args.worker}] {description}", flush=True)
    vocab = getattr(model, "module", model).config.vocab_size  # accelerate may return a DDP wrapper
    shape = (args.warmup + args.steps, GLOBAL_BATCH, SEQ_LEN)
    data = torch.randint(vocab, shape, generator=torch.Generator().manual_seed(1234))
    per_rank = GLOBAL_BATCH // WORLD
    data = data[:, rank * per_rank : (rank + 1) * per_rank]

    model.train()
    sampler = RssSampler()
    sampler.start()
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        if i == args.warmup:  # the timed phase starts: note the CPU used so far, ours and all
            timed = (start, time.process_time(), _busy_cpu_seconds())
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    wall, own_cpu = time.perf_counter() - timed[0], time.process_time() - timed[1]
    all_cpu = _busy_cpu_seconds() - timed[2]
    train_peak = sampler.stop()
    totals = torch.tensor([float(loss.detach()), own_cpu], dtype=torch.float64)
    dist.all_reduce(totals)  # the loss and the CPU time of both ranks
    result = {
        "status": "ok",
        "ran_as": description,
        "is_fsdp": is_fsdp,
        "step_times": times[args.warmup :],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "train_peak_rss": train_peak,
        "last_loss": float(totals[0]) / WORLD,
        "other_load": max(0.0, all_cpu - float(totals[1])) / wall,
    }
    out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the launcher


def _revision() -> str:
    """Where the measured hf_scale lives and its commit, '+dirty' if hf_scale/ has changes."""
    import importlib.util

    root = str(Path(importlib.util.find_spec("hf_scale").origin).parent.parent)
    run = functools.partial(subprocess.run, capture_output=True, text=True)
    git = lambda *a: run(["git", "-C", root, *a]).stdout  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD").strip() or "(no git)"
    return f"{root} {commit}" + ("+dirty" if git("status", "--porcelain", "--", "hf_scale") else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure_reason(log: str, returncode) -> str:
    errors = re.findall(r"^\s*(?:\[rank\d+\]:\s*)?(\w*(?:Error|Exception)\b:? .*)$", log, re.M)
    reason = errors[-1].strip() if errors else f"exit code {returncode}"
    return "failed: " + (reason[:160] + "..." if len(reason) > 160 else reason)


def launch(name: str, args, out_dir: Path) -> dict:
    """Run one contender as its own torchrun (2 ranks); merge the ranks' results into one row."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        os.path.abspath(__file__), "--worker", name, "--out", str(out_dir),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    log_path = out_dir / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            returncode = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {args.timeout}s"
    wall = time.perf_counter() - start
    ranks = [out_dir / f"{name}.rank{r}.json" for r in range(WORLD)]
    results = [json.loads(p.read_text()) for p in ranks if p.exists()]
    if returncode != 0 or len(results) < WORLD or any(r["status"] != "ok" for r in results):
        status = next((r["status"] for r in results if r["status"] != "ok"), None)
        status = status or _failure_reason(log_path.read_text(errors="replace"), returncode)
        return {"status": status, "wall": wall}
    slowest = [max(step) for step in zip(*(r["step_times"] for r in results))]
    first = results[0]
    return dict(
        status="ok", wall=wall, tok_s=GLOBAL_BATCH * SEQ_LEN * len(slowest) / sum(slowest),
        peak=max(r["peak_rss"] for r in results) / 1e9,
        train_peak=max(r["train_peak_rss"] for r in results) / 1e9,
        ran_as=first["ran_as"], is_fsdp=first["is_fsdp"], loss=first["last_loss"],
        other_load=first["other_load"],
    )


def _ok(rows: dict, *names: str) -> bool:
    return all(rows.get(n, {}).get("status") == "ok" for n in names)


def _anchors(rows: dict) -> list[dict]:
    return [rows[a] for a in ANCHORS if _ok(rows, a) and rows[a]["is_fsdp"]]


def table(rows: dict) -> str:
    anchors = _anchors(rows)
    best_tok = max((a["tok_s"] for a in anchors), default=None)
    low_peak = min((a["peak"] for a in anchors), default=None)
    header = ["contender", "ratio_tok/s_vs_best_FSDP_anchor", "ratio_peakRSS_vs_lowest_anchor",
              "tok/s", "peak RSS/rank (GB)", "train-phase peak RSS/rank (GB)", "ran as",
              "last loss", "other load (cores)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in rows.items():
        label = CONTENDERS[name][0]
        if name in ANCHORS and _ok(rows, name):
            label += " (anchor)" if row["is_fsdp"] else " (not an anchor: not FSDP)"
        cells = [label, row["status"]] + [""] * (len(header) - 2)
        if _ok(rows, name):
            cells[1:] = [
                f"{row['tok_s'] / best_tok:.2f}" if best_tok else "n/a",
                f"{row['peak'] / low_peak:.2f}" if low_peak else "n/a",
                f"{row['tok_s']:.0f}", f"{row['peak']:.3f}", f"{row['train_peak']:.3f}",
                row["ran_as"], f"{row['loss']:.5f}", f"{row['other_load']:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(rows: dict) -> list[str]:
    """The issue's targets (a), (b), (c) as PASS/FAIL lines (n/a when a row is missing)."""
    verdict = lambda passed: "PASS" if passed else "FAIL"  # noqa: E731
    anchors, out = _anchors(rows), []
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
        c, f = rows["hf_fsdp_ac_chunk"], rows["hf_fsdp"]
        same = abs(c["loss"] - f["loss"]) <= 1e-3 * abs(f["loss"])
        out.append(f"(c) {verdict(c['peak'] <= 0.7 * f['peak'] and same)}: fsdp+full AC+chunked "
                   f"loss peak RSS {c['peak'] / f['peak']:.3f}x fsdp (need <= 0.70x; train-phase "
                   f"{c['train_peak'] / f['train_peak']:.3f}x); loss {c['loss']:.5f} vs "
                   f"{f['loss']:.5f} ({'same' if same else 'DIFFERENT'} within 1e-3 relative)")
    for check, names in (("(a)", ("hf_fsdp", *ANCHORS)), ("(b)", ("hf_fsdp_ac", "torch_fsdp_ac")),
                         ("(c)", ("hf_fsdp_ac_chunk", "hf_fsdp"))):
        if not any(line.startswith(check) for line in out):
            missing = [f"{n}: {rows.get(n, {}).get('status', 'not run')}"
                       for n in names if not _ok(rows, n)]
            out.append(f"{check} n/a ({'; '.join(missing) or 'no FSDP anchor ran'})")
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    parser.add_argument("--out", help="folder for per-rank results and logs (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per contender")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's default mmap threshold (RSS then includes freed memory)")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if set(names) - set(CONTENDERS) or args.steps < 1:
        parser.error(f"--steps must be >= 1 and --only names among {', '.join(CONTENDERS)}")
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="bench_parallelize_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    malloc = "default" if args.default_malloc else "MALLOC_MMAP_THRESHOLD_=65536"
    print(f"SmolLM2-135M fp32, AdamW lr {LR}, {GLOBAL_BATCH}x{SEQ_LEN} tokens/step over {WORLD} "
          f"gloo ranks, {args.warmup} warm-up + {args.steps} timed steps, malloc {malloc}; "
          f"hf_scale at {_revision()}; logs in {out_dir}", flush=True)
    start, rows = time.perf_counter(), {}
    for name in names:
        row = rows[name] = launch(name, args, out_dir)
        shown = row["status"]
        if _ok(rows, name):
            shown = (f"{row['tok_s']:.0f} tok/s, peak {row['peak']:.3f} GB, "
                     f"other load {row['other_load']:.2f}")
        print(f"  {CONTENDERS[name][0]}: {shown} ({row['wall']:.0f} s)", flush=True)
    print(f"\n{table(rows)}\n")
    print("\n".join(checks(rows)))
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
