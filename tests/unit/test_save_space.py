"""Saves onto a disk without room: one clear error naming needed and free bytes, no partial
folder left behind, ``latest`` still on the previous checkpoint; and keyword-only options."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import hf_scale
from hf_scale import HfScaleCheckpointError
from hf_scale.checkpoint.training_state import complete_checkpoints
from tests.tiny_models import tiny_batch, tiny_model

NO_SPACE = r"no space left for .*: the save needs .* \(([\d,]+) bytes\), the disk of .* has .* \(([\d,]+) bytes\) free"


@pytest.fixture(scope="module")
def trained():
    model = hf_scale.parallelize(tiny_model("llama", "causal"))
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    model(**tiny_batch("causal", 2)).loss.backward()
    optimizer.step()
    return model, optimizer


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".partial", ".old")))


def _numbers(message: str) -> tuple[int, int]:
    needed, free = re.search(NO_SPACE, message).groups()
    return int(needed.replace(",", "")), int(free.replace(",", ""))


def test_free_space_is_checked_before_writing(trained, tmp_path, monkeypatch):
    model, optimizer = trained
    root, out = tmp_path / "ckpt", tmp_path / "out"
    hf_scale.save_state(model, optimizer, root=root, step=1)
    hf_scale.save_pretrained(model, out)
    weights = (out / "model.safetensors").read_bytes()
    full = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: type(full)(full.total, full.total - 1000, 1000))

    with pytest.raises(HfScaleCheckpointError, match=NO_SPACE) as state_error:
        hf_scale.save_state(model, optimizer, root=root, step=2)
    with pytest.raises(HfScaleCheckpointError, match=NO_SPACE) as model_error:
        hf_scale.save_pretrained(model, out)

    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001"]
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert _leftovers(root) == [] and _leftovers(tmp_path) == []
    assert (out / "model.safetensors").read_bytes() == weights
    # The byte counts are the real ones: the model's files, plus the optimizer state for save_state
    # (estimated: DCP's framing of each tensor is a few KB on this tiny model).
    needed, free = _numbers(str(state_error.value))
    assert free == 1000 and needed == pytest.approx(_bytes(root / "step_00000001"), rel=0.15)
    needed, _ = _numbers(str(model_error.value))
    assert needed == (out / "model.safetensors").stat().st_size


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes)`` mounts a tmpfs of that size (root only; skipped where not allowed)."""
    mounted = []

    def mount(size: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


def test_a_real_full_disk(trained, tmp_path, small_disk, monkeypatch):
    """Room for one checkpoint, not two: the second is refused up front; when the free space is
    misreported (another writer filled the disk meanwhile) the write itself hits ENOSPC, and
    the result is the same clear error with the disk cleaned up."""
    model, optimizer = trained
    hf_scale.save_state(model, optimizer, root=tmp_path / "probe", step=1)
    one = _bytes(tmp_path / "probe" / "step_00000001")
    disk = small_disk(int(one * 1.6))
    root = disk / "ckpt"
    hf_scale.save_state(model, optimizer, root=root, step=1)

    with pytest.raises(HfScaleCheckpointError, match=NO_SPACE):
        hf_scale.save_state(model, optimizer, root=root, step=2)  # refused by the check
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10**12))
    with pytest.raises(HfScaleCheckpointError, match="no space left for") as error:
        hf_scale.save_state(model, optimizer, root=root, step=2)  # ENOSPC while writing
    assert isinstance(error.value.__cause__, OSError)  # here in the optimizer state (DCP)
    filler = disk / "filler"
    filler.write_bytes(b"x" * (real(disk).free - 20_000))  # room for less than the weights
    with pytest.raises(HfScaleCheckpointError, match="no space left for") as error:
        hf_scale.save_pretrained(model, disk / "export")  # ENOSPC in the weights' own writes
    assert isinstance(error.value.__cause__, OSError)
    filler.unlink()

    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001"]
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert _leftovers(root) == [] and _leftovers(disk) == [] and not (disk / "export").exists()
    monkeypatch.undo()
    assert real(disk).free > 0.5 * one  # what the failed saves wrote was removed


def test_optional_arguments_are_keyword_only(trained, tmp_path, monkeypatch):
    """``save_state(model, optimizer, "ckpt", step=5)`` used to bind "ckpt" to ``scheduler``
    and fail on rank 0 after the weights were written."""
    model, optimizer = trained
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="positional"):
        hf_scale.save_state(model, optimizer, "ckpt", step=5)
    with pytest.raises(TypeError, match="positional"):
        hf_scale.load_state(model, optimizer, None, "ckpt/latest")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_accepts_nothing_is_a_full_disk_not_a_hang(trained, tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(HfScaleCheckpointError, match="no space left"):
        hf_scale.save_pretrained(trained[0], tmp_path / "model")
    assert not (tmp_path / "model").exists() and _leftovers(tmp_path) == []


def test_a_failed_swap_puts_the_previous_folder_back(tmp_path, monkeypatch):
    from hf_scale.checkpoint.files import swap_into_place

    final, tmp = tmp_path / "model", tmp_path / ".model.partial"
    final.mkdir()
    (final / "old.txt").write_text("previous")
    tmp.mkdir()
    real_rename = Path.rename

    def rename(self, target):
        if self == tmp:
            raise OSError(5, "I/O error")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        swap_into_place(tmp, final)
    assert (final / "old.txt").read_text() == "previous" and not (tmp_path / ".model.old").exists()
