"""The fine-tuning application shards and counts by the data-parallel rank, not the global rank.

Without processes: fake parallel states (what ``hf_scale.get_state`` returns) for tp = 2 on 4
ranks give the loader's rows, evaluation's weights and the step's loss weighting; a one-process
tiny model gives the sample generations and the export check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_scale.parallel_state import STATE_ATTR
from hf_scale.train.dp import DataParallel
from hf_scale.train.loader import PadCollator, ShardedBatches, eval_batches
from tests.tiny_models import CAUSAL, save_tiny_checkpoint, tiny_model, tiny_tokenizer

TP, WORLD = 2, 4


class _Rows(list):
    def select(self, rows):
        return _Rows(self[i] for i in rows)


def _dataset(n):
    return _Rows({"input_ids": [i], "labels": [i]} for i in range(n))


def _ids(batch):
    return batch["input_ids"][:, 0].tolist()


def _parallel_model(dp_rank: int, dp_degree: int, group="dp-group") -> torch.nn.Module:
    """A module carrying a fake parallel state, as ``hf_scale.parallelize`` leaves one."""
    model = torch.nn.Linear(1, 1)
    setattr(model, STATE_ATTR, SimpleNamespace(dp_rank=dp_rank, dp_degree=dp_degree, dp_group=group))
    return model


def _tp_layout() -> list[DataParallel]:
    """tp innermost on the mesh: global ranks 0, 1 form tp group 0 (dp rank 0); 2, 3 dp rank 1."""
    return [DataParallel.of(_parallel_model(rank // TP, WORLD // TP)) for rank in range(WORLD)]


def test_the_coordinate_comes_from_the_parallel_state():
    assert DataParallel.of(torch.nn.Linear(1, 1)) == DataParallel(0, 1, None)  # not parallelized
    assert DataParallel.of(_parallel_model(0, 1, group=None)) == DataParallel(0, 1, None)  # tp == world
    assert [(d.rank, d.degree, d.group) for d in _tp_layout()] == [
        (0, 2, "dp-group"), (0, 2, "dp-group"), (1, 2, "dp-group"), (1, 2, "dp-group")]
    one = torch.ones(2)
    assert DataParallel(0, 1, None).all_reduce(one) is one  # nothing to reduce, no process group needed


def test_a_tensor_parallel_group_sees_one_batch_and_dp_ranks_split_the_global_batch():
    data, collate = _dataset(24), PadCollator(0)
    one = iter(ShardedBatches(data, 8, 0, 1, collate, seed=5))
    ranks = [iter(ShardedBatches(data, 4, dp.rank, dp.degree, collate, seed=5)) for dp in _tp_layout()]
    for _ in range(4):  # 3 batches per epoch: crosses an epoch boundary
        parts = [_ids(next(r)) for r in ranks]
        assert parts[0] == parts[1] and parts[2] == parts[3]  # tp ranks: the same rows
        assert parts[0] + parts[2] == _ids(next(one))  # dp ranks: the one-process batch, split
    # positions are data-parallel: a run with tp=2 on 4 ranks resumes one with 2 dp ranks (fsdp on 2)
    tp_run = ShardedBatches(data, 4, 1, 2, collate, seed=5)
    tp_run.seek(2)
    ShardedBatches(data, 4, _tp_layout()[3].rank, 2, collate, seed=5).load_state_dict(tp_run.state_dict())


def test_evaluation_counts_each_example_once_over_the_dp_ranks():
    data = _dataset(7)
    seen = {}
    for rank, dp in enumerate(_tp_layout()):
        seen[rank] = [i for batch, weight in eval_batches(data, 3, dp.rank, dp.degree, PadCollator(0))
                      for i, w in zip(_ids(batch), weight.tolist()) if w]
    assert seen[0] == seen[1] and seen[2] == seen[3]
    assert sorted(seen[0] + seen[2]) == list(range(7))  # summed over the dp group: once each


class _Mirror(DataParallel):
    """Two data-parallel ranks that saw identical batches: a sum over them doubles."""

    def all_reduce(self, tensor, op=None):
        if op is None or op == torch.distributed.ReduceOp.SUM:
            tensor *= self.degree
        return tensor


def test_the_loss_is_weighted_by_the_dp_degree(monkeypatch):
    """A step on dp_degree = 2 ranks with identical batches is the one-process step: the loss
    is each rank's share of the global label tokens times dp_degree (FSDP averages over dp),
    and tokens are counted on both. A weight of the world size (4 with tp = 2) doubles the
    gradient, which the gradient norm shows."""
    from hf_scale.train.config import JobConfig, ModelConfig, TrainConfig
    from hf_scale.train.loop import _train_step
    from tests.tiny_models import tiny_batch

    job = JobConfig(model=ModelConfig(task="causal_lm"), train=TrainConfig(max_grad_norm=None))
    batch = tiny_batch(CAUSAL, 4)
    batch["labels"][0, :5] = -100  # label counts differ from token counts

    def step(dp):
        model = tiny_model("llama", CAUSAL)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        return _train_step(job, model, optimizer, scaler, iter([dict(batch)]), torch.device("cpu"), dp)

    alone, mirrored = step(DataParallel()), step(_Mirror(1, 2, None))
    assert mirrored["loss"] == pytest.approx(alone["loss"], rel=1e-6)
    assert mirrored["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-6)
    assert mirrored["tokens"] == 2 * alone["tokens"] == 2 * int(batch["attention_mask"].sum())


@pytest.fixture
def logged():
    """What hf_scale logs during the test (its logger does not propagate to pytest's)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hf_scale").addHandler(handler)
    yield lines
    logging.getLogger("hf_scale").removeHandler(handler)


def test_sample_generations_of_the_trained_model_and_of_the_export(tmp_path, logged):
    from hf_scale.train.config import JobConfig, TrainConfig
    from hf_scale.train.finish import card_info, finish_run, held_out_prompts

    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = tiny_tokenizer()
    rows = _Rows({"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, 8, 9]} for _ in range(3))
    job = JobConfig(train=TrainConfig(output_dir=str(tmp_path), sample_generations=2))
    summary = {"steps": 1, "train_time_s": 1.0, "tokens_seen": 10, "final_loss": 0.5}
    assert [p["ids"].tolist() for p in held_out_prompts(rows, tokenizer, 2)] == [[[5, 6, 7]]] * 2
    finish_run(job, tmp_path / "m", summary, rows, tokenizer, world=1, model=model)
    out = "\n".join(logged)
    assert "greedy answers of the trained model (same tokens on all 1 ranks)" in out
    assert "reloaded" in out and "the export gives the trained model's answers" in out
    with torch.no_grad():  # the export differs from the live model: said, not hidden
        model.model.norm.weight.neg_()  # every logit flips sign: argmax becomes argmin
    finish_run(job, tmp_path / "m", summary, rows, tokenizer, world=1, model=model)
    assert "the export's answers differ from the trained model's on 2 of 2" in logged[-1]
    info = card_info(job, summary, tmp_path / "m", world=4, dp_degree=2)
    assert info["hyperparameters"]["global_batch_size"] == job.train.batch_size * 2  # tp ranks share a batch
