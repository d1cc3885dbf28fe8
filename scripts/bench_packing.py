"""Benchmark: packing on data whose lengths vary ~10x (issue 38). hf_scale's padded rows, packed
rows (``data.packing: bfd``) and packed + padding-free rows (``data.padding_free: true``), against
TRL's ``SFTTrainer`` with ``packing=True, padding_free=True`` (``packing_strategy="bfd"``).

Run (one machine, 2 CPU cores; the script launches every leg itself, 2 processes each)::

    python scripts/bench_packing.py                         # 3 rounds of the 6 legs, ~40 min
    python scripts/bench_packing.py --rounds 1 --steps 2    # a quick look
    python scripts/bench_packing.py --write docs/benchmarks.md   # into its section (markers
                                                                 # <!-- bench:packing:start/end -->)

The data: ``--examples`` generated multi-step arithmetic problems (:func:`multistep_example`: 1 to
10 add / subtract steps, chosen uniformly, each step worked out in the answer), written as a JSONL
file of prompt / response pairs and rendered with SmolLM2's chat template (system prompt "Solve
step by step."): 47 to 483 tokens, ~10x between the shortest and the longest (the run prints the
spread). Rows of ``--max-len`` 512 tokens hold every example whole.

Every leg trains the real SmolLM2-135M-Instruct (fp32) on 2 processes (gloo, one thread each) for
``--warmup + --steps`` optimizer steps: AdamW lr 1e-4, cosine, 1 warm-up step, clipping at 1.0.
The legs run in turn, round after round (A B C ... A B C ...), and every measured step of every
round is pooled.

* **padded**: ``hf-scale finetune`` (fsdp), ``data.packing: false``: ``--padded-batch`` examples
  per rank and step, right-padded to the longest of the batch, with an attention mask.
* **packed**: ``data.packing: bfd``: ``--rows`` rows of up to 512 tokens per rank and step (about
  as many examples per step as the padded leg: the table shows both), the rows of a batch padded
  to the longest; documents kept apart by ``position_ids`` restarting at 0, no attention mask.
* **packed + padding_free**: the same rows, each micro-batch flattened into one row: no padding.
* **TRL packing + padding_free** (the anchor): ``SFTTrainer`` under torchrun (accelerate runs it as
  DDP on ``MULTI_CPU``) given the same tokenized examples (hf_scale's tokenization: ``input_ids``
  and ``labels``, prompt tokens -100), ``packing=True, packing_strategy="bfd", padding_free=True,
  max_length=512``, ``--rows`` rows per device, fp32, no gradient checkpointing (TRL's bfd packing
  is always padding-free: it sets ``padding_free`` itself). TRL packs them itself; its rows are
  compared with hf_scale's (the same documents in the same rows) and, when they match, taken in
  hf_scale's order (a sequential sampler over the rows reordered, as ``bench_finetune.py`` does),
  so both train on the same batches: each TRL batch is compared with the one hf_scale's
  ``PackedCollator(flatten=True)`` builds for that rank and step.
* **packed + padding_free (ddp)**: hf_scale in TRL's layout (DDP), TRL's batches;
* **packed + padding_free (all logits)**: ``parallel.loss_labeled_only: false``: the head at every
  position, as TRL computes it.

The other hf_scale legs set ``parallel.loss_labeled_only: true`` (the quickstart's setting: the
output head runs on the answer tokens only); TRL's fused LM head scores every position.

The default batches (4 padded examples, or 2 packed rows, per rank) keep a leg to a few minutes
and 2 ranks within the memory of a 24 GiB machine that others share: a padded rank peaks at ~5
GiB here. The padded leg's padding share, so packing's gain, grows with its batch (more examples
padded to the longest): ``--padded-batch 8 --rows 4`` is Trainer's default batch.

Measured per leg, over the measured steps (the first ``--warmup`` skipped), rounds pooled:

* real tokens/s: the median over the measured steps of (non-padding tokens of the step, both
  ranks / the step's wall time). hf_scale: ``tokens_per_s`` of its ``metrics.jsonl``; TRL: the
  tokens of each batch counted as it is fetched (a padding-free batch has no padding) over the
  time between ``on_step_end`` callbacks;
* real tokens per CPU-second: the measured steps' real tokens over the CPU seconds all the leg's
  processes spent in them (psutil samples of the process tree): less sensitive to what else the
  machine runs than tokens/s;
* other processes' CPU: the cores the rest of the machine kept busy during the measured steps
  (its busy CPU seconds less the leg's), each round. The machine may be shared: before each leg
  the script waits (``--quiet-wait``, up to 10 min) until others keep fewer than
  ``--quiet-cores`` 0.5 CPUs busy, and says how long it waited;
* positions computed/s: real tokens/s over the real share (padding included): where it is the
  same for two legs, their real tokens/s differ only by the padding they compute;
* real share: non-padding tokens / positions the model computed; examples per step;
* peak RSS: the kernel's ``ru_maxrss`` of the leg's largest process (loading included);
* loss per step, the final loss and the mean over the last ``--last`` steps.

Targets (issue 38): packed real tokens/s >= 1.5x padded; hf_scale packed >= 1.2x TRL's packing +
padding_free (a line for hf_scale's packed rows, the target's words, one for its packed +
padding_free, TRL's settings, and, where the ddp leg ran, one for that leg: TRL's settings in TRL's
layout, since TRL runs DDP on CPU and the other hf_scale legs run fsdp); losses on the same curve: the mean loss over the last ``--last``
steps within 10% of the padded leg's (different batches: padded steps hold other examples), and
the legs that train on the same batches (every packed leg, and TRL where its batches matched)
equal at every step within 1e-3 (relative).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_write_arg,
    check_doc,
    markdown_table,
    revision,
    run_sampled,
    torchrun,
    wait_for_quiet,
    write_doc,
)

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
SYSTEM_PROMPT = "Solve step by step."
CURVE_TOLERANCE = 0.10  # mean loss over the last steps, relative to the padded leg's
SAME_BATCH_TOLERANCE = 1e-3  # loss per step, relative, where the batches are the same
SPEEDUP_VS_PADDED, SPEEDUP_VS_TRL = 1.5, 1.2
PADDED, PACKED, FREE, TRL = "padded", "packed", "packed + padding_free", "TRL packing + padding_free"
FREE_DDP, FREE_LOGITS = "packed + padding_free (ddp)", "packed + padding_free (all logits)"
LEGS = {  # name: hf-scale finetune overrides (None: the TRL worker)
    PADDED: ["--data.packing", "false"],
    PACKED: ["--data.packing", "bfd"],
    FREE: ["--data.packing", "bfd", "--data.padding_free", "true"],
    TRL: None,
    FREE_DDP: ["--data.packing", "bfd", "--data.padding_free", "true", "--parallel.strategy", "ddp"],
    FREE_LOGITS: ["--data.packing", "bfd", "--data.padding_free", "true", "--parallel.loss_labeled_only", "false"],
}
DEFAULT_LEGS = list(LEGS)


# ------------------------------------------------------------------ the data


def multistep_example(rng: random.Random, steps: int) -> dict:
    """A prompt / response pair: start from a number, add or subtract ``steps`` two-digit
    numbers; the response works every step out (the expression so far = the running value and
    the operation = the result) and ends with the answer."""
    value = rng.randint(10, 99)
    expression, asks, work = str(value), [], []
    for k in range(steps):
        sign, operand = rng.choice("+-"), rng.randint(10, 99)
        result = value + operand if sign == "+" else value - operand
        asks.append(f"{'add' if sign == '+' else 'subtract'} {operand}")
        expression += f" {sign} {operand}"
        work.append(f"{expression} = {value} {sign} {operand} = {result}." if k else f"{expression} = {result}.")
        value = result
    prompt = f"Start with {expression.split()[0]}, then " + ", then ".join(asks) + "."
    return {"prompt": prompt, "response": " ".join(work) + f" Answer: {value}"}


def make_examples(n: int, seed: int = 0, max_steps: int = 10) -> list[dict]:
    """``n`` examples of 1 to ``max_steps`` steps (uniform), a pure function of ``seed``."""
    rng = random.Random(seed)
    return [multistep_example(rng, rng.randint(1, max_steps)) for _ in range(n)]


def write_jsonl(path: Path, rows) -> int:
    """Write ``rows`` (dicts) one JSON object a line; returns the bytes written."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path.stat().st_size


