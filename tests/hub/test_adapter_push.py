"""``hf-scale push`` of a PEFT adapter folder to the local Hub server: no config.json needed,
the adapter card replaces peft's placeholder, and peft loads the pushed adapter back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, snapshot_download
from safetensors.torch import load_file

from hf_scale.errors import HfScaleCheckpointError
from hf_scale.hub import main, push_to_hub
from hf_scale.hub.upload import LOSS_CURVE
from tests.hub.conftest import ADAPTER_BASE
from tests.tiny_models import tiny_model

REPO = "org/tiny-lora"


def test_push_an_adapter_folder(hub, adapter, capsys, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    shutil.copy(adapter / "adapter_config.json", adapter / "tokenizer_config.json")  # any extra file goes too
    (adapter / LOSS_CURVE).write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main([str(adapter), REPO]) == 0  # hf-scale push FOLDER REPO
    assert capsys.readouterr().out.strip() == f"{hub.url}/{REPO}/commit/{hub.repos[REPO].branches['main']}"
    files = hub.files(REPO)
    local = {p.name: p.read_bytes() for p in adapter.iterdir()}
    assert files == local | {".gitattributes": files[".gitattributes"]}
    assert set(local) == {"adapter_config.json", "adapter_model.safetensors", "README.md", LOSS_CURVE,
                          "tokenizer_config.json"}
    assert [c.paths[-1] for c in hub.commits if c.repo == REPO] == ["adapter_config.json"]  # committed last
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "peft" and card.data.base_model == ADAPTER_BASE
    assert card.data.tags == ["hf-scale", f"base_model:adapter:{ADAPTER_BASE}", "lora", "transformers"]
    assert "[More Information Needed]" not in card.text and f"![Training loss]({LOSS_CURVE})" in card.text
    assert f'PeftModel.from_pretrained(base, "{REPO}")' in card.text

    # downloaded first: peft's file_exists uses huggingface_hub's module-level HfApi, whose
    # endpoint was fixed at import, before the fixture pointed huggingface_hub at the local Hub
    pulled = Path(snapshot_download(REPO, cache_dir=tmp_path / "dl"))
    model = PeftModel.from_pretrained(tiny_model("llama", "causal"), pulled)
    pushed = get_peft_model_state_dict(model, save_embedding_layers=False)
    saved = load_file(adapter / "adapter_model.safetensors")
    assert sorted(pushed) == sorted(saved) and len(saved) == 8  # q and v, A and B, 2 layers
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name


@pytest.mark.parametrize("break_it, message", [
    (lambda f: [p.unlink() for p in f.iterdir() if p.name != "README.md"],
     "no config.json, so it is not a complete checkpoint, and no adapter_config.json, so it is not a PEFT adapter"),
    (lambda f: (f / "adapter_model.safetensors").rename(f / "adapter_model.bin"),
     "no adapter_model.safetensors. It holds adapter_model.bin"),
    (lambda f: (f / "adapter_model.safetensors").write_bytes((f / "adapter_model.safetensors").read_bytes()[:-8]),
     "truncated"),
    (lambda f: (f / "adapter_config.json").write_text('{"r": 4}'), "has no peft_type"),
])
def test_a_broken_adapter_folder_is_refused_before_any_request(hub, adapter, break_it, message):
    break_it(adapter)
    with pytest.raises(HfScaleCheckpointError, match=message):
        push_to_hub(adapter, REPO)
    assert hub.requests == []
