"""Benchmark: QLoRA (LoRA on an NF4 base) with hf_scale against hf_scale's LoRA on an fp32 and a
bf16 base (issue 41's memory targets), and TRL + peft + bitsandbytes QLoRA where it runs here.

Run (one machine, 2 CPU cores; the script launches every leg itself, 2 ranks each)::

    python scripts/bench_qlora.py                          # 1 warm-up + 3 measured steps a leg
    python scripts/bench_qlora.py --legs "lora bf16,qlora fp32" --steps 5
    python scripts/bench_qlora.py --env MALLOC_MMAP_THRESHOLD_=65536   # RSS nearer live memory
    python scripts/bench_qlora.py --write docs/benchmarks.md   # into its section (markers
                                                               # <!-- bench:qlora:start/end -->)

Every leg is ``configs/quickstart-qlora.yaml`` (the real SmolLM2-135M-Instruct via zoo:smollm2,
the quickstart's arithmetic data, LoRA r=16 alpha 32 on all-linear, fsdp over 2 ranks, one thread
a rank) loaded as ``hf-scale finetune`` loads it (``hf_scale.train.model.load_model``: each rank
reads and, for NF4, quantizes only its slices), with the recipe's field overrides per leg:

* **lora fp32**: ``--model.quantize null`` (an fp32 base);
* **lora bf16**: ``--model.quantize null --model.dtype bfloat16`` (the issue's denominator);
* **qlora fp32**: the recipe as shipped (NF4 base, fp32 compute and everything not NF4 in fp32);
* **qlora bf16**: ``--model.dtype bfloat16`` (NF4 base, bf16 compute and non-NF4 weights in bf16);
* **qlora fp32 ddp**: ``--parallel.strategy ddp`` (whole NF4 weights on each rank, no all-gathers:
  the layout class of TRL's leg, which runs DDP).

Then the steps of ``hf-scale finetune``'s loop with the library API (``hf_scale.train_step``
with each rank's loss scaled by its share of the global label tokens, clipping, AdamW, the
recipe's schedule), as ``scripts/bench_adapters.py`` runs them. Measured per leg:

* frozen-weight bytes held per rank, counted in the run from the model's parameters that do not
  require a gradient: an NF4 shard by :func:`hf_scale.quantize.nf4.nf4_nbytes` (its codes,
  scalers and factors), any other ``numel * element_size`` of the rank's local shard; split into
  NF4 and the rest (embeddings, norms, and the weights NF4 cannot take at this world size);
* peak RSS per rank (``ru_maxrss``, loading included; the largest rank), the RSS peak while the
  model loads (sampled every 5 ms) against the RSS just after the load, and the largest slice a
  rank reads (one parameter's local shard in the load dtype) that the difference is measured in;
* tokens/s (median over the measured steps of non-padding tokens of both ranks / rank 0's step
  wall time) and the loss at every step (the mean over all label tokens of the global batch).

The QLoRA bound: a weight is NF4 only where each rank's slice holds whole 64-element blocks (its
scaler block, up to 256, then chosen so that the slice holds whole groups: SmolLM2's attention
projections take 216 at 2 slices, its MLP weights 256), and the embedding (tied to the head) and
norms are never quantized. The report computes from
the parameters' shapes the smallest frozen-bytes ratio such a model can reach.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    ROOT,
    RssSampler,
    add_write_arg,
    check_doc,
    launch_ranks,
    markdown_table,
    revision,
    rss_bytes,
    torchrun,
    write_doc,
)

RECIPE = str(ROOT / "configs" / "quickstart-qlora.yaml")
WORLD = 2
LEGS = {
    "lora fp32": ["--model.quantize", "null"],
    "lora bf16": ["--model.quantize", "null", "--model.dtype", "bfloat16"],
    "qlora fp32": [],
    "qlora bf16": ["--model.dtype", "bfloat16"],
    "qlora fp32 ddp": ["--parallel.strategy", "ddp"],  # the anchor's layout class (whole NF4 weights per rank)
    "TRL qlora": None,  # SFTTrainer + peft + bitsandbytes 4-bit (its own worker)
}
DENOMINATOR = "lora bf16"  # the "bf16 LoRA run"
QLORA = "qlora fp32"  # the recipe as shipped
QLORA_DDP = "qlora fp32 ddp"
TRL = "TRL qlora"
TARGETS = {"frozen": 0.30, "peak": 0.7, "tok_s": 1.2, "loss": 1e-2}
GIB = 2**30


# ------------------------------------------------------------------ each rank of a leg


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def frozen_bytes(model) -> dict:
    """Bytes this rank holds in frozen parameters: NF4 shards (their inner tensors) and the rest
    (``numel * element_size`` of the local shard); elements of each; the largest local slice at
    the load dtype (an NF4 shard counted as it was read, before quantizing)."""
    from torch.distributed.tensor import DTensor

    from hf_scale.quantize.nf4 import is_nf4, nf4_nbytes

    out = {"nf4_bytes": 0, "nf4_numel": 0, "other_bytes": 0, "other_numel": 0, "largest_slice": 0}
    for p in model.parameters():
        if p.requires_grad:
            continue
        local = p._local_tensor if isinstance(p, DTensor) else p
        size = local.numel() * local.element_size()  # an NF4Tensor reports its compute dtype's size
        out["largest_slice"] = max(out["largest_slice"], size)
        if is_nf4(local):
            out["nf4_bytes"] += nf4_nbytes(local)
            out["nf4_numel"] += local.numel()
        else:
            out["other_bytes"] += size
            out["other_numel"] += local.numel()
    out["total"] = out["nf4_bytes"] + out["other_bytes"]
    return out


def worker(args) -> None:
    import torch
    from transformers import get_scheduler

    import hf_scale
    from hf_scale.distributed import init_distributed
    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.train.dp import DataParallel
    from hf_scale.train.loader import PadCollator, ShardedBatches
    from hf_scale.train.model import load_model, load_tokenizer

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = load_job(RECIPE, [*LEGS[args.name], "--train.max_steps", str(total), "--data.eval_split", "null"])
    init_distributed(job.parallel.timeout_seconds)
    rank = torch.distributed.get_rank()
    t = job.train
    tokenizer = load_tokenizer(job.model)
    train = tokenize_causal_lm(load_splits(job.data)["train"], tokenizer, job.data, job.data.max_seq_len,
                               pack=job.data.packing)
    torch.distributed.barrier()
    rss_before = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    began = time.perf_counter()
    model = load_model(job.model, job.parallel, pad_id=tokenizer.pad_token_id, adapter=job.peft, seed=t.seed)
    load_s = time.perf_counter() - began
    load_peak = sampler.stop()
    record = {"rank": rank, "rss_before_load": rss_before, "load_peak": load_peak, "rss_after_load": rss_bytes(),
              "load_s": load_s, "frozen": frozen_bytes(model), "shapes": _frozen_shapes(model),
              "step_end": [], "tokens": [], "loss": []}
    dp = DataParallel.of(model)
    stream = iter(ShardedBatches(train, t.batch_size, dp.rank, dp.degree, PadCollator(tokenizer.pad_token_id),
                                 seed=job.data.seed))
    optimizer = hf_scale.build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas))
    scheduler = get_scheduler(t.scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total)
    record["step_end"].append(time.perf_counter())
    for _ in range(total):
        batch = next(stream)
        labels = float((batch["labels"][:, 1:] != -100).sum())
        counts = torch.tensor([labels], dtype=torch.float64)
        dp.all_reduce(counts)
        share = labels / max(float(counts[0]), 1.0)
        loss = hf_scale.train_step(model, batch, loss_scale=share * dp.degree)
        hf_scale.clip_grad_norm_(model, t.max_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss_sum = torch.tensor(float(loss) * share, dtype=torch.float64)
        dp.all_reduce(loss_sum)
        record["loss"].append(float(loss_sum))
        tokens = torch.tensor([float(batch["attention_mask"].sum())], dtype=torch.float64)
        dp.all_reduce(tokens)
        record["tokens"].append(int(tokens[0]))
        record["step_end"].append(time.perf_counter())
    record["max_rss"] = _max_rss_bytes()
    (Path(args.out) / f"{args.name}.rank{rank}.json").write_text(json.dumps({"status": "ok", **record}))


def _frozen_shapes(model) -> list[list]:
    """[global shape, element count, whether LoRA wraps it] of every frozen parameter (the bound)."""
    return [[list(p.shape), p.numel(), ".base_layer." in name] for name, p in model.named_parameters()
            if not p.requires_grad]


# ------------------------------------------------------------------ the TRL + peft + bitsandbytes leg


def trl_worker(args) -> None:
    """``SFTTrainer`` (DDP over gloo, 2 ranks) on SmolLM2 loaded 4-bit by bitsandbytes (NF4, double
    quantization, fp32 compute; every LoRA base Linear, as hf_scale's NF4 set at 2 slices), a new peft LoRA
    (seed 0) on all-linear, the recipe's rows in the
    order hf_scale's ``ShardedBatches`` gives each rank (as ``bench_adapters.py``'s TRL leg)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.train.loader import PadCollator, ShardedBatches
    from hf_scale.train.model import load_tokenizer, source

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = load_job(RECIPE, ["--train.max_steps", str(total), "--data.eval_split", "null"])
    t = job.train
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=t.batch_size,
        learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        lr_scheduler_type=t.scheduler, warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm or 0.0,
        max_steps=total, seed=t.seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        ddp_backend="gloo", train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True})  # creating the arguments starts the process group
    rank = config.process_index
    tokenizer = load_tokenizer(job.model)
    train = tokenize_causal_lm(load_splits(job.data)["train"], tokenizer, job.data, job.data.max_seq_len,
                               pack=job.data.packing)
    collate = PadCollator(tokenizer.pad_token_id)
    shards = [ShardedBatches(train, t.batch_size, r, WORLD, collate, seed=job.data.seed) for r in range(WORLD)]
    order = []
    for position in range(total):
        epoch, batch = divmod(position, len(shards[0]))
        order += [i for s in shards for i in s.indices(epoch, batch)]
    rss_before = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    began = time.perf_counter()
    # every LoRA base Linear in NF4, as hf_scale's set at 2 slices; the (tied) head stays fp32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["lm_head"])
    path, extra = source(job.model)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu",
                                                 dtype=torch.float32, **extra)
    torch.manual_seed(t.seed)
    model = get_peft_model(model, LoraConfig(r=job.peft.r, lora_alpha=job.peft.alpha, lora_dropout=job.peft.dropout,
                                             target_modules=job.peft.target_modules))
    load_s, load_peak = time.perf_counter() - began, sampler.stop()
    frozen = 0
    for p in model.parameters():
        if not p.requires_grad:
            state = getattr(p, "quant_state", None)
            frozen += p.numel() * p.element_size() + (_bnb_state_bytes(state) if state is not None else 0)
    record = {"rank": rank, "rss_before_load": rss_before, "load_peak": load_peak, "rss_after_load": rss_bytes(),
              "load_s": load_s, "frozen": {"total": frozen, "nf4_bytes": 0, "other_bytes": frozen,
                                           "largest_slice": 0},
              "shapes": [], "step_end": [], "tokens": [], "loss": []}

    class Probe(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            record["step_end"].append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            record["step_end"].append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                record["loss"].append(logs["loss"])

    rows = train.select(order)
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                         callbacks=[Probe()])
    trainer.train()
    per_step = t.batch_size * WORLD
    record["tokens"] = [sum(len(ids) for ids in rows[i * per_step:(i + 1) * per_step]["input_ids"])
                        for i in range(total)]  # the rows unpadded: the non-padding tokens of both ranks
    record["max_rss"] = _max_rss_bytes()
    (Path(args.out) / f"{args.name}.rank{rank}.json").write_text(json.dumps({"status": "ok", **record}))


