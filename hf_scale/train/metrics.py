"""What a run reports: a tqdm bar on rank 0, a metrics JSONL, and a loss-curve PNG at the end.

Each JSONL line is one logged step: ``step``, ``loss``, ``lr`` (the rate the step used),
``grad_norm``, ``tokens_per_s`` (non-padding tokens of the global batch, each counted once: the
ranks of a tensor-parallel group share their tokens), ``data_wait`` (share of the
step spent waiting for the next batch, the slowest rank's), ``peak_mem_gb`` (CUDA max allocated,
or peak RSS on CPU; the largest over ranks) and ``elapsed_s``; evaluation lines carry ``eval_*``
keys. Only rank 0 writes. Each record also goes to the experiment trackers of ``train.report_to``
(:mod:`hf_scale.train.trackers`) as ``train/loss``, ``train/lr``, ..., and ``eval/loss`` for
``eval_loss`` (the prefixes HF Trainer gives W&B).

Usage::

    metrics = Metrics(out_dir, total_steps, enabled=rank == 0, trackers=start_trackers(job))
    metrics.step(step, {"loss": 2.1, "lr": 1e-4, ...})
    metrics.close(); metrics.plot_loss(out_dir / "loss_curve.png")
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from ..log import log_rank0
from .trackers import Tracker

METRICS_FILE = "metrics.jsonl"
LOSS_CURVE = "loss_curve.png"
PROGRESS_EXTRA = ("rewards/accuracies", "rewards/margins")  # shown on the progress line when present


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kb / (2**30 if sys.platform == "darwin" else 2**20)


class Metrics:
    """Rank 0's progress bar, metrics file and trackers; a no-op on the other ranks.

    A new run starts a new file; a resumed one (``start_step`` > 0) keeps the records up to
    that step, so the file and the loss curve cover the whole run. ``trackers`` (started ones)
    get every record from now on and are finished by :meth:`close`.
    """

    def __init__(self, out_dir: str | Path, total_steps: int, *, enabled: bool, progress: bool = True,
                 start_step: int = 0, trackers: list[Tracker] | tuple = ()):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.history: list[dict] = []
        self.bar = None
        self.trackers = list(trackers) if enabled else []
        if not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / METRICS_FILE
        if start_step and path.exists():  # resumed: keep the records up to the checkpoint
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.history = [r for r in records if r["step"] <= start_step]
        self.file = path.open("w")
        for record in self.history:
            self.file.write(json.dumps(record) + "\n")
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def step(self, step: int, values: dict) -> None:
        """Record one optimizer step's values and advance the bar."""
        if not self.enabled:
            return
        elapsed = round(time.perf_counter() - self.start, 2)
        self._write({"step": step, **_rounded(values), "elapsed_s": elapsed})
        self._report(step, {**values, "elapsed_s": elapsed})
        # preference training: TRL's reward accuracy and margin beside the loss
        shown = {k.split("/")[1]: f"{values[k]:.3f}" for k in PROGRESS_EXTRA if k in values}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{values['loss']:.4f}", **shown,
                                 tok_s=f"{values.get('tokens_per_s', 0):,.0f}", refresh=False)
        elif "loss" in values:
            extra = "".join(f"  {k} {v}" for k, v in shown.items())
            log_rank0(f"step {step}  loss {values['loss']:.4f}{extra}  {values.get('tokens_per_s', 0):,.0f} tokens/s")

    def event(self, step: int, values: dict) -> None:
        """Record evaluation (or other) values at ``step`` and print them."""
        if not self.enabled:
            return
        self._write({"step": step, **_rounded(values)})
        self._report(step, values)
        shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        message = f"step {step}: {shown}"
        if self.bar is not None:
            self.bar.write(f"[hf_scale] {message}", file=sys.stderr)
        else:
            log_rank0(message)

    def _write(self, record: dict) -> None:
        self.history.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def _report(self, step: int, values: dict) -> None:
        """Send the numbers to every tracker. A tracker that fails (a lost connection) is dropped
        with a warning instead of stopping rank 0 alone, which would leave the other ranks waiting
        at their next collective; metrics.jsonl keeps every value."""
        named = tracked_names(values)
        for tracker in list(self.trackers):
            try:
                tracker.log(named, step)
            except Exception as e:  # noqa: BLE001 - any library's failure
                self.trackers.remove(tracker)
                log_rank0(f"{tracker.name} failed at step {step} ({type(e).__name__}: {e}); the run goes on "
                          f"without it (every value is still in {METRICS_FILE}).")

    def close(self) -> None:
        """Close the bar and the file, and finish the trackers' runs."""
        if self.enabled:
            if self.bar is not None:
                self.bar.close()
            self.file.close()
            for tracker in self.trackers:
                try:
                    tracker.finish()
                except Exception as e:  # noqa: BLE001 - the run's results are saved anyway
                    log_rank0(f"{tracker.name} failed to finish its run ({type(e).__name__}: {e}).")
            self.trackers = []

    def plot_loss(self, path: str | Path) -> Path | None:
        """Draw training (and eval) loss against step as a PNG; None without matplotlib."""
        if not self.enabled:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log_rank0("matplotlib is not installed: no loss curve (pip install 'hf-scale[plot]').")
            return None
        train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in self.history if "eval_loss" in r]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        if train:
            ax.plot(*zip(*train), label="train loss", linewidth=1.2)
        if evals:
            ax.plot(*zip(*evals), "o--", label="eval loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return Path(path)


def tracked_names(values: dict) -> dict[str, float]:
    """The numbers of a record under their tracker names (HF Trainer's prefixes): ``eval_loss`` ->
    ``eval/loss``, any other key ``k`` -> ``train/k``."""
    return {f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}": float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _rounded(values: dict) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}
