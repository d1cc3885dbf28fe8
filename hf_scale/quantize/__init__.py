"""Quantized frozen bases (QLoRA): NF4 weights through torchao's ``NF4Tensor``, imported in one
place (:mod:`hf_scale.quantize.nf4`) so that its module path moving again is a one-line fix."""

from .nf4 import GROUP, is_nf4, nf4_nbytes, quantize_rows, torchao_nf4

__all__ = ["GROUP", "is_nf4", "nf4_nbytes", "quantize_rows", "torchao_nf4"]
