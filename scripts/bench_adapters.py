"""Benchmark: LoRA fine-tuning with hf_scale against TRL's ``SFTTrainer`` + peft (the anchor),
and against hf_scale's own full fine-tune.

Run (one machine, 2 CPU cores; the script launches every leg itself, 2 ranks each)::

    python scripts/bench_adapters.py                       # 1 warm-up + 4 measured steps a leg
    python scripts/bench_adapters.py --legs "TRL lora,hf_scale lora ddp" --steps 10
    python scripts/bench_adapters.py --rounds 2            # A B A B: a machine others use too
    python scripts/bench_adapters.py --env MALLOC_MMAP_THRESHOLD_=65536   # RSS nearer live memory
    python scripts/bench_adapters.py --write docs/benchmarks.md    # into its section (markers
                                                                   # <!-- bench:adapters:start/end -->)

The four default legs take ~5 min on 2 quiet cores (a LoRA step ~6-9 s, a full one ~14 s).

Every leg trains the real SmolLM2-135M-Instruct (fp32, ``hf_scale.zoo.load_smollm2``) on the
quickstart recipe's data (``configs/quickstart.yaml``: generated arithmetic, chat template, loss
on the answers only), 16 examples per rank and step on 2 ranks (torchrun, gloo, one thread per
rank), AdamW with the recipe's lr / cosine schedule / warm-up / weight decay, clipping at 1.0,
for ``--warmup + --steps`` optimizer steps:

* the same batches: the examples are tokenized once by hf_scale's own code (``load_splits`` +
  ``tokenize_causal_lm``: prompt labels -100), rank r of step k gets the rows ``ShardedBatches``
  gives it, padded on the right (``PadCollator``; TRL's own ``DataCollatorForLanguageModeling``
  pads the same way). Each rank hashes its ``input_ids`` and ``labels`` every step; the hashes
  of every leg are compared.
* the same adapter: LoRA r=16, alpha 32, dropout 0 on every linear layer but the head
  (``target_modules="all-linear"``), created once by this script (seed 0, peft
  ``save_pretrained``) and loaded by every LoRA leg with ``PeftModel.from_pretrained(...,
  is_trainable=True)``.

Legs:

* **TRL lora** (the anchor): ``SFTTrainer`` (TRL, over transformers ``Trainer``; accelerate
  wraps it in ``DistributedDataParallel`` on ``MULTI_CPU``) given the PeftModel, the
  pre-tokenized dataset (``skip_prepare_dataset``, so the rows are hf_scale's; a sequential
  sampler over the rows reordered as ``bench_finetune.py`` does), fp32 (``bf16=False``), no
  gradient checkpointing (TRL's default is on; hf_scale's quickstart runs without), its default
  fused AdamW and fused LM head (log-probs in chunks, no full logits; off Triton devices it
  scores every position, with the entropy and top-1 its metrics log).
  Loss per step: Trainer's logged loss with ``logging_steps=1`` (the mean over ranks of each
  rank's loss scaled by the ranks, i.e. the mean over all label tokens of the global batch).
* **hf_scale lora ddp** / **hf_scale lora fsdp**: the PeftModel through
  ``hf_scale.parallelize(model, {"strategy": ..., "loss_labeled_only": True})`` (the
  quickstart's loss setting, applied to the transformers model inside the PeftModel; where
  parallelize refuses it, as before the adapter work (52c863f), the leg runs with the full
  logits and its line says so), ``hf_scale.build_optimizer``, and the steps of ``hf-scale
  finetune``'s loop with the library API: ``hf_scale.train_step`` with each rank's loss scaled
  by its share of the global label tokens, ``hf_scale.clip_grad_norm_``, the optimizer, the
  schedule (``--recipes`` runs the CLI itself, ``configs/quickstart-lora.yaml``).
* **hf_scale full fsdp**: the same without LoRA (every parameter trained), under fsdp.
* **hf_scale lora fsdp ac** / **hf_scale full fsdp ac** (``--legs``, not run by default): the two
  fsdp legs with full activation checkpointing (``activation_checkpointing: "full"``), both alike:
  what LoRA saves when the activations both legs hold are not most of the step. Their line is the
  0.6x target again; the ``bound`` line under the no-checkpointing pair says how small the
  activations would have to be for that pair to meet it.
* **hf_scale lora ddp base-loss** / **hf_scale lora fsdp base-loss** (not run by default): the
  labeled-only loss put by this script on the PeftModel's base model before ``parallelize``
  (``hf_scale.parallel.loss.apply_chunked_loss``), as the LoRA legs had to be measured before
  parallelize saw through the PeftModel; now the same as those legs.
* ``--recipes``: both quickstart recipes end to end with ``hf-scale finetune`` (LoRA and full),
  held-out exact match before and after training.

Measured the same way on every leg, over the measured steps (the first ``--warmup`` skipped):

* tokens/s: the median over the measured steps of (non-padding tokens of all ranks / the step's
  wall time on rank 0, from one step's end to the next: data, forward, backward, reduction,
  optimizer, logging); and tokens per CPU-second (the same tokens over the CPU time of all
  ranks' processes in those steps), which depends less on what else the machine runs; and how
  busy the machine's other processes kept its CPUs meanwhile (cores, the largest round);
* peak RSS: ``ru_maxrss`` of each rank at the end (loading included), the largest rank, and the
  step it was reached in; and the RSS of the largest rank just before step 1 (model, adapter,
  optimizer built), to tell loading from training. With glibc's default (dynamic) mmap
  threshold, freed activations stay in the heap: the peak counts ~1 GiB more than the live
  tensors on every leg here (``--env MALLOC_MMAP_THRESHOLD_=65536`` to see live memory);
* loss per step, and its largest absolute difference from TRL's;
* evidence of what a step moves: trainable parameters, optimizer state elements, frozen
  parameters left holding a ``.grad``, and bytes all-reduced per step by DDP (a counting
  comm hook on the DDP legs; FSDP's reduce-scatters are not counted).

Targets (issue "PEFT adapters (LoRA) under every layout"): hf_scale LoRA (ddp, the layout TRL
runs) tokens/s >= 1.2x TRL's, peak RSS <= 1.0x TRL's, the same loss at every step (within
1e-4); hf_scale LoRA under fsdp against hf_scale's full fine-tune under fsdp: peak RSS <= 0.6x,
tokens/s >= 1.3x; ``hf-scale finetune configs/quickstart-lora.yaml`` improves held-out exact match
over the base model (``--recipes``, beside the full fine-tune's figures).
"""

