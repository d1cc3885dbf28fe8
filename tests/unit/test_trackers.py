"""``train.report_to``: a run logged through :class:`Metrics` is what each library's own reader
gives back (TensorBoard's EventAccumulator, MlflowClient, the wandb offline run file, trackio's
SQLite store), with the config and no secret; a missing library is a config error naming its pip
extra; rank 1 writes nothing.

All four trackers log one run, once (``HF_TOKEN`` set, ``WANDB_MODE=offline``); trackio's in a
fresh process, with ``TRACKIO_DIR`` (read when trackio is imported) in the test's folder.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_scale.errors import HfScaleConfigError
from hf_scale.train.config import DataConfig, JobConfig, TrainConfig
from hf_scale.train.metrics import Metrics
from hf_scale.train.trackers import ADAPTERS, TRACKERS, Tracker, run_config, start_trackers
from tests.harness import ROOT, cli_env, run_ranks

SECRET = "hf_fakeTokenThatMustNotLeak0123456789"
LOSSES = {1: 2.5, 2: 2.25, 3: 1.875}
EVALS = {0: {"eval_loss": 3.0, "eval_exact_match": 0.0}, 3: {"eval_loss": 1.5, "eval_exact_match": 0.5}}


def tracked_job(out: Path, report_to, **train) -> JobConfig:
    # a secret where a user might paste one: inside a data URL (redacted), and in HF_TOKEN
    return JobConfig(train=TrainConfig(output_dir=str(out), report_to=report_to, run_name="probe",
                                       project="probe", progress=False, **train),
                     data=DataConfig(path=f"https://user:{SECRET}@example.invalid/data.jsonl"))


def write_a_run(out: str, report_to: list[str]) -> None:
    """What the loop does: start the trackers, log eval, steps and eval, close."""
    job = tracked_job(Path(out), report_to)
    metrics = Metrics(out, len(LOSSES), enabled=True, progress=False, trackers=start_trackers(job))
    metrics.event(0, EVALS[0])
    for step, loss in LOSSES.items():
        metrics.step(step, {"loss": loss, "lr": 1e-3 * step, "grad_norm": 0.5 + step, "tokens_per_s": 100.0 * step})
    metrics.event(3, EVALS[3])
    metrics.close()
    if "trackio" in report_to:  # read back here: trackio's store is where TRACKIO_DIR was at import
        from trackio.sqlite_storage import SQLiteStorage

        readback = {"runs": SQLiteStorage.get_runs("probe"), "logs": SQLiteStorage.get_logs("probe", "probe"),
                    "config": SQLiteStorage.get_run_config("probe", "probe")}
        (Path(out) / "trackio_readback.json").write_text(json.dumps(readback, default=str))


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """One run logged to all four trackers, with ``HF_TOKEN`` set and wandb offline; its output
    folder. trackio's run is logged (and read back) in a fresh process, in ``<run>/../trackio``."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    env = {"HF_TOKEN": SECRET, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    unset = ("MLFLOW_TRACKING_URI", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_SPACE_ID")
    trackio = subprocess.Popen(
        [sys.executable, "-c", f"from tests.unit.test_trackers import write_a_run; "
                               f"write_a_run({str(out.parent / 'trackio_run')!r}, ['trackio'])"],
        cwd=ROOT, env={k: v for k, v in cli_env({**env, "TRACKIO_DIR": str(out.parent / "trackio")}).items()
                       if k not in unset},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with pytest.MonkeyPatch.context() as mp:
        for var in unset:
            mp.delenv(var, raising=False)
        for var, value in env.items():
            mp.setenv(var, value)
        write_a_run(str(out), [name for name in TRACKERS if name != "trackio"])
    log, _ = trackio.communicate(timeout=240)
    assert trackio.returncode == 0, log[-3000:]
    return out


def check_losses(got: dict[int, float]) -> None:
    assert set(got) == set(LOSSES)
    for step, loss in LOSSES.items():
        assert math.isclose(got[step], loss, rel_tol=1e-6), (step, got[step], loss)


def test_tensorboard_event_files_hold_the_losses_and_eval(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "runs"))
    events.Reload()
    check_losses({e.step: e.value for e in events.Scalars("train/loss")})
    assert {e.step: e.value for e in events.Scalars("eval/loss")} == {0: 3.0, 3: 1.5}
    assert [e.value for e in events.Scalars("train/grad_norm")] == [1.5, 2.5, 3.5]
    assert {"train/lr", "train/tokens_per_s", "eval/exact_match"} <= set(events.Tags()["scalars"])
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"train.report_to"' in config


