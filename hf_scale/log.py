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


class _TorchaoKernelFilter(logging.Filter):
    """Drops torchao's "Failed to load .../torchao/_C_*.so" warnings. transformers imports
    torchao (when installed: the ``qlora`` extra) in every ``from_pretrained``; the wheel's
    optional compiled kernels (mxfp8, CUTLASS) are built for CUDA and cannot load against the
    CPU build of torch. torchao runs without them, so the lines (one per kernel file, on every
    rank, on stderr) say nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load ") and "/torchao/_C" in message)


logging.getLogger("torchao").addFilter(_TorchaoKernelFilter())


def log_rank0(message: str, *, level: int = logging.INFO, once: bool = False) -> None:
    """Log ``message`` on rank 0 only; with ``once=True`` only the first time it is said."""
    if rank() != 0:
        return
    if once:
        if message in _said:
            return
        _said.add(message)
    logger.log(level, message)