def spread(lengths: list[int]) -> dict:
    """The shortest, median, mean and longest of ``lengths`` and longest / shortest."""
    return {"min": min(lengths), "median": statistics.median(lengths), "mean": statistics.mean(lengths),
            "max": max(lengths), "ratio": max(lengths) / min(lengths)}


# ------------------------------------------------------------------ the arithmetic of the report


def mean_last(losses: list[float], k: int) -> float:
    """The mean of the last ``k`` losses (all of them when there are fewer)."""
    return statistics.mean(losses[-k:])


def curve_gaps(legs: dict, reference: str, k: int) -> dict[str, float]:
    """Each finished leg's relative difference from ``reference`` in the mean loss over the last
    ``k`` steps: |mean(leg) - mean(reference)| / mean(reference)."""
    base = mean_last(legs[reference]["loss"], k)
    return {name: abs(mean_last(leg["loss"], k) - base) / base for name, leg in legs.items()
            if leg["status"] == "ok" and name != reference}


def step_gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two loss curves, step by step (inf if their
    lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def merge(rounds: list[dict]) -> dict:
    """One leg's rounds as one: every measured step's tokens/s pooled (the median is taken over
    them), tokens and CPU seconds summed, the largest peak RSS, the last round's losses."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return rounds[-1]
    pooled = {k: [x for r in ok for x in r[k]] for k in ("tok_s", "step_s", "share", "examples", "others")}
    return {**ok[-1], **pooled, "tokens": sum(r["tokens"] for r in ok), "cpu": sum(r["cpu"] for r in ok),
            "peak": max(r["peak"] for r in ok), "rounds": len(ok),
            "same_loss_every_round": all(step_gap(r["loss"], ok[0]["loss"]) <= SAME_BATCH_TOLERANCE for r in ok)}


def verdicts(legs: dict, k: int) -> list[str]:
    """The target lines (PASS / FAIL, or n/a with the reason)."""
    med = statistics.median
    none = {"status": "not run"}
    padded, trl = legs.get(PADDED, none), legs.get(TRL, none)
    lines = []
    for name in (PACKED, FREE):
        leg = legs.get(name, none)
        if leg["status"] == "ok" and padded["status"] == "ok":
            r = med(leg["tok_s"]) / med(padded["tok_s"])
            per_cpu = (leg["tokens"] / leg["cpu"]) / (padded["tokens"] / padded["cpu"])
            lines.append(f"{'PASS' if r >= SPEEDUP_VS_PADDED else 'FAIL'}: {name} real tokens/s >= "
                         f"{SPEEDUP_VS_PADDED}x padded ({med(leg['tok_s']):.1f} vs {med(padded['tok_s']):.1f} = "
                         f"{r:.2f}x; per CPU-second {per_cpu:.2f}x)")
        else:
            lines.append(f"n/a: {name} vs padded ({name} {leg['status']}, padded {padded['status']})")
    # hf_scale in TRL's layout too (DDP: accelerate drops FSDP on CPU), where that leg ran
    against_trl = [(PACKED, "hf_scale packed (rows)"), (FREE, "hf_scale packed + padding_free (TRL's settings)")]
    if FREE_DDP in legs:
        against_trl.append((FREE_DDP, "hf_scale packed + padding_free under ddp (TRL's settings and layout)"))
    for name, what in against_trl:
        leg = legs.get(name, none)
        if leg["status"] == "ok" and trl["status"] == "ok":
            r = med(leg["tok_s"]) / med(trl["tok_s"])
            per_cpu = (leg["tokens"] / leg["cpu"]) / (trl["tokens"] / trl["cpu"])
            lines.append(f"{'PASS' if r >= SPEEDUP_VS_TRL else 'FAIL'}: {what} real tokens/s >= {SPEEDUP_VS_TRL}x "
                         f"TRL SFTTrainer packing + padding_free ({med(leg['tok_s']):.1f} vs {med(trl['tok_s']):.1f} = "
                         f"{r:.2f}x; per CPU-second {per_cpu:.2f}x)")
        else:
            lines.append(f"n/a: {what} vs TRL ({name} {leg['status']}, {TRL} {trl['status']})")
    if padded["status"] == "ok" and len(legs) > 1:
        gaps = curve_gaps(legs, PADDED, k)
        if gaps:
            worst = max(gaps, key=gaps.get)
            lines.append(f"{'PASS' if gaps[worst] <= CURVE_TOLERANCE else 'FAIL'}: every leg's mean loss over "
                         f"the last {k} steps within {CURVE_TOLERANCE:.0%} of padded's (largest: {worst} "
                         f"{gaps[worst]:.1%}; padded {mean_last(padded['loss'], k):.4f})")
    pairs = [(name, ref) for name, ref in ((FREE, PACKED), (FREE_DDP, PACKED), (FREE_LOGITS, PACKED), (TRL, PACKED))
             if legs.get(name, none)["status"] == "ok" and legs.get(ref, none)["status"] == "ok"
             and (TRL not in (name, ref) or legs[TRL].get("same_batches"))]
    if pairs:
        gaps = {f"{a} vs {b}": step_gap(legs[a]["loss"], legs[b]["loss"]) for a, b in pairs}
        worst = max(gaps, key=gaps.get)
        lines.append(f"{'PASS' if gaps[worst] <= SAME_BATCH_TOLERANCE else 'FAIL'}: the same batches give the "
                     f"same loss at every step within {SAME_BATCH_TOLERANCE:g} relative ({'; '.join(f'{p} {g:.1e}' for p, g in gaps.items())})")
    return lines


def table(legs: dict, k: int) -> str:
    med = statistics.median
    header = ["leg", "real tok/s vs padded", "real tok/s vs TRL", "real tokens/s", "real tokens per CPU-second",
              "positions computed/s", "median step (s)", "real share of positions", "examples per step",
              "peak RSS, largest process (GiB)", "other processes' CPU (cores; each round)", "final loss",
              f"mean loss, last {k} steps", "measured steps"]
    padded, trl = legs.get(PADDED, {"status": "-"}), legs.get(TRL, {"status": "-"})
    rows = []
    for name, leg in legs.items():
        if leg["status"] != "ok":
            rows.append([name, leg["status"]])
            continue

        def vs(base, leg=leg):
            return f"{med(leg['tok_s']) / med(base['tok_s']):.2f}" if base["status"] == "ok" else "n/a"

        rows.append([name, vs(padded), vs(trl), f"{med(leg['tok_s']):.1f}", f"{leg['tokens'] / leg['cpu']:.1f}",
                     f"{med(t / share for t, share in zip(leg['tok_s'], leg['share'])):.1f}", f"{med(leg['step_s']):.1f}", f"{sum(leg['share']) / len(leg['share']):.1%}",
                     f"{statistics.mean(leg['examples']):.1f}", f"{leg['peak'] / 2**30:.2f}",
                     " ".join(f"{x:.2f}" for x in leg["others"]),
                     f"{leg['loss'][-1]:.4f}", f"{mean_last(leg['loss'], k):.4f}", str(len(leg["tok_s"]))])
    return markdown_table(header, rows)


# ------------------------------------------------------------------ the TRL leg (each rank)


def trl_worker(args) -> None:
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hf_scale.data.packing import PackedCollator
    from hf_scale.train.loader import ShardedBatches
    from hf_scale.zoo import load_smollm2

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = _job(args.out, total, [])
    t = job.train
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=args.rows,
        learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        lr_scheduler_type=t.scheduler, warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm,
        max_steps=total, seed=t.seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        ddp_backend="gloo", dataloader_num_workers=0, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, packing=True, packing_strategy="bfd", padding_free=True,
        max_length=job.data.max_seq_len,
    )  # creating the arguments starts the process group
    rank = config.process_index
    tokenizer, examples, ours = _tokenized(job)  # hf_scale's tokens, unpacked and packed
    model, _ = load_smollm2()
    record = {"status": "ok", "rank": rank, "step_end": [], "tokens": [], "positions": [], "examples": [],
              "loss": [], "same": []}
    trainer = None
    shards = [ShardedBatches(ours, args.rows, r, WORLD, PackedCollator(tokenizer.pad_token_id, flatten=True),
                             seed=job.data.seed) for r in range(WORLD)]

    class CountedIterator:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            batch = next(self.it)
            step = len(record["tokens"])
            ids = batch["input_ids"]
            record["tokens"].append(int(ids.numel()))  # padding-free: no padding in the row
            record["positions"].append(int(ids.numel()))
            record["examples"].append(int((batch["position_ids"] == 0).sum()))
            if record["same_order"]:
                epoch, index = divmod(step, len(shards[rank]))
                expected = shards[rank].collate([ours[i] for i in shards[rank].indices(epoch, index)])
                record["same"].append(all(torch.equal(batch[key].cpu(), expected[key])
                                          for key in ("input_ids", "labels", "position_ids")))
            return batch

    class BenchSFTTrainer(SFTTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return super().get_batch_samples(CountedIterator(epoch_iterator), num_batches, device)

    class Probe(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            record["step_end"].append(time.time())
            wrapped = trainer.model_wrapped
            record["ran_as"] = (f"SFTTrainer on {trainer.accelerator.distributed_type.value} x"
                                f"{trainer.accelerator.num_processes}, model wrapped in {type(wrapped).__name__}, "
                                f"collator {type(trainer.data_collator).__name__}(padding_free="
                                f"{trainer.data_collator.padding_free}), {torch.get_num_threads()} torch thread(s)")

        def on_step_end(self, *a, **kw):
            record["step_end"].append(time.time())
            record["peak_rss"] = _max_rss()

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                record["loss"].append(logs["loss"])

    trainer = BenchSFTTrainer(model=model, args=config, train_dataset=examples, processing_class=tokenizer,
                              callbacks=[Probe()])
    packed = trainer.train_dataset  # TRL's own bfd rows, with seq_lengths
    record["rows"], record["hf_scale_rows"] = len(packed), len(ours)
    record["same_order"] = _row_documents(packed, "trl") == _row_documents(ours, "hf_scale")
    if record["same_order"]:  # hf_scale's global batches, rank by rank: what accelerate's sharding hands out
        order = [i for step in range(total) for s in shards for i in s.indices(*divmod(step, len(s)))]
        trainer.train_dataset = packed.select(order)
        trainer.args.train_sampling_strategy = "sequential"
    trainer.train()
    (Path(args.out) / f"{args.name}.rank{rank}.json").write_text(json.dumps(record))


def _row_documents(rows, kind: str) -> list[tuple]:
    """Each packed row as the tuple of its documents' token ids (TRL marks them by
    ``seq_lengths``, hf_scale by ``position_ids`` restarting at 0)."""
    out = []
    for row in rows:
        ids = row["input_ids"]
        if kind == "trl":
            cuts = list(itertools.accumulate(row["seq_lengths"], initial=0))
        else:
            cuts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(ids)]
        out.append(tuple(sorted(tuple(ids[a:b]) for a, b in itertools.pairwise(cuts))))
    return out


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------ shared by the launcher and the workers


RECIPE = """\
# Written by scripts/bench_packing.py: the recipe of its hf_scale legs (each adds its overrides).
model:
  name_or_path: zoo:smollm2
  task: causal_lm
