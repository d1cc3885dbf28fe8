"""NF4 slices (hf_scale.quantize.nf4) against torchao's whole-tensor quantization, the group
checks, which LoRA base weights are chosen, and the error when torchao is missing."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("torchao")

from hf_scale.errors import HfScaleConfigError
from hf_scale.quantize import nf4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("shape,scaler_block", [((256, 256), 256), ((192, 576), 216)])
def test_slice_equals_whole_then_split(dtype, parts, shape, scaler_block):
    """Each of ``parts`` dim-0 slices quantized alone, with the mean of every slice's block-absmax
    sums (what the loader's all-reduce gives), holds exactly the inner tensors of torchao's
    to_nf4(whole, 64, scaler block) split as FSDP splits it; dequantized, it equals that slice.
    192 x 576 (SmolLM2's k / v): no slice holds whole 256-scaler groups, each takes 216."""
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    whole = (torch.randn(*shape) * torch.linspace(0.1, 3, shape[1])).to(dtype)  # columns of different scale
    ref = to_nf4(whole, 64, scaler_block)
    slices = whole.chunk(parts)
    total = sum(nf4.block_absmax(s).double().sum() for s in slices)
    count = sum(nf4.block_absmax(s).numel() for s in slices)
    pieces = ref.split(whole.shape[0] // parts) if parts > 1 else [ref]
    for rows, want in zip(slices, pieces):
        got = nf4.quantize_rows(rows, total / count, tuple(whole.shape))  # its scaler block: the slice's
        assert got.scaler_block_size == want.scaler_block_size == scaler_block
        # the mean is exact (fp64) here and summed in fp32 by torchao: an ulp apart at most
        assert torch.equal(got.quantized_data, want.quantized_data)
        torch.testing.assert_close(got.scaler_mean, want.scaler_mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(got.quantization_factor, want.quantization_factor, rtol=1e-5, atol=0)
        assert (got.quantized_scalers.int() - want.quantized_scalers.int()).abs().max() <= 1
        got = nf4.quantize_rows(rows, want.scaler_mean, tuple(whole.shape))  # given torchao's mean: bit for bit
        for name in (*nf4.INNER, "scaler_mean"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.n_blocks == want.n_blocks and got.shape == want.shape
        assert torch.equal(got.get_original_weight(), want.get_original_weight())


def test_bytes_per_parameter():
    q = nf4.quantize_whole(torch.randn(128, 256))
    assert q.element_size() == 4  # what element_size() says: the compute dtype's
    assert nf4.nf4_nbytes(q) * 8 / q.numel() == pytest.approx(nf4.BITS_PER_PARAMETER) == pytest.approx(nf4.nf4_bits())
    assert 4.12 < nf4.BITS_PER_PARAMETER < 4.13
    q = nf4.quantize_whole(torch.randn(96, 576), 27)  # a smaller scaler block: one fp32 factor per 64 x 27
    assert nf4.nf4_nbytes(q) * 8 / q.numel() == pytest.approx(nf4.nf4_bits(27)) == pytest.approx(4 + 1 / 8 + 32 / (64 * 27))


def test_scaler_block_is_the_largest_that_the_slice_holds_whole():
    """SmolLM2 at 2 slices: MLP 1536 x 576 (6,912 blocks a slice) 256; q / o 576 x 576 (2,592) and
    k / v 192 x 576 (864) 216; at 4 slices q / o (1,296 blocks) 216; a prime block count 1; a slice
    of part of a 64-element block: none."""
    assert nf4.scaler_block_for(1536 * 576 // 2) == 256
    assert nf4.scaler_block_for(576 * 576 // 2) == nf4.scaler_block_for(192 * 576 // 2) == 216
    assert nf4.scaler_block_for(576 * 576 // 4) == 216
    assert nf4.scaler_block_for(64 * 128) == 128 and nf4.scaler_block_for(64 * 257) == 1
    assert nf4.scaler_block_for(64 * 3 + 32) is None and nf4.scaler_block_for(0) is None


def test_group_checks():
    assert nf4.check_groups((256, 256), 4) is None
    assert nf4.check_groups((128, 256), 4) is None  # 128 blocks a slice: scaler block 128
    assert nf4.check_groups((576, 576), 2) is None  # 10.125 groups of 256 scalers: 216 instead
    assert "64-element NF4 blocks" in nf4.check_groups((40, 40), 2)  # 800 elements a slice
    assert "do not split evenly" in nf4.check_groups((130, 256), 4)
    assert "1-D" in nf4.check_groups((256,), 1)
    with pytest.raises(ValueError, match="whole 64-element blocks"):
        nf4.quantize_rows(torch.randn(20, 40), torch.tensor(1.0))
    with pytest.raises(ValueError, match="scaler_block=256"):  # 96 x 96: 144 blocks, not whole groups ...
        nf4.quantize_rows(torch.randn(96, 96), torch.tensor(1.0), scaler_block=256)  # ... of 256 scalers


def test_lora_base_weights_chosen():
    """LoRA's base Linear weights (not embeddings, head, norms); at 4 slices k / v are kept."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_scale.model_plans.quantize import nf4_targets

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules="all-linear"))
    chosen, kept = nf4_targets(model.get_base_model(), 2)
    assert len(chosen) == 7 and not kept and all(n.endswith(".base_layer.weight") for n in chosen)
    assert set(chosen.values()) == {256}
    chosen, kept = nf4_targets(model.get_base_model(), 4)  # k / v: 8,192 elements a slice, 128 blocks
    assert len(chosen) == 7 and not kept
    assert {n.split(".")[4]: b for n, b in chosen.items() if b != 256} == {"k_proj": 128, "v_proj": 128}
    chosen, kept = nf4_targets(model.get_base_model(), 16)  # k / v 8 rows a slice of 256: 32 blocks
    assert chosen["model.layers.0.self_attn.k_proj.base_layer.weight"] == 32 and not kept
    chosen, kept = nf4_targets(model.get_base_model(), 256)  # k / v have 128 rows
    assert sorted(k.split(".")[4] for k in kept) == ["k_proj", "v_proj"] and len(chosen) == 5
    # tp=2: a colwise slice (rows) or rowwise slice (columns) of each weight, then 2 dim-0 parts of it
    styles = {n: "rowwise" if n.split(".")[-2] in ("o_proj", "down_proj") else "colwise"
              for n, _ in model.get_base_model().named_modules() if n.endswith(".base_layer")}
    chosen, kept = nf4_targets(model.get_base_model(), 1, 2, styles)
    assert len(chosen) == 7 and not kept
    chosen, kept = nf4_targets(model.get_base_model(), 2, 2, styles)  # k / v's tp slice halved: 128 blocks
    assert len(chosen) == 7 and not kept and chosen["model.layers.0.self_attn.v_proj.base_layer.weight"] == 128
    assert chosen["model.layers.0.self_attn.o_proj.base_layer.weight"] == 256  # columns split: 65,536 / 4
    styles = {n: "packed_colwise" if ".q_proj." in n else s for n, s in styles.items()}
    chosen, kept = nf4_targets(model.get_base_model(), 1, 2, styles)  # a style NF4 is not split under
    assert len(chosen) == 6 and "DTensor" in kept["model.layers.0.self_attn.q_proj.base_layer.weight"]


def test_missing_torchao_names_the_extra(monkeypatch):
    for name in ("torchao", "torchao.quantization", "torchao.dtypes"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(HfScaleConfigError, match=r"pip install 'hf-scale\[qlora\]'"):
        nf4.torchao_nf4()


def test_quantize_refuses_tp_outside_fsdp_and_zero2():
    """tp or pp with an NF4 base runs under fsdp / zero2 (tp: local NF4 slices, FSDP on top); under
    hsdp or ddp, and tp x pp, it is refused naming the layout."""
    from types import SimpleNamespace

    from hf_scale.model_plans.quantize import check_quantize

    def config(strategy, **degrees):
        return SimpleNamespace(strategy=strategy, **{"tp": 1, "pp": 1, "ep": 1, "cp": 1, **degrees})

    for strategy in ("fsdp", "zero2"):
        check_quantize("nf4", config(strategy, tp=2), adapter="lora")
    for strategy in ("hsdp", "ddp"):
        with pytest.raises(HfScaleConfigError, match=f"tp=2 and strategy='{strategy}'"):
            check_quantize("nf4", config(strategy, tp=2), adapter="lora")
    check_quantize("nf4", config("zero2", pp=2), adapter="lora")
    with pytest.raises(HfScaleConfigError, match="with tp=2 and pp=2:"):
        check_quantize("nf4", config("fsdp", tp=2, pp=2), adapter="lora")
    with pytest.raises(HfScaleConfigError, match="pp=2 and strategy='ddp'"):
        check_quantize("nf4", config("ddp", pp=2), adapter="lora")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,scaler_block", [((256, 256), 256), ((192, 576), 216), ((64, 96), 3)])
def test_dequantization_by_byte_is_torchaos(dtype, shape, scaler_block):
    """hf_scale's dequantization (a 256 x 2 table of each byte's two values) gives torchao's weight
    bit for bit, whole and for an FSDP-style dim-0 split (the matmul's forward and backward use it)."""
    torch.manual_seed(1)
    weight = (torch.randn(*shape) * torch.linspace(0.01, 2, shape[1])).to(dtype)
    q = nf4.quantize_whole(weight, scaler_block)
    ours = type(q).get_original_weight
    assert ours._hf_scale_by_byte
    for held in (q, q.split(shape[0] // 2)[1]):
        assert torch.equal(ours(held), ours.torchao(held))
    x = torch.randn(3, shape[1], dtype=dtype)
    assert torch.equal(torch.nn.functional.linear(x, q), torch.nn.functional.linear(x, ours.torchao(q)))
