"""Training helpers that work the same under every strategy."""

from .optim import build_optimizer, clip_grad_norm_, no_sync, parameter_groups

__all__ = ["build_optimizer", "clip_grad_norm_", "no_sync", "parameter_groups"]