data:
  path: {data}
  system_prompt: {system}
  max_seq_len: {max_len}
  eval_split: null
parallel:
  strategy: fsdp
  loss_labeled_only: true
train:
  output_dir: {out}/unused
  batch_size: {rows}
  lr: 1.0e-4
  warmup_steps: 1
  scheduler: cosine
  weight_decay: 0.0
  max_grad_norm: 1.0
  sample_generations: 0
  eval_every: 0
  exact_match: false
  progress: false
checkpoint:
  save_final: false
  every_steps: 0
launch:
  nproc_per_node: {world}
"""


def _job(out: str | Path, total: int, overrides: list[str]):
    from hf_scale.train.config import load_job

    return load_job(str(Path(out) / "recipe.yaml"), ["--train.max_steps", str(total), *overrides])


def _tokenized(job):
    """(tokenizer, the examples tokenized as hf-scale finetune does, the same packed as it packs);
    quietly (no progress bars, no log lines)."""
    import contextlib
    import io

    import datasets

    from hf_scale.train.data import load_splits, tokenize_causal_lm
    from hf_scale.train.model import load_tokenizer

    datasets.disable_progress_bars()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        tokenizer = load_tokenizer(job.model)
        train = load_splits(job.data)["train"]
        examples = tokenize_causal_lm(train, tokenizer, job.data, job.data.max_seq_len)
        packed = tokenize_causal_lm(train, tokenizer, job.data, job.data.max_seq_len, pack="bfd")
    return tokenizer, examples, packed


def planned_steps(job, world: int, total: int) -> list[dict]:
    """What hf-scale finetune's batches hold, step by step (both ranks): real tokens, positions
    computed, examples; rebuilt here with its own loader and collators (the CLI logs only the
    tokens/s)."""
    from hf_scale.data.packing import PackedCollator, real_tokens
    from hf_scale.train.loader import PadCollator, ShardedBatches

    tokenizer, examples, packed = _tokenized(job)
    pad = tokenizer.pad_token_id
    rows, collate = ((packed, PackedCollator(pad, flatten=job.data.padding_free)) if job.data.packing
                     else (examples, PadCollator(pad)))
    shards = [ShardedBatches(rows, job.train.batch_size, r, world, collate, seed=job.data.seed) for r in range(world)]
    steps = []
    for step in range(total):
        picked = [[rows[i] for i in s.indices(*divmod(step, len(s)))] for s in shards]
        batches = [collate(p) for p in picked]
        steps.append({"tokens": sum(real_tokens(b) for b in batches),
                      "positions": sum(b["input_ids"].numel() for b in batches),
                      "examples": sum(documents(row) for p in picked for row in p)})
    return steps


def documents(row: dict) -> int:
    """Examples in a row: one, or a packed row's documents (its ``position_ids`` restarts)."""
    return list(row["position_ids"]).count(0) if "position_ids" in row else 1


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


