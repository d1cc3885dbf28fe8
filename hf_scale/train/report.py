"""The end of a run: model card, optional push, a summary, and generations from the export.

The generations are the proof that the saved folder is a plain transformers checkpoint: rank 0
reloads it with ``AutoModelForCausalLM.from_pretrained`` (no hf_scale involved) and answers a
few held-out prompts greedily, printed beside the expected answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..log import log_rank0
from ..ranks import run_together
from ..zoo import HUB_IDS
from .config import JobConfig
from .metrics import LOSS_CURVE

SUMMARY_FILE = "summary.json"


def finish_run(job: JobConfig, model_dir: Path | None, summary: dict, eval_ds, tokenizer, world: int) -> None:
    """Write the summary (and, with a saved model, its card), print them, push if asked."""
    from ..hub import push_to_hub, write_model_card

    def on_rank0() -> None:
        (Path(job.train.output_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        _print_summary(summary, model_dir)
        if model_dir is not None:
            info = card_info(job, summary, model_dir, world)
            write_model_card(model_dir, info, template=job.hub.card_template)
            if job.train.sample_generations and eval_ds is not None and job.model.task == "causal_lm":
                print_generations(model_dir, tokenizer, eval_ds, job.train.sample_generations)

    run_together(on_rank0, only_rank0=True)  # a card that fails to render fails every rank, not one
    if job.hub.push and model_dir is not None:
        push_to_hub(model_dir, job.hub.repo_id, private=job.hub.private, revision=job.hub.revision)


def card_info(job: JobConfig, summary: dict, model_dir: Path, world: int) -> dict:
    """What the model card says about this run (``hf_scale.hub.CardInfo`` fields)."""
    before, after = summary.get("before") or {}, summary.get("after") or {}
    evals = {k: v for k, v in after.items() if k != "eval_examples"}
    evals.update({f"{k} (before fine-tuning)": v for k, v in before.items() if k != "eval_examples"})
    mesh = mesh_sizes(job, world)
    train = job.train
    on_hub = not (job.data.path.startswith("builtin:") or Path(job.data.path).exists())
    return {
        "model_name": (job.hub.repo_id or Path(job.train.output_dir).resolve().name).split("/")[-1],
        "base_model": HUB_IDS.get(job.model.name_or_path, job.model.name_or_path),
        "datasets": [job.data.path] if on_hub else [],
        "license": job.hub.license,
        "description": f"Fine-tuned with hf_scale ({job.model.task}) on `{job.data.path}`.",
        "strategy": job.parallel.strategy,
        "mesh": mesh,
        "world_size": world,
        "hyperparameters": {
            "learning_rate": train.lr, "scheduler": train.scheduler, "warmup_steps": train.warmup_steps,
            "weight_decay": train.weight_decay, "per_rank_batch_size": train.batch_size,
            "gradient_accumulation": train.grad_accum, "global_batch_size": train.batch_size * world * train.grad_accum,
            "max_grad_norm": train.max_grad_norm, "max_seq_len": job.data.max_seq_len, "steps": summary["steps"],
            "seed": train.seed, "dtype": job.model.dtype, "mixed_precision": job.parallel.mixed_precision or "fp32",
            "activation_checkpointing": job.parallel.activation_checkpointing or "off",
        },
        "training_time_seconds": summary["train_time_s"],
        "tokens_seen": summary["tokens_seen"],
        "train_metrics": {"train_loss": summary["final_loss"]} if summary.get("final_loss") is not None else {},
        "eval_metrics": evals,
        "loss_curve": LOSS_CURVE if (model_dir / LOSS_CURVE).exists() else None,
        "repo_id": job.hub.repo_id,
    }


def mesh_sizes(job: JobConfig, world: int) -> dict:
    """Mesh degrees of this run (``{"dp_shard": 2, ...}``), size-1 dimensions left out."""
    from ..distributed import read_env
    from ..mesh import MESH_DIMS, ParallelDims

    if world == 1:
        return {}
    dims = ParallelDims.resolve(job.parallel, world, read_env().num_nodes)
    return {name: getattr(dims, name) for name in MESH_DIMS if getattr(dims, name) > 1}


def _print_summary(summary: dict, model_dir: Path | None) -> None:
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key in ("eval_exact_match", "eval_accuracy", "eval_loss"):
        if key in after:
            was = f"{before[key]:.3f} -> " if key in before else ""
            log_rank0(f"{key}: {was}{after[key]:.3f} on {after['eval_examples']} held-out examples")
    saved = f"; model saved to {model_dir}" if model_dir is not None else " (checkpoint.save_final: false)"
    log_rank0(f"trained {summary['steps']} steps, {summary['tokens_seen']:,} tokens in "
              f"{summary['train_time_s']:.0f} s{saved}")


@torch.no_grad()
def print_generations(model_dir: Path, tokenizer, eval_ds, count: int) -> None:
    """Reload ``model_dir`` with plain transformers and print greedy answers to held-out prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    log_rank0(f"reloaded {model_dir} with transformers.AutoModelForCausalLM; greedy answers:")
    for row in eval_ds.select(range(min(count, len(eval_ds)))):
        labels = row["labels"]
        start = next(i for i, t in enumerate(labels) if t != -100)
        prompt = torch.tensor([row["input_ids"][:start]])
        expected = tokenizer.decode([t for t in labels if t != -100], skip_special_tokens=True)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, start:], skip_special_tokens=True)
        question = tokenizer.decode(prompt[0], skip_special_tokens=True).strip().splitlines()
        log_rank0(f"  {question[-2] if len(question) > 1 else question[-1]!r:40} -> {answer!r:10} (expected {expected!r})")
