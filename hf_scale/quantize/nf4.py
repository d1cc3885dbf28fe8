"""NF4 (QLoRA's 4-bit NormalFloat) weights as torchao ``NF4Tensor`` s, quantized slice by slice.

torchao's ``to_nf4(w, 64, scaler_block)`` quantizes a whole tensor: each block of 64 elements
keeps its absmax as a scaler, and the scalers are quantized again (double quantization) to int8
in blocks of ``scaler_block`` scalers (torchao's default 256), after subtracting **one mean over
the whole tensor**. Every other part is local to a 64 x ``scaler_block``-element group. So a rank
holding whole groups of a tensor (a dim-0 slice, as FSDP shards) can quantize its own slice alone,
given that mean: :func:`quantize_rows` does exactly torchao's arithmetic with the mean passed in
(the loader agrees it with one all-reduce of block-absmax sums). The result holds the same inner
tensors as the whole tensor quantized and split by FSDP (``aten.split`` on an ``NF4Tensor``
splits its inner tensors and keeps ``n_blocks``, ``scaler_block_size`` and the mean).

The scaler block is chosen per weight (:func:`scaler_block_for`): the largest divisor of a slice's
64-element block count up to 256, so that any slice of whole 64-element blocks holds whole
groups. torchao keeps it per tensor (``NF4Tensor.scaler_block_size``, carried through FSDP's
split and all-gather). Its cost: one factor (the weight's dtype) per group, 32 / (64 x
scaler_block) bits a parameter in fp32 (0.002 at 256, 0.016 at 32). SmolLM2's 576 x 576
attention projections at 2 slices hold 2,592 blocks each (10.125 groups of 256 scalers), so
they take 216; its 192 x 576 ones 864 blocks: 216 too.

FSDP2 shards and all-gathers ``NF4Tensor`` in 4-bit through its ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` hooks; its forward dequantizes (``F.linear`` -> ``LinearNF4``).

torchao is an optional dependency (``pip install 'hf-scale[qlora]'``), imported only here.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from ..errors import HfScaleConfigError

BLOCK = 64  # elements per absmax scaler (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # the most scalers per int8 double-quantization block (torchao's default)
GROUP = BLOCK * SCALER_BLOCK  # elements of a group at that scaler block
BITS_PER_PARAMETER = 4 + 8 / BLOCK + 32 / GROUP  # 4.127: codes, int8 scalers, fp32 factors (at 256)
INNER = ("quantized_data", "quantized_scalers", "quantization_factor")  # what a rank stores per slice


def torchao_nf4():
    """torchao's ``NF4Tensor`` class, or a clear error naming the extra to install."""
    try:
        from torchao.quantization import NF4Tensor
    except ImportError:
        try:  # torchao < 0.13 kept it under dtypes
            from torchao.dtypes import NF4Tensor
        except ImportError:
            raise HfScaleConfigError(
                "quantize='nf4' (QLoRA) needs torchao's NF4Tensor (torchao>=0.18), which is not installed: "
                "pip install 'hf-scale[qlora]' (or pip install torchao), or train without model.quantize."
            ) from None
    _accept_dtensor_out(NF4Tensor)
    _dequantize_by_byte(NF4Tensor)
    return NF4Tensor


def _dequantize_by_byte(cls) -> None:
    """Make ``cls.get_original_weight`` (every NF4 matmul's dequantization, in forward and again in
    backward) look each byte's two code values up at once in a 256 x 2 table, then scale each
    64-element block: one gather and one multiply, where torchao splits the nibbles into two
    int64 tensors, gathers each, expands the scalers twice and interleaves with a stack. The
    same products (code x dequantized scaler, in the weight's dtype), so bitwise the same weight.
    Done once per class."""
    original = cls.get_original_weight
    if getattr(original, "_hf_scale_by_byte", False):
        return

    def get_original_weight(self) -> torch.Tensor:
        nf4 = self.nf4
        table = torch.stack((nf4.repeat_interleave(16), nf4.repeat(16)), dim=-1)  # byte -> (high, low) values
        scalers = self.dequantize_scalers(self.quantized_scalers, self.quantization_factor, self.scaler_block_size)
        pairs = table[self.quantized_data.to(torch.int32)]  # (numel / 2, 2)
        return (pairs.view(-1, self.block_size) * scalers.unsqueeze(-1)).reshape(self.shape)

    get_original_weight._hf_scale_by_byte = True
    get_original_weight.torchao = original  # what the tests compare with
    cls.get_original_weight = get_original_weight


