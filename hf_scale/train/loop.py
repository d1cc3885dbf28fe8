"""One fine-tuning run, from a :class:`JobConfig` to a saved (and optionally pushed) model.

Order: process group -> tokenizer and data (rank 0 tokenises first) -> pretrained model in its
parallel layout -> optimizer and schedule -> resume -> trackers (``train.report_to``) -> evaluate
-> train (periodic eval and checkpoints) -> evaluate -> save the Hub-format model, loss curve and
model card -> push.

The loss of a step is the mean over every label token of the global batch (all data-parallel
ranks, all accumulated micro-batches), as one process would compute it on the whole batch: each
micro-batch's mean loss is weighted by its share of the step's label tokens.

Data is sharded over the data-parallel ranks (:class:`DataParallel`), not over all ranks: the
ranks of one tensor-parallel group see the same batch, and token counts are reduced over the
data-parallel group only, so every token counts once.

Usage::

    summary = run(load_job("configs/quickstart.yaml"))     # on every rank (torchrun)
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..api import get_state
from ..checkpoint import load_state, save_pretrained, save_state
from ..data.packing import PackedCollator, check_packing, real_tokens
from ..data.preference import tokenize_preference
from ..data.streaming import StreamBatches
from ..distributed import init_distributed
from ..log import log_rank0
from ..parallel.optim import build_optimizer, clip_grad_norm_, no_sync
from ..parallel.step import train_step
from ..ranks import rank_world
from .config import JobConfig
from .data import (
    causal_lm_format,
    check_seq_len,
    check_vocab,
    label_ids,
    load_splits,
    stream_encoder,
    tokenize_causal_lm,
    tokenize_classification,
)
from .dp import DataParallel, context_degree, pipeline_degree
from .evaluate import evaluate
from .finish import finish_run
from ..host_memory import release_freed_memory
from .loader import PadCollator, ShardedBatches
from .metrics import LOSS_CURVE, Metrics, peak_memory_gb
from .preference import add_reference, evaluate_preference, load_reference_model, pair_datasets, preference_step_values
from .reward import RewardCollator
from .streaming_data import stream_eval, stream_source
from .model import MODEL_SOURCES, load_config, load_model, load_tokenizer, meta_model, read_model_config
from .trackers import start_trackers


def run(job: JobConfig) -> dict:
    """Train as ``job`` says; call on every rank. Returns the summary rank 0 printed."""
    env = init_distributed(job.parallel.timeout_seconds)
    rank, world = env.rank, env.world_size
    if env.device.type == "cpu":  # the model's tensors live in host memory: give freed ones back
        release_freed_memory()
    if job.parallel.auto:  # the planner's layout for this world size and the recipe's batches
        job = _with_auto_layout(job)
    if rank != 0:
        _quiet_progress_bars()
    _seed(job.train.seed)
    model_config = read_model_config(job.model, MODEL_SOURCES)  # one clear error for a model that is not there
    tokenizer = load_tokenizer(job.model)
    check_seq_len(job.data.max_seq_len, model_config)
    if job.data.keeps_documents_apart:  # before any data or weights are read
        check_packing(model_config)
        if job.parallel.packed_attention is None:  # each document attended alone (same results, less work)
            job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, packed_attention=True))
    train_ds, eval_ds, labels, answers = _datasets(job, tokenizer)
    check_vocab(tokenizer, model_config, train_ds, eval_ds)
    model = load_model(job.model, job.parallel, labels=labels, pad_id=tokenizer.pad_token_id, adapter=job.peft,
                       seed=job.train.seed, center_rewards_coefficient=job.train.center_rewards_coefficient)
    device = get_state(model).env.device
    dp = DataParallel.of(model)  # ranks of one tensor-parallel group share a batch
    if job.preference.enabled:  # the reference's log-probs: the policy as loaded is the reference
        train_ds, eval_ds = add_reference(job, model, train_ds, eval_ds, dp, tokenizer.pad_token_id)
    reference = load_reference_model(job, model) if job.preference.enabled else None  # reference: model
    collate, eval_collate = _collators(job, tokenizer.pad_token_id)
    batches = _batches(job, train_ds, tokenizer, collate, dp)
    total_steps = job.train.max_steps or max(1, math.ceil(job.train.epochs * len(batches) / job.train.grad_accum))
    optimizer = build_optimizer(model, lr=job.train.lr, weight_decay=job.train.weight_decay,
                                betas=tuple(job.train.betas))
    scheduler = _scheduler(job, optimizer, total_steps)
    start = _resume(job, model, optimizer, scheduler, batches)
    log_rank0(
        f"{'streamed' if train_ds is None else len(train_ds)} training {'rows' if job.data.packing else 'examples'}, "
        f"{len(eval_ds) if eval_ds is not None else 0} eval; "
        f"global batch {job.train.batch_size * dp.degree * job.train.grad_accum} ({job.train.batch_size} x {dp.degree} "
        f"data-parallel ranks x {job.train.grad_accum} accumulation); {total_steps} steps; strategy {job.parallel.strategy}"
        + (f", ep {job.parallel.ep}" if job.parallel.ep > 1 else "")
    )
    trackers = start_trackers(job, start_step=start)  # train.report_to's runs, on rank 0 ([] elsewhere)
    metrics = Metrics(job.train.output_dir, total_steps, enabled=rank == 0, progress=job.train.progress,
                      start_step=start, trackers=trackers)
    evaluate_at = _evaluator(job, model, eval_ds, eval_collate, dp, device, metrics, answers, reference)
    before = evaluate_at(start) if start == 0 else None
    began, tokens_seen = time.perf_counter(), 0
    stream = iter(batches)
    scaler = torch.amp.GradScaler(device.type, enabled=job.parallel.mixed_precision == "fp16")
    for step in range(start + 1, total_steps + 1):
        lr = scheduler.get_last_lr()[0]  # the rate this step uses
        values = {**_train_step(job, model, optimizer, scaler, stream, device, dp, reference), "lr": lr}
        scheduler.step()
        tokens_seen += values.pop("tokens")
        if step % job.train.log_every == 0 or step == total_steps:
            metrics.step(step, values)
        if job.train.eval_every and step % job.train.eval_every == 0 and step != total_steps:
            evaluate_at(step)
        if job.checkpoint.every_steps and step % job.checkpoint.every_steps == 0:
            save_state(model, optimizer, scheduler=scheduler, root=job.checkpoint_dir, step=step, dataloader=batches,
                       keep_last=job.checkpoint.keep_last)
    train_time = time.perf_counter() - began
    after = evaluate_at(total_steps)
    metrics.close()
    last_loss = next((r["loss"] for r in reversed(metrics.history) if "loss" in r), None)
    summary = {"steps": total_steps, "train_time_s": round(train_time, 1), "tokens_seen": tokens_seen,
               "before": before, "after": after, "final_loss": last_loss}
    model_dir = None
    if job.checkpoint.save_final:
        model_dir = Path(job.train.output_dir) / "model"
        save_pretrained(model, model_dir, tokenizer=tokenizer, max_shard_size=job.checkpoint.max_shard_size)
        if rank == 0:
            metrics.plot_loss(model_dir / LOSS_CURVE)
    if job.preference.enabled and eval_ds is not None:  # sample generations: the prompts, chosen expected
        if job.preference.loss == "kto":  # unpaired: the desirable examples
            eval_ds = eval_ds.filter(lambda row: row["label"]).remove_columns("label")
        else:
            eval_ds = eval_ds.rename_columns({"chosen_input_ids": "input_ids", "chosen_labels": "labels"})
    finish_run(job, model_dir, summary, eval_ds, tokenizer, world, dp_degree=dp.degree, model=model)
    return summary


def _with_auto_layout(job: JobConfig) -> JobConfig:
    """``job`` with ``parallel.strategy: auto`` replaced by the planner's layout, planned for the
    recipe's sequences (``max_seq_len``), batch per data-parallel rank and micro-batch (the
    recipe's ``batch_size``; ``grad_accum`` of them per step); the recipe's checks run again on it."""
    from ..layout_search.auto import resolve_auto

    def job_accepts(layout, parallel) -> bool:  # e.g. pp microbatches must divide eval_batch_size too
        return job.refuses(parallel) is None

    source = (lambda: meta_model(job.model, job.peft)) if job.peft.enabled else (lambda: load_config(job.model))
    rows, reference = job.planner_rows()  # preference: chosen and rejected rows, a held reference
    parallel = resolve_auto(source, job.parallel, seq=job.data.max_seq_len, batch=rows,
                            micro_batch=rows // job.train.grad_accum, keep=job_accepts, reference=reference,
                            quantize=job.model.quantize)
    return dataclasses.replace(job, parallel=parallel)


def _collators(job: JobConfig, pad_id: int):
    """(training, evaluation) collators: padded rows with an attention mask, or rows of documents
    kept apart by ``position_ids`` (packing, padding-free: one flattened row per micro-batch in
    training; evaluation keeps rows, whose examples it weighs one by one). A reward model's batches
    are preference pairs, chosen and rejected interleaved (:class:`RewardCollator`), as are
    preference training's (``PairCollator``)."""
    if job.model.task == "reward":
        return RewardCollator(pad_id), RewardCollator(pad_id)
    if job.preference.loss == "kto":  # an example and its KL row, interleaved
        from ..data.unpaired import UnpairedCollator

        return UnpairedCollator(pad_id, job.data.max_seq_len), UnpairedCollator(pad_id, job.data.max_seq_len)
    if job.preference.enabled:
        from ..data.preference import PairCollator

        return PairCollator(pad_id), PairCollator(pad_id)
    if not job.data.keeps_documents_apart:
        return PadCollator(pad_id), PadCollator(pad_id)
    return PackedCollator(pad_id, flatten=job.data.padding_free), PackedCollator(pad_id)


