"""export_checkpoint / ``hf-scale export`` refuse a checkpoint whose shard bytes changed."""

from __future__ import annotations

import pytest

import hf_scale
from hf_scale import HfScaleCheckpointError
from hf_scale.checkpoint.export import export_checkpoint
from tests.harness import run_cli
from tests.tiny_models import tiny_model


@pytest.fixture
def corrupted(tmp_path):
    """A training checkpoint whose one model shard has one byte flipped in its tensor data."""
    model = hf_scale.parallelize(tiny_model("gpt2", "causal"))
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    hf_scale.save_state(model, optimizer, root=tmp_path / "ckpt", step=1)
    shards = sorted((tmp_path / "ckpt" / "step_00000001" / "model").glob("*.safetensors"))
    assert shards, "save_state wrote no model shard"
    shard = shards[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # the last tensor's bytes: the header still parses, the weights are wrong
    shard.write_bytes(bytes(data))
    return tmp_path / "ckpt" / "latest", shard.name


def test_export_refuses_a_corrupted_shard(corrupted, tmp_path):
    checkpoint, shard = corrupted
    with pytest.raises(HfScaleCheckpointError, match=rf"{shard}.*do not match checksums.sha256"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / ".out.partial").exists()  # the copy that failed its check is removed


def test_export_without_checksums_says_it_could_not_verify(corrupted, tmp_path, caplog):
    checkpoint, _ = corrupted
    from hf_scale.checkpoint.training_state import resolve_checkpoint

    (resolve_checkpoint(checkpoint) / "model" / "checksums.sha256").unlink()
    with caplog.at_level("WARNING", logger="hf_scale"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert "no checksums.sha256" in caplog.text and "not verified" in caplog.text


def test_export_command_refuses_a_corrupted_shard(corrupted, tmp_path):
    checkpoint, shard = corrupted
    done = run_cli("export", str(checkpoint), str(tmp_path / "out"), check=False)
    assert done.returncode == 2, done.stdout
    assert shard in done.stdout and "checksums.sha256" in done.stdout and "Traceback" not in done.stdout
    assert not (tmp_path / "out").exists()
