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
- ``kto``: ``KTOTrainer`` (``trl/trainer/kto_trainer.py``), unpaired: :func:`kto_losses` per
  example against the KL reference point (:mod:`hf_scale.parallel.kto` runs the step).

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

LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo", "kto")
REFERENCE_FREE = ("simpo", "orpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """Which preference loss, and its knobs (TRL's names and defaults).

    ``rpo_alpha``: weight of the NLL term on chosen (RPO for the DPO family, CPO's ``cpo_alpha``
    for simpo; None = no term); orpo always has its NLL term, weight 1. ``desirable_weight`` /
    ``undesirable_weight``: kto's weights of the desirable (label true) and undesirable examples'
    losses (TRL's ``KTOConfig``); kto is unpaired (:mod:`hf_scale.parallel.kto`), not a pair loss.
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

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
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise HfScaleConfigError(f"preference {name}={value!r} must be a number > 0 (TRL's default: 1.0).")
            if value != 1.0 and self.loss != "kto":
                raise HfScaleConfigError(f"preference {name}={value} weighs kto's unpaired examples; loss "
                                         f"{self.loss!r} has pairs. Use loss: kto, or leave {name} at 1.0.")
        if self.label_smoothing and self.loss in ("ipo", "hinge", "orpo", "kto"):
            raise HfScaleConfigError(
                f"preference label_smoothing={self.label_smoothing} has no meaning for loss {self.loss!r}: "
                "use sigmoid (conservative DPO), robust or simpo, or set label_smoothing to 0."
            )
        if self.rpo_alpha is not None and (self.rpo_alpha < 0 or self.loss in ("orpo", "kto")):
            raise HfScaleConfigError(
                f"preference rpo_alpha={self.rpo_alpha!r}: a weight >= 0 for the NLL term on chosen, and "
                "not for orpo (whose NLL term is its own, weight 1) nor kto (unpaired: TRL's KTO has no NLL "
                "term). Set it to null or a number >= 0."
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
    if knobs.loss == "kto":
        raise HfScaleConfigError("kto is unpaired: its loss is hf_scale.parallel.preference_loss.kto_losses, on "
                                 "examples with a desirable / undesirable label, not on pairs.")
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


KTO_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@dataclass
class KtoTerms:
    """Per example: KTO's loss (weighted), reward and summed completion log-prob, and its label."""

    losses: torch.Tensor
    rewards: torch.Tensor
    logps: torch.Tensor
    desirable: torch.Tensor

    def metric_sums(self, weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """TRL's KTO metrics summed over the desirable (``*/chosen``) and undesirable
        (``*/rejected``) examples, with their counts ``count/chosen`` / ``count/rejected``
        (detached, fp64; ``weight`` per example, e.g. 0 for padding copies): divide each by its
        count after summing over micro-batches and data-parallel ranks."""
        w = torch.ones_like(self.logps, dtype=torch.float64) if weight is None else weight.detach().double()
        w = w.to(self.logps.device)
        good = self.desirable.to(w.device).double()
        out = {}
        for side, mask in (("chosen", good * w), ("rejected", (1 - good) * w)):
            out[f"rewards/{side}"] = (self.rewards.detach().double() * mask).sum()
            out[f"logps/{side}"] = (self.logps.detach().double() * mask).sum()
            out[f"count/{side}"] = mask.sum()
        return out


def kto_losses(knobs: PreferenceLoss, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor | float) -> KtoTerms:
    """KTO's per-example loss (TRL 1.16 ``KTOTrainer``, loss_type ``kto``; Eqn (7) of the KTO
    paper) from the summed completion log-probs ``logps`` ``[N]``, the reference's, the labels
    (True: desirable) and the KL reference point ``kl`` (detached, clamped at 0 by the caller):
    ``desirable_weight x (1 - sigmoid(beta (ratio - kl)))`` for a desirable example,
    ``undesirable_weight x (1 - sigmoid(beta (kl - ratio)))`` for an undesirable one, where
    ``ratio = logps - ref_logps``. The reward is ``beta x ratio``."""
    beta = knobs.beta
    ratio = logps - ref_logps.to(logps.dtype)
    kl = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()
    desirable = desirable.to(device=logps.device, dtype=torch.bool)
    chosen = knobs.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    rejected = knobs.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return KtoTerms(torch.where(desirable, chosen, rejected), beta * ratio.detach(), logps, desirable)


def kto_means(sums: dict, examples: float) -> dict[str, float]:
    """TRL's KTO metrics from summed :meth:`KtoTerms.metric_sums` (and ``kl``: the KL reference
    point times each micro-batch's examples): ``rewards/*`` and ``logps/*`` per side when the
    side has examples, ``rewards/margins`` when both have, ``kl`` the examples' mean."""
    out = {}
    for side in ("chosen", "rejected"):
        count = float(sums.get(f"count/{side}", 0.0))
        if count > 0:
            out[f"rewards/{side}"] = float(sums[f"rewards/{side}"]) / count
            out[f"logps/{side}"] = float(sums[f"logps/{side}"]) / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    if "kl" in sums:
        out["kl"] = float(sums["kl"]) / max(examples, 1.0)
    return out
