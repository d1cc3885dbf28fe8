"""Benchmark: the parts of a fine-tuning step that explain ``bench_finetune.py``'s numbers.

    python scripts/bench_step_parts.py            # ~1 minute on 2 CPU cores
    python scripts/bench_step_parts.py --write docs/benchmarks.md     # and into its doc section

1. AdamW's step over the real SmolLM2-135M-Instruct parameters (one process, one thread):
   torch's fused kernel (what ``hf_scale.build_optimizer`` and HF ``Trainer`` use) against the
   per-tensor loop (``foreach=False``) and the multi-tensor one (``foreach=True``).
2. The collectives FSDP and DDP issue per transformer block, on 2 gloo ranks (torchrun), for one
   SmolLM2 block of fp32 parameters: FSDP all-gathers each block in forward and in backward and
   reduce-scatters its gradients; DDP all-reduces the gradients once.

Ratios first, as in the other benchmarks. Times are medians over repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_write_arg, check_doc, torchrun, write_doc

BLOCK_PARAMS = 4_424_000  # one SmolLM2-135M decoder layer (fp32 elements)
BLOCKS = 30


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def optimizer_table() -> list[str]:
    import torch

    from hf_scale.zoo import load_smollm2

    torch.set_num_threads(1)
    model, _ = load_smollm2()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows = {}
    for name, kwargs in [("fused", {"fused": True}), ("foreach", {"foreach": True}), ("loop", {"foreach": False})]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
        rows[name] = _median_seconds(optimizer.step, 3)
    lines = ["| AdamW step (SmolLM2-135M, 1 thread) | ratio vs fused | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {t / rows['fused']:.2f} | {t:.3f} |" for name, t in rows.items()]
    return lines


def collectives_worker() -> None:
    """Run under torchrun: time the per-block collectives, rank 0 prints a table."""
    import warnings

    import torch
    import torch.distributed as dist

    from hf_scale.distributed import shutdown_distributed

    warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor names are deprecated
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    full, shard, gathered = torch.randn(BLOCK_PARAMS), torch.randn(BLOCK_PARAMS // world), torch.empty(BLOCK_PARAMS)

    def timed(fn):
        def run():
            fn()
            dist.barrier()
        return _median_seconds(run, 10)

    ag = timed(lambda: dist.all_gather_into_tensor(gathered, shard))
    rs = timed(lambda: dist.reduce_scatter_tensor(shard, full))
    ar = timed(lambda: dist.all_reduce(full))
    if dist.get_rank() == 0:
        fsdp, ddp = BLOCKS * (2 * ag + rs), BLOCKS * ar
        print(f"| collective per block ({BLOCK_PARAMS / 1e6:.1f}M fp32, {world} gloo ranks) | ratio vs all-reduce | ms |")
        print("|---|---|---|")
        for name, t in [("all-gather", ag), ("reduce-scatter", rs), ("all-reduce", ar)]:
            print(f"| {name} | {t / ar:.2f} | {t * 1e3:.1f} |")
        print(f"\nper step, {BLOCKS} blocks: fsdp 2 x all-gather + reduce-scatter = {fsdp:.2f} s; "
              f"ddp all-reduce = {ddp:.2f} s ({fsdp / ddp:.1f}x)")
    shutdown_distributed()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_write_arg(parser, "step-parts")
    parser.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives:
        return collectives_worker()
    check_doc(args)
    print(f"command: python {' '.join(sys.argv)}; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    optimizer = "\n".join(optimizer_table())
    print(optimizer + "\n", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    collectives = subprocess.run(torchrun(__file__, 2, "--collectives"), check=True, env=env,
                                 stdout=subprocess.PIPE, text=True, timeout=600).stdout
    print(collectives)
    write_doc(args, f"{optimizer}\n\n{collectives}", "Times depend on what else the machine runs "
              "(load average in this line).")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
