"""The fine-tuning application (on top of the library; ``import hf_scale`` never loads it).

``run(load_job("configs/quickstart.yaml"))`` is what ``hf-scale finetune`` runs on every rank.
The engine helpers that lived here until 0.1 (``build_optimizer``, ``clip_grad_norm_``,
``no_sync``, ``parameter_groups``) are in :mod:`hf_scale.parallel.optim` and at the top level
(``hf_scale.build_optimizer``); they are re-exported here so old imports keep working.
"""

from ..parallel.optim import build_optimizer, clip_grad_norm_, no_sync, parameter_groups
from .config import JobConfig, load_job
from .loop import run

__all__ = ["JobConfig", "build_optimizer", "clip_grad_norm_", "load_job", "no_sync", "parameter_groups", "run"]
