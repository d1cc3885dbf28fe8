"""Mixture-of-experts training throughput: hf_scale's expert parallel beside transformers' own
(``DistributedConfig(fsdp_size=W, ep_size=W)``) and plain fsdp, on a Qwen3-MoE-shaped model
(16 experts, top-2, hidden 512, random init, fp32) at 2 and 4 CPU ranks (gloo).

hf_scale's ep runs twice: with the dense weights replicated by DDP (``{"strategy": "ddp",
"ep": W}``: every rank its own experts, the dense gradients all-reduced in buckets while backward
goes on, no parameter all-gather) and FSDP-sharded (``{"strategy": "fsdp", "ep": W}``, the
layout of transformers' leg, whose ``DistributedConfig`` has no replicated-dense ep: its ep must
divide fsdp x tp). The throughput target is judged on the first, at no more peak memory than
transformers' ep; the second is shown beside it.

Each leg trains the same model on the same data (every rank its own batch) for ``--steps``
AdamW steps after ``--warmup``; it reports tokens/s over the measured steps, the ranks' peak RSS,
the losses of every step (mean over ranks), the expert bytes a rank holds, and for hf_scale's
ep the time spent in the token all-to-alls per step beside their byte count.

    python scripts/bench_moe.py                               # 2 and 4 ranks, print the table
    python scripts/bench_moe.py --write docs/benchmarks.md    # into its section
    python scripts/bench_moe.py --bounds                      # and what limits any ep here (BOUNDS)
    python scripts/bench_moe.py --worker LEG OUT              # one leg's rank (run by torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
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

MODEL = dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_experts=16,
             num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, vocab_size=8192, max_position_embeddings=512, norm_topk_prob=True)
SEQ, BATCH, LR = 256, 4, 1e-4
LEGS = ("hf_scale_ep_ddp", "hf_scale_ep", "transformers_ep", "hf_scale_fsdp")
# --bounds: what limits any ep implementation on this machine, not ways to train: ep + ddp with
# DDP's gradient all-reduce switched off (the dense gradients are then NOT averaged: its losses
# drift from the others), and every rank training a whole model alone on its own batch, no process
# group work but the one-number loss all-reduce every leg records (the same expert rows per rank as
# balanced ep, spread over all the experts instead of 1/ep of them: the compute floor)
BOUNDS = ("bound_ep_ddp_no_allreduce", "bound_no_communication")
# hf_scale's layouts: ep (over every rank) with the dense weights replicated (ddp) or FSDP-sharded
# (fsdp, the layout of transformers' leg); plain fsdp without ep
CONFIGS = {"hf_scale_ep_ddp": {"strategy": "ddp", "ep": True}, "hf_scale_ep": {"strategy": "fsdp", "ep": True},
           "hf_scale_fsdp": {"strategy": "fsdp"}, "bound_ep_ddp_no_allreduce": {"strategy": "ddp", "ep": True}}


def make_model(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**MODEL)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def batch_for(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def worker(leg: str, out: Path, folder: Path, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    record = {"status": "ok", "leg": leg, "world": world}
    try:
        dist.init_process_group("gloo")
        sampler = RssSampler()
        sampler.start()
        if leg == "bound_no_communication":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        elif leg == "transformers_ep":
            from transformers import AutoModelForCausalLM
            from transformers.distributed import DistributedConfig

            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world))
            # fused, as HF Trainer's default (adamw_torch_fused), hf_scale's build_optimizer and the bound leg
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        else:
            import hf_scale

            config = {**CONFIGS[leg], **({"ep": world} if CONFIGS[leg].get("ep") else {})}  # ep: every rank
            model = hf_scale.from_pretrained(folder, config)
            optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.0)
            if leg == "bound_ep_ddp_no_allreduce":
                model.set_requires_gradient_sync(False)
        model.train()
        record["expert_bytes"] = _expert_bytes(model)
        timer = _A2ATimer()
        losses, start, phases = [], None, [0.0, 0.0, 0.0]
        for step in range(warmup + steps):
            if step == warmup:
                dist.barrier()
                start, timer.seconds, timer.bytes, phases = time.perf_counter(), 0.0, 0, [0.0, 0.0, 0.0]
            t0 = time.perf_counter()
            loss = model(**batch_for(step, rank)).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            t3 = time.perf_counter()
            for i, seconds in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                phases[i] += seconds
            value = loss.detach().reshape(1).clone()
            dist.all_reduce(value)
            losses.append(float(value) / world)
        dist.barrier()
        elapsed = time.perf_counter() - start
        timer.stop()
        record.update(losses=losses, seconds=elapsed, tokens_per_s=steps * BATCH * SEQ * world / elapsed,
                      a2a_seconds_per_step=timer.seconds / steps, a2a_bytes_per_step=timer.bytes / steps,
                      phases_ms=[1e3 * p / steps for p in phases],
                      peak_rss=sampler.stop())
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the table says why a leg failed
        import traceback

        traceback.print_exc()
        record["status"] = f"{type(e).__name__}: {str(e)[:200]}"
    (out / f"{leg}.w{os.environ['WORLD_SIZE']}.rank{rank}.json").write_text(json.dumps(record))


def _expert_bytes(model) -> int:
    """Bytes of expert weights this rank holds between steps (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


class _A2ATimer:
    """Wall time and bytes of the float (token) ``all_to_all_single`` calls, both directions."""

    def __init__(self):
        import torch.distributed as dist

        self.seconds, self.bytes, self.dist = 0.0, 0, dist
        self.original = dist.all_to_all_single

        def timed(output, input, *args, **kwargs):
            t = time.perf_counter()
            result = self.original(output, input, *args, **kwargs)
            if input.is_floating_point():
                self.seconds += time.perf_counter() - t
                self.bytes += input.numel() * input.element_size()
            return result

        dist.all_to_all_single = timed

    def stop(self):
        self.dist.all_to_all_single = self.original


def run(worlds: list[int], steps: int, warmup: int, timeout: int, legs=LEGS) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    folder = out / "model"
    make_model(folder)
    results = {}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for world in worlds:
        for leg in legs:
            cmd = torchrun(__file__, world, "--worker", leg, str(out), str(folder), str(steps), str(warmup))
            ranks, error = launch_ranks(cmd, out, f"{leg}.w{world}", world, timeout, env)
            results[(leg, world)] = (ranks, error)
            print(f"{leg} at {world} ranks: {error or 'ok'}", flush=True)
    return results


def report(results: dict, worlds: list[int]) -> str:
    rows = []
    for world in worlds:
        base = results.get(("transformers_ep", world))
        base_ok = base and not base[1]
        for leg in [leg for leg in (*LEGS, *BOUNDS) if (leg, world) in results]:
            ranks, error = results[(leg, world)]
            if error:
                rows.append([f"{leg} ({world} ranks)", f"failed: {error}"])
                continue
            tps = ranks[0]["tokens_per_s"]
            rss = max(r["peak_rss"] for r in ranks)
            expert = max(r["expert_bytes"] for r in ranks)
            losses = ranks[0]["losses"]
            ratio = rss_ratio = loss_diff = "-"
            if base_ok:
                ratio = f"{tps / base[0][0]['tokens_per_s']:.2f}x"
                rss_ratio = f"{rss / max(r['peak_rss'] for r in base[0]):.2f}x"
                loss_diff = f"{max(abs(a - b) for a, b in zip(losses, base[0][0]['losses'])):.1e}"
            a2a = ranks[0]["a2a_bytes_per_step"]
            a2a_text = (f"{ranks[0]['a2a_seconds_per_step'] * 1e3:.1f} ms for {a2a / 2**20:.1f} MiB"
                        if a2a else "-")
            rows.append([f"{leg} ({world} ranks)", ratio, rss_ratio, loss_diff, f"{tps:,.0f}",
                         f"{rss / 2**20:,.0f}", f"{expert / 2**20:,.1f}", a2a_text,
                         " / ".join(f"{v:.0f}" for v in ranks[0]["phases_ms"]),
                         " ".join(f"{v:.4f}" for v in losses)])
    header = ["leg", "tokens/s vs transformers ep", "peak RSS vs transformers ep", "max loss diff",
              "tokens/s", "peak RSS MiB", "expert MiB per rank", "token all-to-all per step (rank 0)",
              "forward / backward / optimizer ms per step (rank 0)", "losses"]
    experts = 16 * (512 * 512 + 512 * 256) * 4 * MODEL["num_hidden_layers"]
    note = (f"Qwen3-MoE-shaped: {MODEL['num_hidden_layers']} layers, 16 experts, top-2, hidden 512, moe "
            f"intermediate 256, random init, fp32 (all experts: {experts / 2**20:.1f} MiB); {BATCH} x {SEQ} "
            "tokens per rank per step; fused AdamW in every leg (HF Trainer's default).")
    return markdown_table(header, rows) + "\n\n" + note + "\n\n```\n" + "\n".join(verdicts(results, worlds)) + "\n```"


def verdicts(results: dict, worlds: list[int]) -> list[str]:
    """Issue 27's targets, one PASS / FAIL line each (the docs' summaries read them): hf_scale's ep
    against transformers' ep at each world size."""
    lines = []
    experts = 16 * (512 * 512 + 512 * 256) * 4 * MODEL["num_hidden_layers"]
    for world in worlds:
        theirs = results.get(("transformers_ep", world))
        for leg, label in (("hf_scale_ep_ddp", "ep + ddp"), ("hf_scale_ep", "ep + fsdp")):
            ours = results.get((leg, world))
            if not ours or ours[1] or not theirs or theirs[1]:
                lines.append(f"FAIL: {world} ranks, {label}: a leg failed ({(ours or theirs or (None, 'missing'))[1]})")
                continue
            a, b = ours[0], theirs[0]
            tps = a[0]["tokens_per_s"] / b[0]["tokens_per_s"]
            rss = max(r["peak_rss"] for r in a) / max(r["peak_rss"] for r in b)
            diff = max(abs(x - y) for x, y in zip(a[0]["losses"], b[0]["losses"]))
            held = max(r["expert_bytes"] for r in a)
            # the throughput target is judged on ep + ddp (a layout transformers' DistributedConfig
            # cannot express) at no more memory than transformers' ep; ep + fsdp, transformers' own
            # layout, is shown beside it
            verdict = ("PASS" if tps >= 1.2 else "FAIL") if leg == "hf_scale_ep_ddp" else "info"
            lines += [
                f"{verdict}: {world} ranks, {label}: tokens/s {tps:.2f}x transformers' ep (need >= 1.2x)",
                f"{'PASS' if rss <= 1.0 else 'FAIL'}: {world} ranks, {label}: peak RSS {rss:.2f}x transformers' ep "
                "(need <= 1.0x)",
                f"{'PASS' if diff <= 1e-5 else 'FAIL'}: {world} ranks, {label}: losses within {diff:.1e} of "
                "transformers' ep (need <= 1e-5)",
                f"{'PASS' if held == experts // world else 'FAIL'}: {world} ranks, {label}: expert bytes per rank "
                f"{held / 2**20:.1f} MiB = 1/{experts / max(held, 1):.2g} of the experts (need 1/{world})",
            ]
        for leg, label in (("bound_no_communication", "every rank training alone, no communication (the compute "
                            "floor)"), ("bound_ep_ddp_no_allreduce", "ep + ddp without DDP's gradient all-reduce")):
            bound = results.get((leg, world))
            if bound and not bound[1] and theirs and not theirs[1]:
                ratio = bound[0][0]["tokens_per_s"] / theirs[0][0]["tokens_per_s"]
                lines.append(f"info: {world} ranks, bound: {label}: tokens/s {ratio:.2f}x transformers' ep")
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        leg, out, folder, steps, warmup = sys.argv[2:7]
        worker(leg, Path(out), Path(folder), int(steps), int(warmup))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--bounds", action="store_true",
                        help="also run the bounds (BOUNDS): what limits any ep implementation here")
    add_write_arg(parser, "moe")
    args = parser.parse_args()
    check_doc(args)
    worlds = [int(w) for w in args.worlds.split(",")]
    body = report(run(worlds, args.steps, args.warmup, args.timeout, LEGS + (BOUNDS if args.bounds else ())), worlds)
    print(body)
    write_doc(args, body)


if __name__ == "__main__":
    main()