def _batches(job: JobConfig, train_ds, tokenizer, collate, dp: DataParallel):
    """This data-parallel rank's training batches: of the tokenised dataset, or streamed (read,
    tokenised and packed as training goes) when ``train_ds`` is None."""
    if train_ds is not None:
        return ShardedBatches(train_ds, job.train.batch_size, dp.rank, dp.degree, collate, seed=job.data.seed)
    data = job.data
    encode = stream_encoder(tokenizer, data, data.max_seq_len, data.packing)
    return StreamBatches(stream_source(data, dp.rank, dp.degree), encode, job.train.batch_size, collate,
                         pack=data.packing, max_len=data.max_seq_len, group=data.pack_group)


def _datasets(job: JobConfig, tokenizer):
    """(train, eval, classification labels, whether the causal LM rows have answers to match:
    conversations and pairs do, plain text does not). ``train`` is None when streamed."""
    max_len = job.data.max_seq_len
    if job.data.streaming:  # the training split is read as training goes (_batches)
        ev = stream_eval(job.data)
        answers = ev is not None and causal_lm_format(ev.column_names, job.data).kind != "text"
        return None, ev and tokenize_causal_lm(ev, tokenizer, job.data, max_len, pack=_eval_packing(job)), None, answers
    splits = load_splits(job.data)
    if job.preference.enabled:  # pairs: the loss and rewards on held-out pairs, no exact match
        train, ev = pair_datasets(job, tokenizer, splits)
        return train, ev, None, False
    if job.model.task == "reward":  # preference pairs: one row per pair
        train = tokenize_preference(splits["train"], tokenizer, job.data, max_len)
        ev = splits["eval"] and tokenize_preference(splits["eval"], tokenizer, job.data, max_len)
        return train, ev, None, False
    if job.model.task == "causal_lm":
        train = tokenize_causal_lm(splits["train"], tokenizer, job.data, max_len, pack=job.data.packing)
        ev = splits["eval"] and tokenize_causal_lm(splits["eval"], tokenizer, job.data, max_len, pack=_eval_packing(job))
        answers = causal_lm_format(splits["train"].column_names, job.data).kind != "text"
        return train, ev, None, answers
    labels = label_ids(splits["train"], job.data)
    train = tokenize_classification(splits["train"], tokenizer, job.data, max_len, labels)
    ev = splits["eval"] and tokenize_classification(splits["eval"], tokenizer, job.data, max_len, labels)
    return train, ev, labels, False


