"""Where zoo:smollm2's de-quantized copy lives (the copy itself is checked against the GGUF load
in tests/integration/test_real_models.py)."""

from __future__ import annotations

import json
import tempfile

import pytest

from hf_scale import zoo
from hf_scale.errors import HfScaleConfigError


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """A cache home that is a file (no folder can be made in it, root or not) and a temp folder."""
    (tmp_path / "home-is-a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-is-a-file"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return zoo.zoo_cache_roots()


def test_an_unwritable_cache_home_falls_back_to_the_temporary_folder(roots, tmp_path):
    assert roots[1] == tmp_path / "tmp" / "hf_scale_zoo"
    assert zoo._writable(roots) == roots[1] and roots[1].is_dir()


def test_a_complete_copy_is_read_not_made_again(roots, monkeypatch):
    made = []
    monkeypatch.setattr(zoo, "_convert", lambda entry, gguf, folder, key: made.append(folder) or
                        (folder.mkdir(parents=True), (folder / zoo._DONE).write_text(json.dumps({"source": key}))))
    first = zoo.converted_folder("zoo:smollm2")
    assert made == [first] and first.parent == roots[1]
    assert zoo.converted_folder("zoo:smollm2") == first and made == [first]  # found, not made again


def test_no_writable_place_is_one_clear_error(roots):
    with pytest.raises(HfScaleConfigError, match="cannot write the de-quantized zoo model.*XDG_CACHE_HOME"):
        zoo._writable(roots[:1])
