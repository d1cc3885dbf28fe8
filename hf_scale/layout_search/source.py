"""Where the planner reads a model from, without weights: a config.json (or its folder), a Hub id
from the local cache only, a recipe (.yaml: its model, and its sequence length, batch and
parallel settings), a ``PretrainedConfig`` or a model object.

Usage::

    config, recipe = read_source("configs/quickstart.yaml")   # recipe: the JobConfig, or None
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import HfScaleConfigError


def read_source(source):
    """``(config or model, job)``: what :func:`.profile.model_facts` takes, and the recipe's
    ``JobConfig`` when ``source`` is a recipe (else None)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, (nn.Module, PretrainedConfig)):
        return source, None
    name = str(source)
    if name.endswith((".yaml", ".yml")):
        from ..train.config import load_job
        from ..train.model import read_model_config

        job = load_job(name, [])
        return read_model_config(job.model), job
    path = Path(name)
    if path.is_file() and path.suffix == ".json":
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HfScaleConfigError(f"{name!r} has no config.json: give a model folder, its config.json, "
                                     "a recipe .yaml or a Hub id in the local cache.")
        return AutoConfig.from_pretrained(str(path)), None
    from ..zoo import is_zoo

    if is_zoo(name):
        from ..train.config import ModelConfig
        from ..train.model import read_model_config

        return read_model_config(ModelConfig(name_or_path=name)), None
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), None
    except (OSError, ValueError) as e:
        raise HfScaleConfigError(
            f"cannot read the config of {name!r} offline: it is not a local folder, config.json or recipe, "
            f"and not in the local Hugging Face cache ({' '.join(str(e).split())[:160]}). Download it first "
            "(`hf download ID config.json`) or give its config.json."
        ) from None