from __future__ import annotations

import argparse
import hashlib
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
    add_write_arg,
    busy_cpu_seconds,
    check_doc,
    failure_reason,
    launch_ranks,
    markdown_table,
    ran_as,
    revision,
    torchrun,
    write_doc,
)

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "configs" / "quickstart.yaml")
WORLD = 2
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LOSS_TOLERANCE = 1e-4


# ------------------------------------------------------------------ shared by the workers


def _job(total_steps: int):
    from hf_scale.train.config import load_job

    return load_job(RECIPE, ["--train.max_steps", str(total_steps), "--data.eval_split", "null"])


def _train_rows(job, tokenizer):
    """The quickstart's tokenized training examples, as ``hf-scale finetune`` builds them."""
    from hf_scale.train.data import load_splits, tokenize_causal_lm

    return tokenize_causal_lm(load_splits(job.data)["train"], tokenizer, job.data,
                              job.data.max_seq_len, pack=job.data.packing)


def _digest(batch) -> str:
    """A short hash of a batch's token ids and labels (what both frameworks must feed the model)."""
    h = hashlib.sha1()
    for key in ("input_ids", "labels", "attention_mask"):
        h.update(batch[key].to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class AllReduceCounter:
    """The state of :func:`counting_allreduce`: bytes all-reduced since the last reset."""

    def __init__(self):
        self.bytes = 0


def counting_allreduce(state: AllReduceCounter, bucket):
    """A DDP comm hook: all-reduce (DDP's default hook, the default group) and count the bytes.
    Register with ``ddp.register_comm_hook(AllReduceCounter(), counting_allreduce)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def _model_facts(model, optimizer) -> dict:
    """Trainable parameters, optimizer state size and frozen parameters holding a gradient."""
    params = list(model.parameters())

    def numel(p):
        return p.numel()  # a DTensor's numel is its global size

    state = sum(t.numel() for s in optimizer.state.values() for t in s.values()
                if hasattr(t, "numel") and t.dim() > 0)
    return {"trainable": sum(numel(p) for p in params if p.requires_grad),
            "total": sum(numel(p) for p in params),
            "optimizer_state": state,
            "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
            "frozen_with_grad": sum(1 for p in params if not p.requires_grad and p.grad is not None)}


def _mark(record: dict) -> None:
    """A step's end (or the first one's start): wall time, this process's CPU time, peak RSS."""
    record["step_end"].append(time.perf_counter())
    record["cpu"].append(time.process_time())
    record["max_rss"].append(_max_rss_bytes())
    record.setdefault("busy", []).append(busy_cpu_seconds())


