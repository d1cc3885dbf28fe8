"""Experiment trackers: ``train.report_to`` sends a run's config and metrics to TensorBoard,
Weights & Biases, MLflow and trackio, through each library's own API, on rank 0 only.

One small adapter per library, all with the same three calls: ``start(config)`` (the JobConfig
as a flat dict), ``log(metrics, step)`` and ``finish()``. :class:`~hf_scale.train.metrics.Metrics`
fans each logged record out to them with the prefixes HF Trainer gives W&B (``train/loss``,
``eval/loss``), the same in all four.
Each library is imported only when its tracker starts; whether it is installed is checked when
the recipe is loaded (:func:`report_to_names`), on every rank, before anything trains.

Where the runs go when nothing else is set (each library's own variables are honoured):
TensorBoard event files in ``train.logging_dir`` (default ``<output_dir>/runs``); MLflow in
``MLFLOW_TRACKING_URI``, else a SQLite store ``<output_dir>/mlflow.db``; wandb as ``WANDB_MODE``
says (``offline`` writes ``<output_dir>/wandb`` for a later ``wandb sync``); trackio in its local
store (``TRACKIO_DIR``, default under the Hugging Face cache). See docs/tracking.md.

Usage::

    trackers = start_trackers(job, start_step=0)   # every rank; rank 0 gets the started ones
    metrics = Metrics(out_dir, total_steps, enabled=rank == 0, trackers=trackers)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

from ..errors import HfScaleConfigError
from ..ranks import share_from_rank0

#: the ``report_to`` names; each is also the module that must be importable and the pip extra
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
DEFAULT_PROJECT = "hf_scale"
#: a config key or environment variable whose last word names a secret
SECRET_NAME = re.compile(r"(^|_)(token|secret|password|passwd|api_key|access_key|credentials?)$", re.IGNORECASE)
REDACTED = "<redacted>"


# ---------------------------------------------------------------- config: names, installed, the run's config


def report_to_names(value: str | list[str] | None) -> list[str]:
    """``train.report_to`` as a list of tracker names, as HF's ``TrainingArguments`` reads it:
    one name or a list; ``none`` (or null): none; ``all``: every one that is installed. A name
    whose library is not installed is an error naming the pip extra."""
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [name for name in TRACKERS if _installed(name)]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise HfScaleConfigError(
            f"train.report_to={value!r}: {', '.join(map(repr, unknown))} is not a tracker hf_scale reports to. "
            f"Use any of {', '.join(TRACKERS)}, or 'all' (those installed), or 'none'."
        )
    for name in names:
        if not _installed(name):
            raise HfScaleConfigError(
                f"train.report_to includes {name!r}, but the {name} package is not installed: "
                f"pip install 'hf-scale[{name}]' (or 'hf-scale[tracking]' for every tracker)."
            )
    return list(dict.fromkeys(names))


def _installed(module: str) -> bool:
    """Importable, without importing it (``sys.modules[module] = None`` blocks it, as for import)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def run_config(job) -> dict:
    """The job's config as one flat dict (``{"train.lr": 2e-5, ...}``), without secrets: keys
    named like a token / password are left out, and the value of any such environment variable
    (``HF_TOKEN``, ``WANDB_API_KEY``, ...) found inside a value is replaced by ``<redacted>``."""
    secrets = [v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8]
    flat = {}
    for key, value in _flatten(job.to_dict()):
        if not SECRET_NAME.search(key.rsplit(".", 1)[-1]):
            flat[key] = _redact(value, secrets)
    return flat


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _redact(value, secrets: list[str]):
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, (list, tuple)):
        return [_redact(v, secrets) for v in value]
    return value


def resolved_run_name(train) -> str:
    """``train.run_name``, else the output folder's name (``out/sft-1`` -> ``sft-1``)."""
    return train.run_name or Path(train.output_dir).resolve().name


def _project(train, variable: str) -> str:
    """``train.project``, else the library's own variable (``WANDB_PROJECT``...), else hf_scale."""
    return train.project or os.environ.get(variable) or DEFAULT_PROJECT


# ---------------------------------------------------------------- the trackers


class Tracker:
    """What every tracker does: start a run with the config, log values at a step, finish."""

    name = ""

    def start(self, config: dict) -> None:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``train.logging_dir`` (default ``<output_dir>/runs``), written by
    ``torch.utils.tensorboard`` (the ``tensorboard`` package). The config is a text summary.
    ``purge_step`` makes TensorBoard drop what an earlier attempt logged from there on: a resumed
    run continues its curve, a new run in the same folder replaces it."""

    name = "tensorboard"

    def __init__(self, train, start_step: int = 0):
        self.log_dir = Path(train.logging_dir or Path(train.output_dir) / "runs")
        self.purge_step = start_step + 1 if start_step else 0

    def start(self, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (``wandb.init``) in ``train.project`` / ``WANDB_PROJECT``, its files
    under ``<output_dir>/wandb`` unless ``WANDB_DIR`` says otherwise. Online or offline is
    ``WANDB_MODE``'s to say, as for wandb itself: hf_scale sets neither."""

    name = "wandb"

    def __init__(self, train, start_step: int = 0):
        self.train = train

    def start(self, config: dict) -> None:
        import wandb

        folder = None if os.environ.get("WANDB_DIR") else Path(self.train.output_dir)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=_project(self.train, "WANDB_PROJECT"), name=resolved_run_name(self.train),
                              config=config, dir=folder and str(folder))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (no global active run), in the experiment
    ``train.project`` / ``MLFLOW_EXPERIMENT_NAME``. The store is ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<output_dir>/mlflow.db`` (MLflow 3 refuses new ``file:`` stores unless told to)."""

    name = "mlflow"
    MAX_PARAMS = 100  # per log_batch call

    def __init__(self, train, start_step: int = 0):
        self.train = train
        self.own_store = not os.environ.get("MLFLOW_TRACKING_URI")
        out = Path(train.output_dir).resolve()
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / 'mlflow.db'}"
        self.artifacts = (out / "mlartifacts").as_uri()

    def start(self, config: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.own_store:
            Path(self.train.output_dir).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.tracking_uri)
        name = _project(self.train, "MLFLOW_EXPERIMENT_NAME")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=self.artifacts if self.own_store else None)
        self.run_id = self.client.create_run(experiment_id, run_name=resolved_run_name(self.train)).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in config.items()]  # MLflow's longest parameter
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    """A trackio run (``trackio.init``) in ``train.project``, in trackio's local store
    (``TRACKIO_DIR``); ``TRACKIO_SPACE_ID`` sends it to a Space instead, as trackio decides."""

    name = "trackio"

    def __init__(self, train, start_step: int = 0):
        self.train = train

    def start(self, config: dict) -> None:
        import trackio

        self.run = trackio.init(project=self.train.project or DEFAULT_PROJECT, name=resolved_run_name(self.train),
                                config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


ADAPTERS = {cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker)}


def start_trackers(job, *, start_step: int = 0) -> list[Tracker]:
    """Collective: on rank 0, start a run in every tracker of ``job.train.report_to`` with the
    job's config and return them; ``[]`` on the other ranks. A tracker that cannot start (not
    logged in, server unreachable) raises on every rank, before training; those already started
    are finished first."""
    if not job.train.report_to:
        return []
    started: list[Tracker] = []

    def start() -> None:
        config = run_config(job)
        try:
            for name in job.train.report_to:
                tracker = ADAPTERS[name](job.train, start_step)
                tracker.start(config)
                started.append(tracker)
        except Exception:
            for tracker in started:
                tracker.finish()
            raise

    share_from_rank0(start)
    return started
