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


class _TorchaoImportFilter(logging.Filter):
    """Drops the warnings importing torchao prints. transformers imports torchao (when
    installed: the ``qlora`` extra) in every ``from_pretrained``, and on every rank it says, on
    stderr: "Failed to load .../torchao/_C_*.so" (its optional kernels are built for CUDA and
    cannot load against the CPU build of torch; torchao runs without them), and, through torch's
    ``torch.utils._pytree`` logger, that registering its Enum types is deprecated. None of it is
    something a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load ") and "/torchao/_C" in message)
        return "is an Enum subclass and is now natively supported by torch.compile" not in message


_quiet = _TorchaoImportFilter()
logging.getLogger("torchao").addFilter(_quiet)
logging.getLogger("torch.utils._pytree").addFilter(_quiet)


def log_rank0(message: str, *, level: int = logging.INFO, once: bool = False) -> None:
    """Log ``message`` on rank 0 only; with ``once=True`` only the first time it is said."""
    if rank() != 0:
        return
    if once:
        if message in _said:
            return
        _said.add(message)
    logger.log(level, message)
