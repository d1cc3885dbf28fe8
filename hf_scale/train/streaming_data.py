"""``data.streaming: true``: the training split read as training goes, never loaded whole.

``datasets`` opens the source as an ``IterableDataset`` (local files, a Hub dataset, or a
generated task), shuffled through a seeded buffer (``data.shuffle_buffer``; its order is a
function of the seed and the epoch, so a resume reads the same order again), split over the
data-parallel ranks without overlap (``datasets.distributed.split_dataset_by_node``: whole
shards per rank where they divide, else every ``world``-th example), then read past the
position a checkpoint saved (the skipped examples are read, not tokenised). :class:`hf_scale.data.streaming.StreamBatches` tokenises and packs
on the fly. The evaluation split is small: its first ``max_eval_samples`` examples are read
into memory and evaluated as usual.

Usage::

    source = stream_source(job.data, dp.rank, dp.degree)   # source(epoch, skip) -> examples
    evaluation = stream_eval(job.data)                       # a Dataset, or None
"""

from __future__ import annotations

from itertools import islice

from ..errors import HfScaleConfigError
from .config import DataConfig
from .data_files import BUILDERS, data_files, is_local
from .tasks import PREFIX, builtin_dataset

EVAL_SAMPLES = 1000  # streamed evaluation examples read when data.max_eval_samples is not set


def _open(cfg: DataConfig, split: str, path: str | None = None):
    """The ``IterableDataset`` of ``split`` of the source (``path``: a separate local file), or None."""
    from pathlib import Path

    from datasets import load_dataset

    path = path or cfg.path
    if path.startswith(PREFIX):
        splits = builtin_dataset(path, seed=cfg.seed + 1234)
        return splits[split].to_iterable_dataset(num_shards=4) if split in splits else None
    if is_local(path):
        files = data_files(path, "data.eval_path" if path == cfg.eval_path else "data.path")
        if split != "train":
            return None
        return load_dataset(BUILDERS[Path(files[0]).suffix], data_files={"train": files}, streaming=True)["train"]
    try:
        splits = load_dataset(path, cfg.name, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; say which dataset failed
        raise HfScaleConfigError(
            f"could not stream the Hub dataset {path!r} (subset {cfg.name!r}): {type(e).__name__}: "
            f"{str(e)[:300]}. Local files stream too: data.path: train.jsonl."
        ) from None
    return splits[split] if split in splits else None


def stream_source(cfg: DataConfig, rank: int, world: int):
    """``source(epoch, skip)``: this data-parallel rank's examples of the training split in
    ``epoch``'s shuffled order, after its first ``skip``."""
    from datasets.distributed import split_dataset_by_node

    if cfg.eval_fraction > 0:
        raise HfScaleConfigError(
            f"data.eval_fraction={cfg.eval_fraction} with data.streaming: a stream has no length to hold a "
            "fraction of out. Set data.eval_path (a local file) or data.eval_split instead."
        )
    base = _open(cfg, cfg.train_split)
    if base is None:
        raise HfScaleConfigError(f"data.train_split={cfg.train_split!r} is not a split of {cfg.path!r}.")
    if cfg.max_train_samples is not None:
        base = base.take(cfg.max_train_samples)
    shuffled = base.shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer) if cfg.shuffle_buffer > 1 else base
    mine = split_dataset_by_node(shuffled, rank=rank, world_size=world)

    def source(epoch: int, skip: int):
        # skipped by reading (not IterableDataset.skip: after split_dataset_by_node of a stream with
        # fewer shards than ranks it skips the source's examples, shifting which ones are this rank's)
        mine.set_epoch(epoch)
        return islice(iter(mine), skip, None)

    return source


def stream_eval(cfg: DataConfig):
    """The evaluation examples as a ``Dataset`` (the first ``max_eval_samples``), or None."""
    from datasets import Dataset

    if cfg.eval_path:
        stream = _open(cfg, "train", cfg.eval_path)
    elif cfg.eval_split:
        stream = _open(cfg, cfg.eval_split)
    else:
        stream = None
    if stream is None:
        return None
    rows = list(islice(iter(stream), cfg.max_eval_samples or EVAL_SAMPLES))
    return Dataset.from_list(rows) if rows else None
