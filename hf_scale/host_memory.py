"""Host memory a CPU process gives back to the system as it frees it.

glibc's ``malloc`` serves a large request (128 KiB and up at first) with its own ``mmap``, which
``free`` unmaps; but each time such a block is freed it raises that threshold to the block's
size (up to 32 MiB), so from the first freed activation on, a step's activations and gradients
(a few MiB each on a small model) come from the heap, whose freed pages stay resident: the
process's RSS grows step after step to far more than it uses (a LoRA DPO run of SmolLM2 on 2
CPU ranks: 2.2 GiB at its peak, 0.2 GiB in use after each step, the rest freed but held).
:func:`release_freed_memory` fixes the threshold (which turns the raising off): blocks of
``threshold`` bytes and more are mapped and unmapped again, so RSS follows what the tensors
hold (that run: 1.36 GiB), at the cost of the page faults of fresh pages.

Set ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable) to choose another threshold: it is left
alone then. Other C libraries (musl, macOS) are left alone.

Loading can leave the same behind without a training loop: quantizing a model's weights on load
(NF4, :mod:`hf_scale.checkpoint.quantized`) makes many short-lived temporaries of a few MiB (each
slice read in the compute dtype, its codes and block maxima), served from the heap once the
threshold has risen; their pages stay resident after the load. :func:`trim_heap`
(``malloc_trim(0)``) gives the heap's free pages back: SmolLM2 QLoRA at 2 CPU ranks, rank 0 held
0.98 GiB right after loading and 0.51 GiB after it (rank 1: 0.52 / 0.51).

Usage::

    release_freed_memory()          # once, early in a CPU training process
    trim_heap()                     # after a phase that made and freed many large temporaries
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
THRESHOLD = 256 * 1024  # bytes: a 64-token row of 576 fp32 features is 147 KiB, a step's activations MiBs


def release_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Make glibc map every allocation of ``threshold`` bytes and more on its own and unmap it
    when freed (``mallopt(M_MMAP_THRESHOLD)``); True when set. A no-op returning False outside
    glibc or where ``MALLOC_MMAP_THRESHOLD_`` is set (the user's value stands)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has mallopt but ignores it)
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing in use is
    touched); True when some were released, False when none or outside glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0) == 1)
