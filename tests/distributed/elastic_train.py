"""A training script for the fault-tolerance tests, run under torchrun.

    torchrun --nproc_per_node 2 --max-restarts 1 tests/distributed/elastic_train.py ROOT [--kill-at STEP]

Trains 8 steps of a tiny Llama with fsdp, saving a checkpoint every 2 steps and resuming from
the newest complete one at start. With ``--kill-at``, rank 1 SIGKILLs itself at that step on
the first attempt (mid-save when the step is a save step); torchrun then restarts the job.
Rank 0 writes the final loss and the number of attempts to ROOT/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_scale  # noqa: E402
from hf_scale.checkpoint import safetensors_io  # noqa: E402
from tests.distributed.resume_checks import _setup, _train  # noqa: E402

STEPS, EVERY = 8, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    model, optimizer, scheduler, loader = _setup({"strategy": "fsdp"}, seed=0)
    ckpt = Path(args.root) / "ckpt"
    step = 0
    if (ckpt / "latest").exists():
        step = hf_scale.load_state(model, optimizer, scheduler=scheduler, path=ckpt / "latest", dataloader=loader)
    loss = None
    while step < STEPS:
        (loss,) = _train(model, optimizer, scheduler, loader, 1)
        step += 1
        if step % EVERY == 0:
            if attempt == 0 and rank == 1 and step == args.kill_at:
                _die_mid_save()
            hf_scale.save_state(model, optimizer, scheduler=scheduler, root=ckpt, step=step, dataloader=loader, keep_last=2)
    if rank == 0:
        (Path(args.root) / "result.json").write_text(json.dumps({"loss": loss, "attempts": attempt + 1}))


def _die_mid_save() -> None:
    """SIGKILL this rank while it writes its bytes of the next checkpoint."""
    original = safetensors_io._write_my_bytes

    def write_then_die(*a, **k):
        original(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    safetensors_io._write_my_bytes = write_then_die


if __name__ == "__main__":
    main()