def _eval_packing(job: JobConfig) -> str | None:
    """Evaluation is packed as training is (the same per-token loss), never wrapped across examples."""
    return job.data.packing if job.data.packing != "wrapped" else None


def _train_step(job: JobConfig, model, optimizer, scaler, stream, device, dp: DataParallel, reference=None) -> dict:
    """One optimizer step over ``grad_accum`` micro-batches; returns its metrics. ``reference``:
    preference training's frozen reference model (``preference.reference: model``), else None.

    Each micro-batch goes through ``hf_scale.train_step`` (forward + backward; under pipeline
    parallel over the schedule's microbatches), one code path for every strategy. FSDP / DDP
    average gradients over the ``dp.degree`` data-parallel ranks (the ranks of a tensor-parallel
    group or of one pipeline hold parts of one gradient and are not averaged), so each rank's
    loss is scaled by its micro-batch's share of the global label tokens times ``dp.degree``,
    times fp16's loss scale when the GradScaler is on. Label and token counts are summed over
    ``dp.group``: the tp and pp ranks of one replica hold the same batch.
    """
    started = time.perf_counter()
    waited = 0.0
    micro = []
    for _ in range(job.train.grad_accum):
        t = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in next(stream).items()}
        waited += time.perf_counter() - t
        micro.append(batch)
    preference = job.preference.enabled
    # the SFT loss's items per micro-batch (preference steps count their pairs themselves) and the
    # real tokens, summed over the data-parallel ranks in one all-reduce
    counts = torch.tensor([0.0 if preference else _loss_items(b, job.model.task) for b in micro]
                          + [float(sum(real_tokens(b) for b in micro))], dtype=torch.float64)
    dp.all_reduce(counts)
    tokens = int(counts[-1])
    # fp16's current loss scale (1.0 when the scaler is off); scaling a one also starts the scaler
    amp_scale = float(scaler.scale(torch.ones((), device=device)))
    if preference:  # micro-batches weighted by their pairs (hf_scale.train.preference)
        extra = preference_step_values(job, model, micro, dp, amp_scale, reference)
        loss = extra.pop("loss")  # the step's loss, every rank's
    else:
        extra, loss = {}, _sft_loss(job, model, micro, dp, amp_scale, label_total=float(counts[:-1].sum()))
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm_(model, job.train.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # skips the step when fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    # the slowest rank's data wait and the largest peak memory are what limit the job
    worst = torch.tensor([waited / elapsed, peak_memory_gb(device)], dtype=torch.float64)
    if rank_world()[1] > 1:  # over every rank, tp and pp ranks included
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"loss": loss, "grad_norm": float(grad_norm), "tokens_per_s": tokens / elapsed,
            "data_wait": float(worst[0]), "peak_mem_gb": float(worst[1]), "tokens": tokens, **extra}


