"""Reward models (``model.task: reward``): a sequence-classification head with one score,
trained on preference pairs with the Bradley-Terry loss, as TRL's ``RewardTrainer``.

A batch is :class:`~hf_scale.data.preference.PairCollator`'s (chosen and rejected interleaved:
row ``2i`` is pair ``i``'s chosen, row ``2i + 1`` its rejected, so one forward scores both)
with its token labels replaced by one label per row: 1 for chosen, 0 for rejected
(:class:`RewardCollator`). The score of a row is the head's output at its last non-pad token
(transformers reads ``config.pad_token_id``, which the loader sets, as TRL does). The loss of a
batch is the mean over its pairs of ``-logsigmoid(score_chosen - score_rejected)``, plus
``center_rewards_coefficient * mean((score_chosen + score_rejected) ** 2)`` when set (TRL's
option that keeps the scores centred on 0). Both are means over pairs, so the loop weights
micro-batches by pairs and a step's loss is the mean over all pairs of the global batch.

:func:`apply_reward_loss` makes the model's own forward return that loss (``output.loss``), so
``hf_scale.train_step`` / ``eval_step`` and every data-parallel and tensor-parallel layout run a
reward model as they run a classifier: the forward hook reads the pooled scores
(``output.logits``, ``[2B, 1]``), whatever the architecture computes its own loss with.

Usage::

    apply_reward_loss(model)                       # before or after parallelize
    batch = RewardCollator(tokenizer.pad_token_id)(rows)   # rows of tokenize_preference
    loss = model(**batch).loss                     # Bradley-Terry over the batch's pairs
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.preference import PairCollator
from ..errors import HfScaleConfigError


class RewardCollator:
    """:class:`PairCollator`'s interleaved batch with ``labels`` one per row: ``[1, 0] * B``
    (chosen, rejected), a LongTensor ``[2B]``. Token labels do not matter to a reward model
    (its score is read at the last token), and reference log-probabilities are dropped."""

    def __init__(self, pad_id: int):
        self.pairs = PairCollator(pad_id)

    def __call__(self, rows) -> dict:
        batch = self.pairs(rows)
        batch.pop("ref_logps", None)
        batch["labels"] = torch.tensor([1, 0] * len(rows), dtype=torch.long)
        return batch


def pair_scores(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores ``[B]``, rejected scores ``[B]``) of an interleaved batch's ``[2B, 1]``
    scores; refuses labels other than :class:`RewardCollator`'s ``[1, 0, 1, 0, ...]``."""
    if scores.dim() != 2 or scores.shape[-1] != 1:
        raise HfScaleConfigError(f"a reward model gives one score per sequence; this one gives {tuple(scores.shape)} "
                                 "(num_labels must be 1).")
    expected = torch.tensor([1, 0], device=labels.device).repeat(scores.shape[0] // 2)
    if scores.shape[0] % 2 or labels.shape != expected.shape or not torch.equal(labels.long(), expected):
        raise HfScaleConfigError(
            f"a reward batch holds pairs interleaved, labels [1, 0] * pairs (RewardCollator); got labels of shape "
            f"{tuple(labels.shape)} for {scores.shape[0]} rows. Micro-batches must keep pairs together.")
    pairs = scores.float().view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """TRL ``RewardTrainer``'s loss: mean of ``-logsigmoid(chosen - rejected)`` over the pairs,
    plus ``center_rewards_coefficient * mean((chosen + rejected) ** 2)`` when given."""
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


def apply_reward_loss(model: nn.Module, center_rewards_coefficient: float | None = None) -> None:
    """Make ``model``'s forward return the Bradley-Terry loss of its pooled scores.

    A forward called with ``labels`` (:class:`RewardCollator`'s) runs without them (the
    architecture's own loss, a regression for one label, is never computed) and its output's
    ``loss`` is :func:`bradley_terry_loss` of the scores it returns; a forward without labels
    is unchanged. ``model`` is a transformers sequence classifier with one label."""
    labels_of: dict = {}

    def take_labels(module, args, kwargs):
        labels_of["labels"] = kwargs.pop("labels", None)
        return args, kwargs

    def add_loss(module, args, kwargs, output):
        labels = labels_of.pop("labels", None)
        if labels is None:
            return output
        chosen, rejected = pair_scores(output.logits, labels)
        output["loss"] = bradley_terry_loss(chosen, rejected, center_rewards_coefficient)
        return output

    model.register_forward_pre_hook(take_labels, with_kwargs=True)
    model.register_forward_hook(add_loss, with_kwargs=True)


@torch.no_grad()
def reward_scores(scores: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(loss sum, pairs, pairs ranked right, pairs) of an evaluation batch, each pair weighted by
    ``weight`` (0 for the copies that even out the ranks): ranked right when the chosen
    completion scores strictly higher. The loss is the Bradley-Terry term alone."""
    chosen, rejected = pair_scores(scores, labels)
    losses = -F.logsigmoid(chosen - rejected)
    right = (chosen > rejected).float()
    weight = weight.to(losses.device, losses.dtype)
    return torch.stack([(losses * weight).sum(), weight.sum(), (right * weight).sum(), weight.sum()]).float()
