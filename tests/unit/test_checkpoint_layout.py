"""Checkpoint layout bookkeeping and one-process saves (no process group)."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

import hf_scale
from hf_scale import HfScaleCheckpointError
from hf_scale.checkpoint import safetensors_io
from hf_scale.checkpoint.layout import TensorSpec, contiguous_runs, parse_size, plan_files
from tests.tiny_models import AUTO, tiny_batch, tiny_model


@pytest.mark.parametrize(
    "global_shape, local_shape, offset",
    [((6, 4), (3, 4), (3, 0)), ((6, 4), (6, 2), (0, 2)), ((4, 3, 5), (2, 3, 2), (2, 0, 3)), ((7,), (3,), (4,)), ((), (), ())],
)
def test_contiguous_runs_place_a_block_exactly(global_shape, local_shape, offset):
    full = np.arange(math.prod(global_shape)).reshape(global_shape)
    block = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))].reshape(-1)
    flat, out = full.reshape(-1), np.full(full.size, -1)
    for g, l, n in contiguous_runs(local_shape, offset, global_shape):
        out[g : g + n] = block[l : l + n]
    assert np.array_equal(out[out >= 0], np.sort(block)) and (out >= 0).sum() == block.size
    assert np.array_equal(out[out >= 0], flat[out >= 0])


def test_files_are_named_and_packed_like_transformers():
    specs = [TensorSpec(f"w{i}", (10, 10), torch.float32) for i in range(5)]  # 400 bytes each
    files = plan_files(specs, 1000)
    assert [f.name for f in files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert [len(f.tensors) for f in files] == [2, 2, 1]
    assert plan_files(specs, "5GB")[0].name == "model.safetensors"
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size(7) == 7
    with pytest.raises(HfScaleCheckpointError, match="max_shard_size='lots' is not a size"):
        parse_size("lots")


def test_header_is_valid_safetensors(tmp_path):
    model = tiny_model("gpt2", "causal")
    folder = hf_scale.save_pretrained(model, tmp_path / "m", max_shard_size=30000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for name, file in index["weight_map"].items():
        with safe_open(folder / file, framework="pt") as f:
            assert torch.equal(f.get_tensor(name), model.state_dict()[name])
    assert "lm_head.weight" not in index["weight_map"]  # tied to transformer.wte.weight


def test_crash_mid_save_leaves_the_previous_folder_intact(tmp_path, monkeypatch):
    first = tiny_model("llama", "causal", seed=1)
    folder = hf_scale.save_pretrained(first, tmp_path / "out")

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors_io, "_write_my_bytes", crash)
    with pytest.raises(OSError, match="simulated"):
        hf_scale.save_pretrained(tiny_model("llama", "causal", seed=2), tmp_path / "out")
    reloaded = AUTO["causal"].from_pretrained(folder)
    for (name, p), q in zip(reloaded.named_parameters(), first.parameters()):
        assert torch.equal(p, q), name
    monkeypatch.undo()
    hf_scale.save_pretrained(tiny_model("llama", "causal", seed=2), tmp_path / "out")  # a later save succeeds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # and leaves no partial folder behind


def test_tokenizer_and_generation_config_saved(tmp_path):
    from transformers import AutoTokenizer

    from hf_scale.zoo import minilm_dir

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    folder = hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "m", tokenizer=tokenizer)
    assert (folder / "generation_config.json").exists()
    assert AutoTokenizer.from_pretrained(folder)("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    with torch.no_grad():
        assert AUTO["causal"].from_pretrained(folder)(**tiny_batch("causal", 1)).logits.shape == (1, 16, 128)


def test_save_without_checksums(tmp_path):
    folder = hf_scale.save_pretrained(tiny_model("gpt2", "causal"), tmp_path / "m", checksums=False)
    assert not (folder / "checksums.sha256").exists()
    assert AUTO["causal"].from_pretrained(folder) is not None
