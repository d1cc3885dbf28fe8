"""Adapter checkpoints in one process: peft-format save, slice-wise load into a fresh model,
merge into a plain model, and the errors for bad input. (Layouts: tests/distributed/test_adapters.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")

import hf_scale  # noqa: E402
from hf_scale.errors import HfScaleCheckpointError, HfScaleConfigError  # noqa: E402
from tests.tiny_models import save_tiny_checkpoint, tiny_batch  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny base checkpoint and a LoRA adapter for it (random factors: a merge changes weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapter")
    base = save_tiny_checkpoint(root / "base", "llama")
    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**LORA))
    folder = hf_scale.save_pretrained(model, root / "adapter")
    return root, base, folder, model


def test_save_writes_peft_format(trained):
    _, base, folder, model = trained
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "checksums.sha256"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    saved = load_file(folder / "adapter_model.safetensors")
    want = get_peft_model_state_dict(model)  # what peft's own save_pretrained writes
    assert sorted(saved) == sorted(want)
    for key, value in want.items():
        assert torch.equal(saved[key], value), key


def test_from_pretrained_with_adapter_equals_peft(trained):
    _, base, folder, model = trained
    loaded = hf_scale.from_pretrained(base, adapter=str(folder))
    batch = tiny_batch("causal", 2)
    with torch.no_grad():
        want = model(**batch).logits
        got = loaded(**batch).logits
    assert torch.equal(got, want)
    assert all(not p.requires_grad for n, p in loaded.named_parameters() if "lora_" not in n)
    assert all(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)


def test_new_adapter_is_peft_initialised_and_seeded(trained):
    """A new adapter from a config: lora_B zero (peft's default), lora_A random, the same on
    every rank (a fixed seed, whatever the caller's RNG)."""
    _, base, _, _ = trained
    torch.manual_seed(0)
    a = hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    torch.manual_seed(1)
    b = hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    lora = {n: p for n, p in a.named_parameters() if "lora_" in n}
    assert len(lora) == 8  # 2 layers x (q, v) x (A, B)
    for name, p in lora.items():
        assert not p.is_meta
        if "lora_B" in name:
            assert not p.any(), name
        else:
            assert p.abs().sum() > 0, name
        assert torch.equal(p, dict(b.named_parameters())[name]), name


def test_merge_equals_peft_merge_and_unload_and_the_formula(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, folder, _ = trained
    out = hf_scale.merge_adapter(folder, tmp_path / "merged", base=base)
    merged = AutoModelForCausalLM.from_pretrained(out)
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder)).merge_and_unload()
    got, ref = merged.state_dict(), want.state_dict()
    assert sorted(got) == sorted(ref) and not any("lora" in k for k in got)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
    # and by LoRA's own formula, not peft's code: W + alpha / r * B @ A
    from safetensors.torch import load_file

    factors = load_file(folder / "adapter_model.safetensors")
    plain = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for layer in range(2):
        key = f"model.layers.{layer}.self_attn.q_proj"
        a, b = (factors[f"base_model.model.{key}.lora_{x}.weight"] for x in "AB")
        want = plain[f"{key}.weight"] + LORA["lora_alpha"] / LORA["r"] * b @ a
        assert not torch.equal(want, plain[f"{key}.weight"])
        torch.testing.assert_close(got[f"{key}.weight"], want, rtol=1e-6, atol=1e-6)


def test_export_merge_cli(trained, tmp_path):
    """hf-scale export --merge, base from the adapter config (a local folder here)."""
    from transformers import AutoModelForCausalLM

    _, base, folder, _ = trained
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    run = subprocess.run([sys.executable, "-m", "hf_scale.cli", "export", "--merge", str(folder), str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "merged into" in run.stdout
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")


def test_bad_adapter_inputs(trained, tmp_path):
    _, base, folder, _ = trained
    with pytest.raises(HfScaleConfigError, match="q_proj"):  # names what the model has
        hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["qkv"]})
    with pytest.raises(HfScaleCheckpointError, match="not a peft adapter folder"):
        hf_scale.from_pretrained(base, adapter=str(tmp_path))
    other = hf_scale.from_pretrained(base, adapter={"r": 2, "target_modules": "all-linear"})
    with pytest.raises(HfScaleCheckpointError, match="r=4"):
        hf_scale.load_adapter(other, folder)
    fewer = hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj"]})
    with pytest.raises(HfScaleCheckpointError, match="does not fit this model"):
        hf_scale.load_adapter(fewer, folder)


@pytest.mark.parametrize("init", [True, False])
def test_new_adapter_init_follows_peft_and_the_seed(trained, init):
    """init_lora_weights=False keeps nn.Linear's random init (lora_B non-zero too), not the
    uninitialised memory of a meta tensor made real; another seed gives another adapter."""
    _, base, _, _ = trained
    adapter = {"r": 4, "target_modules": ["q_proj"], "init_lora_weights": init}
    one = dict(hf_scale.from_pretrained(base, adapter=adapter, adapter_seed=1).named_parameters())
    again = dict(hf_scale.from_pretrained(base, adapter=adapter, adapter_seed=1).named_parameters())
    other = dict(hf_scale.from_pretrained(base, adapter=adapter, adapter_seed=2).named_parameters())
    for name, p in one.items():
        if "lora_" not in name:
            continue
        assert torch.equal(p, again[name]), name
        bound = 1 / p.shape[1] ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound; peft's A uses the same
        assert p.abs().max() <= bound + 1e-6, f"{name}: {float(p.abs().max())} is not an initialised value"
        if "lora_A" in name or not init:
            assert p.abs().sum() > 0 and not torch.equal(p, other[name]), name
        else:
            assert not p.any(), name


def test_modules_to_save_copy_starts_as_the_base_module(trained):
    """A recipe's modules_to_save: the trained copy is read from the base checkpoint (here the
    tied head, whose weights are the embedding's)."""
    _, base, _, _ = trained
    model = hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj"],
                                                    "modules_to_save": ["lm_head"]})
    params = dict(model.named_parameters())
    copy = next(p for n, p in params.items() if "lm_head.modules_to_save" in n)
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    assert copy.requires_grad and torch.equal(copy, embed)


def test_new_adapters_computed_from_the_base_are_refused(trained):
    _, base, _, _ = trained
    with pytest.raises(HfScaleConfigError, match="DoRA"):
        hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj"], "use_dora": True})
    with pytest.raises(HfScaleConfigError, match="pissa"):
        hf_scale.from_pretrained(base, adapter={"r": 4, "target_modules": ["q_proj"], "init_lora_weights": "pissa"})


def test_adapter_of_another_alpha_is_refused(trained):
    _, base, folder, _ = trained
    other = hf_scale.from_pretrained(base, adapter={"r": 4, "lora_alpha": 16, "target_modules": "all-linear"})
    with pytest.raises(HfScaleCheckpointError, match="lora_alpha"):
        hf_scale.load_adapter(other, folder)
