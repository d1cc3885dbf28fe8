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
def test_slice_equals_whole_then_split(dtype, parts):
    """Each of ``parts`` dim-0 slices quantized alone, with the mean of every slice's block-absmax
    sums (what the loader's all-reduce gives), holds exactly the inner tensors of torchao's
    to_nf4(whole) split as FSDP splits it; dequantized, it equals that slice."""
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    whole = (torch.randn(256, 256) * torch.linspace(0.1, 3, 256)).to(dtype)  # rows of different scale
    ref = to_nf4(whole, 64, 256)
    slices = whole.chunk(parts)
    total = sum(nf4.block_absmax(s).double().sum() for s in slices)
    count = sum(nf4.block_absmax(s).numel() for s in slices)
    pieces = ref.split(whole.shape[0] // parts) if parts > 1 else [ref]
    for rows, want in zip(slices, pieces):
        got = nf4.quantize_rows(rows, total / count, tuple(whole.shape))
        for name in (*nf4.INNER, "scaler_mean"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.n_blocks == want.n_blocks and got.shape == want.shape
        assert torch.equal(got.get_original_weight(), want.get_original_weight())


def test_bytes_per_parameter():
    q = nf4.quantize_whole(torch.randn(128, 256))
    assert q.element_size() == 4  # what element_size() says: the compute dtype's
    assert nf4.nf4_nbytes(q) * 8 / q.numel() == pytest.approx(nf4.BITS_PER_PARAMETER)
    assert 4.12 < nf4.BITS_PER_PARAMETER < 4.13


def test_group_checks():
    assert nf4.check_groups((256, 256), 4) is None
    assert "16384-element" in nf4.check_groups((128, 256), 4)
    assert "do not split evenly" in nf4.check_groups((130, 256), 4)
    assert "1-D" in nf4.check_groups((256,), 1)


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
    chosen, kept = nf4_targets(model.get_base_model(), 4)
    assert len(chosen) == 5 and sorted(k.split(".")[4] for k in kept) == ["k_proj", "v_proj"]
    # tp=2: a colwise slice (rows) or rowwise slice (columns) of each weight, then 2 dim-0 parts of it
    styles = {n: "rowwise" if n.split(".")[-2] in ("o_proj", "down_proj") else "colwise"
              for n, _ in model.get_base_model().named_modules() if n.endswith(".base_layer")}
    chosen, kept = nf4_targets(model.get_base_model(), 1, 2, styles)
    assert len(chosen) == 7 and not kept
    chosen, kept = nf4_targets(model.get_base_model(), 2, 2, styles)
    assert len(chosen) == 5 and sorted(k.split(".")[4] for k in kept) == ["k_proj", "v_proj"]
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
