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
from hf_scale.quantize.nf4 import GROUP, INNER, block_absmax, nf4_nbytes, nf4_placeholder, quantize_rows

SEQ = 16
pytestmark = pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 2,
                                reason="a CUDA build of torch with fewer than 2 visible GPUs")
EVERY_INNER = (*INNER, "scaler_mean", "nf4")  # what an NF4Tensor holds (FSDP shards the first three)


def lora_llama():
    """A Llama on the meta device in bf16 whose MLP weights (256 x 128, 128 x 256: two NF4 groups)
    hold whole groups at 2 slices and whose attention weights (128 x 128, 64 x 128) do not;
    LoRA on every Linear, adapters in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
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
    with pytest.raises(ValueError, match="whole 16384-element groups"):
        nf4_placeholder((64, 128), dtype, "meta")


def nf4_slices(parts: int, tp: int) -> list[tuple[int, int]]:
    """(rows, columns) of each NF4 weight one rank holds under ``parts`` dim-0 slices after a tp
    split (the test's own rule: q, k, v, gate, up split by rows, o and down by columns; NF4 where
    the rank's slice holds whole groups)."""
    shapes = {"q": (128, 128), "k": (64, 128), "v": (64, 128), "o": (128, 128),
              "gate": (256, 128), "up": (256, 128), "down": (128, 256)}
    held = []
    for name, (out, inp) in shapes.items():
        out, inp = (out, inp // tp) if name in ("o", "down") else (out // tp, inp)
        if out % parts == 0 and (out * inp // parts) % GROUP == 0:
            held.append((out // parts, inp))
    return held * 2  # two blocks


def allocated(t: torch.Tensor) -> int:
    """Bytes MemTracker counts for one tensor on a GPU (the caching allocator's 512-byte blocks)."""
    from torch.distributed._tools.mem_tracker import _PYTORCH_MIN_ALLOCATE

    return -(-t.numel() * t.element_size() // _PYTORCH_MIN_ALLOCATE) * _PYTORCH_MIN_ALLOCATE


LAYOUTS = {  # the loader's three paths: FSDP shards the placeholder; kept whole and moved; tp slices moved
    "fsdp": (Layout("fsdp", dp_shard=2, precision="bf16"), 2, 1),
    "ddp": (Layout("ddp", dp_replicate=2, precision="bf16"), 1, 1),
    "tp2": (Layout("fsdp", tp=2), 1, 2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_qlora_simulation_holds_nf4_slices_and_agrees_with_the_estimate(name):
    """Simulated with and without ``quantize``: the parameters' bytes differ by exactly the NF4
    weights' (their slices in the compute dtype, less torchao's inner tensors of such a slice,
    each counted as MemTracker counts it); every tensor on its GPU; the planner's estimate of
    the parameters within 10% of the simulated (it counts the NF4 bytes, not the bf16 ones) and
    of the whole peak within 0.8-1.25x (a tiny model: fixed costs weigh)."""
    layout, parts, tp = LAYOUTS[name]
    model = lora_llama()
    nf4 = simulate(model, 2, 0, layout, seq=SEQ, batch=1, quantize="nf4")
    plain = simulate(model, 2, 0, layout, seq=SEQ, batch=1)
    saved = 0
    for shape in nf4_slices(parts, tp):
        rows = torch.randn(shape, dtype=torch.bfloat16)
        real = quantize_rows(rows, block_absmax(rows).double().mean())
        saved += allocated(rows) - sum(allocated(getattr(real, n)) for n in EVERY_INNER)
    assert saved > 0 and plain.peak["params"] - nf4.peak["params"] == saved, (name, saved, nf4.format())
    assert nf4.misplaced == [] and set(nf4.placement["parameters"]) == {"cuda:0"}
    trainable = sum(p.requires_grad for p in model.parameters())
    assert sum(nf4.placement["gradients"].values()) == trainable  # the NF4 base makes no gradient
    assert abs(nf4.estimate.params / nf4.peak["params"] - 1) < 0.1, nf4.format()
    assert 0.8 < nf4.ratio < 1.25, nf4.format()


def test_layouts_the_loader_refuses_are_refused_in_the_simulation():
    with pytest.raises(HfScaleConfigError, match="quantize='nf4' with"):
        simulate(lora_llama(), 2, 0, Layout("hsdp", dp_replicate=1, dp_shard=1, tp=2), seq=SEQ, quantize="nf4")
    with pytest.raises(HfScaleConfigError, match="reference"):
        simulate(lora_llama(), 2, 0, Layout("fsdp", dp_shard=2), seq=SEQ, quantize="nf4", reference=True)
