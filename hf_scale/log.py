"""Rank-0 output: the one place hf_scale prints from.

Every message goes through the ``hf_scale`` logger; :func:`log_rank0` drops it on ranks other
than 0 so a torchrun log shows each line once.
"""

from __future__ import annotations

import logging

from .ranks import rank

logger = logging.getLogger("hf_scale")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[hf_scale] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_said: set[str] = set()


def log_rank0(message: str, *, level: int = logging.INFO, once: bool = False) -> None:
    """Log ``message`` on rank 0 only; with ``once=True`` only the first time it is said."""
    if rank() != 0:
        return
    if once:
        if message in _said:
            return
        _said.add(message)
    logger.log(level, message)
