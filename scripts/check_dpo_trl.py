"""TRL 1.16 parity of hf_scale's preference losses: each loss computed by TRL's own trainer and by
hf_scale on the same tiny model, the same tokenised pairs and the same reference, at step 0 and
over 3 AdamW steps (fp32, one process, CPU); prints a table of the largest differences.

    PYTHONPATH=. python scripts/check_dpo_trl.py [--steps 3] [--pairs 4]

TRL: ``DPOTrainer`` for sigmoid, robust, ipo, hinge and RPO (``loss_type=["sigmoid", "sft"]``),
``CPOTrainer(loss_type="simpo")`` for simpo (with and without CPO's NLL term), ``ORPOTrainer``
for orpo. Each trainer tokenises the pairs its own way; hf_scale gets exactly those token ids
(prompt masked in the labels), interleaved by ``PairCollator``, and its reference is the policy
before the first step (TRL's is its copy of the initial model). Both train on the one batch of
all pairs for ``--steps`` steps (AdamW, lr 1e-3, no weight decay, no clipping); the table shows
per loss the largest relative difference over the steps of the loss, the gradient norm, the
rewards / logps metrics, and of the parameters after the last step.

TRL is an anchor for this script only: neither the package nor its tests import it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_scale.data.preference import PairCollator
from hf_scale.parallel.preference import preference_step, sequence_logps
from hf_scale.parallel.preference_loss import PreferenceLoss
from tests.tiny_models import tiny_model, tiny_tokenizer

LR = 1e-3
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")

# name -> (hf_scale knobs, TRL trainer, TRL config kwargs)
CASES = {
    "sigmoid": ({"loss": "sigmoid", "beta": 0.5}, "dpo", {"loss_type": ["sigmoid"], "beta": 0.5}),
    "robust": ({"loss": "robust", "beta": 0.5, "label_smoothing": 0.1}, "dpo",
               {"loss_type": ["robust"], "beta": 0.5, "label_smoothing": 0.1}),
    "ipo": ({"loss": "ipo", "beta": 0.5}, "dpo", {"loss_type": ["ipo"], "beta": 0.5}),
    "hinge": ({"loss": "hinge", "beta": 0.5}, "dpo", {"loss_type": ["hinge"], "beta": 0.5}),
    "sigmoid+rpo": ({"loss": "sigmoid", "beta": 0.5, "rpo_alpha": 0.5}, "dpo",
                    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.5}),
    "simpo": ({"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "label_smoothing": 0.1}, "cpo",
              {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "label_smoothing": 0.1, "cpo_alpha": 0.0}),
    "simpo+cpo_nll": ({"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "rpo_alpha": 0.5}, "cpo",
                      {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5}),
    "orpo": ({"loss": "orpo", "beta": 0.5}, "orpo", {"beta": 0.5}),
}

PROMPTS = ["12+7=", "What is 3*4?", "Name a colour:", "5-9=", "Say hi:", "2**5="]
CHOSEN = ["19", "12", "blue", "-4", "hi there", "32"]
REJECTED = ["20", "seven", "maybe green or red", "4", "no", "25"]


def dataset(pairs: int):
    from datasets import Dataset

    n = min(pairs, len(PROMPTS))
    return Dataset.from_dict({"prompt": PROMPTS[:n], "chosen": CHOSEN[:n], "rejected": REJECTED[:n]})


def model():
    m = tiny_model("llama", "causal")
    m.config.max_position_embeddings = 128
    return m


def trl_trainer(kind: str, kwargs: dict, pairs: int, steps: int, out: str):
    common = {"output_dir": out, "per_device_train_batch_size": pairs, "max_steps": steps, "learning_rate": LR,
                  "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 1e9, "logging_steps": 1,
                  "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0, "optim": "adamw_torch",
                  "warmup_steps": 0, "dataloader_drop_last": False, "remove_unused_columns": False, "bf16": False, "fp16": False, "disable_tqdm": True}
    tok = tiny_tokenizer(chat_template=False)
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, **kwargs, max_length=None)
        return DPOTrainer(model=model(), ref_model=model(), args=args, train_dataset=dataset(pairs), processing_class=tok)
    if kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, **kwargs, max_length=128)
        return CPOTrainer(model=model(), args=args, train_dataset=dataset(pairs), processing_class=tok)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(**common, **kwargs, max_length=128)
    return ORPOTrainer(model=model(), args=args, train_dataset=dataset(pairs), processing_class=tok)


def rows_of(trainer, kind: str) -> list[dict]:
    """The token ids TRL trains on, as hf_scale's pair rows (labels -100 on the prompt)."""
    rows = []
    for ex in trainer.train_dataset:
        row = {}
        for side in ("chosen", "rejected"):
            if kind == "dpo":
                ids = list(ex["prompt_ids"]) + list(ex[f"{side}_ids"])
                labels = [-100] * len(ex["prompt_ids"]) + list(ex[f"{side}_ids"])
            else:
                ids, labels = list(ex[f"{side}_input_ids"]), list(ex[f"{side}_labels"])
            row[f"{side}_input_ids"], row[f"{side}_labels"] = ids, labels
        rows.append(row)
    return rows


def trl_run(trainer, steps: int) -> dict:
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h][:steps]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            **{m: [h[m] for h in logs] for m in METRICS}, "params": params}


def hf_scale_run(rows: list[dict], knobs: PreferenceLoss, steps: int) -> dict:
    policy = model()
    collate = PairCollator(0)
    batch = collate(rows)
    if knobs.needs_reference:  # the policy before the first step
        policy.eval()
        ref = sequence_logps(policy, batch).view(-1, 2)
        policy.train()
        batch = collate([{**r, "ref_chosen_logps": float(c), "ref_rejected_logps": float(j)}
                         for r, (c, j) in zip(rows, ref)])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    out = {"loss": [], "grad_norm": [], **{m: [] for m in METRICS}}
    for _ in range(steps):
        result = preference_step(policy, batch, knobs)
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        out["loss"].append(float(result.loss))
        for m in METRICS:
            out[m].append(float(result.sums[m]) / result.pairs)
    out["params"] = {n: p.detach().clone() for n, p in policy.named_parameters()}
    return out


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.use_deterministic_algorithms(True)
    header = ["loss type", "loss@0", "loss (all steps)", "grad_norm", "rewards/*", "logps/*", "params after"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    worst = 0.0
    for name, (knobs, kind, trl_kwargs) in CASES.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as out:
            trainer = trl_trainer(kind, trl_kwargs, args.pairs, args.steps, out)
            rows = rows_of(trainer, kind)
            trl = trl_run(trainer, args.steps)
        ours = hf_scale_run(rows, PreferenceLoss(**knobs), args.steps)
        params = max(rel(ours["params"][n], p) for n, p in trl["params"].items())
        cells = [rel(ours["loss"][:1], trl["loss"][:1]), rel(ours["loss"], trl["loss"]),
                 rel(ours["grad_norm"], trl["grad_norm"]),
                 max(rel(ours[m], trl[m]) for m in METRICS if m.startswith("rewards")),
                 max(rel(ours[m], trl[m]) for m in METRICS if m.startswith("logps")), params]
        worst = max(worst, *cells)
        print(f"{name} | " + " | ".join(f"{c:.1e}" for c in cells)
              + f"   (trl loss {[round(x, 5) for x in trl['loss']]}, ours {[round(x, 5) for x in ours['loss']]})")
    print(f"largest relative difference: {worst:.1e}")


if __name__ == "__main__":
    main()