# ------------------------------------------------------------------ the legs (launcher)


def hf_scale_leg(args, out: Path, name: str, tag: str) -> dict:
    overrides = [*LEGS[name], "--train.batch_size", str(args.padded_batch if name == PADDED else args.rows)]
    run_dir = out / tag
    total = args.warmup + args.steps
    plan = planned_steps(_job(out, total, overrides), WORLD, total)
    cmd = [sys.executable, "-m", "hf_scale.cli", "finetune", str(out / "recipe.yaml"), "--train.max_steps",
           str(total), "--train.output_dir", str(run_dir), *overrides]
    metrics, seen = run_dir / "metrics.jsonl", []

    def note_steps(now: float):  # the wall time each step's line appears
        if metrics.exists():
            lines = metrics.read_text().count("\n")
            seen.extend([now] * (lines - len(seen)))

    run = run_sampled(cmd, out / f"{tag}.log", args.timeout, env=_env(), cwd=ROOT, on_sample=note_steps)
    if run.error:
        return {"status": run.error}
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    seen += [run.samples[-1][0]] * (len(steps) - len(seen))  # a last line written after the last sample
    logged = json.loads((run_dir / "summary.json").read_text())["tokens_seen"]
    w = args.warmup
    measured = plan[w:]
    log = (out / f"{tag}.log").read_text(errors="replace").splitlines()
    layout = next((ln.removeprefix("[hf_scale] ") for ln in log if " over pp=" in ln), "?")
    counted = sum(s["tokens"] for s in plan)
    return {"status": "ok", "tok_s": [s["tokens_per_s"] for s in steps[w:]],
            "step_s": [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(steps)][w - 1:],
            "tokens": sum(s["tokens"] for s in measured), "cpu": run.cpu_between(seen[w - 1], seen[-1]),
            "others": [run.others_between(seen[w - 1], seen[-1])],
            "share": [s["tokens"] / s["positions"] for s in measured], "examples": [s["examples"] for s in measured],
            "peak": run.maxrss, "loss": [s["loss"] for s in steps],
            "check": f"tokens the run logged {logged}, counted here {counted}"
                     + ("" if logged == counted else " -> DIFFERENT"),
            "ran_as": f"hf-scale finetune (torchrun, {WORLD} workers): {layout}",
            "cmd": " ".join(["hf-scale", *cmd[3:]]).replace(str(out), "OUT")}


