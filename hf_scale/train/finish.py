"""The end of a run: model card, optional push, a summary, and sample generations.

The trained model answers a few held-out prompts greedily on every rank together (a sharded or
tensor-parallel model needs all ranks in each forward; identical inputs give identical tokens,
which is checked across ranks); under pipeline parallel no stage can generate alone, so that
part is skipped, with a line saying so. Then rank 0 reloads the saved folder with
``AutoModelForCausalLM.from_pretrained`` (no hf_scale involved) and answers the same prompts:
the proof that the export is a plain transformers checkpoint of the model that was trained.
Both are printed beside the expected answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.adapters import ADAPTER_CONFIG
from ..log import log_rank0
from ..parallel_state import get_state
from ..ranks import gather, run_together
from ..zoo import HUB_IDS
from .config import JobConfig
from .dp import context_degree, pipeline_degree
from .metrics import LOSS_CURVE

SUMMARY_FILE = "summary.json"


def finish_run(job: JobConfig, model_dir: Path | None, summary: dict, eval_ds, tokenizer, world: int,
               dp_degree: int | None = None, model=None) -> None:
    """Write the summary (and, with a saved model, its card), print them and sample
    generations, push if asked. Call on every rank: ``model`` (the trained, parallelized
    model) generates on all of them. ``dp_degree`` is how many ranks saw different data
    (``world`` without tensor parallel)."""
    from ..hub import push_to_hub, write_model_card

    prompts = []
    if job.train.sample_generations and eval_ds is not None and job.model.task == "causal_lm":
        prompts = held_out_prompts(eval_ds, tokenizer, job.train.sample_generations)
    live = None
    if model is not None and prompts:
        pp, cp = pipeline_degree(model), context_degree(model)
        then = "; the saved export's answers follow" if model_dir is not None else ""
        if pp > 1:
            log_rank0(f"sample generations of the trained model skipped: under pipeline parallel (pp={pp}) no "
                      f"stage can generate alone{then}")
        elif cp > 1:
            log_rank0(f"sample generations of the trained model skipped: context parallel (cp={cp}) splits whole "
                      f"sequences and refuses generate's cache{then}")
        else:
            live = greedy_answers(model, prompts, tokenizer.pad_token_id)
    same_on_ranks = live is None or all(x == live for x in gather([live]))

    def on_rank0() -> None:
        (Path(job.train.output_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        _print_summary(summary, model_dir)
        if model_dir is not None:
            info = card_info(job, summary, model_dir, world, dp_degree, plan_source(model))
            write_model_card(model_dir, info, template=job.hub.card_template)
        if prompts:
            print_generations(prompts, tokenizer, live, model_dir, world, same_on_ranks, base=job.model)

    run_together(on_rank0, only_rank0=True)  # a card that fails to render fails every rank, not one
    if job.hub.push and model_dir is not None:
        push_to_hub(model_dir, job.hub.repo_id, private=job.hub.private, revision=job.hub.revision)


def plan_source(model) -> dict[str, str]:
    """Where the tensor- and pipeline-parallel plans the run applied came from (for the card)."""
    from ..parallel_state import get_state

    state = get_state(model) if model is not None else None
    if state is None or state.dims is None:
        return {}
    applied = {"tp_plan": state.dims.tp_enabled, "pp_plan": state.dims.pp_enabled}
    return {k: state.plan.source.get(k, "inferred") for k, used in applied.items() if used}


def card_info(job: JobConfig, summary: dict, model_dir: Path, world: int, dp_degree: int | None = None,
              plan_source: dict[str, str] | None = None) -> dict:
    """What the model card says about this run (``hf_scale.hub.CardInfo`` fields); the global
    batch counts the ``dp_degree`` data-parallel ranks (``world`` without tensor parallel)."""
    dp_degree = world if dp_degree is None else dp_degree
    before, after = summary.get("before") or {}, summary.get("after") or {}
    evals = {k: v for k, v in after.items() if k != "eval_examples"}
    evals.update({f"{k} (before fine-tuning)": v for k, v in before.items() if k != "eval_examples"})
    mesh = mesh_sizes(job, world)
    train = job.train
    on_hub = not (job.data.path.startswith("builtin:") or Path(job.data.path).exists())
    return {
        "model_name": (job.hub.repo_id or Path(job.train.output_dir).resolve().name).split("/")[-1],
        "base_model": hub_id(HUB_IDS.get(job.model.name_or_path, job.model.name_or_path)),
        "datasets": [job.data.path] if on_hub else [],
        "license": job.hub.license,
        "description": f"Fine-tuned with hf_scale ({job.model.task}) on `{job.data.path}`.",
        "strategy": job.parallel.strategy,
        "mesh": mesh,
        "world_size": world,
        "plan_source": dict(plan_source or {}),
        "hyperparameters": {
            "learning_rate": train.lr, "scheduler": train.scheduler, "warmup_steps": train.warmup_steps,
            "weight_decay": train.weight_decay, "per_rank_batch_size": train.batch_size,
            "gradient_accumulation": train.grad_accum, "global_batch_size": train.batch_size * dp_degree * train.grad_accum,
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
    """Mesh degrees of this run (``{"dp_shard": 2, ...}``), size-1 dimensions left out, and the
    expert-parallel degree (``"ep"``, carved out of the data-parallel ones) where it is on."""
    from ..distributed import read_env
    from ..mesh import MESH_DIMS, ParallelDims

    if world == 1:
        return {}
    dims = ParallelDims.resolve(job.parallel, world, read_env().num_nodes)
    return {name: getattr(dims, name) for name in (*MESH_DIMS, "ep") if getattr(dims, name) > 1}


def hub_id(name_or_path: str) -> str | None:
    """``name_or_path`` when it names a Hub repository, None for a local folder: the card's
    ``base_model`` links to the Hub, whose metadata check rejects a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name_or_path).exists():
        return None
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None
    return name_or_path


