"""Training: the helpers that work under every strategy, and the fine-tuning job.

``run(load_job("configs/quickstart.yaml"))`` is what ``hf-scale finetune`` runs on every rank.
"""

from .config import JobConfig, load_job
from .loop import run
from .optim import build_optimizer, clip_grad_norm_, no_sync, parameter_groups

__all__ = ["JobConfig", "build_optimizer", "clip_grad_norm_", "load_job", "no_sync", "parameter_groups", "run"]
