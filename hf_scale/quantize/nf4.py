"""NF4 (QLoRA's 4-bit NormalFloat) weights as torchao ``NF4Tensor`` s, quantized slice by slice.

torchao's ``to_nf4(w, 64, 256)`` quantizes a whole tensor: each block of 64 elements keeps its
absmax as a scaler, and the scalers are quantized again (double quantization) to int8 in blocks
of 256 scalers, after subtracting **one mean over the whole tensor**. Every other part is local
to a 64 x 256 = 16,384-element group (:data:`GROUP`). So a rank holding whole groups of a
tensor (a dim-0 slice whose size is a multiple of :data:`GROUP`, as FSDP shards) can quantize
its own slice alone, given that mean: :func:`quantize_rows` does exactly torchao's arithmetic
with the mean passed in (the loader agrees it with one all-reduce of block-absmax sums). The
result holds the same inner tensors as the whole tensor quantized and split by FSDP
(``aten.split`` on an ``NF4Tensor`` splits its inner tensors and keeps ``n_blocks`` and the mean).

FSDP2 shards and all-gathers ``NF4Tensor`` in 4-bit through its ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` hooks; its forward dequantizes (``F.linear`` -> ``LinearNF4``).

torchao is an optional dependency (``pip install 'hf-scale[qlora]'``), imported only here.
"""

from __future__ import annotations

import sys

import torch

from ..errors import HfScaleConfigError

BLOCK = 64  # elements per absmax scaler (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # scalers per int8 double-quantization block
GROUP = BLOCK * SCALER_BLOCK  # elements a slice must hold whole multiples of
BITS_PER_PARAMETER = 4 + 8 / BLOCK + 32 / GROUP  # 4.127: codes, int8 scalers, fp32 factors
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
    return NF4Tensor


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


def check_groups(shape: tuple[int, ...], parts: int) -> str | None:
    """Why a ``shape`` weight split in ``parts`` dim-0 slices cannot be NF4, or None when it can."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) != 2:
        return f"{len(shape)}-D, not a Linear weight"
    if shape[0] % parts:
        return f"{shape[0]} rows do not split evenly over {parts} ranks"
    if (numel // parts) % GROUP:
        return f"a slice of {numel // parts} elements is not a whole number of {GROUP}-element NF4 groups"
    return None


@torch.no_grad()
def quantize_rows(rows: torch.Tensor, mean: torch.Tensor, whole_shape: tuple[int, ...] | None = None):
    """``rows`` (a 2-D slice of whole groups of a weight) as an ``NF4Tensor``, quantized as
    torchao's ``to_nf4(whole, 64, 256)`` quantizes them, with ``mean`` (the whole tensor's mean
    block absmax) for the double quantization. ``whole_shape``: the whole tensor's shape (its
    block count is kept, as FSDP's split keeps it); None: ``rows`` is the whole tensor.
    Works on the meta device (the placeholder FSDP shards before the load)."""
    cls = torchao_nf4()
    args = sys.modules[cls.__module__].SubclassTensorArgs
    rows = rows.contiguous()
    if rows.numel() % GROUP:
        raise ValueError(f"NF4 slices hold whole {GROUP}-element groups; got {tuple(rows.shape)}")
    dtype, device = rows.dtype, rows.device
    nf4 = torch.tensor(NF4_CODES, dtype=dtype, device=device)
    scalers = block_absmax(rows)
    centred = (scalers - mean.to(dtype)).view(-1, SCALER_BLOCK)
    factor = 256 / (2 * centred.abs().amax(dim=1))  # torchao's quantization_factor, per scaler block
    scaled = (centred * factor.unsqueeze(-1)).round().clamp(-128, 127)
    codes = cls.convert_to_norm_float_weight(rows, rows.numel() // BLOCK, BLOCK, nf4)
    whole = tuple(whole_shape or rows.shape)
    n_blocks = whole[0] * whole[1] // BLOCK
    meta = args(rows.size(), rows.stride(), 0, dtype, device, False)
    return cls(meta, BLOCK, n_blocks, SCALER_BLOCK, scaled.flatten().to(torch.int8).clone(),
               factor.contiguous().clone(), mean.to(dtype).reshape(()).clone(), codes, nf4)


def nf4_placeholder(shape: tuple[int, ...], dtype: torch.dtype, device, whole_shape: tuple[int, ...] | None = None):
    """An ``NF4Tensor`` of ``shape`` whose inner tensors are empty (uninitialised) tensors of the
    shapes and dtypes :func:`quantize_rows` makes, on ``device``: the placeholder FSDP shards
    before the load (``device="meta"``), or, under ``FakeTensorMode``, a simulated run's NF4
    weight (:func:`hf_scale.layout_search.simulate.simulate`: quantizing reads values, which fake
    tensors have not). ``whole_shape``: as in :func:`quantize_rows`."""
    cls = torchao_nf4()
    args = sys.modules[cls.__module__].SubclassTensorArgs
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) != 2 or numel % GROUP:
        raise ValueError(f"NF4 weights are 2-D slices of whole {GROUP}-element groups; got {tuple(shape)}")
    whole = tuple(whole_shape or shape)
    meta = args(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device(device), False)

    def empty(n, kind):
        return torch.empty(n, dtype=kind, device=device)

    return cls(meta, BLOCK, whole[0] * whole[1] // BLOCK, SCALER_BLOCK, empty(numel // BLOCK, torch.int8),
               empty(numel // GROUP, dtype), empty((), dtype), empty(numel // 2, torch.uint8),
               empty(len(NF4_CODES), dtype))


def quantize_whole(weight: torch.Tensor):
    """``weight`` quantized whole (one process: what :func:`quantize_rows` of all slices is)."""
    return quantize_rows(weight, block_absmax(weight).double().mean())


# the 16 NF4 code values (QLoRA, Dettmers et al. 2023), as torchao's from_tensor lists them
NF4_CODES = (-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000)
