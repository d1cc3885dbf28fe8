"""NF4 (QLoRA) bases in the planner: which frozen weights are 4-bit at a layout, their bytes, and
the dequantization each matmul pays.

A QLoRA run (``model.quantize: nf4``) stores the LoRA base ``nn.Linear`` weights that
:func:`hf_scale.model_plans.quantize.nf4_targets` chooses at the layout's ``dp_shard`` dim-0
slices as torchao ``NF4Tensor`` s; the rest of the frozen weights (embeddings, head, norms, and
a base weight whose slice cannot hold whole 64-element blocks) stay in the compute dtype.
An NF4 weight of ``n`` elements stores ``n/2`` bytes of codes, ``n/64`` int8 scalers and
``n / (64 x scaler_block)`` quantization factors in the weight's own dtype (its scaler block:
:func:`hf_scale.quantize.nf4.scaler_block_for`, 256 where its slices allow; :func:`nf4_element_bytes`:
0.5159 bytes at fp32 and 256, :data:`hf_scale.quantize.nf4.BITS_PER_PARAMETER` / 8); ``element_size()`` of
an ``NF4Tensor`` says the compute dtype's, so the planner counts the inner tensors' bytes.

FSDP2 shards and all-gathers the inner tensors (torchao's ``fsdp_pre_all_gather`` hands them
over as they are, and ``fsdp_post_all_gather`` ignores the ``MixedPrecisionPolicy``'s
``param_dtype``): a gathered unit holds its NF4 weights in NF4 bytes, and the all-gather moves
NF4 bytes, with or without mixed precision.

Dequantization (the workspace): torchao's ``LinearNF4`` saves the NF4 weight for backward and
dequantizes the whole weight to the input's dtype in forward (``weight.to(input.dtype)``) and
again in backward (``grad_output @ weight.to(grad_output.dtype)``), one weight at a time; the
copy is freed after its matmul. hf_scale's ``NF4Tensor.get_original_weight``
(:func:`hf_scale.quantize.nf4._dequantize_by_byte`) holds the codes as int32 byte indices
(``n/2`` of them: ``2 n`` bytes) beside the looked-up pairs (``n`` elements in the compute dtype),
then the pairs beside the scaled result (``n`` more): ``n x max(2 + d, 2 d)`` bytes for the
largest NF4 weight (:func:`dequant_workspace`; 4 bytes per element in bf16, 8 in fp32), live
only inside one NF4 matmul. The estimate adds it where a
block's matmuls run beside the peak: a block's backward (the step's end, a recomputation), not
the logits' moment at backward's start, when no block runs. Its time: that traffic, read and
written once (codes in, int32 indices out and in, pairs out and in, result out:
``4.5 + 3 d`` bytes per element), at the device's memory bandwidth, in forward, in backward and
in a checkpoint's recomputation (full or selective: the dequantizing ops are not among those
selective checkpointing keeps) (:func:`dequant_bytes_per_step`); assumed, not measured.

Usage::

    share = nf4_share(facts, parts=8)       # None unless facts.quantize == "nf4"
    share.params, share.blocks, share.largest
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quantize.nf4 import BLOCK, SCALER_BLOCK


@dataclass(frozen=True)
class NF4Share:
    """The weights a layout holds in NF4: elements per block and outside the blocks, the bytes
    they would take as stored without quantization (what ``Frozen.element_bytes`` counted), the
    bytes they take in NF4, and the largest one's elements."""

    blocks: list[int]  # NF4 elements per block (the plan's blocks, in order)
    root: int  # NF4 elements outside every block (0 for LoRA's usual targets)
    plain_bytes: int  # their bytes in their own dtype
    nf4_bytes: int  # their bytes as NF4 (codes, scalers, factors)
    largest: int  # elements of the largest NF4 weight (the dequantization workspace)
    held: float = 1.0  # the share of them one rank holds (pp: its stages'; bytes above already scaled)

    @property
    def params(self) -> int:
        """NF4 elements one rank holds (``blocks`` stay per block: a unit gathers a whole block)."""
        return int((sum(self.blocks) + self.root) * self.held)

    @property
    def saved_bytes(self) -> int:
        """Bytes NF4 saves over storing these weights as they were."""
        return self.plain_bytes - self.nf4_bytes

    @property
    def bytes_per_element(self) -> float:
        return self.nf4_bytes / self.params if self.params else 0.0