def _write(out: str, name: str, rank: int, record: dict) -> None:
    (Path(out) / f"{name}.rank{rank}.json").write_text(json.dumps({"status": "ok", **record}))


# ------------------------------------------------------------------ the hf_scale legs (each rank)


def hf_scale_worker(args) -> None:
    import torch
    from transformers import get_scheduler

    import hf_scale
    from hf_scale.train.dp import DataParallel
    from hf_scale.train.loader import PadCollator, ShardedBatches
    from hf_scale.train.model import load_tokenizer
    from hf_scale.zoo import load_smollm2

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = _job(total)
    t = job.train
    tokenizer = load_tokenizer(job.model)
    model, _ = load_smollm2()
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
    model, loss_note = _parallelize(model, args)
    rank = torch.distributed.get_rank()
    train = _train_rows(job, tokenizer)
    dp = DataParallel.of(model)
    stream = iter(ShardedBatches(train, t.batch_size, dp.rank, dp.degree,
                                 PadCollator(tokenizer.pad_token_id), seed=job.data.seed))
    optimizer = hf_scale.build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas))
    scheduler = get_scheduler(t.scheduler, optimizer, num_warmup_steps=t.warmup_steps,
                              num_training_steps=total)
    counter = None
    if args.strategy in ("ddp", "zero1"):
        counter = AllReduceCounter()
        model.register_comm_hook(counter, counting_allreduce)
    note = f"strategy {args.strategy}; {loss_note}; {'activation checkpointing full; ' if args.ac else ''}{torch.get_num_threads()} torch thread(s)"
    record = {"rank": rank, "ran_as": ran_as(model, note)[0],
              "rss_setup": _rss_bytes(), "max_rss_setup": _max_rss_bytes(),
              "step_end": [], "cpu": [], "max_rss": [], "tokens": [], "digests": [], "loss": [],
              "allreduce_bytes": []}
    _mark(record)  # the start of step 1
    for _ in range(total):
        batch = next(stream)
        record["digests"].append(_digest(batch))
        labels = float((batch["labels"][:, 1:] != -100).sum())
        counts = torch.tensor([labels, float(batch["attention_mask"].sum())], dtype=torch.float64)
        dp.all_reduce(counts)
        share = labels / max(float(counts[0]), 1.0)
        # gradients are averaged over the ranks: each rank's share counts dp.degree times
        loss = hf_scale.train_step(model, batch, loss_scale=share * dp.degree)
        hf_scale.clip_grad_norm_(model, t.max_grad_norm or float("inf"))
        optimizer.step()
        if len(record["step_end"]) == 1:
            record["facts"] = _model_facts(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss_sum = torch.tensor(float(loss) * share, dtype=torch.float64)
        dp.all_reduce(loss_sum)
        record["loss"].append(float(loss_sum))
        record["tokens"].append(int(batch["attention_mask"].sum()))
        _mark(record)
        if counter is not None:
            record["allreduce_bytes"].append(counter.bytes)
            counter.bytes = 0
    record["max_rss_end"] = _max_rss_bytes()
    _write(args.out, args.name, rank, record)


def _parallelize(model, args):
    """``hf_scale.parallelize`` with the quickstart's ``loss_labeled_only`` (the head on the
    labeled positions only). ``--loss base``: the labeled-only loss put on the PeftModel's base
    model by this script (hf_scale's own refuses a PeftModel), then parallelize without it. When
    parallelize refuses ``loss_labeled_only``, the leg runs with the full logits and says so."""
    import hf_scale
    from hf_scale.errors import HfScaleConfigError

    config = {"strategy": args.strategy, **({"activation_checkpointing": "full"} if args.ac else {})}
    if args.loss == "base":
        from hf_scale.parallel.loss import apply_chunked_loss

        base = model.get_base_model()
        apply_chunked_loss(base, base.get_output_embeddings(), None, labeled_only=True)
        return hf_scale.parallelize(model, config), "loss: head on labeled positions (put on the base model by the bench)"
    try:
        return hf_scale.parallelize(model, {**config, "loss_labeled_only": True}), "loss_labeled_only"
    except HfScaleConfigError as e:
        refused = str(e).split(". ")[0]
        return hf_scale.parallelize(model, config), f"loss_labeled_only REFUSED ({refused}): full logits"


# ------------------------------------------------------------------ the TRL leg (each rank)


def trl_worker(args) -> None:
    import torch
    from peft import PeftModel
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hf_scale.train.loader import PadCollator, ShardedBatches
    from hf_scale.train.model import load_tokenizer
    from hf_scale.zoo import load_smollm2

    torch.set_num_threads(1)
    total = args.warmup + args.steps
    job = _job(total)
    t = job.train
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], lr_scheduler_type=t.scheduler,
        warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm or 0.0, max_steps=total,
        seed=t.seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        ddp_backend="gloo", train_sampling_strategy="sequential", dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True},
    )  # creating the arguments starts the process group
    rank = config.process_index
    tokenizer = load_tokenizer(job.model)
    model, _ = load_smollm2()
    model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
    train = _train_rows(job, tokenizer)
    collate = PadCollator(tokenizer.pad_token_id)
    shards = [ShardedBatches(train, t.batch_size, r, WORLD, collate, seed=job.data.seed)
              for r in range(WORLD)]
    order = []  # hf_scale's global batches, rank by rank: what accelerate's sharding hands out
    for position in range(total * t.grad_accum):
        epoch, batch = divmod(position, len(shards[0]))
        order += [i for s in shards for i in s.indices(epoch, batch)]
    record = {"rank": rank, "step_end": [], "cpu": [], "max_rss": [], "tokens": [], "digests": [],
              "loss": [], "allreduce_bytes": []}
    counter = AllReduceCounter()

    class CountedIterator:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            batch = next(self.it)
            record["digests"].append(_digest(batch))
            record["tokens"].append(int(batch["attention_mask"].sum()))
            return batch

    class BenchSFTTrainer(SFTTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return super().get_batch_samples(CountedIterator(epoch_iterator), num_batches, device)

    class Probe(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            wrapped = trainer.model_wrapped
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                wrapped.register_comm_hook(counter, counting_allreduce)
            record.update(rss_setup=_rss_bytes(), max_rss_setup=_max_rss_bytes(), ran_as=describe())
            _mark(record)

        def on_step_end(self, *a, **kw):
            _mark(record)
            record["allreduce_bytes"].append(counter.bytes)
            counter.bytes = 0

        def on_optimizer_step(self, *a, **kw):
            if "facts" not in record:
                record["facts"] = _model_facts(trainer.model, trainer.optimizer)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                record["loss"].append(logs["loss"])

    def describe() -> str:
        wrapped = trainer.model_wrapped
        ddp = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        return (f"SFTTrainer on {trainer.accelerator.distributed_type.value} x"
                f"{trainer.accelerator.num_processes}, model wrapped in {type(wrapped).__name__}"
                + (f" (find_unused_parameters={wrapped.find_unused_parameters})" if ddp else "")
                + f", optimizer {type(trainer.optimizer).__name__}"
                + f" fused={trainer.optimizer.defaults.get('fused')}"
                + f", collator {type(trainer.data_collator).__name__}"
                + f"; {torch.get_num_threads()} torch thread(s)")

    trainer = BenchSFTTrainer(model=model, args=config, train_dataset=train.select(order),
                              processing_class=tokenizer, callbacks=[Probe()])
    trainer.train()
    record["max_rss_end"] = _max_rss_bytes()
    _write(args.out, args.name, rank, record)


# ------------------------------------------------------------------ the launcher


LEGS = {  # name: worker arguments
    "TRL lora": ["--worker", "trl"],
    "hf_scale lora ddp": ["--worker", "hf_scale", "--strategy", "ddp"],
    "hf_scale lora fsdp": ["--worker", "hf_scale", "--strategy", "fsdp"],
    "hf_scale full fsdp": ["--worker", "hf_scale", "--strategy", "fsdp", "--full"],
    "hf_scale lora fsdp ac": ["--worker", "hf_scale", "--strategy", "fsdp", "--ac"],
    "hf_scale full fsdp ac": ["--worker", "hf_scale", "--strategy", "fsdp", "--full", "--ac"],
    # not run by default: what the LoRA legs would give with the head on the labeled positions
    "hf_scale lora ddp base-loss": ["--worker", "hf_scale", "--strategy", "ddp", "--loss", "base"],
    "hf_scale lora fsdp base-loss": ["--worker", "hf_scale", "--strategy", "fsdp", "--loss", "base"],
}
DEFAULT_LEGS = ["TRL lora", "hf_scale lora ddp", "hf_scale lora fsdp", "hf_scale full fsdp"]
ANCHOR, LORA_VS_TRL, LORA_VS_FULL, FULL = "TRL lora", "hf_scale lora ddp", "hf_scale lora fsdp", "hf_scale full fsdp"
LORA_AC, FULL_AC = "hf_scale lora fsdp ac", "hf_scale full fsdp ac"


def make_adapter(folder: Path) -> None:
    """The initial LoRA adapter every LoRA leg loads (seed 0; B is zero, so step 1 is the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_scale.zoo import load_smollm2

    torch.manual_seed(0)
    model, _ = load_smollm2()
    get_peft_model(model, LoraConfig(**LORA)).save_pretrained(folder)


def run_leg(args, out: Path, name: str, round_: int = 0) -> dict:
    tag = f"{name.replace(' ', '_')}_{round_}"
    extra = list(LEGS[name])
    if "--full" in extra:
        extra.remove("--full")
    else:
        extra += ["--adapter", str(out / "init_adapter")]
    cmd = torchrun(__file__, WORLD, *extra, "--name", tag, "--out", str(out),
                   "--steps", str(args.steps), "--warmup", str(args.warmup))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(item.split("=", 1) for item in args.env)
    ranks, error = launch_ranks(cmd, out, tag, WORLD, args.timeout, env=env)
    if error and "ChildFailedError" in error:  # torchrun's last words: find the rank's own error
        log = (out / f"{tag}.log").read_text(errors="replace").splitlines()
        error = failure_reason("\n".join(ln for ln in log if "ChildFailedError" not in ln), "?")
    if error:
        return {"status": error}
    ranks.sort(key=lambda r: r["rank"])
    r0, w = ranks[0], args.warmup
    tokens = [sum(step) for step in zip(*(r["tokens"] for r in ranks))]
    step_s = [b - a for a, b in zip(r0["step_end"], r0["step_end"][1:])]
    cpu_s = sum(r["cpu"][-1] - r["cpu"][w] for r in ranks)  # the measured steps, all ranks
    wall, busy = r0["step_end"][-1] - r0["step_end"][w], r0["busy"][-1] - r0["busy"][w]
    rates = [n / s for n, s in zip(tokens[w:], step_s[w:])]
    return {"status": "ok", "tok_s": statistics.median(rates), "rates": rates, "step_s": step_s[w:],
            "cpu": (sum(tokens[w:]), cpu_s), "rounds": 1, "others": [(busy - cpu_s) / wall],
            "peak_step": 1 + next(i for i, m in enumerate(r0["max_rss"][1:]) if m == r0["max_rss"][-1]),
            "tokens": tokens, "loss": r0["loss"], "digests": [r["digests"] for r in ranks],
            "peak": max(r["max_rss_end"] for r in ranks) / 2**30,
            "setup": max(r["rss_setup"] for r in ranks) / 2**30,
            "peak_setup": max(r["max_rss_setup"] for r in ranks) / 2**30,
            "facts": r0.get("facts", {}), "allreduce": r0["allreduce_bytes"][w:],
            "ran_as": r0["ran_as"], "cmd": " ".join(["torchrun", *cmd[cmd.index(__file__):]])}


def merge(rounds: list[dict]) -> dict:
    """One leg's rounds as one: the median tokens/s over every measured step of every round, the largest
    peak RSS, the last round's losses (each round trains the same steps)."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return rounds[-1]
    rates = [x for r in ok for x in r["rates"]]
    cpu = tuple(sum(r["cpu"][i] for r in ok) for i in (0, 1))
    return {**ok[-1], "tok_s": statistics.median(rates), "rates": rates, "cpu": cpu,
            "others": [x for r in ok for x in r["others"]],
            "step_s": [x for r in ok for x in r["step_s"]],
            "peak": max(r["peak"] for r in ok), "setup": max(r["setup"] for r in ok), "rounds": len(ok),
            "same_loss_every_round": all(r["loss"] == ok[0]["loss"] for r in ok)}


def report(legs: dict, args) -> tuple[str, str, str]:
    """(what each leg ran, the table with the ratios first, the verdicts and losses)."""
    none = {"status": "not run"}
    ok = {name: leg for name, leg in legs.items() if leg["status"] == "ok"}
    anchor, full = legs.get(ANCHOR, none), legs.get(FULL, none)
    header = ["leg", "tok/s vs TRL", "peak RSS vs TRL", "tok/s vs full fsdp", "peak RSS vs full fsdp",
              "tokens/s", "tokens per CPU-second", "median step (s)", "peak RSS (GiB; reached in)",
              "RSS before step 1 (GiB)", "other processes' CPU (cores)",
              "max loss diff vs TRL", "trainable params", "optimizer state (elements)",
              "all-reduced per step (MB)"]
    rows = []
    for name, leg in legs.items():
        if leg["status"] != "ok":
            rows.append([name, leg["status"]])
            continue

        def ratio(base, key, leg=leg):
            return f"{leg[key] / base[key]:.2f}" if base["status"] == "ok" else "n/a"

        facts = leg["facts"]
        sent = f"{sum(leg['allreduce']) / len(leg['allreduce']) / 1e6:.1f}" if any(leg["allreduce"]) else "-"
        steps = sorted(leg["step_s"])
        rows.append([name, ratio(anchor, "tok_s"), ratio(anchor, "peak"), ratio(full, "tok_s"),
                     ratio(full, "peak"), f"{leg['tok_s']:.1f}", f"{leg['cpu'][0] / leg['cpu'][1]:.1f}",
                     f"{statistics.median(steps):.2f}",
                     f"{leg['peak']:.2f} (step {leg['peak_step']})", f"{leg['setup']:.2f}",
                     f"{max(leg['others']):.2f}", _loss_diff(leg, anchor),
                     f"{facts.get('trainable', 0) / 1e6:.2f}M of {facts.get('total', 0) / 1e6:.1f}M",
                     f"{facts.get('optimizer_state', 0) / 1e6:.2f}M", sent])
    ran = "\n".join(f"  {name}: {leg['cmd']}\n    {leg['ran_as']}" for name, leg in ok.items())
    lines = _verdicts(legs, none)
    if anchor["status"] == "ok":
        for name, leg in ok.items():
            if name != ANCHOR and "lora" in name:
                same = leg["digests"] == anchor["digests"]
                lines.append(f"batches (token ids, labels, mask of every rank and step), {name} vs TRL: "
                             + ("identical" if same else "DIFFERENT"))
    for name, leg in ok.items():
        lines.append(f"loss per step, {name}: {', '.join(f'{x:.6f}' for x in leg['loss'])}")
    return ran, markdown_table(header, rows), "\n".join(lines)


def _loss_diff(leg: dict, anchor: dict) -> str:
    if anchor["status"] != "ok" or leg is anchor or len(leg["loss"]) != len(anchor["loss"]):
        return "-"
    return f"{max(abs(a - b) for a, b in zip(leg['loss'], anchor['loss'])):.1e}"


def _per_cpu(leg: dict, base: dict) -> str:
    a, b = (x["cpu"][0] / x["cpu"][1] for x in (leg, base))
    return f"{a:.1f} vs {b:.1f} = {a / b:.2f}x"


def _verdicts(legs: dict, none: dict) -> list[str]:
    lines = []
    lora, anchor = legs.get(LORA_VS_TRL, none), legs.get(ANCHOR, none)
    if lora["status"] == "ok" and anchor["status"] == "ok":
        r = lora["tok_s"] / anchor["tok_s"]
        lines.append(f"{'PASS' if r >= 1.2 else 'FAIL'}: hf_scale LoRA (ddp) tokens/s >= 1.2x TRL SFTTrainer "
                     f"+ peft ({lora['tok_s']:.1f} vs {anchor['tok_s']:.1f} = {r:.2f}x; per CPU-second "
                     f"{_per_cpu(lora, anchor)})")
        r = lora["peak"] / anchor["peak"]
        lines.append(f"{'PASS' if r <= 1.0 else 'FAIL'}: hf_scale LoRA (ddp) peak RSS <= 1.0x TRL's "
                     f"({lora['peak']:.2f} vs {anchor['peak']:.2f} GiB = {r:.2f}x)")
        diffs = [abs(a - b) for a, b in zip(lora["loss"], anchor["loss"])]
        same = len(lora["loss"]) == len(anchor["loss"]) and max(diffs) <= LOSS_TOLERANCE
        lines.append(f"{'PASS' if same else 'FAIL'}: hf_scale LoRA (ddp) loss = TRL's at every step within "
                     f"{LOSS_TOLERANCE:g} (largest difference {max(diffs):.1e} over {len(diffs)} steps)")
    else:
        lines.append(f"n/a: hf_scale LoRA vs TRL ({LORA_VS_TRL} {lora['status']}, {ANCHOR} {anchor['status']})")
    lora, full = legs.get(LORA_VS_FULL, none), legs.get(FULL, none)
    if lora["status"] == "ok" and full["status"] == "ok":
        r = lora["peak"] / full["peak"]
        lines.append(f"{'PASS' if r <= 0.6 else 'FAIL'}: hf_scale LoRA (fsdp) peak RSS <= 0.6x hf_scale full "
                     f"fine-tune (fsdp) ({lora['peak']:.2f} vs {full['peak']:.2f} GiB = {r:.2f}x)")
        r = lora["tok_s"] / full["tok_s"]
        lines.append(f"{'PASS' if r >= 1.3 else 'FAIL'}: hf_scale LoRA (fsdp) tokens/s >= 1.3x hf_scale full "
                     f"fine-tune (fsdp) ({lora['tok_s']:.1f} vs {full['tok_s']:.1f} = {r:.2f}x; per CPU-second "
                     f"{_per_cpu(lora, full)})")
    else:
        lines.append(f"n/a: hf_scale LoRA vs full fine-tune ({LORA_VS_FULL} {lora['status']}, {FULL} {full['status']})")
        return lines
    lines.append(f"  bound: of the LoRA leg's {lora['peak']:.2f} GiB, {lora['peak'] - lora['setup']:.2f} are what "
                 f"its steps add above the built model (activations, gathered units, logits), which the full "
                 f"fine-tune adds too; the full leg's own extra (gradients, AdamW state) is "
                 f"{full['peak'] - full['setup'] - (lora['peak'] - lora['setup']):.2f} GiB; 0.6x needs the "
                 f"shared part <= {_shared_limit(lora, full):.2f} GiB (the ac legs: activation checkpointing)")
    ac_lora, ac_full = legs.get(LORA_AC, none), legs.get(FULL_AC, none)
    if ac_lora["status"] == "ok" and ac_full["status"] == "ok":
        r = ac_lora["peak"] / ac_full["peak"]
        lines.append(f"{'PASS' if r <= 0.6 else 'FAIL'}: hf_scale LoRA (fsdp) peak RSS <= 0.6x hf_scale full "
                     f"fine-tune (fsdp), both with activation checkpointing ({ac_lora['peak']:.2f} vs "
                     f"{ac_full['peak']:.2f} GiB = {r:.2f}x)")
    return lines


def _shared_limit(lora: dict, full: dict) -> float:
    """The step memory both legs hold alike (activations: ``a``) at which LoRA's peak would be 0.6x
    the full leg's, everything else as measured: ``lora_setup + a = 0.6 (full_setup + extra + a)``,
    ``extra`` the full leg's gradients and optimizer state (its step's addition less LoRA's)."""
    shared = lora["peak"] - lora["setup"]
    extra = full["peak"] - full["setup"] - shared
    return max(0.0, (0.6 * (full["setup"] + extra) - lora["setup"]) / 0.4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per leg (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before them (>= 1)")
    parser.add_argument("--legs", default=",".join(DEFAULT_LEGS),
                        help=f"comma-separated among {', '.join(LEGS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the legs this many times, in turn (A B A B: a machine whose speed drifts)")
    parser.add_argument("--out", help="folder for logs and results (default: a temp dir)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every leg's environment, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc "
                        "then returns freed activations to the system: RSS closer to live memory)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per leg")
    parser.add_argument("--recipes", action="store_true",
                        help="also run both quickstart recipes (LoRA and full) end to end: held-out exact "
                        "match before and after (~12 min)")
    add_write_arg(parser, "adapters")
    parser.add_argument("--worker", choices=["trl", "hf_scale"], help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--loss", default="labeled", help=argparse.SUPPRESS)
    parser.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return (trl_worker if args.worker == "trl" else hf_scale_worker)(args)
    check_doc(args)
    names = [n.strip() for n in args.legs.split(",") if n.strip()]
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or set(names) - set(LEGS) or any(
            "=" not in item for item in args.env):
        parser.error(f"--steps, --warmup and --rounds must be >= 1, --legs among {', '.join(LEGS)}, "
                     "--env KEY=VALUE")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_adapters_"))
    out.mkdir(parents=True, exist_ok=True)
    import peft
    import torch
    import transformers
    import trl

    print(f"command: python scripts/bench_adapters.py {' '.join(sys.argv[1:])}".rstrip())
    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
                f"{trl.__version__}, peft {peft.__version__}")
    print(f"{versions}; hf_scale at {revision()}; {os.cpu_count()} CPUs, OMP_NUM_THREADS=1 per rank; "
          f"logs in {out}", flush=True)
    title = (f"SmolLM2-135M-Instruct fp32, {configs_note()}; LoRA r={LORA['r']} alpha {LORA['lora_alpha']} "
             f"dropout {LORA['lora_dropout']} on {LORA['target_modules']}; {args.warmup} warm-up + "
             f"{args.steps} measured steps per leg, {args.rounds} round(s)"
             + "".join(f"; {item}" for item in args.env) + f"; {versions}; hf_scale at {revision()}")
    start = time.perf_counter()
    if any("lora" in n for n in names):
        make_adapter(out / "init_adapter")
    runs = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            load, began = os.getloadavg()[0], time.perf_counter()
            row = run_leg(args, out, name, i)
            runs[name].append(row)
            shown = (f"{row['tok_s']:.1f} tok/s, {row['cpu'][0] / row['cpu'][1]:.1f} per CPU-s, other "
                     f"processes busy {row['others'][0]:.2f} cores" if row["status"] == "ok" else row["status"])
            print(f"  round {i} {name}: {shown} ({time.perf_counter() - began:.0f} s; load average "
                  f"{load:.2f} before, {os.getloadavg()[0]:.2f} after)", flush=True)
    legs = {name: merge(rows) for name, rows in runs.items()}
    ran, table, verdicts = report(legs, args)
    recipes = ""
    if args.recipes:
        recipe_table, recipe_lines = run_recipes(out, args.timeout)
        verdicts = "\n".join([*recipe_lines, verdicts])
        recipes = f"\n\nThe quickstart recipes end to end (200 held-out questions):\n\n{recipe_table}"
    print(f"\n{title}\n\nwhat each leg ran:\n{ran}\n\n{table}{recipes}\n\n{verdicts}")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    write_doc(args, f"{title}.\n\nWhat each leg ran:\n\n```\n{ran}\n```\n\n{table}{recipes}\n\n```\n{verdicts}\n```",
              "Tokens/s depend on what else the machine runs (load average in this line); losses do not.")


RECIPES = {"LoRA (configs/quickstart-lora.yaml)": "quickstart-lora.yaml",
           "full fine-tune (configs/quickstart.yaml)": "quickstart.yaml"}


def run_recipes(out: Path, timeout: int) -> tuple[str, list[str]]:
    """Both quickstart recipes end to end with ``hf-scale finetune`` (as shipped: every step,
    evaluation before and after): held-out exact match before/after, train time, the table
    and the verdict that LoRA improves on the base model."""
    import subprocess

    rows, summaries = [], {}
    for name, recipe in RECIPES.items():
        folder = out / recipe.removesuffix(".yaml")
        cmd = [sys.executable, "-m", "hf_scale.cli", "finetune", str(ROOT / "configs" / recipe),
               "--train.output_dir", str(folder), "--train.progress", "false", "--train.sample_generations", "0"]
        began = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        (out / f"{folder.name}.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            rows.append([name, f"failed ({failure_reason(run.stdout + run.stderr, run.returncode)})"])
            continue
        summary = summaries[name] = json.loads((folder / "summary.json").read_text())
        rows.append([name, f"{summary['before']['eval_exact_match']:.3f}", f"{summary['after']['eval_exact_match']:.3f}",
                     f"{summary['train_time_s']:.0f}", f"{time.perf_counter() - began:.0f}",
                     " ".join(cmd[2:]).replace(str(ROOT) + "/", "")])
    table = markdown_table(["recipe", "exact match before", "exact match after", "train time (s)", "wall (s)",
                            "command"], rows)
    lora = summaries.get(next(iter(RECIPES)))
    if lora is None:
        return table, ["n/a: the LoRA recipe did not finish"]
    before, after = lora["before"]["eval_exact_match"], lora["after"]["eval_exact_match"]
    return table, [f"{'PASS' if after > before else 'FAIL'}: hf-scale finetune configs/quickstart-lora.yaml "
                   f"improves held-out exact match over the base model ({before:.3f} -> {after:.3f})"]


def configs_note() -> str:
    job = _job(1)
    t = job.train
    return (f"{job.data.path} ({job.data.max_train_samples} examples, max {job.data.max_seq_len} tokens), "
            f"{t.batch_size} examples/rank/step x {WORLD} ranks, AdamW lr {t.lr} {t.scheduler} warm-up "
            f"{t.warmup_steps}, weight decay {t.weight_decay}, clip {t.max_grad_norm}")


if __name__ == "__main__":
    main()
