"""Preference losses as pure functions of per-sequence log-probabilities (no model, no layout).

Each loss follows TRL 1.16's definition of the same name, term for term:

- ``sigmoid`` (DPO), ``robust``, ``ipo``, ``hinge``: ``DPOTrainer`` (``trl/trainer/dpo_trainer.py``),
  on the log-ratios ``policy - reference`` of summed completion log-probs; ``ipo`` divides each
  log-ratio by its completion's token count first. ``sigmoid`` with ``label_smoothing > 0`` is
  conservative DPO (cDPO: ``-(1-e) logsig(b d) - e logsig(-b d)``), which TRL 1.16's DPO sigmoid no
  longer applies (it is CPO's ``sigmoid``); with ``label_smoothing = 0`` the two are one.
- ``rpo_alpha``: RPO's SFT term on chosen, TRL 1.16's ``loss_type=["sigmoid", "sft"]`` with
  ``loss_weights=[1, rpo_alpha]``: ``rpo_alpha`` x the mean negative log-likelihood of the chosen
  completions' tokens (a mean over the batch's tokens, not per pair).
- ``simpo``: ``CPOTrainer(loss_type="simpo")`` (``trl/experimental/cpo``): reference-free, on the
  length-normalised (token-mean) log-probs, ``logits = c - r - gamma / beta``, with cDPO's label
  smoothing; ``rpo_alpha`` plays CPO's ``cpo_alpha`` (set 0 / None for pure SimPO).
- ``orpo``: ``ORPOTrainer`` (``trl/experimental/orpo``): token-mean log-probs, the log odds ratio
  ``(c - r) - (log(1 - e^c) - log(1 - e^r))``, loss ``NLL(chosen) - beta logsig(log odds)``, where
  ORPO's NLL is over the chosen sequence's every token, prompt included (TRL's labels there are
  the attended input ids).

Rewards, as TRL logs them: ``beta x`` the log-ratio (DPO family) or ``beta x`` the token-mean
log-prob (simpo, orpo); ``logps/*`` are the log-probs the loss uses (summed for the DPO family,
token means for simpo and orpo).

Usage::

    knobs = PreferenceLoss("sigmoid", beta=0.1)
    terms = pair_losses(knobs, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen, ref_rejected)
    loss = terms.losses.mean() + knobs.nll_weight * nll_per_token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import HfScaleConfigError

LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """Which preference loss, and its knobs (TRL's names and defaults).

    ``rpo_alpha``: weight of the NLL term on chosen (RPO for the DPO family, CPO's ``cpo_alpha``
    for simpo; None = no term); orpo always has its NLL term, weight 1.
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise HfScaleConfigError(f"preference loss {self.loss!r} is not one of {', '.join(LOSSES)}.")
        if not isinstance(self.beta, (int, float)) or self.beta <= 0:
            raise HfScaleConfigError(f"preference beta={self.beta!r} must be a number > 0 (TRL's default: 0.1).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise HfScaleConfigError(
                f"preference label_smoothing={self.label_smoothing!r} must lie in [0, 0.5) (the probability "
                "that a preference label is flipped)."
            )
        if self.label_smoothing and self.loss in ("ipo", "hinge", "orpo"):
            raise HfScaleConfigError(
                f"preference label_smoothing={self.label_smoothing} has no meaning for loss {self.loss!r}: "
                "use sigmoid (conservative DPO), robust or simpo, or set label_smoothing to 0."
            )
        if self.rpo_alpha is not None and (self.rpo_alpha < 0 or self.loss == "orpo"):
            raise HfScaleConfigError(
                f"preference rpo_alpha={self.rpo_alpha!r}: a weight >= 0 for the NLL term on chosen, and "
                "not for orpo (whose NLL term is its own, weight 1). Set it to null or a number >= 0."
            )

    @property
    def needs_reference(self) -> bool:
        """simpo and orpo are reference-free; the DPO family compares with a reference."""
        return self.loss not in REFERENCE_FREE

    @property
    def token_mean(self) -> bool:
        """Whether the loss uses token-mean log-probs (simpo, orpo) rather than sums."""
        return self.loss in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """The weight of the NLL term on chosen (0: none)."""
        return 1.0 if self.loss == "orpo" else float(self.rpo_alpha or 0.0)

    @property
    def nll_on_prompt(self) -> bool:
        """ORPO's NLL counts the chosen prompt's tokens too; RPO's / CPO's the completion's only."""
        return self.loss == "orpo"


@dataclass
class PairTerms:
    """Per pair: the loss (the NLL term aside), the rewards and the log-probs the loss used."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor

    def metric_sums(self, weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """TRL's metrics summed over the pairs (detached, fp64; ``weight`` per pair, e.g. 0 for
        padding copies): divide by the pair count for the means, after summing over
        micro-batches and data-parallel ranks."""
        c, r = self.chosen_rewards.detach().double(), self.rejected_rewards.detach().double()
        values = (c, r, c - r, (c > r).double(), self.chosen_logps.detach().double(),
                  self.rejected_logps.detach().double())
        w = 1.0 if weight is None else weight.detach().double().to(c.device)
        return {name: (v * w).sum() for name, v in zip(METRICS, values)}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2`` (TRL's ORPO helper)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(knobs: PreferenceLoss, chosen: torch.Tensor, rejected: torch.Tensor,
                chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None) -> PairTerms:
    """The per-pair loss of ``knobs.loss`` from summed completion log-probs ``chosen`` /
    ``rejected`` ``[P]``, their completion token counts and (DPO family) the reference's sums."""
    beta, ls = knobs.beta, knobs.label_smoothing
    chosen_tokens = chosen_tokens.to(chosen.dtype).clamp(min=1)
    rejected_tokens = rejected_tokens.to(rejected.dtype).clamp(min=1)
    if knobs.token_mean:
        c, r = chosen / chosen_tokens, rejected / rejected_tokens
        if knobs.loss == "simpo":
            logits = c - r - knobs.simpo_gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        else:  # orpo
            c64, r64 = c.float(), r.float()
            log_odds = (c64 - r64) - (log1mexp(c64) - log1mexp(r64))
            losses = -beta * F.logsigmoid(log_odds)
        return PairTerms(losses, beta * c.detach(), beta * r.detach(), c, r)
    if ref_chosen is None or ref_rejected is None:
        raise HfScaleConfigError(
            f"preference loss {knobs.loss!r} compares with a reference: pass the reference's log-probs "
            "(ref_chosen / ref_rejected), or use a reference-free loss (simpo, orpo)."
        )
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if knobs.loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - ls) - F.logsigmoid(-beta * delta) * ls
    elif knobs.loss == "robust":
        losses = (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
    elif knobs.loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:  # ipo: token-mean log-ratios
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected)