def trl_leg(args, out: Path, name: str, tag: str) -> dict:
    cmd = torchrun(__file__, WORLD, "--worker", "--name", tag, "--out", str(out), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--rows", str(args.rows))
    for r in range(WORLD):
        (out / f"{tag}.rank{r}.json").unlink(missing_ok=True)
    run = run_sampled(cmd, out / f"{tag}.log", args.timeout, env=_env(), cwd=ROOT)
    paths = [out / f"{tag}.rank{r}.json" for r in range(WORLD)]
    if run.error or not all(p.exists() for p in paths):
        return {"status": run.error or "failed: a rank wrote no result"}
    ranks = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["rank"])
    r0, w = ranks[0], args.warmup
    ends = r0["step_end"]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    tokens = [sum(step) for step in zip(*(r["tokens"] for r in ranks))]
    positions = [sum(step) for step in zip(*(r["positions"] for r in ranks))]
    examples = [sum(step) for step in zip(*(r["examples"] for r in ranks))]
    same = r0["same_order"] and all(all(r["same"]) for r in ranks)
    rows = (f"TRL packed {r0['rows']} rows, hf_scale {r0['hf_scale_rows']}: "
            + ("the same documents in the same rows; taken in hf_scale's order, every batch identical to hf_scale's"
               if same else "the rows differ or a batch did: TRL's own order, batches NOT compared"))
    return {"status": "ok", "tok_s": [n / s for n, s in zip(tokens[w:], step_s[w:])], "step_s": step_s[w:],
            "tokens": sum(tokens[w:]), "cpu": run.cpu_between(ends[w], ends[-1]),
            "others": [run.others_between(ends[w], ends[-1])],
            "share": [t / p for t, p in zip(tokens[w:], positions[w:])], "examples": examples[w:],
            "peak": run.maxrss, "loss": r0["loss"], "same_batches": same, "check": rows,
            "ran_as": r0["ran_as"], "cmd": " ".join(["torchrun", *cmd[cmd.index(__file__):]]).replace(str(out), "OUT").replace(f"{ROOT}/", "")}


