"""The fine-tuning application (on top of the library; ``import hf_scale`` never loads it).

``run(load_job("configs/quickstart.yaml"))`` is what ``hf-scale finetune`` runs on every rank.
"""

from .config import JobConfig, load_job
from .loop import run

__all__ = ["JobConfig", "load_job", "run"]