def _print_summary(summary: dict, model_dir: Path | None) -> None:
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key in ("eval_exact_match", "eval_accuracy", "eval_rewards/accuracies", "eval_rewards/margins", "eval_loss"):
        if key in after:
            was = f"{before[key]:.3f} -> " if key in before else ""
            log_rank0(f"{key}: {was}{after[key]:.3f} on {after['eval_examples']} held-out examples")
    saved = f"; model saved to {model_dir}" if model_dir is not None else " (checkpoint.save_final: false)"
    log_rank0(f"trained {summary['steps']} steps, {summary['tokens_seen']:,} tokens in "
              f"{summary['train_time_s']:.0f} s{saved}")


def held_out_prompts(eval_ds, tokenizer, count: int) -> list[dict]:
    """The first ``count`` held-out examples as prompts: question text, prompt ids, expected
    answer. The answer is the last labelled span (a conversation's last trained assistant turn),
    the prompt everything before it."""
    prompts = []
    for row in eval_ds.select(range(min(count, len(eval_ds)))):
        labels = row["labels"]
        start = max(i for i, t in enumerate(labels) if t != -100 and (i == 0 or labels[i - 1] == -100))
        ids = torch.tensor([row["input_ids"][:start]])
        question = tokenizer.decode(ids[0], skip_special_tokens=True).strip().splitlines()
        answer = [t for t in labels[start:] if t != -100]
        prompts.append({"ids": ids, "question": question[-2] if len(question) > 1 else question[-1],
                        "expected": tokenizer.decode(answer, skip_special_tokens=True)})
    return prompts


@torch.no_grad()
def greedy_answers(model, prompts: list[dict], pad_id: int, max_new_tokens: int = 16) -> list[list[int]]:
    """The new token ids ``model`` generates greedily for each prompt.

    On a parallelized model every rank must call this with the same prompts: each forward is a
    collective (FSDP all-gathers, tensor-parallel all-reduces), and greedy decoding of the same
    prompt stops at the same step on every rank.
    """
    was_training = model.training
    model.eval()
    state = get_state(model)  # FSDP may keep parameters on the CPU (offload): inputs go to the rank's device
    device = state.env.device if state is not None else next(model.parameters()).device
    answers = []
    for prompt in prompts:
        ids = prompt["ids"].to(device)
        # synced_gpus: every rank keeps stepping until all are done, so a rank that stopped
        # early (it should not: the logits are the same everywhere) cannot leave the others
        # waiting in a collective.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id,
                             synced_gpus=state is not None and state.mesh is not None)
        answers.append(out[0, ids.shape[1]:].tolist())
    model.train(was_training)
    return answers


def print_generations(prompts: list[dict], tokenizer, live: list[list[int]] | None, model_dir: Path | None,
                      world: int, same_on_ranks: bool, base=None) -> None:
    """Print the trained model's answers (``live``) and those of the export reloaded with plain
    transformers (an adapter: with peft, on ``base``, the job's model section), beside the
    expected answers; say where the two differ."""
    exported, reloaded = None, "transformers.AutoModelForCausalLM"
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        if (model_dir / ADAPTER_CONFIG).is_file():
            from peft import PeftModel

            from .model import source

            dtype = getattr(torch, base.dtype)
            reloaded = "peft.PeftModel on the base model"
            plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source(base)[0], dtype=dtype),
                                              str(model_dir))
        else:
            plain = AutoModelForCausalLM.from_pretrained(model_dir)
        exported = greedy_answers(plain, prompts, tokenizer.pad_token_id)
    if live is not None:
        where = f"same tokens on all {world} ranks" if same_on_ranks else "RANKS GENERATED DIFFERENT TOKENS"
        log_rank0(f"greedy answers of the trained model ({where}):")
        _show(prompts, live, tokenizer)
    if exported is not None:
        log_rank0(f"reloaded {model_dir} with {reloaded}; greedy answers:")
        _show(prompts, exported, tokenizer)
        if live is not None:
            differ = sum(a != b for a, b in zip(live, exported))
            log_rank0("the export gives the trained model's answers" if not differ else
                      f"the export's answers differ from the trained model's on {differ} of {len(prompts)} "
                      "prompts (expected only under mixed precision, which computes in lower precision)")


def _show(prompts: list[dict], answers: list[list[int]], tokenizer) -> None:
    for prompt, tokens in zip(prompts, answers):
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        log_rank0(f"  {prompt['question']!r:40} -> {answer!r:10} (expected {prompt['expected']!r})")