def _sft_loss(job: JobConfig, model, micro: list[dict], dp: DataParallel, amp_scale: float, *,
              label_total: float) -> float:
    """Forward and backward of an SFT / classification step's micro-batches (``label_total``:
    their loss items over every data-parallel rank); the step's loss, every rank's."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    for i, batch in enumerate(micro):
        share = _loss_items(batch, job.model.task) / max(label_total, 1.0)
        with no_sync(model, enabled=i < len(micro) - 1):
            # gradients are averaged over dp ranks: each rank's share counts dp.degree times
            loss = train_step(model, batch, loss_scale=share * dp.degree * amp_scale)
        loss_sum += float(_local(loss)) * share  # the micro-batch's mean loss, unscaled
    dp.all_reduce(loss_sum)
    return float(loss_sum)


def _local(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a tensor-parallel loss may come back as a replicated DTensor."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _loss_items(batch: dict, task: str) -> float:
    """What a micro-batch's mean loss averages over: label tokens (causal LM), examples
    (classification), pairs (a reward model's rows are chosen / rejected, two per pair)."""
    if task == "causal_lm":
        return float((batch["labels"][:, 1:] != -100).sum())
    if task == "reward":
        return float(batch["labels"].numel() // 2)
    return float(batch["labels"].numel())


def _evaluator(job, model, eval_ds, collate, dp: DataParallel, device, metrics, answers: bool, reference=None):
    exact_match = job.train.exact_match and answers
    pp, cp = pipeline_degree(model), context_degree(model)
    if eval_ds is not None and pp > 1 and (exact_match or job.model.task != "causal_lm"):
        log_rank0(f"evaluation under pipeline parallel (pp={pp}) reports the loss only: exact match and accuracy "
                  "need the whole model's logits, which no stage has alone")
        exact_match = False
    if eval_ds is not None and cp > 1 and exact_match:
        log_rank0(f"evaluation under context parallel (cp={cp}) reports the loss only: exact match needs every "
                  "position's logits, and each rank holds its own part of the sequence")
        exact_match = False

    def evaluate_at(step: int):
        if eval_ds is None:
            return None
        if job.preference.enabled:  # the preference loss and rewards on held-out pairs
            scores = evaluate_preference(job, model, eval_ds, collate, dp, device, reference)
            metrics.event(step, scores)
            return scores
        scores = evaluate(model, eval_ds, collate, task=job.model.task, batch_size=job.train.eval_batch_size,
                          rank=dp.rank, world=dp.degree, group=dp.group, device=device,
                          exact_match=exact_match)
        metrics.event(step, scores)
        return scores

    return evaluate_at


def _scheduler(job: JobConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    return get_scheduler(job.train.scheduler, optimizer, num_warmup_steps=job.train.warmup_steps,
                         num_training_steps=total_steps)


def _resume(job: JobConfig, model, optimizer, scheduler, batches) -> int:
    from ..checkpoint.training_state import complete_checkpoints

    resume = job.checkpoint.resume
    if resume == "auto":
        resume = "latest" if complete_checkpoints(job.checkpoint_dir) else None
    if not resume:
        return 0
    path = job.checkpoint_dir / "latest" if resume == "latest" else Path(resume)
    step = load_state(model, optimizer, scheduler=scheduler, path=path, dataloader=batches)
    if isinstance(batches, StreamBatches):  # a position per rank, restored with the rank's state
        log_rank0(f"resumed from {path} at step {step} (stream epoch {batches.epoch}, after {batches.consumed} "
                  f"examples and {batches.emitted} rows of the next on rank 0)")
        return step
    expected = step * job.train.grad_accum
    if batches.position != expected:  # another world size: positions were not restored
        batches.seek(expected)
    log_rank0(f"resumed from {path} at step {step} (epoch {batches.epoch}, batch {batches.batch})")
    return step


def _quiet_progress_bars() -> None:
    """Only rank 0 shows progress: silence ``datasets`` and transformers bars elsewhere."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
