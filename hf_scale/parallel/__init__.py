"""The engine: small ``apply_*`` functions with explicit arguments and no model names.

:func:`hf_scale.parallelize` calls them in this order: pipeline stages (:mod:`.pp`: prune the
model to this rank's stages), tensor parallel (:mod:`.tp`), context parallel (:mod:`.cp`: the
sequence split and the attention function), activation checkpointing, then FSDP (fsdp, zero2,
hsdp) or DDP (ddp, zero1) with autocast for mixed precision, on each stage;
:mod:`.pp_schedule` runs a batch through the stages and :mod:`.step` gives every layout the
same ``train_step`` / ``eval_step``. The chunked (or vocabulary-parallel) loss is applied first of all: it only changes
what the model's forward computes. :mod:`.optim` holds the
helpers that work under every strategy once it is applied (optimizer, clipping, ``no_sync``).
"""

from .activation import apply_ac
from .ddp import apply_ddp
from .fsdp import apply_fsdp
from .loss import apply_chunked_loss
from .optim import build_optimizer, clip_grad_norm_, no_sync, parameter_groups
from .precision import apply_autocast
from .tp import apply_tp

__all__ = [
    "apply_ac", "apply_autocast", "apply_chunked_loss", "apply_ddp", "apply_fsdp", "apply_tp",
    "build_optimizer", "clip_grad_norm_", "no_sync", "parameter_groups",
]
