"""Checkpoint layout bookkeeping and one-process saves (no process group)."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

import hf_scale
from hf_scale import HfScaleCheckpointError
from hf_scale.checkpoint import safetensors_io
from hf_scale.checkpoint.shard_layout import TensorSpec, contiguous_runs, parse_size, plan_files
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


# ------------------------------------------------------------------ boxes of a DTensor block

def _placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "S0": Shard(0), "S1": Shard(1), "R": Replicate(),
        "SS0/2": _StridedShard(0, split_factor=2), "SS1/2": _StridedShard(1, split_factor=2),
        "SS0/3": _StridedShard(0, split_factor=3),
    }


# (global shape, mesh shape, placements): plain shards, uneven ones, and FSDP2's own
# (dp _StridedShard(d, sf=tp), tp Shard(d)) layout, even and uneven
ONE_BOX = [
    ((8, 4), (2, 2), ("SS0/2", "S0")), ((10, 3), (2, 2), ("SS0/2", "S0")), ((7, 3), (2, 2), ("SS0/2", "S0")),
    ((5, 6), (2, 2), ("SS0/2", "S0")), ((4, 10), (2, 2), ("SS1/2", "S1")), ((6, 4), (2, 2), ("S0", "S1")),
    ((6, 5), (2, 2), ("S1", "S0")), ((9, 4), (2, 2), ("S0", "S0")), ((4, 6), (2, 2), ("R", "S1")),
    ((3, 4), (4,), ("S0",)), ((12, 6), (2, 2, 2), ("R", "SS0/2", "S0")), ((5,), (2,), ("S0",)),
]


@pytest.mark.parametrize("global_shape, mesh_shape, names", ONE_BOX)
def test_layout_boxes_match_torch_where_a_block_is_one_box(global_shape, mesh_shape, names):
    """Where torch's single offset is right (no packed placement), the boxes are that one block."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from hf_scale.checkpoint.boxes import layout_boxes

    placements = [_placements()[n] for n in names]
    for coord in itertools.product(*map(range, mesh_shape)):
        boxes = layout_boxes(global_shape, mesh_shape, list(coord), placements)
        shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), placements)
        if math.prod(shape) == 0:
            assert boxes == []
            continue
        assert [(b.offset, b.shape) for b in boxes] == [(tuple(offset), tuple(shape))], coord
        assert boxes[0].local == tuple(slice(0, n) for n in shape)


def test_layout_boxes_of_a_packed_slice_are_its_parts():
    """Fused q;k;v (12 rows) with _StridedShard(0, sf=3) on 2 ranks: rank 1 holds rows 2:4, 6:8,
    10:12 (torch gives the single offset 2); on a 2 x 2 (dp, tp) FSDP2 mesh the dp shard is cut
    from the tp rank's [q_r; k_r; v_r] (FSDP2's marker sf=2 on dp)."""
    from hf_scale.checkpoint.boxes import layout_boxes

    p = _placements()
    boxes = layout_boxes((12, 2), (2,), [1], [p["SS0/3"]])
    assert [(b.local[0], b.offset, b.shape) for b in boxes] == [
        (slice(0, 2), (2, 0), (2, 2)), (slice(2, 4), (6, 0), (2, 2)), (slice(4, 6), (10, 0), (2, 2))]
    full = np.arange(24)  # q 0:8, k 8:16, v 16:24; tp rank r: q[4r:4r+4], k[..], v[..]
    for dp, tp in itertools.product(range(2), range(2)):
        tp_local = np.concatenate([full[8 * part + 4 * tp : 8 * part + 4 * tp + 4] for part in range(3)])
        dp_local = np.array_split(tp_local, 2)[dp]  # FSDP2 chunks the tp-local rows
        boxes = layout_boxes((24,), (2, 2), [dp, tp], [p["SS0/2"], p["SS0/3"]])
        got = np.concatenate([full[b.offset[0] : b.offset[0] + b.shape[0]] for b in boxes])
        assert np.array_equal(got, dp_local), (dp, tp)
        assert [b.local[0].start for b in boxes] == list(np.cumsum([0] + [b.shape[0] for b in boxes[:-1]]))


# ------------------------------------------------------------------ the latest pointer

def test_crash_while_pointing_latest_leaves_the_previous_pointer(tmp_path, monkeypatch):
    """``latest`` lies outside the staged folder: a crash while replacing it (here os.replace
    of the pointer fails) must leave it naming the previous complete checkpoint, readable."""
    import os

    from hf_scale.checkpoint import state as state_module

    model = hf_scale.parallelize(tiny_model("gpt2", "causal"))
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    hf_scale.save_state(model, optimizer, root=tmp_path, step=1)
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    real = os.replace

    def crash_on_pointer(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "latest":
            raise OSError("power cut (simulated)")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(state_module.os, "replace", crash_on_pointer)
    with pytest.raises(OSError, match="simulated"):
        hf_scale.save_state(model, optimizer, root=tmp_path, step=2)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_00000001\n"  # whole, and the old name
    assert state_module.resolve_checkpoint(tmp_path / "latest").name == "step_00000001"
    hf_scale.save_state(model, optimizer, root=tmp_path, step=3)  # the stale temporary file is no obstacle
    assert state_module.resolve_checkpoint(tmp_path / "latest").name == "step_00000003"


def test_a_torn_latest_pointer_falls_back_to_the_newest_checkpoint(tmp_path):
    from hf_scale.checkpoint import state as state_module

    for step in (1, 2):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text("step_000")  # a pointer cut short
    assert state_module.resolve_checkpoint(tmp_path / "latest").name == "step_00000002"
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text(f"../{outside.name}")  # never a folder outside the root
    assert state_module.resolve_checkpoint(tmp_path / "latest").name == "step_00000002"


def test_auto_shard_size_gives_each_rank_a_file_to_hash():
    """``max_shard_size="auto"``: as many files as ranks (SmolLM2's 538 MB at 2 ranks: 2 files),
    none under ~100 MB (a tiny model stays one file), none over 5 GB, packed in order."""
    smollm2 = [TensorSpec("model.embed_tokens.weight", (49152, 576), torch.float32)] + [
        TensorSpec(f"model.layers.{i}.w{j}", (1536, 576), torch.float32) for i in range(30) for j in range(4)]
    total = sum(t.nbytes for t in smollm2)
    for ranks, count in [(1, 1), (2, 2), (4, 4)]:
        files = plan_files(smollm2, "auto", ranks)
        assert len(files) == count, ranks
        assert [t.name for f in files for t in f.tensors] == [t.name for t in smollm2]
        sizes = [sum(t.nbytes for t in f.tensors) for f in files]
        assert max(sizes) <= total / count + smollm2[0].nbytes  # balanced up to one tensor
    tiny = [TensorSpec(f"w{i}", (64, 64), torch.float32) for i in range(8)]
    assert [f.name for f in plan_files(tiny, "auto", 4)] == ["model.safetensors"]
    big = [TensorSpec(f"w{i}", (50_000, 10_000), torch.float32) for i in range(8)]  # 8 x 2 GB
    assert all(sum(t.nbytes for t in f.tensors) <= 5 * 10**9 for f in plan_files(big, "auto", 2))
    odd = [TensorSpec(f"w{i}", (75_000, 10_000), torch.float32) for i in range(3)]  # 3 x 3 GB: no two fit 5 GB
    assert [sum(t.nbytes for t in f.tensors) for f in plan_files(odd, "auto", 2)] == [3e9] * 3
