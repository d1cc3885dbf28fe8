"""Model cards for checkpoints trained with hf_scale: :class:`CardInfo` -> ``README.md``.

The card is rendered with huggingface_hub's ``ModelCard.from_template`` from a Jinja template:
``hf_scale/hub/templates/default.md`` (shipped in the package) unless told otherwise. The
repository's ``model_cards/`` holds an identical copy to start your own from, and
``model_cards/README.md`` lists the variables. Its YAML header (``ModelCardData``) carries
what the Hub indexes: base model, datasets, license, ``library_name: transformers``, the
pipeline tag and the tags ``hf-scale`` and the strategy. The body gives the parallel layout,
hyperparameters, training time, tokens seen, final metrics, the loss curve when its image is
in the folder, and how to load the model.

A PEFT adapter folder (``adapter_config.json``, no base weights: ``hub/adapter.py``) gets the
Hub's adapter conventions instead, from ``templates/adapter.md``: ``library_name: peft``, the
base model from the adapter config, the tags ``base_model:adapter:<base>``, ``lora`` and
``transformers`` as peft's own cards have them, and a body giving the adapter (method, ``r``,
``lora_alpha``, target modules) and how to load it on its base with peft or hf_scale.

Usage::

    info = CardInfo(base_model="HuggingFaceTB/SmolLM2-135M", datasets=["yahma/alpaca-cleaned"],
                    strategy="fsdp", mesh={"dp_shard": 8}, world_size=8,
                    hyperparameters={"lr": 2e-5}, train_metrics={"loss": 1.23})
    write_model_card("out/", info)            # -> out/README.md
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import from_dict
from ..errors import HfScaleConfigError
from ..log import log_rank0
from .adapter import adapter_tags, base_model_of, head_names, read_adapter_config, template_config

TEMPLATES = Path(__file__).resolve().parent / "templates"  # package data (pyproject.toml)
DEFAULT_TEMPLATE = TEMPLATES / "default.md"
ADAPTER_TEMPLATE = TEMPLATES / "adapter.md"  # the default for a PEFT adapter folder
VARIABLES_DOC = "model_cards/README.md in the hf_scale repository"

# the model's head (from config.json's architectures) -> (pipeline tag, Auto class to load it)
HEADS = {
    "ForCausalLM": ("text-generation", "AutoModelForCausalLM"),
    "ForSequenceClassification": ("text-classification", "AutoModelForSequenceClassification"),
    "ForConditionalGeneration": ("text2text-generation", "AutoModelForSeq2SeqLM"),
    "ForTokenClassification": ("token-classification", "AutoModelForTokenClassification"),
    "ForMaskedLM": ("fill-mask", "AutoModelForMaskedLM"),
}


@dataclasses.dataclass
class CardInfo:
    """What a model card says about one training run; every field is optional.

    Attributes:
        model_name: the card's title (default: the repo name, else the folder name).
        base_model: Hub id of the pretrained model that was fine-tuned (an adapter folder's
            default: ``base_model_name_or_path`` of its ``adapter_config.json``).
        repo_id: where the model is pushed, for the loading snippet (``push_to_hub`` fills it).
        datasets: Hub ids of the training datasets.
        license: a Hub license id (``apache-2.0``, ``mit``, ``other``, ...).
        language: language codes (``en``, ...).
        pipeline_tag: the Hub task; default: from the head in ``config.json``
            (``...ForCausalLM`` -> ``text-generation``), or an adapter's ``task_type``.
        tags: extra tags, added to ``hf-scale`` and the strategy.
        description: a paragraph placed under the title.
        strategy: the hf_scale strategy (``fsdp``, ``zero2``, ``zero1``, ``ddp``, ``hsdp``).
        mesh: mesh sizes, e.g. ``{"dp_replicate": 2, "dp_shard": 4}``.
        world_size: number of processes.
        plan_source: where the parallel plans applied came from, e.g. ``{"tp_plan": "inferred,
            checked", "pp_plan": "transformers"}`` (``transformers``, ``registry:<type>``,
            ``user``, ``inferred``).
        hyperparameters: name -> value, shown as a table.
        training_time_seconds: wall-clock training time.
        tokens_seen: training tokens processed.
        train_metrics / eval_metrics: final metrics, name -> value.
        loss_curve: file name of a loss-curve image in the checkpoint folder (``loss_curve.png``);
            embedded when the file is there.
    """

    model_name: str | None = None
    base_model: str | None = None
    repo_id: str | None = None
    datasets: list[str] = dataclasses.field(default_factory=list)
    license: str | None = None
    language: list[str] = dataclasses.field(default_factory=list)
    pipeline_tag: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)
    description: str | None = None
    strategy: str | None = None
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    world_size: int | None = None
    plan_source: dict[str, str] = dataclasses.field(default_factory=dict)
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    training_time_seconds: float | None = None
    tokens_seen: int | None = None
    train_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    loss_curve: str | None = None


def as_card_info(info: CardInfo | Mapping[str, Any]) -> CardInfo:
    """A CardInfo from itself or a dict of its fields (an unknown key is an HfScaleConfigError)."""
    if isinstance(info, CardInfo):
        return info
    if isinstance(info, Mapping):
        return from_dict(CardInfo, dict(info), path="card")
    raise HfScaleConfigError(f"card info must be a CardInfo or a dict, got {type(info).__name__}.")


def write_model_card(
    folder: str | Path, info: CardInfo | Mapping[str, Any], *, template: str | Path | None = None
) -> Path:
    """Render ``folder/README.md`` from ``info`` and a template; return its path.

    ``template`` is a Jinja file as ``ModelCard.from_template`` takes it (default:
    :data:`DEFAULT_TEMPLATE`, or :data:`ADAPTER_TEMPLATE` for a PEFT adapter folder; both
    shipped in the package). The Hub validates the YAML header when the card is pushed.

    Usage::

        write_model_card("out/", {"base_model": "gpt2", "strategy": "fsdp", "world_size": 2})
    """
    from huggingface_hub import ModelCard, ModelCardData

    info, folder = as_card_info(info), Path(folder)
    if not folder.is_dir():
        raise HfScaleConfigError(f"cannot write a model card into {folder}: it is not a folder.")
    adapter = read_adapter_config(folder)
    default = ADAPTER_TEMPLATE if adapter else DEFAULT_TEMPLATE
    template = check_template(template if template is not None else default, "template=")
    if adapter:
        info = dataclasses.replace(info, base_model=info.base_model or base_model_of(adapter))
    pipeline_tag, auto_class = head_of(head_names(adapter) if adapter else _architectures(folder))
    tags = ["hf-scale", *([info.strategy] if info.strategy else []),
            *(adapter_tags(adapter, info.base_model) if adapter else []), *info.tags]
    data = ModelCardData(
        base_model=info.base_model, datasets=info.datasets or None, license=info.license,
        language=info.language or None, library_name="peft" if adapter else "transformers",
        pipeline_tag=info.pipeline_tag or pipeline_tag, tags=list(dict.fromkeys(tags)),
    )
    variables = _template_vars(info, folder, auto_class)
    variables["adapter_config"] = template_config(adapter) if adapter else None
    card = ModelCard.from_template(data, template_path=str(template), **variables)
    path = folder / "README.md"
    card.save(path)
    return path


def check_template(template: str | Path, where: str) -> Path:
    """``template`` as a Path once it is a readable Jinja file (HfScaleConfigError otherwise).

    ``where`` names the setting that gave it (``hub.card_template``), for the message. Called
    when a recipe is loaded, so a bad template fails before training rather than after.
    """
    import jinja2

    path = Path(template)
    if not path.is_file():
        raise HfScaleConfigError(
            f"model card template {str(path)!r} ({where}) does not exist: give the path of a "
            f"Jinja markdown file, e.g. a copy of {DEFAULT_TEMPLATE.name} from model_cards/ (see "
            f"{VARIABLES_DOC} for the variables it gets)."
        )
    try:
        jinja2.Environment().parse(path.read_text(encoding="utf-8"))
    except jinja2.TemplateSyntaxError as e:
        raise HfScaleConfigError(
            f"model card template {str(path)!r} ({where}): Jinja syntax error on line {e.lineno}: "
            f"{e.message}. Fix the template (see {VARIABLES_DOC} for the variables it gets)."
        ) from None
    except UnicodeDecodeError as e:
        raise HfScaleConfigError(
            f"model card template {str(path)!r} ({where}) is not UTF-8 text ({e.reason}): give a markdown file."
        ) from None
    return path


def validate_card(path: Path, endpoint: str) -> None:
    """The Hub's check of a card's YAML metadata (HfScaleConfigError listing its complaints)."""
    from huggingface_hub import ModelCard

    try:
        ModelCard.load(path).validate()
    except ValueError as e:
        try:
            said = "; ".join(err["message"] for err in json.loads(str(e))["errors"])
        except (ValueError, KeyError, TypeError):
            said = " ".join(str(e).split())
        raise HfScaleConfigError(
            f"the Hub at {endpoint} rejected the metadata of {path}: {said}. Fix the card info "
            "(CardInfo / card=) and push again."
        ) from None


def _architectures(folder: Path) -> list[str]:
    """The ``architectures`` named in ``folder/config.json`` (none without one)."""
    config = folder / "config.json"
    return (json.loads(config.read_text()).get("architectures") if config.is_file() else None) or []


def head_of(architectures: list[str]) -> tuple[str | None, str]:
    """(pipeline tag, Auto class) for the first class name that ends in a head of :data:`HEADS`."""
    for arch in architectures:
        for suffix, head in HEADS.items():
            if arch.endswith(suffix):
                return head
    return None, "AutoModel"


def _template_vars(info: CardInfo, folder: Path, auto_class: str) -> dict[str, Any]:
    loss_curve = info.loss_curve
    if loss_curve and not (folder / loss_curve).is_file():
        log_rank0(f"model card: {loss_curve} is not in {folder}; the card has no loss curve.")
        loss_curve = None
    from .. import __version__

    return {
        **dataclasses.asdict(info),
        "model_name": info.model_name or (info.repo_id or folder.resolve().name).split("/")[-1],
        "repo_id": info.repo_id or str(folder),
        "auto_class": auto_class,
        "training_time": format_duration(info.training_time_seconds),
        "tokens_seen": f"{info.tokens_seen:,}" if info.tokens_seen is not None else None,
        "loss_curve": loss_curve,
        "hf_scale_version": __version__,
    }


def format_duration(seconds: float | None) -> str | None:
    """``3725.0`` -> ``"1h 02m 05s"`` (None stays None)."""
    if seconds is None:
        return None
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
