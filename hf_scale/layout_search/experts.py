"""A mixture-of-experts model as the planner sees it: its routed experts, how many a token uses,
and what expert parallel (``Layout.ep``) changes in memory, compute and communication.

The numbers come from :func:`hf_scale.layout_preview.ep_report` (what ``hf-scale plan --ep N``
prints), itself reading the engine's experts layout (:func:`hf_scale.model_plans.ep.experts_layout`:
transformers' ``base_model_ep_plan``, else an ``...Experts`` module with ``num_experts``), and
the config's ``num_experts_per_tok`` (or ``top_k``); never a model name. A model without routed
experts (or whose experts are not called with the routing: those ep refuses) has no
:class:`MoeFacts`: every parameter counts as active and ep is never tried.

- active compute: a token runs ``top_k`` of the ``E`` experts of each MoE layer, so
  ``(1 - top_k / E)`` of the experts' weights are idle per token (:func:`inactive_params`);
- expert parallel: ``E / ep`` whole experts per rank, FSDP-sharded over the ``dp_shard / ep``
  ranks that hold the same ones: the same bytes per rank as FSDP over ``dp_shard``, but a layer
  gathers only its ``1 / ep`` share of the experts for compute, and its FSDP collectives run
  over ``dp_shard / ep`` ranks;
- the all-to-all: ``tokens x hidden x top_k x 2`` (out and back) per MoE layer in forward, as
  much again in backward (:func:`all_to_all_bytes`), ``(ep - 1) / ep`` of it leaving the rank
  when routing is even.

Usage::

    moe = moe_facts(facts)            # None for a dense model
    ep_degrees(facts)                 # (1, 2, 4, ...): 1 and the divisors of num_experts
    all_to_all_bytes(facts, tokens=4096, element_bytes=2)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HfScalePlanError
from .profile import ModelFacts


@dataclass(frozen=True)
class MoeFacts:
    """The routed experts of a model: counts from ``ep_report`` at ep = 1."""

    num_experts: int
    top_k: int
    moe_layers: int
    expert_params: int  # every routed expert's weights, all MoE layers
    trainable_expert_params: int  # of them, those that train (all, unless an adapter run froze them)
    hidden: int
    # all-to-all bytes of one token per byte of element, one step (forward + backward): hidden x
    # top_k x 2 directions x 2 passes x MoE layers (ep_report at tokens=1, act_bytes=1)
    all_to_all_per_token: int
    blocks: frozenset[int] = frozenset()  # the blocks (wrap units, in order) that hold routed experts

    @property
    def layer_params(self) -> int:
        """One MoE layer's experts (every layer holds the same count)."""
        return self.expert_params // self.moe_layers

    @property
    def frozen_fraction(self) -> float:
        """The experts' share that does not train (an adapter run's frozen experts)."""
        return (self.expert_params - self.trainable_expert_params) / self.expert_params

    @property
    def idle_fraction(self) -> float:
        """The experts' share a token does not run: ``1 - top_k / E``."""
        return 1 - min(self.top_k, self.num_experts) / self.num_experts


def moe_facts(facts: ModelFacts) -> MoeFacts | None:
    """The model's routed experts, or None (dense, or experts ep cannot split); once per model."""
    return facts.cached("moe", lambda: _moe_facts(facts))


def _moe_facts(facts: ModelFacts) -> MoeFacts | None:
    from ..layout_preview import ep_report
    from ..model_plans import wrap_units
    from ..model_plans.ep import experts_layout, moe_blocks

    try:
        layout = experts_layout(facts.model, facts.plan)
    except HfScalePlanError:  # experts of different counts: ep refuses the model, count it dense
        return None
    if not layout.is_moe:
        return None
    report = ep_report(facts.model, facts.plan, 1, tokens=1, act_bytes=1)
    trainable = sum(p.numel() for name, params in layout.modules.items() for p in
                    (facts.model.get_submodule(name).get_parameter(n) for n in params) if p.requires_grad)
    blocks = moe_blocks(facts.model, wrap_units(facts.model, facts.plan), layout.modules)
    return MoeFacts(num_experts=report["num_experts"], top_k=report["top_k"], moe_layers=report["moe_layers"],
                    expert_params=report["expert_params"], trainable_expert_params=trainable,
                    hidden=report["hidden"], all_to_all_per_token=report["all_to_all_bytes_step"], blocks=blocks)


def ep_degrees(facts: ModelFacts) -> tuple[int, ...]:
    """The expert-parallel degrees worth trying: 1, and for a MoE model every divisor of its
    experts (the chooser keeps those that divide ``dp_shard``)."""
    moe = moe_facts(facts)
    if moe is None:
        return (1,)
    return tuple(d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0)


def check_layout_ep(facts: ModelFacts, ep: int) -> None:
    """Refuse an ``ep`` the engine would refuse for this model, with its message
    (:func:`hf_scale.model_plans.ep.check_ep`: a dense model, an ep that does not divide the experts)."""
    if ep > 1:
        facts.cached(("ep_check", ep), lambda: _check(facts, ep))


def _check(facts: ModelFacts, ep: int) -> bool:
    from ..model_plans.ep import check_ep, experts_layout

    check_ep(experts_layout(facts.model, facts.plan), facts.model, facts.plan, ep)
    return True


def inactive_params(facts: ModelFacts) -> tuple[float, float]:
    """Matmul parameters a token does not run (the unchosen experts), and of them the trainable
    ones; (0, 0) for a dense model."""
    moe = moe_facts(facts)
    if moe is None:
        return 0.0, 0.0
    return moe.expert_params * moe.idle_fraction, moe.trainable_expert_params * moe.idle_fraction


def all_to_all_bytes(facts: ModelFacts, tokens: int, element_bytes: int) -> int:
    """Bytes one rank exchanges by all-to-all in one step of ``tokens`` tokens (forward and
    backward, out and back, every MoE layer), at ``element_bytes`` per value; 0 for a dense model.
    ``ep_report``'s arithmetic: tokens x hidden x top_k x 2 x 2 x MoE layers x bytes."""
    moe = moe_facts(facts)
    return 0 if moe is None else tokens * element_bytes * moe.all_to_all_per_token


def dispatch_buffer_bytes(facts: ModelFacts, tokens: int, element_bytes: int) -> int:
    """One MoE layer's all-to-all token buffers under ep: the ``tokens x top_k`` rows of
    ``hidden`` sent out and the rows received back, at ``element_bytes`` per value."""
    moe = moe_facts(facts)
    return 0 if moe is None else 2 * tokens * moe.top_k * moe.hidden * element_bytes