def _accept_dtensor_out(cls) -> None:
    """Let ``cls.fsdp_post_all_gather`` take FSDP2's ``out=`` as a DTensor: FSDP over a
    tensor-parallel NF4 weight (a DTensor on the tp mesh whose local tensor is NF4) passes the
    unsharded DTensor when it gathers again (backward, after resharding), and torchao's hook
    asserts a plain NF4Tensor. Its NF4 local tensor is what the hook checks (the gathered storage
    is already in place); torchao's float8 hook unwraps the DTensor so. Done once per class."""
    original = cls.fsdp_post_all_gather
    if getattr(original, "_hf_scale_unwraps_dtensor", False):
        return

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from torch.distributed.tensor import DTensor

        if isinstance(out, DTensor):
            out = out._local_tensor
        return original(self, all_gather_outputs, metadata, param_dtype, out=out)

    fsdp_post_all_gather._hf_scale_unwraps_dtensor = True
    cls.fsdp_post_all_gather = fsdp_post_all_gather


def is_nf4(t) -> bool:
    """Whether ``t`` (a tensor, or a DTensor's local tensor) is an ``NF4Tensor``; torchao is
    looked up only if it was imported (a model without NF4 weights never imports it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return "torchao" in sys.modules and hasattr(t, "quantized_data") and hasattr(t, "fsdp_pre_all_gather")


def nf4_nbytes(t) -> int:
    """Bytes an NF4 tensor (or a DTensor's local NF4 shard) really stores: its inner tensors
    (``element_size()`` reports the compute dtype's 2 or 4)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return sum(getattr(t, name).numel() * getattr(t, name).element_size() for name in INNER)


def block_absmax(rows: torch.Tensor) -> torch.Tensor:
    """The absmax of each 64-element block of ``rows`` (flattened), in its dtype."""
    return rows.reshape(-1, BLOCK).abs().amax(dim=1)


def scaler_block_for(numel: int) -> int | None:
    """The scaler block for a slice of ``numel`` elements: the largest divisor of its 64-element
    block count up to :data:`SCALER_BLOCK`, so that the slice holds whole groups (None: the slice
    is not whole 64-element blocks). Every slice of a weight has the same size, so one value."""
    if numel <= 0 or numel % BLOCK:
        return None
    blocks = numel // BLOCK
    return next(n for n in range(min(SCALER_BLOCK, blocks), 0, -1) if blocks % n == 0)


def nf4_bits(scaler_block: int = SCALER_BLOCK, dtype_bytes: int = 4) -> float:
    """Bits an NF4 weight stores per parameter: a 4-bit code, an int8 scaler per 64 elements and a
    factor in the weight's dtype per group of 64 x ``scaler_block``."""
    return 4 + 8 / BLOCK + 8 * dtype_bytes / (BLOCK * scaler_block)


def check_groups(shape: tuple[int, ...], parts: int) -> str | None:
    """Why a ``shape`` weight split in ``parts`` dim-0 slices cannot be NF4, or None when it can
    (its slices hold whole 64-element blocks: :func:`scaler_block_for` then finds whole groups)."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) != 2:
        return f"{len(shape)}-D, not a Linear weight"
    if shape[0] % parts:
        return f"{shape[0]} rows do not split evenly over {parts} ranks"
    if scaler_block_for(numel // parts) is None:
        return f"a slice of {numel // parts} elements is not a whole number of {BLOCK}-element NF4 blocks"
    return None


class EncodedRows(NamedTuple):
    """A slice's 4-bit codes and its 64-element blocks' absmax: all of NF4 that does not need the
    whole tensor's mean (:func:`encode_rows`). The loader keeps these, not the slice read in the
    compute dtype, until the means are agreed: 1/8 + 1/16 of the slice's fp32 bytes."""

    codes: torch.Tensor  # uint8, two codes a byte
    absmax: torch.Tensor  # one per 64-element block, in the slice's dtype
    shape: torch.Size
    dtype: torch.dtype


@torch.no_grad()
def encode_rows(rows: torch.Tensor) -> EncodedRows:
    """``rows``' codes (torchao's, from each block's exact absmax) and block absmax."""
    rows = rows.contiguous()
    if rows.numel() % BLOCK:
        raise ValueError(f"NF4 weights are 2-D slices of whole {BLOCK}-element blocks; got {tuple(rows.shape)}")
    nf4 = torch.tensor(NF4_CODES, dtype=rows.dtype, device=rows.device)
    codes = torchao_nf4().convert_to_norm_float_weight(rows, rows.numel() // BLOCK, BLOCK, nf4)
    return EncodedRows(codes, block_absmax(rows), rows.shape, rows.dtype)


@torch.no_grad()
def quantize_rows(rows, mean: torch.Tensor, whole_shape: tuple[int, ...] | None = None,
                  scaler_block: int | None = None):
    """``rows`` (a 2-D slice of whole groups of a weight, or its :func:`encode_rows`) as an
    ``NF4Tensor``, quantized as torchao's ``to_nf4(whole, 64, scaler_block)`` quantizes them, with
    ``mean`` (the whole tensor's mean block absmax) for the double quantization. ``whole_shape``:
    the whole tensor's shape (its block count is kept, as FSDP's split keeps it); None: ``rows``
    is the whole tensor. ``scaler_block``: None, :func:`scaler_block_for` of ``rows`` (the slice
    each rank holds). Works on the meta device (the placeholder FSDP shards before the load)."""
    cls = torchao_nf4()
    args = sys.modules[cls.__module__].SubclassTensorArgs
    encoded = rows if isinstance(rows, EncodedRows) else encode_rows(rows)
    shape, dtype, device = encoded.shape, encoded.dtype, encoded.codes.device
    group = _group(shape, scaler_block)
    nf4 = torch.tensor(NF4_CODES, dtype=dtype, device=device)
    centred = (encoded.absmax - mean.to(dtype)).view(-1, group)
    factor = 256 / (2 * centred.abs().amax(dim=1))  # torchao's quantization_factor, per scaler block
    scaled = (centred * factor.unsqueeze(-1)).round().clamp(-128, 127)
    whole = tuple(whole_shape or shape)
    n_blocks = whole[0] * whole[1] // BLOCK
    meta = args(torch.Size(shape), (shape[1], 1), 0, dtype, device, False)
    return cls(meta, BLOCK, n_blocks, group, scaled.flatten().to(torch.int8).clone(),
               factor.contiguous().clone(), mean.to(dtype).reshape(()).clone(), encoded.codes, nf4)


def _group(shape, scaler_block: int | None) -> int:
    """``scaler_block`` (None: :func:`scaler_block_for` of ``shape``), checked: a 2-D ``shape`` of whole
    64 x ``scaler_block`` groups, else a ValueError naming it."""
    numel = 1
    for n in shape:
        numel *= n
    chosen = scaler_block or scaler_block_for(numel)
    if len(shape) != 2 or chosen is None or numel % (BLOCK * chosen):
        raise ValueError(f"NF4 weights are 2-D slices of whole {BLOCK}-element blocks (and of whole groups of "
                         f"{BLOCK} x scaler_block={scaler_block} elements where given); got {tuple(shape)}")
    return chosen


def nf4_placeholder(shape: tuple[int, ...], dtype: torch.dtype, device, whole_shape: tuple[int, ...] | None = None,
                    scaler_block: int | None = None):
    """An ``NF4Tensor`` of ``shape`` whose inner tensors are empty (uninitialised) tensors of the
    shapes and dtypes :func:`quantize_rows` makes, on ``device``: the placeholder FSDP shards
    before the load (``device="meta"``), or, under ``FakeTensorMode``, a simulated run's NF4
    weight (:func:`hf_scale.layout_search.simulate.simulate`: quantizing reads values, which fake
    tensors have not). ``whole_shape`` and ``scaler_block``: as in :func:`quantize_rows` (a whole
    weight's placeholder that FSDP will shard: the scaler block of its shards)."""
    cls = torchao_nf4()
    args = sys.modules[cls.__module__].SubclassTensorArgs
    numel = 1
    for n in shape:
        numel *= n
    group = _group(shape, scaler_block)
    whole = tuple(whole_shape or shape)
    meta = args(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device(device), False)

    def empty(n, kind):
        return torch.empty(n, dtype=kind, device=device)

    return cls(meta, BLOCK, whole[0] * whole[1] // BLOCK, group, empty(numel // BLOCK, torch.int8),
               empty(numel // (BLOCK * group), dtype), empty((), dtype), empty(numel // 2, torch.uint8),
               empty(len(NF4_CODES), dtype))


def quantize_whole(weight: torch.Tensor, scaler_block: int | None = None):
    """``weight`` quantized whole (one process: what :func:`quantize_rows` of all slices is, given
    their ``scaler_block``)."""
    return quantize_rows(weight, block_absmax(weight).double().mean(), scaler_block=scaler_block)


# the 16 NF4 code values (QLoRA, Dettmers et al. 2023), as torchao's from_tensor lists them
NF4_CODES = (-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000)