def prepare(args, out: Path) -> str:
    """Write the data and the recipe; return a line describing them (lengths in tokens)."""
    size = write_jsonl(out / "train.jsonl", make_examples(args.examples, seed=0))
    (out / "recipe.yaml").write_text(RECIPE.format(data=out / "train.jsonl", system=SYSTEM_PROMPT, out=out,
                                                   max_len=args.max_len, rows=args.rows, world=WORLD))
    job = _job(out, 1, [])
    _, examples, packed = _tokenized(job)
    s = spread([len(ids) for ids in examples["input_ids"]])
    return (f"{args.examples} multi-step arithmetic examples (1-10 steps; {size / 1e6:.1f} MB of JSONL), "
            f"SmolLM2 chat template: {s['min']} to {s['max']} tokens (median {s['median']:.0f}, mean "
            f"{s['mean']:.0f}; longest / shortest {s['ratio']:.1f}x); bfd packs them into {len(packed)} rows of "
            f"<= {args.max_len} tokens ({len(examples) / len(packed):.2f} examples a row)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per leg (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before them (>= 1)")
    parser.add_argument("--rounds", type=int, default=3, help="run the legs this many times, in turn (A B A B)")
    parser.add_argument("--legs", default=",".join(DEFAULT_LEGS), help=f"comma-separated among {', '.join(LEGS)}")
    parser.add_argument("--examples", type=int, default=2000, help="generated examples")
    parser.add_argument("--max-len", type=int, default=512, help="data.max_seq_len: tokens per packed row")
    parser.add_argument("--padded-batch", type=int, default=4, help="examples per rank and step, padded leg")
    parser.add_argument("--rows", type=int, default=2, help="packed rows per rank and step (hf_scale and TRL)")
    parser.add_argument("--last", type=int, default=3, help="steps whose mean loss the legs compare")
    parser.add_argument("--out", help="folder for data, logs and results (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per leg")
    parser.add_argument("--quiet-wait", type=float, default=600, help="before each leg, wait up to this many "
                        "seconds for other processes to keep fewer than --quiet-cores CPUs busy (0: do not wait)")
    parser.add_argument("--quiet-cores", type=float, default=0.5, help="see --quiet-wait")
    add_write_arg(parser, "packing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return trl_worker(args)
    check_doc(args)
    names = [n.strip() for n in args.legs.split(",") if n.strip()]
    if min(args.steps, args.warmup, args.rounds, args.last) < 1 or set(names) - set(LEGS):
        parser.error(f"--steps, --warmup, --rounds, --last must be >= 1, --legs among {', '.join(LEGS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_packing_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers
    import trl

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    print(f"{versions}; hf_scale at {revision()}; {os.cpu_count()} CPUs, OMP_NUM_THREADS=1 per process; "
          f"logs in {out}", flush=True)
    data = prepare(args, out)
    title = (f"SmolLM2-135M-Instruct fp32, 2 processes; {data}; padded: {args.padded_batch} examples/rank/step, "
             f"packed: {args.rows} rows/rank/step; AdamW lr 1e-4 cosine, 1 warm-up step, clip 1.0; {args.warmup} "
             f"warm-up + {args.steps} measured steps per leg, {args.rounds} round(s) of {', '.join(names)}; "
             f"{versions}; hf_scale at {revision()}")
    print(title, flush=True)
    start, runs = time.perf_counter(), {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            busy, waited = wait_for_quiet(args.quiet_wait, args.quiet_cores) if args.quiet_wait else (0.0, 0.0)
            load, began = os.getloadavg()[0], time.perf_counter()
            tag = re.sub(r"\W+", "_", name.replace("+", "and")).strip("_") + f"_{i}"
            row = (trl_leg if LEGS[name] is None else hf_scale_leg)(args, out, name, tag)
            runs[name].append(row)
            shown = (f"{statistics.median(row['tok_s']):.1f} real tok/s, {row['tokens'] / row['cpu']:.1f} per "
                     f"CPU-s, losses {', '.join(f'{x:.4f}' for x in row['loss'])}" if row["status"] == "ok"
                     else row["status"])
            others = f"; other processes {row['others'][0]:.2f} cores meanwhile" if row["status"] == "ok" else ""
            print(f"  round {i} {name}: {shown} ({time.perf_counter() - began:.0f} s, after waiting {waited:.0f} s "
                  f"for a quiet machine ({busy:.2f} cores busy); load average {load:.2f} before, "
                  f"{os.getloadavg()[0]:.2f} after{others})", flush=True)
    legs = {name: merge(rows) for name, rows in runs.items()}
    ran = "\n".join(f"  {name}: {leg['cmd']}\n    {leg['ran_as']}\n    {leg['check']}"
                    for name, leg in legs.items() if leg["status"] == "ok")
    lines = verdicts(legs, args.last)
    for name, leg in legs.items():
        if leg["status"] == "ok":
            same = "" if leg["same_loss_every_round"] else " (rounds differ; the last shown)"
            lines.append(f"loss per step, {name}{same}: {', '.join(f'{x:.4f}' for x in leg['loss'])}")
    text = "\n".join(lines)
    print(f"\nwhat each leg ran (OUT = {out}):\n{ran}\n\n{table(legs, args.last)}\n\n{text}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_doc(args, f"{title}.\n\nWhat each leg ran (OUT: the run's folder):\n\n```\n{ran}\n```\n\n"
                    f"{table(legs, args.last)}\n\n```\n{text}\n```",
              "Tokens/s depend on what else the machine runs (load average in this line and per leg in the "
              "run's output); tokens per CPU-second less so; losses not at all.")


if __name__ == "__main__":
    main()
