"""``hf-scale export --merge --dequantize``: a QLoRA adapter merged into the base it was trained
against (its NF4 weights quantized and dequantized again, torchtune's merge) reproduces the trained
model in plain transformers; merged into the full-precision base (peft's default) it does not, by
the quantization error. The adapter folder records which weights were NF4 (``quantization.json``)."""

from __future__ import annotations

import json

import pytest
import torch

import hf_scale
from hf_scale.checkpoint.merge import merge_adapter
from hf_scale.checkpoint.quantized import QUANTIZATION_FILE
from hf_scale.errors import HfScaleConfigError
from tests.distributed.adapter_checks import set_adapters
from tests.distributed.qlora_checks import LORA, init_lora, save_base
from tests.tiny_models import tiny_batch

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A QLoRA model (one process) with non-zero adapters, its logits on a batch, saved adapter-only."""
    root = tmp_path_factory.mktemp("merge_nf4")
    save_base(str(root / "base"))
    model = hf_scale.from_pretrained(str(root / "base"), {"strategy": "ddp"}, adapter=LORA, quantize="nf4")
    set_adapters(model.get_base_model(), init_lora)  # B non-zero: the merge changes every targeted weight
    batch = tiny_batch("causal", 2, seed=3)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    hf_scale.save_pretrained(model, root / "adapter")
    return root, model, batch, logits


def _merged_logits(root, batch, name, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    merge_adapter(root / "adapter", root / name, base=str(root / "base"), **kwargs)
    merged = AutoModelForCausalLM.from_pretrained(root / name)
    with torch.no_grad():
        return merged(input_ids=batch["input_ids"]).logits


def test_the_adapter_folder_records_its_nf4_weights(trained):
    from hf_scale.quantize.nf4 import is_nf4

    root, model, _, _ = trained
    record = json.loads((root / "adapter" / QUANTIZATION_FILE).read_text())
    nf4 = sorted(n.replace(".base_layer.", ".") for n, p in model.get_base_model().named_parameters() if is_nf4(p))
    assert record["weights"] == nf4 and len(nf4) == 14  # q, k, v, o, gate, up, down of 2 layers
    assert (record["quantize"], record["dtype"]) == ("nf4", "float32")
    assert record["scaler_block"] == dict.fromkeys(nf4, 256)  # each weight's (2 slices: whole groups of 256)


def test_merged_into_the_dequantized_base_it_is_the_trained_model(trained):
    root, _, batch, logits = trained
    into_nf4 = (_merged_logits(root, batch, "merged_nf4", dequantize=True) - logits).abs().max().item()
    into_full = (_merged_logits(root, batch, "merged_full") - logits).abs().max().item()
    assert into_nf4 < 2e-5, into_nf4
    assert into_full > 50 * max(into_nf4, 1e-6), (into_full, into_nf4)  # the quantization error, left in


def test_dequantize_needs_a_qlora_adapter(trained, tmp_path):
    root, _, _, _ = trained
    plain = hf_scale.from_pretrained(str(root / "base"), {"strategy": "ddp"}, adapter=LORA)
    hf_scale.save_pretrained(plain, tmp_path / "adapter")
    assert not (tmp_path / "adapter" / QUANTIZATION_FILE).exists()
    with pytest.raises(HfScaleConfigError, match="has no quantization.json: the adapter was not trained on an NF4"):
        merge_adapter(tmp_path / "adapter", tmp_path / "out", base=str(root / "base"), dequantize=True)


def test_dequantize_applies_with_merge_only(capsys):
    from hf_scale.cli import main

    assert main(["export", "ckpt", "out", "--dequantize"]) == 2
    assert "--base, --dtype and --dequantize apply with --merge only" in capsys.readouterr().err


def test_dequantize_follows_the_tp_split_recorded(tmp_path):
    """An adapter trained under tp records each split weight's dim and degree (``tp_split``): the
    round trip quantizes each tp slice alone, as the ranks did, which differs from the whole's."""
    from transformers import AutoModelForCausalLM

    from hf_scale.checkpoint.quantized import dequantized_base
    from hf_scale.quantize.nf4 import quantize_whole

    save_base(str(tmp_path / "base"))
    name, other = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    (tmp_path / QUANTIZATION_FILE).write_text(json.dumps(
        {"quantize": "nf4", "dtype": "float32", "weights": [name, other], "tp_split": {name: [1, 2]},
         "scaler_block": {name: 256, other: 128}}))  # each weight's scaler block, as the layout chose it
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    weight, k = (model.get_parameter(n).detach().clone() for n in (name, other))
    dequantized_base(model, tmp_path)
    slices = torch.cat([quantize_whole(w.contiguous()).get_original_weight() for w in weight.chunk(2, 1)], 1)
    assert torch.equal(model.get_parameter(name), slices)
    assert not torch.equal(slices, quantize_whole(weight).get_original_weight())
    assert torch.equal(model.get_parameter(other), quantize_whole(k, 128).get_original_weight())
    assert not torch.equal(model.get_parameter(other), quantize_whole(k, 256).get_original_weight())


def test_the_nf4_load_trims_the_heap(tmp_path, monkeypatch):
    """Loading an NF4 base gives the heap pages its freed temporaries held back (hf_scale.host_memory);
    a load without NF4 weights does not call it."""
    import hf_scale.host_memory

    calls = []
    monkeypatch.setattr(hf_scale.host_memory, "trim_heap", lambda: calls.append(1) or True)
    save_base(str(tmp_path / "base"))
    hf_scale.from_pretrained(str(tmp_path / "base"), {"strategy": "ddp"}, adapter=LORA)
    assert calls == []
    hf_scale.from_pretrained(str(tmp_path / "base"), {"strategy": "ddp"}, adapter=LORA, quantize="nf4")
    assert calls == [1]
