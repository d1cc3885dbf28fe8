"""Reward-model training on N ranks through the fine-tuning loop's own step, and the one-process
oracle it is compared with (tests/distributed/test_reward.py).

The oracle knows nothing of hf_scale's reward code: it scores every sequence alone (no padding,
so the score is plainly the last token's), pairs them by hand and takes TRL's Bradley-Terry loss
over the whole global batch, plain transformers + AdamW. The parallel run goes through
``RewardCollator`` (interleaved, right-padded pairs), ``apply_reward_loss`` (the loss from the
forward), ``hf_scale.parallelize`` and ``hf_scale.train.loop._train_step`` (micro-batches
weighted by pairs, gradients averaged over the data-parallel ranks), each data-parallel rank on
its own pairs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

GLOBAL_PAIRS = 8
STEPS = 3
LR = 1e-3
WEIGHT_DECAY = 0.1
MAX_NORM = 1.0
PAD = 0  # tests.tiny_models.tiny_tokenizer's pad id


def reward_model(seed: int = 0):
    """A tiny Llama sequence classifier with one score; the score is read at the last non-pad token."""
    from transformers import AutoModelForSequenceClassification

    from tests.tiny_models import tiny_config

    config = tiny_config("llama")
    config.num_labels, config.pad_token_id = 1, PAD
    config.max_position_embeddings = 256
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def oracle_scores(model, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores, each sequence scored alone."""
    def score(ids):
        return model(input_ids=torch.tensor([ids])).logits[0, 0]

    chosen = torch.stack([score(r["chosen_input_ids"]) for r in rows])
    rejected = torch.stack([score(r["rejected_input_ids"]) for r in rows])
    return chosen, rejected


def oracle_loss(model, rows, center: float | None):
    chosen, rejected = oracle_scores(model, rows)
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center:
        loss = loss + center * ((chosen + rejected) ** 2).mean()
    return loss


def oracle_eval(model, rows) -> dict:
    with torch.no_grad():
        chosen, rejected = oracle_scores(model, rows)
    return {"eval_loss": float(-F.logsigmoid(chosen - rejected).mean()),
            "eval_accuracy": int((chosen > rejected).sum()) / len(rows), "eval_examples": len(rows)}


def reference_run(steps_rows: list[list[dict]], eval_rows: list[dict], center: float | None) -> dict:
    from hf_scale.parallel.optim import parameter_groups

    model = reward_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    before = oracle_eval(model, eval_rows)
    losses, norms = [], []
    for rows in steps_rows:
        loss = oracle_loss(model, rows, center)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "initial": initial, "before": before,
            "after": oracle_eval(model, eval_rows)}


def parallel_run(case: dict, steps_rows: list[list[dict]], eval_rows: list[dict]) -> dict:
    """One layout: the loop's step over this data-parallel rank's pairs, then evaluation."""
    import hf_scale
    from hf_scale.train.config import JobConfig, ModelConfig, TrainConfig
    from hf_scale.train.dp import DataParallel
    from hf_scale.train.evaluate import evaluate
    from hf_scale.train.loop import _train_step
    from hf_scale.train.reward import RewardCollator, apply_reward_loss
    from tests.distributed.training import full_params

    accum, center = case.get("accum", 1), case.get("center")
    job = JobConfig(model=ModelConfig(name_or_path="tiny", task="reward"),
                    train=TrainConfig(grad_accum=accum, max_grad_norm=MAX_NORM, center_rewards_coefficient=center,
                                      batch_size=GLOBAL_PAIRS // accum))
    model = reward_model()
    apply_reward_loss(model, center)
    model = hf_scale.parallelize(model, case["config"])
    dp = DataParallel.of(model)
    device = hf_scale.get_state(model).env.device
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    collate = RewardCollator(PAD)

    def scores():
        return evaluate(model, eval_rows, collate, task="reward", batch_size=2, rank=dp.rank, world=dp.degree,
                        group=dp.group, device=device)

    before = scores()
    losses, norms = [], []
    for rows in steps_rows:
        per_rank = len(rows) // dp.degree
        mine = rows[dp.rank * per_rank:(dp.rank + 1) * per_rank]
        size = per_rank // accum
        stream = iter([collate(mine[i * size:(i + 1) * size]) for i in range(accum)])
        values = _train_step(job, model, optimizer, scaler, stream, device, dp)
        losses.append(values["loss"])
        norms.append(values["grad_norm"])
    after = scores()
    params = full_params(model)
    rank = int(os.environ["RANK"])
    return {"losses": losses, "norms": norms, "params": params if rank == 0 else None, "before": before,
            "after": after}


def run_reward_cases(cases: list[dict], steps_rows, eval_rows) -> list[dict]:
    """Every case in one process group; an error is reported per case."""
    import traceback

    out = []
    for case in cases:
        try:
            out.append(parallel_run(case, steps_rows, eval_rows))
        except Exception:  # noqa: BLE001 - report it with the case, keep the group going
            out.append({"error": traceback.format_exc()})
    return out
