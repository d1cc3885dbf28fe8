"""QLoRA in the simulation (issue 41): ``simulate(..., quantize="nf4")`` holds the LoRA base
weights as ``NF4Tensor`` s built from fake inner tensors, placed, sharded and assigned as the
loader does. Checked against torchao's real quantization (the bytes of each inner tensor), not
against figures; the planner's estimate of the same run beside it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
peft = pytest.importorskip("peft")

from hf_scale.errors import HfScaleConfigError
from hf_scale.layout_search.estimate import Layout
from hf_scale.layout_search.simulate import simulate
from hf_scale.quantize.nf4 import (
    INNER,
    block_absmax,
    nf4_nbytes,
    nf4_placeholder,
    quantize_rows,
)

SEQ = 16
pytestmark = pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 2,
                                reason="a CUDA build of torch with fewer than 2 visible GPUs")
EVERY_INNER = (*INNER, "scaler_mean", "nf4")  # what an NF4Tensor holds (FSDP shards the first three)


def lora_llama():
    """A Llama on the meta device in bf16 whose Linear weights (512 x 256, 256 x 256, 128 x 256)
    hold whole NF4 groups of 256 scalers at 2 slices, at tp=2 too; LoRA on every Linear, adapters
    in fp32. (Smaller ones would hold NF4 inner tensors so small that the allocator's 512-byte
    rounding outweighs them; the scaler blocks below 256: tests/unit/test_nf4.py.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, whole", [((256, 128), None), ((128, 256), (512, 256))])
def test_fake_nf4_weight_is_the_real_quantization_without_values(dtype, rows, whole):
    """The placeholder (meta, and fake under FakeTensorMode) holds the inner tensors torchao's
    quantization of a real slice holds: the same shapes, dtypes and bytes, the same block counts."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    weight = torch.randn(rows, dtype=dtype)
    real = quantize_rows(weight, block_absmax(weight).double().mean(), whole)
    with FakeTensorMode():
        fake = nf4_placeholder(rows, dtype, "cpu", whole)
    meta = nf4_placeholder(rows, dtype, "meta", whole)
    for placeholder in (fake, meta):
        assert type(placeholder) is type(real) and placeholder.shape == real.shape and placeholder.dtype == dtype
        for name in EVERY_INNER:
            mine, theirs = getattr(placeholder, name), getattr(real, name)
            assert (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype), name
        assert (placeholder.block_size, placeholder.n_blocks, placeholder.scaler_block_size) == (
            real.block_size, real.n_blocks, real.scaler_block_size)
        assert nf4_nbytes(placeholder) == nf4_nbytes(real)
    assert isinstance(fake.quantized_data, FakeTensor) and meta.quantized_data.is_meta
    with pytest.raises(ValueError, match="whole 64-element blocks"):
        nf4_placeholder((3, 40), dtype, "meta")


def allocated(t: torch.Tensor) -> int:
    """Bytes MemTracker counts for one tensor on a GPU (the caching allocator's 512-byte blocks)."""
    from torch.distributed._tools.mem_tracker import _PYTORCH_MIN_ALLOCATE

    return -(-t.numel() * t.element_size() // _PYTORCH_MIN_ALLOCATE) * _PYTORCH_MIN_ALLOCATE


def held_bytes(model, parts: int) -> int:
    """Bytes of ``model``'s parameters on one rank holding a dim-0 slice of each of ``parts``
    (FSDP's shards; 1: whole), each a tensor of its own, with the LoRA base weights whose slice
    holds whole NF4 groups (the test's own rule) really quantized: torchao's inner tensors of a
    random slice of that shape."""
    total = 0
    for name, p in model.named_parameters():
        local = torch.empty((p.shape[0] // parts, *p.shape[1:]), dtype=p.dtype)
        if "base_layer.weight" in name and p.shape[0] % parts == 0 and (p.numel() // parts) % 64 == 0:
            rows = torch.randn(local.shape, dtype=p.dtype)  # scaler block: the largest divisor up to 256 of its blocks
            blocks = local.numel() // 64
            real = quantize_rows(rows, block_absmax(rows).double().mean(),
                                 scaler_block=max(n for n in range(1, 257) if blocks % n == 0))
            total += sum(allocated(getattr(real, n)) for n in EVERY_INNER)
        else:
            total += allocated(local)
    return total


LAYOUTS = {  # the loader's paths: FSDP shards the placeholders; kept whole on the host and moved;
    # assigned after parallelize, which leaves a model with meta parameters where it is, then moved
    "fsdp": (Layout("fsdp", dp_shard=2, precision="bf16"), 2),
    "ddp": (Layout("ddp", dp_replicate=2, precision="bf16"), 1),
    "one_process": (Layout("fsdp", precision="bf16"), 1),
    "tp2": (Layout("fsdp", tp=2), None),  # the same path as one process, with tp slices
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_qlora_simulation_holds_nf4_slices_and_agrees_with_the_estimate(name):
    """The parameters' bytes on the simulated rank are its slices' with the NF4 weights' as
    torchao's inner tensors of such a slice, each counted as MemTracker counts it; every tensor
    on its GPU; the planner's estimate of the parameters within 10% of the simulated (it counts
    the NF4 bytes, not the bf16 ones: 1.6x more here) and of the whole peak within 0.8-1.25x (a
    tiny model: fixed costs weigh)."""
    layout, parts = LAYOUTS[name]
    model = lora_llama()
    result = simulate(model, layout.world_size, 0, layout, seq=SEQ, batch=1, quantize="nf4")
    if parts is not None:
        assert result.peak["params"] == held_bytes(model, parts), result.format()
    assert result.misplaced == [] and set(result.placement["parameters"]) == {"cuda:0"}
    trainable = sum(p.requires_grad for p in model.parameters())
    assert sum(result.placement["gradients"].values()) == trainable  # the NF4 base makes no gradient
    assert abs(result.estimate.params / result.peak["params"] - 1) < 0.1, result.format()
    assert 0.8 < result.ratio < 1.25, result.format()


def test_layouts_the_loader_refuses_are_refused_in_the_simulation(monkeypatch):
    """Before the layout is applied, with the loader's message (the estimate would refuse it too,
    after the run)."""
    import hf_scale.api

    def parallelize(*args, **kwargs):
        raise AssertionError("the layout was applied before the refusal")

    monkeypatch.setattr(hf_scale.api, "parallelize", parallelize)
    with pytest.raises(HfScaleConfigError, match="quantize='nf4' with"):
        simulate(lora_llama(), 2, 0, Layout("hsdp", dp_replicate=1, dp_shard=1, tp=2), seq=SEQ, quantize="nf4")
    with pytest.raises(HfScaleConfigError, match="reference"):
        simulate(lora_llama(), 2, 0, Layout("fsdp", dp_shard=2), seq=SEQ, quantize="nf4", reference=True)