def _bnb_state_bytes(state) -> int:
    """Bytes of a bitsandbytes 4-bit QuantState's tensors (absmax, its nested state, the code)."""
    import torch

    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif hasattr(value, "absmax"):
            total += _bnb_state_bytes(value)
    return total


# ------------------------------------------------------------------ the driver


def run_leg(args, out: Path, name: str) -> dict:
    cmd = torchrun(__file__, WORLD, "--worker", "--name", name, "--out", str(out),
                   "--steps", str(args.steps), "--warmup", str(args.warmup))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           **dict(item.split("=", 1) for item in args.env)}
    results, error = launch_ranks(cmd, out, name, WORLD, args.timeout, env)
    if error:
        return {"status": error}
    results.sort(key=lambda r: r["rank"])
    r0 = results[0]
    steps = [b - a for a, b in zip(r0["step_end"], r0["step_end"][1:])][args.warmup:]
    tokens = r0["tokens"][args.warmup:]
    worst = max(results, key=lambda r: r["load_peak"] - r["rss_after_load"])
    return {"status": "ok", "loss": r0["loss"], "tok_s": statistics.median(t / s for t, s in zip(tokens, steps)),
            "step_s": statistics.median(steps),
            "peak": max(r["max_rss"] for r in results) / GIB,
            "frozen": max(r["frozen"]["total"] for r in results), "frozen_parts": r0["frozen"],
            "load_peak": worst["load_peak"] / GIB, "after_load": worst["rss_after_load"] / GIB,
            "before_load": worst["rss_before_load"] / GIB, "slice": worst["frozen"]["largest_slice"] / GIB,
            "load_s": max(r["load_s"] for r in results), "shapes": r0["shapes"]}


