"""What a simulated rank's peers would send it, for the exchanges whose values steer the run.

Torch's fake process group completes every collective and point-to-point message at once and
writes nothing into the receiving buffer; under ``FakeTensorMode`` that buffer holds shapes only,
which is all that most exchanges need (the activations and gradients a pipeline stage receives,
FSDP's gathered shards). A few exchanges carry values the receiving rank then acts on; one
simulated rank has no peers to send them, so these stand-ins give what the peers would send if
they were like this rank (as :func:`.simulate._symmetric_objects` does for object collectives):

- :func:`pipeline_peers`: a pipeline stage's start-up exchanges (torch 2.13's
  ``PipelineStage``). The vote on the metadata mode: every stage votes as this rank's stages do
  (hf_scale's stages give no static shapes: every stage infers them). The forward metadata a
  stage receives from the stage before it (held by another rank): the hidden states that stage
  hands on, ``(microbatch, seq, hidden)`` (``hidden``: the input embedding's width) in the
  dtype the blocks compute in (FSDP's ``param_dtype`` under mixed precision, else the
  parameters' dtype: autocast keeps the residual stream in it). A rank that also sends hidden
  states on (a middle stage) is checked against that assumption: what it sends must be what it
  was assumed to receive (:attr:`PeerLog.mismatches`). The backward metadata a stage receives
  from the stage after it: the gradients of its own outputs (same shapes and dtypes: exact).
  And the pipeline's check that every pp rank passed the same batch (it reads sums of the
  token ids back): the peers passed this rank's batch.
- :func:`expert_peers`: see its docstring (ep's token counts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class PeerLog:
    """What the stand-ins assumed, and where the rank's own messages contradicted it."""

    assumed: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


@contextlib.contextmanager
def pipeline_peers(microbatch: int, seq: int) -> Iterator[PeerLog]:
    """The pipeline stand-ins above while entered; ``microbatch`` x ``seq`` tokens per
    microbatch (what the simulation feeds the pipeline)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        _TensorMeta,
    )
    from torch.distributed.pipelining.stage import PipelineStage

    from ..parallel.pp_schedule import Pipeline

    log = PeerLog()
    received: dict[int, tuple] = {}  # stage index -> the forward metas assumed received

    def warmup_p2p(self, stages, has_backward, p2p_done):
        dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    def recv_meta(self, src_stage: int):
        if src_stage > self.stage_index:  # from the next stage: the gradients of this stage's outputs
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        width, dtype = _hidden_width(self.submod), _compute_dtype(self.submod)
        meta = _TensorMeta.from_tensor(torch.empty((microbatch, seq, width), dtype=dtype, device="meta")
                                       .requires_grad_(self.has_backward))
        received[self.stage_index] = (meta,)
        note = (f"stage {self.stage_index} receives hidden states {tuple(meta.shape)} {str(dtype).removeprefix('torch.')} "
                f"from stage {src_stage} (assumed)")
        if note not in log.assumed:
            log.assumed.append(note)
        return _StageForwardMeta(forward_metas=(meta,))

    def send_meta(self, meta, dst_stage: int) -> None:
        if isinstance(meta, _StageForwardMeta) and self.stage_index in received:
            sent, assumed = _plain(meta.forward_metas), _plain(received[self.stage_index])
            if sent != assumed:
                log.mismatches.append(f"stage {self.stage_index} was assumed to receive {assumed} but sends {sent}")

    def same_batch(self, ids, mask, labels, positions, problem) -> None:
        if problem is not None:
            from ..errors import HfScaleConfigError

            raise HfScaleConfigError(problem)

    replaced = [(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p), (PipelineStage, "_recv_meta", recv_meta),
                (PipelineStage, "_send_meta", send_meta), (Pipeline, "_check_same_batch", same_batch),
                (Pipeline, "_label_tokens", staticmethod(_all_labeled))]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in replaced]
    try:
        for owner, name, fn in replaced:
            setattr(owner, name, fn)
        yield log
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _all_labeled(labels: torch.Tensor) -> tuple[int, int]:
    """The label tokens of a batch whose labels are its token ids (the simulation's): all but the
    first of each sequence, and every position (the pipeline counts them from the values, which
    are fake)."""
    return labels[:, 1:].numel(), labels.numel()


def _plain(metas) -> list[tuple]:
    return [(tuple(m.shape), m.dtype) for m in metas]


def _hidden_width(stage: torch.nn.Module) -> int:
    """The width of the hidden states between stages: the (text) config's ``hidden_size``, else
    the input embedding's (its stand-in keeps it; a factored embedding, OPT-350m's 512 projected
    to 1024, is narrower than the blocks)."""
    from ..parallel.pp import ZeroEmbedding

    config = getattr(getattr(stage, "view", stage), "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if isinstance(getattr(config, "hidden_size", None), int):
        return config.hidden_size
    for module in stage.modules():
        if isinstance(module, ZeroEmbedding):
            return module.dim
        if isinstance(module, torch.nn.Embedding):
            return module.embedding_dim
    raise NotImplementedError(f"{type(stage).__name__} holds no input embedding (nor its stand-in): the width "
                              "of the hidden states it receives is unknown to the simulation")


def _compute_dtype(stage: torch.nn.Module) -> torch.dtype:
    """The dtype the stage's blocks compute in: FSDP's ``param_dtype``, else the parameters' own."""
    from torch.distributed.fsdp import FSDPModule

    for module in stage.modules():
        if isinstance(module, FSDPModule):
            dtype = module._get_fsdp_state()._mp_policy.param_dtype
            if dtype is not None:
                return dtype
    return next((p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32)


@contextlib.contextmanager
def expert_peers() -> Iterator[PeerLog]:
    """Expert parallel's counts step (:meth:`hf_scale.parallel.ep.TokenDispatcher.exchange_counts`)
    as if the routing were balanced: the router's choices are fake values (the token rows each
    rank sends, and so what it receives, are unknown), so each rank is taken to send ``T x k / ep``
    of its ``T`` tokens' ``k`` (token, expert) pairs to every ep rank, ``T x k / E`` to each expert,
    and to receive as many (the remainder of an uneven division to the first ranks and experts).
    The exchanged rows, and so the experts' activations, are then those of a perfectly balanced
    router: a real router's imbalance (the load-balancing loss bounds it, it does not remove it)
    makes the busiest ep rank hold more."""
    from ..parallel.ep import TokenDispatcher

    log = PeerLog()

    def exchange_counts(self, expert_ids: torch.Tensor):
        pairs = expert_ids.shape[0]
        per_expert = _split(pairs, self.ep * self.num_local)
        sizes = [sum(per_expert[r * self.num_local:(r + 1) * self.num_local]) for r in range(self.ep)]
        recv_counts = torch.tensor(per_expert, device=expert_ids.device).view(self.ep, self.num_local)
        note = (f"ep={self.ep}: balanced routing assumed: {pairs} (token, expert) pairs per rank and layer, "
                f"{'/'.join(map(str, sorted(set(sizes))))} sent to and received from each ep rank")
        if note not in log.assumed:
            log.assumed.append(note)
        return recv_counts, sizes, list(sizes)

    saved = TokenDispatcher.__dict__["exchange_counts"]
    TokenDispatcher.exchange_counts = exchange_counts
    try:
        yield log
    finally:
        TokenDispatcher.exchange_counts = saved


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal whole parts, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]
