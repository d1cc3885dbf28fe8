"""Reward models in one process (hf_scale.train.reward and its wiring): the Bradley-Terry loss
against hand-computed values, the interleaved batch, the loss returned by the model's forward
against an oracle that scores each sequence alone, evaluation, the loop's weighting by pairs,
loading, and the config's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_scale.errors import HfScaleConfigError
from hf_scale.config import ParallelConfig
from hf_scale.train.config import AdapterConfig, DataConfig, JobConfig, ModelConfig, TrainConfig, load_job
from hf_scale.train.evaluate import evaluate
from hf_scale.train.loop import _loss_items
from hf_scale.train.reward import (
    RewardCollator,
    apply_reward_loss,
    bradley_terry_loss,
    pair_scores,
    reward_scores,
)
from tests.distributed.reward_checks import PAD, oracle_eval, oracle_loss, reward_model

ROWS = [  # prompts masked, chosen and rejected of different lengths
    {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8],
     "rejected_input_ids": [5, 6, 9], "rejected_labels": [-100, -100, 9]},
    {"chosen_input_ids": [10, 11, 12], "chosen_labels": [-100, 12, 12],
     "rejected_input_ids": [10, 11, 13, 14, 15, 16], "rejected_labels": [-100, -100, 13, 14, 15, 16],
     "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0},
    {"chosen_input_ids": [20, 21], "chosen_labels": [-100, 21],
     "rejected_input_ids": [20, 22, 23, 24], "rejected_labels": [-100, 22, 23, 24]},
]


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    plain = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(2.0))) / 2
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(plain, rel=1e-6)
    # TRL's centring term: coefficient x mean((chosen + rejected) ** 2) = 0.1 x (1 + 4) / 2
    assert float(bradley_terry_loss(chosen, rejected, 0.1)) == pytest.approx(plain + 0.25, rel=1e-6)


def test_reward_collator_interleaves_pairs_with_one_label_per_row():
    batch = RewardCollator(PAD)(ROWS[:2])
    assert batch["labels"].tolist() == [1, 0, 1, 0]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 0, 0], [5, 6, 9, 0, 0, 0], [10, 11, 12, 0, 0, 0],
                                           [10, 11, 13, 14, 15, 16]]
    assert batch["attention_mask"].sum(-1).tolist() == [4, 3, 3, 6]
    assert "ref_logps" not in batch


def test_pair_scores_reads_the_interleaving_and_refuses_other_batches():
    chosen, rejected = pair_scores(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), torch.tensor([1, 0, 1, 0]))
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    with pytest.raises(HfScaleConfigError, match="interleaved"):
        pair_scores(torch.zeros(4, 1), torch.tensor([1, 1, 0, 0]))  # concatenated, not interleaved
    with pytest.raises(HfScaleConfigError, match="interleaved"):
        pair_scores(torch.zeros(3, 1), torch.tensor([1, 0, 1]))
    with pytest.raises(HfScaleConfigError, match="num_labels must be 1"):
        pair_scores(torch.zeros(4, 3), torch.tensor([1, 0, 1, 0]))


@pytest.mark.parametrize("center", [None, 0.1])
def test_the_forward_returns_trls_loss_with_each_score_at_the_last_real_token(center):
    """Padded, interleaved batch through the model's own forward == each sequence scored alone."""
    model = reward_model()
    apply_reward_loss(model, center)
    batch = RewardCollator(PAD)(ROWS)
    loss = model(**batch).loss
    want = oracle_loss(model, ROWS, center)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    grads = torch.autograd.grad(loss, [model.score.weight])[0]
    want_grads = torch.autograd.grad(oracle_loss(model, ROWS, center), [model.score.weight])[0]
    torch.testing.assert_close(grads, want_grads, rtol=1e-5, atol=1e-7)
    # without labels the forward is the classifier's own: scores, no loss
    plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert plain.loss is None and plain.logits.shape == (6, 1)


def test_evaluation_reports_pair_accuracy_and_loss():
    model = reward_model()
    apply_reward_loss(model)
    # 3 pairs in batches of 2: the last batch is filled with a copy weighted 0
    got = evaluate(model, ROWS, RewardCollator(PAD), task="reward", batch_size=2, rank=0, world=1,
                   device=torch.device("cpu"))
    want = oracle_eval(model, ROWS)
    assert got["eval_examples"] == 3 and got["eval_accuracy"] == want["eval_accuracy"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    totals = reward_scores(torch.tensor([[2.0], [1.0], [0.0], [3.0], [5.0], [0.0]]), torch.tensor([1, 0] * 3),
                           torch.tensor([1.0, 1.0, 0.0]))
    assert totals.tolist() == pytest.approx([math.log1p(math.exp(-1)) + math.log1p(math.exp(3)), 2.0, 1.0, 2.0])


def test_the_loop_weights_reward_micro_batches_by_pairs():
    batch = RewardCollator(PAD)(ROWS)
    assert _loss_items(batch, "reward") == 3.0
    assert _loss_items(batch, "sequence_classification") == 6.0


def test_load_model_gives_a_one_score_classifier_that_returns_the_loss(tmp_path):
    from hf_scale.train.model import load_model
    from tests.tiny_models import CAUSAL, save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "tiny", "llama", CAUSAL)  # a causal LM: the score head is new
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    config["pad_token_id"] = 1  # not the tokenizer's pad: the score must be read by the tokenizer's
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    model = load_model(ModelConfig(name_or_path=folder, task="reward"), ParallelConfig(), pad_id=PAD)
    assert model.config.num_labels == 1 and model.config.pad_token_id == PAD
    batch = RewardCollator(PAD)(ROWS)
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(float(oracle_loss(model, ROWS, None)), rel=1e-5)


def test_config_refusals(tmp_path):
    reward = ModelConfig(task="reward")
    with pytest.raises(HfScaleConfigError, match="model.task: reward with parallel.pp=2"):
        JobConfig(model=reward, parallel=ParallelConfig(pp=2))
    with pytest.raises(HfScaleConfigError, match="peft: LoRA adapters are supported for model.task=causal_lm"):
        JobConfig(model=reward, peft=AdapterConfig(r=8))
    with pytest.raises(HfScaleConfigError, match="data.packing"):
        JobConfig(model=reward, data=DataConfig(packing="bfd"))
    with pytest.raises(HfScaleConfigError, match="train.center_rewards_coefficient is for reward models"):
        JobConfig(train=TrainConfig(center_rewards_coefficient=0.01))
    with pytest.raises(HfScaleConfigError, match="train.center_rewards_coefficient=-1"):
        TrainConfig(center_rewards_coefficient=-1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  task: reward\ntrain:\n  center_rewards_coefficient: 0.01\n")
    job = load_job(str(recipe), ["--data.chosen_column", "good"])
    assert job.model.task == "reward" and job.train.center_rewards_coefficient == 0.01
    assert job.data.chosen_column == "good"