def nf4_bound(shapes: list[list], world: int, other_bytes: int) -> tuple[float, int, int]:
    """(the smallest frozen bytes of a QLoRA model / its bf16 LoRA's, the NF4-able elements, all
    elements) from the frozen parameters' [shape, numel, LoRA-wrapped]: a LoRA base weight is NF4
    where :func:`check_groups` allows its ``world`` slices, at the bits its scaler block gives
    (factors in the compute dtype, ``other_bytes``); everything else (embeddings, norms, the
    weights it refuses) is held at ``other_bytes`` per element."""
    from hf_scale.quantize.nf4 import check_groups, nf4_bits, scaler_block_for

    nf4 = total = 0
    held = 0.0
    for shape, numel, wrapped in shapes:
        total += numel
        if wrapped and check_groups(tuple(shape), world) is None:
            nf4 += numel
            held += numel * nf4_bits(scaler_block_for(numel // world), other_bytes) / 8
        else:
            held += numel * other_bytes
    return held / (2 * total), nf4, total


def verdicts(legs: dict) -> list[str]:
    """The PASS / FAIL / n/a lines for issue 41's memory targets (pure: the unit test checks it)."""
    none = {"status": "not run"}
    q, d = legs.get(QLORA, none), legs.get(DENOMINATOR, none)
    if q["status"] != "ok" or d["status"] != "ok":
        return [f"n/a: {QLORA} ({q['status']}) vs {DENOMINATOR} ({d['status']})"]
    lines = []
    r = q["frozen"] / d["frozen"]
    lines.append(f"{'PASS' if r <= TARGETS['frozen'] else 'FAIL'}: frozen-weight bytes per rank, {QLORA} / "
                 f"{DENOMINATOR} = {q['frozen'] / 1e6:.1f} / {d['frozen'] / 1e6:.1f} MB = {r:.3f} "
                 f"(target <= {TARGETS['frozen']})")
    for name in (n for n in legs if n.startswith("qlora") and n != QLORA and legs[n]["status"] == "ok"):
        r = legs[name]["frozen"] / d["frozen"]
        lines.append(f"also (no target): frozen-weight bytes per rank, {name} / "
                     f"{DENOMINATOR} = {legs[name]['frozen'] / 1e6:.1f} / {d['frozen'] / 1e6:.1f} MB = {r:.3f}")
    r = q["peak"] / d["peak"]
    lines.append(f"{'PASS' if r <= TARGETS['peak'] else 'FAIL'}: peak RSS (largest rank), {QLORA} / {DENOMINATOR} "
                 f"= {q['peak']:.2f} / {d['peak']:.2f} GiB = {r:.2f} (target <= {TARGETS['peak']})")
    anchor = legs.get(TRL, none)
    if anchor["status"] == "ok":
        r = q["tok_s"] / anchor["tok_s"]
        lines.append(f"{'PASS' if r >= TARGETS['tok_s'] else 'FAIL'}: tokens/s, {QLORA} / {TRL} = {q['tok_s']:.1f} / "
                     f"{anchor['tok_s']:.1f} = {r:.2f} (target >= {TARGETS['tok_s']})")
        ddp = legs.get(QLORA_DDP, none)
        if ddp["status"] == "ok":
            r = ddp["tok_s"] / anchor["tok_s"]
            lines.append(f"also (no target; the anchor's layout class, DDP): tokens/s, {QLORA_DDP} / {TRL} = "
                         f"{ddp['tok_s']:.1f} / {anchor['tok_s']:.1f} = {r:.2f}")
        diffs = [abs(a - b) for a, b in zip(q["loss"], anchor["loss"])]
        same = len(q["loss"]) == len(anchor["loss"]) and max(diffs) <= TARGETS["loss"]
        lines.append(f"{'PASS' if same else 'FAIL'}: loss per step, {QLORA} vs {TRL}, within {TARGETS['loss']:g} "
                     f"(largest difference {max(diffs):.1e} over {len(diffs)} steps)")
    else:
        lines.append(f"n/a: {QLORA} vs {TRL} ({anchor['status']})")
    for name, leg in legs.items():
        if name.startswith("qlora") and leg["status"] == "ok":
            over = leg["load_peak"] - leg["after_load"]
            lines.append(f"{'PASS' if over <= leg['slice'] else 'FAIL'}: {name} RSS peak during load within one "
                         f"slice of the footprint after it: {leg['load_peak']:.3f} - {leg['after_load']:.3f} = "
                         f"{over * 1024:.1f} MiB over, the largest slice {leg['slice'] * 1024:.1f} MiB")
    return lines


def report(legs: dict) -> tuple[str, str]:
    """(the table, ratios first; the verdicts, the bound and the losses)."""
    d = legs.get(DENOMINATOR, {"status": "not run"})
    header = ["leg", f"frozen bytes vs {DENOMINATOR}", f"peak RSS vs {DENOMINATOR}", f"tok/s vs {DENOMINATOR}",
              f"tok/s vs {TRL}", f"max loss diff vs {TRL}",
              "frozen MB per rank (NF4 + other)", "peak RSS (GiB)", "load: RSS before / peak / after (GiB)",
              "largest slice (MiB)", "load (s)", "tokens/s", "median step (s)", "max loss diff vs lora fp32"]
    rows = []
    base = legs.get("lora fp32", {"status": "not run"})
    anchor = legs.get(TRL, {"status": "not run"})
    for name, leg in legs.items():
        if leg["status"] != "ok":
            rows.append([name, leg["status"]])
            continue

        def ratio(key, leg=leg, to=d):
            return f"{leg[key] / to[key]:.3f}" if to["status"] == "ok" else "n/a"

        def loss_diff(to, leg=leg):
            if to["status"] != "ok" or leg is to or len(leg["loss"]) != len(to["loss"]):
                return "-"
            return f"{max(abs(a - b) for a, b in zip(leg['loss'], to['loss'])):.1e}"

        parts = leg["frozen_parts"]
        rows.append([name, ratio("frozen"), ratio("peak"), ratio("tok_s"), ratio("tok_s", to=anchor), loss_diff(anchor),
                     f"{leg['frozen'] / 1e6:.1f} ({parts['nf4_bytes'] / 1e6:.1f} + {parts['other_bytes'] / 1e6:.1f})",
                     f"{leg['peak']:.2f}", f"{leg['before_load']:.2f} / {leg['load_peak']:.2f} / {leg['after_load']:.2f}",
                     f"{leg['slice'] * 1024:.1f}", f"{leg['load_s']:.1f}", f"{leg['tok_s']:.1f}",
                     f"{leg['step_s']:.2f}", loss_diff(base)])
    lines = verdicts(legs)
    q = legs.get(QLORA, {"status": "not run"})
    if q["status"] == "ok":
        bound, nf4, total = nf4_bound(q["shapes"], WORLD, 4)
        bound16, _, _ = nf4_bound(q["shapes"], WORLD, 2)
        lines.append(
            f"bound from SmolLM2's shapes at {WORLD} slices: {nf4 / 1e6:.1f}M of {total / 1e6:.1f}M frozen elements can "
            f"be NF4 (every LoRA base weight: each slice holds whole 64-element blocks, its scaler block the largest "
            f"divisor up to 256 of its block count); the embedding (tied head, {(total - nf4) / total:.0%} of the "
            f"frozen elements) and the norms stay in the compute dtype, so frozen bytes / bf16 LoRA's >= {bound:.3f} "
            f"with fp32 compute, >= {bound16:.3f} with bf16 compute (all-NF4 would be {4.127 / 16:.3f}): 0.30 is out "
            f"of this model's reach while its embedding stays unquantized")
    for name, leg in legs.items():
        if leg["status"] == "ok":
            lines.append(f"loss per step, {name}: {', '.join(f'{x:.6f}' for x in leg['loss'])}")
    return markdown_table(header, rows), "\n".join(lines)


def trl_bnb_line(legs: dict) -> str:
    """Which bitsandbytes ran the TRL leg, or why it is not there (checked, not assumed)."""
    try:
        import bitsandbytes
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"{TRL}: not run (bitsandbytes does not import: {type(e).__name__}: {e})"
    status = legs.get(TRL, {"status": "not run (not in --legs)"})["status"]
    return f"{TRL}: bitsandbytes {bitsandbytes.__version__} (CPU backend), {status}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per leg (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before them (>= 1)")
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated among {', '.join(LEGS)}")
    parser.add_argument("--out", help="folder for logs and results (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per leg")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every leg's environment, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc "
                        "then returns freed activations to the system: RSS closer to live memory)")
    add_write_arg(parser, "qlora")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return (trl_worker if args.name == TRL else worker)(args)
    check_doc(args)
    names = [n.strip() for n in args.legs.split(",") if n.strip()]
    if args.steps < 1 or args.warmup < 1 or set(names) - set(LEGS) or any("=" not in e for e in args.env):
        parser.error(f"--steps and --warmup must be >= 1, --legs among {', '.join(LEGS)}, --env KEY=VALUE")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_qlora_"))
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import torchao

    print(f"command: python scripts/bench_qlora.py {' '.join(sys.argv[1:])}".rstrip())
    title = (f"configs/quickstart-qlora.yaml (SmolLM2-135M-Instruct, LoRA r=16 all-linear, fsdp x {WORLD} ranks, "
             f"16 examples/rank/step), {args.warmup} warm-up + {args.steps} measured steps per leg; torch "
             f"{torch.__version__}, torchao {torchao.__version__}; hf_scale at {revision()}"
             + "".join(f"; {item}" for item in args.env))
    print(f"{title}; logs in {out}", flush=True)
    start, legs = time.perf_counter(), {}
    for name in names:
        load, began = os.getloadavg()[0], time.perf_counter()
        legs[name] = run_leg(args, out, name)
        shown = f"{legs[name]['tok_s']:.1f} tok/s" if legs[name]["status"] == "ok" else legs[name]["status"]
        print(f"  {name}: {shown} ({time.perf_counter() - began:.0f} s; load average {load:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after)", flush=True)
    table, lines = report(legs)
    lines += "\n" + trl_bnb_line(legs)
    print(f"\n{title}\n\n{table}\n\n{lines}\n\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_doc(args, f"{title}.\n\n{table}\n\n```\n{lines}\n```",
              "Tokens/s and RSS depend on what else the machine runs (load average in this line); "
              "frozen bytes and losses do not.")


if __name__ == "__main__":
    main()