def test_mlflow_default_sqlite_store_holds_the_run(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{logged / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("probe").experiment_id])
    assert run.info.run_name == "probe" and run.info.status == "FINISHED"
    check_losses({m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")})
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")} == {0: 3.0, 3: 1.5}
    assert run.data.params["train.lr"] == "2e-05" and run.data.params["train.run_name"] == "probe"


def wandb_records(run_file: Path):
    """The records of a wandb run file (LevelDB log format: 32 KiB blocks of CRC'd chunks after a
    7-byte header), parsed as wandb's own protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, pending = run_file.read_bytes(), 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, or middle / last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_file_holds_the_history_and_config(logged):
    (run_file,) = (logged / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, names = {}, {}, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # a key with a slash is stored split: nested_key ["train", "loss"]
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            names.append((record.run.project, record.run.display_name))
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert names == [("probe", "probe")]
    check_losses({step: row["train/loss"] for step, row in history.items() if "train/loss" in row})
    assert {step: row["eval/loss"] for step, row in history.items() if "eval/loss" in row} == {0: 3.0, 3: 1.5}
    assert config["train.lr"] == 2e-5 and config["train.report_to"] == ["tensorboard", "wandb", "mlflow"]


def test_trackio_local_store_holds_the_run(logged):
    readback = json.loads((logged.parent / "trackio_run" / "trackio_readback.json").read_text())
    assert readback["runs"] == ["probe"]
    check_losses({row["step"]: row["train/loss"] for row in readback["logs"] if "train/loss" in row})
    assert {row["step"]: row["eval/loss"] for row in readback["logs"] if "eval/loss" in row} == {0: 3.0, 3: 1.5}
    assert readback["config"]["train.lr"] == 2e-5


def test_tensorboard_resumed_run_replaces_what_came_after_its_checkpoint(tmp_path):
    """A first attempt logged steps 1-3; resumed from step 1, the curve is step 1 of the first
    attempt, then the second's (purge_step); a new run in the folder replaces it all."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def attempt(start: int, losses: dict) -> dict:
        job = tracked_job(tmp_path, "tensorboard")
        metrics = Metrics(tmp_path, 3, enabled=True, progress=False, start_step=start,
                          trackers=start_trackers(job, start_step=start))
        for step, loss in losses.items():
            metrics.step(step, {"loss": loss})
        metrics.close()
        events = EventAccumulator(str(tmp_path / "runs"))
        events.Reload()
        return {e.step: e.value for e in events.Scalars("train/loss")}

    assert attempt(0, {1: 3.0, 2: 2.0, 3: 1.0}) == {1: 3.0, 2: 2.0, 3: 1.0}
    assert attempt(1, {2: 2.5, 3: 1.5}) == {1: 3.0, 2: 2.5, 3: 1.5}
    assert attempt(0, {1: 4.0}) == {1: 4.0}


def test_no_secret_in_anything_written(logged):
    """HF_TOKEN was set and pasted into a config value: no file of any tracker holds it."""
    files = [p for p in logged.parent.rglob("*") if p.is_file()]
    assert len(files) > 5
    assert not [p for p in files if SECRET.encode() in p.read_bytes()]


def test_run_config_is_flat_and_drops_secret_keys(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-0123456789")
    job = JobConfig(data=DataConfig(path="s3://bucket/wandb-key-0123456789/x.jsonl"))
    config = run_config(job)
    assert config["train.lr"] == 2e-5 and config["parallel.loss_chunk_tokens"] is None  # "tokens" is no secret
    assert config["data.path"] == "s3://bucket/<redacted>/x.jsonl"
    assert len(config) == len(list(_leaves(job.to_dict())))
    # a section with keys named like secrets (none of hf_scale's is today) loses them
    job = SimpleNamespace(to_dict=lambda: {"hub": {"token": "x", "hf_token": "y", "api_key": "z", "repo_id": "o/r"}})
    assert run_config(job) == {"hub.repo_id": "o/r"}


def _leaves(tree):
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else [value]


def test_mlflow_tracking_uri_is_honoured(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in for a file store
    write_a_run(str(tmp_path / "run"), ["mlflow"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("probe").experiment_id])
    check_losses({m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")})
    assert not (tmp_path / "run" / "mlflow.db").exists()


@pytest.mark.parametrize("name", TRACKERS)
def test_a_missing_library_is_a_config_error_naming_the_extra(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now fails, as when not installed
    with pytest.raises(HfScaleConfigError, match=rf"pip install 'hf-scale\[{name}\]'"):
        TrainConfig(report_to=["tensorboard", name] if name != "tensorboard" else name)
    assert name not in TrainConfig(report_to="all").report_to  # all: those installed


def test_report_to_reads_as_hf_does():
    assert TrainConfig().report_to == [] and TrainConfig(report_to="none").report_to == []
    assert TrainConfig(report_to="wandb").report_to == ["wandb"]
    assert TrainConfig(report_to="all").report_to == list(TRACKERS)
    with pytest.raises(HfScaleConfigError, match="'comet_ml' is not a tracker"):
        TrainConfig(report_to=["comet_ml"])


def test_a_tracker_that_fails_mid_run_is_dropped_not_fatal(tmp_path):
    class Flaky:
        name, logged, finished = "flaky", [], False

        def log(self, metrics, step):
            if step == 2:
                raise ConnectionError("lost")
            self.logged.append(step)

        def finish(self):
            self.finished = True

    flaky = Flaky()
    metrics = Metrics(tmp_path, 3, enabled=True, progress=False, trackers=[flaky])
    for step in (1, 2, 3):
        metrics.step(step, {"loss": 1.0})
    metrics.close()
    assert flaky.logged == [1] and not flaky.finished
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_tracker_that_cannot_start_stops_the_run_and_finishes_the_others(tmp_path, monkeypatch):
    finished = []

    class Up(Tracker):
        def __init__(self, train, start_step):
            pass

        def start(self, config):
            pass

        def finish(self):
            finished.append("up")

    class Down(Up):
        def start(self, config):
            raise ConnectionError("tracking server unreachable")

    monkeypatch.setitem(ADAPTERS, "tensorboard", Up)
    monkeypatch.setitem(ADAPTERS, "wandb", Down)
    with pytest.raises(ConnectionError, match="unreachable"):
        start_trackers(tracked_job(tmp_path, ["tensorboard", "wandb"]))
    assert finished == ["up"]


def _two_ranks(out: str) -> list[str]:
    """Both ranks log different losses to one output folder; returns this rank's trackers."""
    from hf_scale.distributed import init_distributed
    from hf_scale.ranks import rank

    init_distributed(120)
    trackers = start_trackers(tracked_job(Path(out), ["tensorboard"]))
    metrics = Metrics(out, 2, enabled=rank() == 0, progress=False, trackers=trackers)
    for step in (1, 2):
        metrics.step(step, {"loss": float(10 * rank() + step)})
    metrics.close()
    return [t.name for t in trackers]


def test_only_rank_0_writes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run_ranks(_two_ranks, 2, str(out), timeout=300) == [["tensorboard"], []]
    assert len(list((out / "runs").glob("events.*"))) == 1
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == {1: 1.0, 2: 2.0}  # rank 0's


def test_report_to_from_the_command_line(tmp_path):
    from hf_scale.config import apply_overrides, from_dict

    job = from_dict(JobConfig, apply_overrides({}, ["--train.report_to", "tensorboard"]))
    assert job.train.report_to == ["tensorboard"]
    job = from_dict(JobConfig, apply_overrides({}, ["--train.report_to", "[wandb, mlflow]"]))
    assert job.train.report_to == ["wandb", "mlflow"]
