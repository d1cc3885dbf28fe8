"""Runs on each of 2 ranks: fsdp, save_pretrained, then push_to_hub from every rank (rank 0 pushes)."""

from __future__ import annotations

import os

import hf_scale
from hf_scale.errors import HfScaleError
from tests.tiny_models import tiny_model


def save_and_push(root: str, repo_id: str, wrong_token: str) -> dict:
    """Push a saved fsdp checkpoint, then two failing pushes; return what this rank saw."""
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"strategy": "fsdp"})
    folder = hf_scale.save_pretrained(model, os.path.join(root, "out"), max_shard_size=12_000)
    card = {"base_model": "org/base", "strategy": "fsdp", "mesh": {"dp_shard": 2}, "world_size": 2}
    url = hf_scale.push_to_hub(folder, repo_id, private=True, card=card)
    errors = {}
    for case, kwargs in {"bad_id": {"repo_id": "not a repo id"},
                         "refused": {"repo_id": repo_id, "token": wrong_token}}.items():
        try:
            hf_scale.push_to_hub(folder, **kwargs)
        except HfScaleError as e:
            errors[case] = (type(e).__name__, str(e))
    return {"folder": str(folder), "url": url, "errors": errors}
