"""Fixtures for Hub tests: a local Hub server, huggingface_hub pointed at it, tiny checkpoints.

How huggingface_hub is pointed at the server: it reads ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
``HF_HUB_DISABLE_XET``, the cache and token paths into ``huggingface_hub.constants`` once, when
first imported (which ``import hf_scale`` / transformers already did, and ``tests/conftest.py``
set ``HF_HUB_OFFLINE=1`` before that). So :func:`point_hub_at` does both, undone after the test
by ``monkeypatch``:

* it sets the environment variables, which processes started by the test inherit (the 2-rank
  harness spawns fresh interpreters, which then read the right values on import);
* it sets the same values on ``huggingface_hub.constants`` for this process. Every code path the
  tests use reads them there at call time (``HfApi()`` takes ``constants.ENDPOINT`` when built,
  and hf_scale builds one per push).

Nothing else of huggingface_hub is patched: requests go through its real HTTP client to the server.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.hub_server import HubServer

TOKEN = "hf_test_SECRET_token_0123456789"


def point_hub_at(url: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point huggingface_hub (this process and its children) at ``url``, caching under ``home``."""
    from huggingface_hub import constants

    values = {  # environment variable -> (attribute of huggingface_hub.constants, value)
        "HF_ENDPOINT": ("ENDPOINT", url),
        "HF_HUB_OFFLINE": ("HF_HUB_OFFLINE", False),
        "HF_HUB_DISABLE_XET": ("HF_HUB_DISABLE_XET", True),
        "HF_HUB_DISABLE_TELEMETRY": ("HF_HUB_DISABLE_TELEMETRY", True),
        "HF_HUB_CACHE": ("HF_HUB_CACHE", str(home / "hub")),
        "HF_TOKEN_PATH": ("HF_TOKEN_PATH", str(home / "token")),
    }
    for var, (attr, value) in values.items():
        monkeypatch.setenv(var, "1" if value is True else "0" if value is False else value)
        monkeypatch.setattr(constants, attr, value)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub on 127.0.0.1 (token :data:`TOKEN` in ``HF_TOKEN``), huggingface_hub pointed at it."""
    with HubServer(tmp_path / "hub_server", token=TOKEN) as server:
        point_hub_at(server.url, tmp_path / "hf_home", monkeypatch)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield server
    assert not server.unrouted, f"huggingface_hub called APIs the test server lacks: {server.unrouted}"


@pytest.fixture
def closed_port_url() -> str:
    """A 127.0.0.1 URL nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny Llama saved by hf_scale.save_pretrained in 4 shards (with index and checksums)."""
    import hf_scale
    from tests.tiny_models import tiny_model

    folder = hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "out", max_shard_size=12_000)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


ADAPTER_BASE = "org/tiny-base"


def save_adapter(folder: Path, base_name: str | None = ADAPTER_BASE, task_type: str | None = "CAUSAL_LM") -> Path:
    """A LoRA adapter (r=4, alpha=8, on q_proj and v_proj) of a tiny Llama, as peft's
    ``save_pretrained`` writes it (its placeholder README.md included). ``base_name``: the
    base's ``name_or_path`` (as ``from_pretrained(base_name)`` sets it), recorded by peft."""
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import tiny_model

    model = tiny_model("llama", "causal")
    model.name_or_path = base_name or ""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"], task_type=task_type,
                        init_lora_weights=False)  # random A and B: a round trip that drops weights shows
    get_peft_model(model, config).save_pretrained(folder, save_embedding_layers=False)  # no base lookup
    return folder


@pytest.fixture
def adapter(tmp_path) -> Path:
    """A LoRA adapter folder of base :data:`ADAPTER_BASE`, saved by peft (see :func:`save_adapter`)."""
    return save_adapter(tmp_path / "adapter")