def nf4_element_bytes(dtype_bytes: int, scaler_block: int = SCALER_BLOCK) -> float:
    """Bytes an NF4 weight stores per element: half a byte of code, an int8 scaler per 64
    elements, a quantization factor of ``dtype_bytes`` (the weight's own dtype) per group of
    64 x ``scaler_block`` (16,384 at 256)."""
    return 0.5 + 1 / BLOCK + dtype_bytes / (BLOCK * scaler_block)


def nf4_share(facts, parts: int, tp: int = 1, held: float = 1.0) -> NF4Share | None:
    """The NF4 weights of ``facts``' model (adapters inside) split in ``parts`` dim-0 slices
    (of each tp slice under ``tp`` > 1), as the loader chooses them; None when the run quantizes
    nothing. Under tp the elements are one tp rank's (a colwise / rowwise base holds 1/tp); under
    pp ``held`` is the busiest pp rank's share of the model (its stages'), which scales the bytes
    and :attr:`NF4Share.params`, not the per-block counts."""
    if getattr(facts, "quantize", None) is None:
        return None
    share = facts.cached(("nf4", parts, tp), lambda: _share(facts, parts, tp))
    if held == 1.0:
        return share
    from dataclasses import replace

    return replace(share, plain_bytes=int(share.plain_bytes * held), nf4_bytes=int(share.nf4_bytes * held), held=held)


def nf4_chosen(facts, parts: int, tp: int = 1) -> tuple[list[str], dict[str, str]]:
    """:func:`hf_scale.model_plans.quantize.nf4_targets` at ``parts`` x ``tp`` with the plan's tp styles."""
    from ..model_plans.quantize import nf4_targets
    from .profile import _tp_styles

    return nf4_targets(facts.model, parts, tp, _tp_styles(facts) if tp > 1 else None)


def _share(facts, parts: int, tp: int = 1) -> NF4Share:
    from ..model_plans import wrap_units
    from ..model_plans.quantize import NF4_TP_SPLIT

    chosen, _ = nf4_chosen(facts, parts, tp)
    styles = {}
    if tp > 1:
        from .profile import _tp_styles

        styles = _tp_styles(facts)
    params = dict(facts.model.named_parameters())
    weights = [params[name] for name in chosen]
    split = {id(params[n]): tp if styles.get(n.rpartition(".")[0]) in NF4_TP_SPLIT else 1 for n in chosen}
    owner = {}
    for i, unit in enumerate(wrap_units(facts.model, facts.plan)):
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    blocks = [0] * len(facts.block_params)
    root = 0
    held = {id(w): w.numel() // split[id(w)] for w in weights}  # this tp rank's elements
    for w in weights:
        if id(w) in owner:
            blocks[owner[id(w)]] += held[id(w)]
        else:
            root += held[id(w)]
    return NF4Share(blocks=blocks, root=root,
                    plain_bytes=sum(held[id(w)] * w.element_size() for w in weights),
                    nf4_bytes=int(sum(held[id(params[n])] * nf4_element_bytes(params[n].element_size(), block)
                                      for n, block in chosen.items())),
                    largest=max(held.values(), default=0))


def dequant_workspace(share: NF4Share | None, compute_bytes: int) -> int:
    """Bytes one NF4 matmul holds while it dequantizes the largest NF4 weight (the module doc)."""
    return int(share.largest * max(2 + compute_bytes, 2 * compute_bytes)) if share else 0


def dequant_bytes_per_step(share: NF4Share | None, compute_bytes: int, passes: float) -> float:
    """Memory traffic of dequantizing every NF4 weight once per forward, once per backward and
    once per recomputed forward (``passes``: 2, or 3 under activation checkpointing), per micro-batch."""
    return share.params * (4.5 + 3 * compute_bytes) * passes if share else 0.0


def check_layout_quantize(facts, layout) -> None:
    """The loader's refusal of ``layout`` for a quantized run (ep, zero1, tp x pp, tp or pp under
    hsdp or ddp: NF4 bases are held under fsdp, zero2, hsdp and ddp, tp or pp under fsdp or zero2),
    raised before any estimate so that the chooser rejects the layout with the message the run
    would stop with."""
    if getattr(facts, "quantize", None) is None:
        return
    from ..model_plans.quantize import check_quantize

    check_quantize(facts.quantize, layout.parallel_config(), adapter="lora")
