"""Benchmark: the quickstart fine-tuning (``hf-scale finetune``) against transformers ``Trainer``.

Run (one machine, 2 CPU cores; the script launches both legs itself, 2 ranks each)::

    python scripts/bench_finetune.py                  # 2 warm-up + 8 measured steps, ~11 min
    python scripts/bench_finetune.py --rounds 2       # A B A B, for a machine whose speed drifts
    python scripts/bench_finetune.py --write docs/benchmarks.md    # and into its doc section

Both legs train the real SmolLM2-135M-Instruct (GGUF de-quantized to fp32 by
``hf_scale.zoo.load_smollm2``) on the quickstart recipe's data (``configs/quickstart.yaml``:
generated arithmetic, chat template, loss on the answers), 16 examples per rank and step, AdamW
with the recipe's lr / cosine schedule / warm-up, clipping at 1.0, for ``--warmup + --steps``
optimizer steps, with every rank at OMP_NUM_THREADS=1:

* **hf_scale**: ``hf-scale finetune configs/quickstart.yaml --train.max_steps N ...`` (its own
  torchrun, fsdp over 2 processes), evaluation, sample generations and the final save turned
  off. Numbers are read from its ``metrics.jsonl`` (rank 0).
* **Trainer** (the anchor): ``accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2``
  running this file, which builds ``transformers.Trainer`` with ``fsdp="full_shard auto_wrap"``
  (FSDP2, LlamaDecoderLayer units). The training examples are hf_scale's own
  (``load_splits`` + ``tokenize_causal_lm`` + ``PadCollator``), reordered so that rank r of
  step k gets exactly the rows ``ShardedBatches`` gives it (accelerate hands rank r every
  second per-device batch of a sequential sampler). What Trainer really ran (accelerate's
  distributed type, ``is_fsdp_enabled``, the model wrapper's class on each rank, DTensor
  parameters) is printed: on CPU accelerate keeps ``MULTI_CPU``.

Per leg, over the measured steps (the first ``--warmup`` steps are skipped):

* tokens/s: median over steps of (non-padding tokens of the step over all ranks / step time);
  hf_scale's per-step ``tokens_per_s``, Trainer's from a callback (time between consecutive
  ``on_step_end``; tokens counted as each batch is fetched);
* step time: median wall time between consecutive step records (rank 0);
* data wait: median share of the step spent getting the next batch (hf_scale's ``data_wait``;
  Trainer: time inside ``next()`` on its data loader / step time);
* peak RSS: rank 0's ``ru_maxrss`` at the last step (GiB; includes loading; glibc's default
  allocator, so it includes freed memory malloc kept);
* loss per step, to show both legs train the same thing.

* **hf_scale ddp** / **hf_scale auto**: the same command with ``--parallel.strategy ddp`` /
  ``auto`` (the planner's choice for 2 processes and the recipe's batches, printed with the leg).

Targets (from the issues): hf_scale's data wait < 5% of step time; hf_scale tokens/s >= 1.0x
Trainer; with ``strategy: auto`` (issue 14) >= 1.0x Trainer.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_write_arg, check_doc, free_port, revision, run_logged, write_doc

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "configs" / "quickstart.yaml")
WORLD = 2
QUIET = ["--train.sample_generations", "0", "--checkpoint.save_final", "false",
         "--train.eval_every", "0", "--data.eval_split", "null", "--train.progress", "false"]


def _overrides(total_steps: int, out: Path) -> list[str]:
    return ["--train.max_steps", str(total_steps), "--train.output_dir", str(out), *QUIET]


# ------------------------------------------------------------------ the Trainer leg (each rank)


def trainer_worker(args) -> None:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_scale.train.config import load_job
    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.train.loader import PadCollator, ShardedBatches
    from hf_scale.train.model import load_tokenizer
    from hf_scale.zoo import load_smollm2

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = load_job(RECIPE, _overrides(total, Path(args.out) / "unused"))
    t = job.train
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], lr_scheduler_type=t.scheduler,
        warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm or 0.0, max_steps=total,
        seed=t.seed, use_cpu=True, train_sampling_strategy="sequential", dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, fsdp="full_shard auto_wrap",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )  # creating the arguments starts the process group
    rank = targs.process_index
    tokenizer = load_tokenizer(job.model)
    train = tokenize_causal_lm(load_splits(job.data)["train"], tokenizer, job.data,
                               job.data.max_seq_len, pack=job.data.packing)
    collate = PadCollator(tokenizer.pad_token_id)
    shards = [ShardedBatches(train, t.batch_size, r, WORLD, collate, seed=job.data.seed)
              for r in range(WORLD)]
    order = []  # hf_scale's global batches, rank by rank: what accelerate's sharding hands out
    for position in range(total * t.grad_accum):
        epoch, batch = divmod(position, len(shards[0]))
        order += [i for s in shards for i in s.indices(epoch, batch)]
    model, _ = load_smollm2()
    record = {"step_end": [], "fetch": [], "tokens": [], "loss": [], "rank": rank}

    class TimedIterator:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            start = time.perf_counter()
            batch = next(self.it)
            record["fetch"][-1] += time.perf_counter() - start
            record["tokens"][-1] += int(batch["attention_mask"].sum())
            return batch

    class BenchTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            record["fetch"].append(0.0)
            record["tokens"].append(0)
            return super().get_batch_samples(TimedIterator(epoch_iterator), num_batches, device)

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            record["train_begin"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            record["step_end"].append(time.perf_counter())
            if len(record["step_end"]) == 1:
                record["ran_as"] = ran_as(trainer)
            record["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                record["loss"].append(logs["loss"])

    def ran_as(trainer) -> dict:
        wrapped = trainer.model_wrapped
        params = list(trainer.model.parameters())
        return {
            "distributed_type": str(trainer.accelerator.distributed_type.value),
            "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "wrapper": type(wrapped).__name__,
            "ddp": isinstance(wrapped, torch.nn.parallel.DistributedDataParallel),
            "dtensor_params": f"{sum(isinstance(p, DTensor) for p in params)}/{len(params)}",
            "dtype": str(params[0].dtype).removeprefix("torch."),
            "world": trainer.accelerator.num_processes,
        }

    trainer = BenchTrainer(model=model, args=targs, train_dataset=train.select(order),
                           data_collator=collate, callbacks=[StepTimes()])
    trainer.train()
    (Path(args.out) / f"trainer.rank{rank}.json").write_text(json.dumps(record))


# ------------------------------------------------------------------ the launcher


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def _run(cmd: list[str], log_path: Path, timeout: int) -> str | None:
    """Run ``cmd`` with its output in ``log_path``; None when it succeeded, else why not."""
    return run_logged(cmd, log_path, timeout, env=_env(), cwd=ROOT)


def hf_scale_leg(args, out: Path, tag: str, extra: tuple = ()) -> dict:
    run_dir = out / tag
    cmd = [str(Path(sys.executable).parent / "hf-scale"), "finetune", RECIPE,
           *_overrides(args.warmup + args.steps, run_dir), *extra]
    error = _run(cmd, out / f"{tag}.log", args.timeout)
    if error:
        return {"status": error}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "tokens_per_s" in s]
    log = (out / f"{tag}.log").read_text(errors="replace").splitlines()
    layout = next((ln.removeprefix("[hf_scale] ") for ln in log if " over pp=" in ln), "?")
    chose = next((ln.removeprefix("[hf_scale] ") for ln in log if "strategy 'auto' chose" in ln), None)
    if chose:
        layout = f"{chose}; {layout}"
    ends = [s["elapsed_s"] for s in steps]
    measured = steps[args.warmup:]
    return {"status": "ok", "tok_s": [s["tokens_per_s"] for s in measured],
            "step_s": [b - a for a, b in itertools.pairwise(ends)][args.warmup - 1:],
            "wait": [s["data_wait"] for s in measured], "peak": steps[-1]["peak_mem_gb"],
            "loss": [s["loss"] for s in steps],
            "ran_as": f"hf-scale finetune (torchrun, {WORLD} workers): {layout}",
            "cmd": " ".join(["hf-scale", *cmd[1:]])}


def trainer_leg(args, out: Path, tag: str) -> dict:
    leg_dir = out / tag
    leg_dir.mkdir()
    fsdp = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy",
            "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", str(WORLD),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), *fsdp, __file__, "--worker", "--out",
           str(leg_dir), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    error = _run(cmd, out / f"{tag}.log", args.timeout)
    paths = [leg_dir / f"trainer.rank{r}.json" for r in range(WORLD)]
    if error or not all(p.exists() for p in paths):
        return {"status": error or "failed: a rank wrote no result"}
    ranks = [json.loads(p.read_text()) for p in paths]
    r0 = ranks[0]
    ends = [r0["train_begin"], *r0["step_end"]]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    tokens = [sum(step) for step in zip(*(r["tokens"] for r in ranks))]
    w = args.warmup
    seen = [r["ran_as"] for r in ranks]
    kinds = [", ".join(f"{k} {v}" for k, v in ran.items()) for ran in seen]
    per_rank = (f"every rank: {kinds[0]}" if len(set(kinds)) == 1
                else "; ".join(f"rank {r}: {k}" for r, k in enumerate(kinds)))
    if not any(ran["is_fsdp_enabled"] or not ran["dtensor_params"].startswith("0/") for ran in seen):
        per_rank += (f" -> NOT FSDP: the FSDP settings were dropped, Trainer ran "
                     f"{seen[0]['wrapper']} on {seen[0]['distributed_type']}")
    return {"status": "ok", "tok_s": [n / s for n, s in zip(tokens[w:], step_s[w:])],
            "step_s": step_s[w:], "wait": [f / s for f, s in zip(r0["fetch"][w:], step_s[w:])],
            "peak": r0["peak_rss_gib"], "loss": r0["loss"], "tokens": tokens,
            "ran_as": f"accelerate launch -> Trainer: {per_rank}",
            "cmd": " ".join(["accelerate", *cmd[1:]])}


LEGS = {  # name: runner; "hf_scale" is the quickstart itself, the targets are about it
    "hf_scale": hf_scale_leg,
    "Trainer": trainer_leg,
    "hf_scale ddp": functools.partial(hf_scale_leg, extra=("--parallel.strategy", "ddp")),
    "hf_scale auto": functools.partial(hf_scale_leg, extra=("--parallel.strategy", "auto")),
}


def _merge(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return {"status": rounds[0]["status"]}
    merged = {k: [x for r in ok for x in r[k]] for k in ("tok_s", "step_s", "wait")}
    return {**ok[-1], **merged, "peak": max(r["peak"] for r in ok), "rounds": len(ok)}


def report(legs: dict) -> list[str]:
    none = {"status": "not run"}
    h, a = legs.get("hf_scale", none), legs.get("Trainer", none)
    med = statistics.median
    header = ["leg", "ratio tok/s vs Trainer", "tokens/s", "step time (s)",
              "data wait (share of step)", "peak RSS rank 0 (GiB)", "measured steps"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, leg in legs.items():
        if leg["status"] != "ok":
            lines.append(f"| {name} | {leg['status']} |" + " |" * (len(header) - 2))
            continue
        ratio = f"{med(leg['tok_s']) / med(a['tok_s']):.2f}" if a["status"] == "ok" else "n/a"
        lines.append(f"| {name} | {ratio} | {med(leg['tok_s']):.1f} | {med(leg['step_s']):.2f} | "
                     f"{med(leg['wait']):.2%} (max {max(leg['wait']):.2%}) | {leg['peak']:.2f} | "
                     f"{len(leg['tok_s'])} |")
    lines.append("")
    if h["status"] == "ok":
        wait = max(h["wait"])
        lines.append(f"{'PASS' if wait < 0.05 else 'FAIL'}: hf_scale data wait < 5% of step time "
                     f"(worst measured step {wait:.3%}, median {med(h['wait']):.3%})")
    if h["status"] == "ok" and a["status"] == "ok":
        ratio = med(h["tok_s"]) / med(a["tok_s"])
        lines.append(f"{'PASS' if ratio >= 1.0 else 'FAIL'}: hf_scale tokens/s >= 1.0x Trainer "
                     f"({med(h['tok_s']):.1f} vs {med(a['tok_s']):.1f} = {ratio:.3f}x)")
    else:
        lines.append(f"n/a: tokens/s ratio (hf_scale {h['status']}, Trainer {a['status']})")
    auto = legs.get("hf_scale auto", none)
    if auto["status"] == "ok" and a["status"] == "ok":  # issue 14's target for strategy: auto
        ratio = med(auto["tok_s"]) / med(a["tok_s"])
        lines.append(f"{'PASS' if ratio >= 1.0 else 'FAIL'}: hf_scale with strategy auto tokens/s >= 1.0x "
                     f"Trainer ({med(auto['tok_s']):.1f} vs {med(a['tok_s']):.1f} = {ratio:.3f}x)")
    for name, leg in legs.items():
        if leg["status"] == "ok":
            lines.append(f"loss per step, {name}: {', '.join(f'{x:.4f}' for x in leg['loss'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per leg (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="steps skipped before them (>= 1)")
    parser.add_argument("--rounds", type=int, default=1, help="run every leg this many times")
    parser.add_argument("--legs", default=",".join(LEGS),
                        help=f"comma-separated among {', '.join(LEGS)}")
    parser.add_argument("--out", help="folder for logs and results (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per leg")
    add_write_arg(parser, "finetune")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return trainer_worker(args)
    check_doc(args)
    names = [n.strip() for n in args.legs.split(",") if n.strip()]
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or set(names) - set(LEGS):
        parser.error(f"--steps, --warmup, --rounds must be >= 1, --legs among {', '.join(LEGS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_finetune_"))
    out.mkdir(parents=True, exist_ok=True)
    import accelerate
    import torch
    import transformers

    print(f"command: python scripts/bench_finetune.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate "
          f"{accelerate.__version__}; hf_scale at {revision()}; {os.cpu_count()} CPUs, "
          f"OMP_NUM_THREADS=1 per rank; logs in {out}")
    title = (f"SmolLM2-135M-Instruct fp32, {configs_note()}; {args.warmup} warm-up + "
             f"{args.steps} measured steps per leg, {args.rounds} round(s) of {', '.join(names)}; "
             f"hf_scale at {revision()}")
    print(title, flush=True)
    start, runs = time.perf_counter(), {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            load, began = os.getloadavg()[0], time.perf_counter()
            row = LEGS[name](args, out, f"{name.replace(' ', '_')}_{i}")
            runs[name].append(row)
            shown = (f"median {statistics.median(row['tok_s']):.1f} tok/s" if row["status"] == "ok"
                     else row["status"])
            print(f"  round {i} {name}: {shown} ({time.perf_counter() - began:.0f} s; load "
                  f"average {load:.2f} before, {os.getloadavg()[0]:.2f} after)", flush=True)
    legs = {name: _merge(rows) for name, rows in runs.items()}
    ran = "\n".join(f"  {name}: {leg['cmd']}\n    {leg['ran_as']}"
                    for name, leg in legs.items() if leg["status"] == "ok")
    lines = report(legs)
    cut = lines.index("")  # the table, then the targets and the losses
    table, verdicts = "\n".join(lines[:cut]), "\n".join(lines[cut + 1 :])
    print(f"\nwhat each leg ran:\n{ran}\n\n{table}\n\n{verdicts}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_doc(args, f"{title}.\n\nWhat each leg ran:\n\n```\n{ran}\n```\n\n{table}\n\n"
                    f"```\n{verdicts}\n```", "Step times and tokens/s depend on what else the machine runs "
              "(load average in this line); losses and data wait do not.")


def configs_note() -> str:
    from hf_scale.train.config import load_job

    job = load_job(RECIPE, [])
    t = job.train
    return (f"{job.data.path} ({job.data.max_train_samples} examples, max {job.data.max_seq_len} "
            f"tokens), {t.batch_size} examples/rank/step x {WORLD} ranks, AdamW lr {t.lr} "
            f"{t.scheduler} warm-up {t.warmup_steps}, clip {t.max_grad_norm}")


if __name__ == "__main__":
    main()
