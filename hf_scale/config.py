"""Typed configuration: :class:`ParallelConfig` and a small loader from dicts, YAML and CLI flags.

Configs are plain dataclasses. :func:`from_dict` builds one from a mapping and rejects unknown
keys (suggesting the closest name) and values of the wrong type, naming the full key path.
:func:`apply_overrides` applies ``--section.field value`` flags to a nested dict before that.

Usage::

    cfg = ParallelConfig(strategy="hsdp", dp_replicate=2, mixed_precision="bf16")
    cfg = from_dict(ParallelConfig, {"strategy": "zero2"})
    cfg = load_yaml(ParallelConfig, "configs/parallel.yaml", ["--strategy", "ddp"])
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from .errors import HfScaleConfigError

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
# Mixture-of-experts options of other stacks (DeepSpeed-MoE, Megatron, Tutel) that hf_scale does
# not have: what to do instead, for the unknown-key error
_DROPLESS = ("hf_scale's expert parallel drops no token and pads none: every (token, expert) pair "
             "reaches its expert, as the model computes in one process. Remove this key.")
_ROUTER = ("The routing is the model's own (router, top-k, normalisation, auxiliary loss), unchanged "
           "under ep: set it on the model's config before loading (e.g. num_experts_per_tok, "
           "router_aux_loss_coef, output_router_logits), not in the parallel config.")
ROUTING_KEYS = dict.fromkeys(("capacity_factor", "eval_capacity_factor", "min_capacity", "expert_capacity",
                              "moe_capacity", "capacity", "drop_tokens", "token_dropping", "moe_token_dropping",
                              "expert_capacity_factor"), _DROPLESS)
ROUTING_KEYS.update(dict.fromkeys(("top_k", "moe_top_k", "num_experts_per_tok", "router_topk", "router_jitter",
                                   "noisy_gate_policy", "aux_loss_coef", "router_aux_loss_coef",
                                   "moe_router_topk", "moe_aux_loss_coeff"), _ROUTER))
# other stacks' names of the parallel degrees (transformers' DistributedConfig, DeepSpeed,
# Megatron, torchtitan), for the unknown-key error: difflib finds none of them close to ours
SYNONYMS = {**dict.fromkeys(("expert_parallel", "expert_parallel_size", "ep_size", "moe_expert_parallel_size",
                             "expert_model_parallel_size", "enable_expert_parallel"), "ep"),
            **dict.fromkeys(("tensor_parallel", "tensor_parallel_size", "tp_size", "tensor_model_parallel_size"), "tp"),
            **dict.fromkeys(("pipeline_parallel", "pipeline_parallel_size", "pp_size", "pipeline_model_parallel_size"),
                            "pp"),
            **dict.fromkeys(("fsdp_size", "data_parallel_shard_degree"), "dp_shard"),
            **dict.fromkeys(("data_parallel_replicate_degree", "replicate_size"), "dp_replicate"),
            **dict.fromkeys(("context_parallel", "context_parallel_size", "context_parallel_degree", "cp_size",
                             "cp_degree"), "cp")}
AUTO = "auto"  # strategy: let hf_scale.layout_search choose the layout (fields given beside it stay fixed)
PRECISIONS = (None, "bf16", "fp16")
AC_MODES = (None, "full", "selective")
# torch.distributed.pipelining schedules; the last three hold several stages per rank.
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# how context parallel deals a sequence out: head_tail (rank r: chunks r and 2cp-1-r of 2cp, the
# causal work balanced) or contiguous (rank r: chunk r of cp)
CP_LAYOUTS = ("head_tail", "contiguous")
CP_ATTENTIONS = ("auto", "masked")
# how context parallel's attention exchanges the split sequence: allgather (K and V of the whole
# sequence on every rank) or alltoall (Ulysses: heads for sequence, each rank a share of the heads)
CP_EXCHANGES = ("allgather", "alltoall")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv")
PP_GRAD_SYNCS = ("auto", "last", "each")
# schedules whose every microbatch runs a full backward (not split into input and weight
# backwards), where a per-microbatch reduce-scatter follows FSDP2's own post-backward hooks
GRAD_SYNC_EACH_SCHEDULES = ("gpipe", "1f1b")

T = TypeVar("T")


@dataclasses.dataclass
class ParallelConfig:
    """How :func:`hf_scale.parallelize` distributes a model.

    Attributes:
        strategy: ``"fsdp"`` (ZeRO-3: FSDP2 ``fully_shard``, one unit per block plus the root),
            ``"zero2"`` (FSDP2 that keeps parameters gathered between forward and backward),
            ``"zero1"`` (DDP + ``ZeroRedundancyOptimizer``: only optimizer state sharded),
            ``"ddp"`` (DistributedDataParallel) or ``"hsdp"`` (replicate x shard 2-D mesh).
            ``"auto"``: :func:`hf_scale.parallelize` asks the planner for the fastest layout that
            fits this world size and device memory; the other fields given (those not at their
            defaults) are kept fixed (:meth:`fixed_fields`).
        dp_replicate: replica groups. Default: 1, except hsdp where it is the number of nodes.
        dp_shard: ranks that shard one replica. Default: every rank not used by dp_replicate.
        mixed_precision: ``None`` (fp32), ``"bf16"`` or ``"fp16"``: parameters are cast for
            compute, gradients are reduced and stored in fp32. fp16 needs a loss scaler
            (``torch.amp.GradScaler``), as in plain PyTorch.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU
            (fsdp, zero2 and hsdp only).
        activation_checkpointing: ``None``, ``"full"`` (recompute whole blocks) or
            ``"selective"`` (save matmul outputs, recompute the cheap ops in between).
        ac_every: with ``"full"``, checkpoint one block in every ``ac_every`` (1 = all blocks).
        reshard_after_forward: free gathered parameters after forward (fsdp/hsdp). ``None``
            means True for fsdp/hsdp; zero2 is exactly this set to False.
        blocks_per_unit: consecutive blocks grouped into one FSDP unit (fsdp, zero2, hsdp): one
            all-gather and one reduce-scatter per group, so fewer collectives and less per-unit
            work, for a larger gathered unit in memory. ``None``: one block per unit (``"auto"``
            lets the planner choose).
        fsdp_prefetch: FSDP units whose all-gathers each unit issues ahead of need, explicitly,
            in forward and in backward (fsdp, zero2, hsdp). ``None``: FSDP2's defaults (the
            next unit, queued when the host reaches it). 1 hides the forward all-gathers when
            the host is the bottleneck; each unit deeper keeps one more unit gathered.
        tp: tensor-parallel degree: each block's Linear layers are split over ``tp`` ranks (the
            innermost mesh dimension, ranks of one node) by the model's TP plan; the data-parallel
            strategy then runs over ``world_size / tp`` ranks. 1 = no tensor parallel.
        ep: expert-parallel degree (mixture-of-experts models): each of ``ep`` data-parallel ranks
            holds ``num_experts / ep`` whole experts and tokens travel to their experts' rank by
            all-to-all. The ep ranks are carved out of ``dp_shard`` (torchtitan's layout): the
            dense weights stay FSDP-sharded over every data-parallel rank, the experts over the
            ``dp_shard / ep`` ranks that hold the same ones (hsdp: within each replica group,
            the experts replicated over the groups; pp: within each stage). Needs fsdp, zero2 or hsdp, or ddp (dense
            weights replicated and all-reduced by DDP as the backward goes; ep carved out of the
            replicas, the experts FSDP-sharded over the ``replicas / ep`` holding the same ones,
            none when ep is every replica; DeepSpeed-MoE's layout, which transformers'
            ``DistributedConfig`` cannot express: its ep must divide fsdp x tp). 1 = none.
        pp: pipeline-parallel degree: the blocks are split into stages over ``pp`` ranks (the
            outermost mesh dimension); train with ``model.train_step(batch)``. Causal LMs only.
        pp_schedule: one of ``PP_SCHEDULES``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zero_bubble"`` (interleaved zero bubble) or ``"zbv"`` (zero bubble, V-shaped).
        pp_stages_per_rank: stages each pp rank holds (None: 1 for gpipe / 1f1b, 2 for the
            interleaved and zero-bubble schedules; zbv needs exactly 2).
        pp_microbatches: microbatches a batch is split into (None: the number of stages); must
            divide the per-rank batch size.
        pp_split_points: first block index of every stage after the first (None: split so each
            stage's compute, head and embedding included, is balanced).
        pp_grad_sync: when a pipeline stage under fsdp / zero2 / hsdp reduces its gradients
            (:mod:`hf_scale.parallel.pp_grads`). ``"last"``: torch's default, once after the
            last microbatch: until then the stage holds its parameters gathered and its
            gradients unsharded in fp32 (the whole stage's, on every rank). ``"each"``: every
            microbatch's backward reduce-scatters its gradients into the sharded gradient (they
            accumulate there) and reshards, so memory stays sharded through the schedule, for
            one reduce-scatter (and all-gather) of the stage per microbatch instead of one per
            step; gpipe and 1f1b only. ``"auto"`` (default): ``"each"`` on a CUDA device where
            the stage's unsharded fp32 gradients exceed half the device memory free once the
            model is sharded onto it (on any rank: one choice for all), else ``"last"``; on
            the CPU ``"last"``. An explicit value wins.
        loss_chunk_tokens: causal LMs only: compute output head + cross-entropy this many tokens
            at a time, so the full logits never exist (see ``hf_scale.parallel.loss``). Training
            forwards (labels given, gradients on) then return ``logits=None``.
        loss_labeled_only: causal LMs only: compute the output head and cross-entropy at the
            positions that have a label only (prompt tokens masked with -100 get no logits): the
            same loss and gradients, with less work where most positions are masked (instruction
            tuning: the head of a 50k vocabulary is ~20% of a small model's FLOPs). Training
            forwards then return ``logits=None``; evaluation and ``generate`` are unchanged.
        cp: context-parallel degree: every sequence of a batch is split over ``cp`` ranks, which
            all get the same batch; attention all-gathers keys and values over them
            (:mod:`hf_scale.parallel.cp`). Causal LMs whose attention goes through transformers'
            attention registry only; FSDP then shards over ``dp_shard x cp``. 1 = none.
        cp_layout: one of ``CP_LAYOUTS``: ``"head_tail"`` (rank r holds chunks r and 2cp-1-r of
            2cp: every rank has as much causal attention work) or ``"contiguous"`` (rank r holds
            chunk r of cp).
        cp_attention: one of ``CP_ATTENTIONS``: ``"auto"`` (default): plain causal layers on the CPU
            attend in blocks without a mask, K and V gathered per layer and freed (memory 1/cp,
            :mod:`hf_scale.parallel.cp_blocks`), the rest (packed documents, sliding windows,
            soft-capping, other devices) under a mask; ``"masked"``: the mask everywhere (the
            gathered K / V kept for backward; to compare or to rule the blocks out).
        cp_exchange: one of ``CP_EXCHANGES``: ``"allgather"`` (default): each rank keeps its queries
            and gathers the whole sequence's keys and values; ``"alltoall"`` (Ulysses): q, k and v
            are exchanged heads-for-sequence, each rank attends over the whole sequence with
            heads / cp of the heads (:mod:`hf_scale.parallel.cp_alltoall`): no rank holds the whole
            sequence's K / V of every head. Needs the attention and key-value heads divisible by cp
            (key-value heads fewer than cp and dividing it are repeated).
        packed_attention: packed documents (``position_ids`` restarting at 0, no attention mask)
            attended one document at a time, one causal SDPA call each, instead of one call over
            the whole row under a block-diagonal mask (:mod:`hf_scale.parallel.packed_attention`:
            the same results, attention work ``sum n_d^2`` instead of ``(sum n_d)^2``). Models on
            transformers' ``"sdpa"`` only; not under cp (which keeps documents apart itself).
            None (default): off here; ``hf-scale finetune`` turns it on for packed or
            padding-free data. True / False: as said.
        timeout_seconds: collective timeout when hf_scale creates the process group.
    """

    strategy: str = "fsdp"
    dp_replicate: int | None = None
    dp_shard: int | None = None
    mixed_precision: str | None = None
    cpu_offload: bool = False
    activation_checkpointing: str | None = None
    ac_every: int = 1
    reshard_after_forward: bool | None = None
    blocks_per_unit: int | None = None
    fsdp_prefetch: int | None = None
    tp: int = 1
    ep: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int | None = None
    pp_microbatches: int | None = None
    pp_split_points: list[int] | None = None
    pp_grad_sync: str = "auto"
    loss_chunk_tokens: int | None = None
    loss_labeled_only: bool = False
    cp: int = 1
    cp_layout: str = "head_tail"
    cp_attention: str = "auto"
    cp_exchange: str = "allgather"
    packed_attention: bool | None = None
    timeout_seconds: int = 1800

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, (*STRATEGIES, AUTO))
        _check_choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _check_choice("activation_checkpointing", self.activation_checkpointing, AC_MODES)
        for name in ("dp_replicate", "dp_shard"):
            _check_positive_int(name, getattr(self, name), "or None (derive it from the world size)")
        _check_positive_int("tp", self.tp, "(1 = no tensor parallel)", optional=False)
        if self.tp > 1 and self.strategy in ("ddp", "zero1"):
            raise HfScaleConfigError(
                f"strategy={self.strategy!r} with tp={self.tp}: DDP does not take tensor-parallel "
                "(DTensor) parameters. Use strategy='zero2' (gradients and optimizer state sharded, "
                "parameters kept gathered: DDP's speed) or 'fsdp' with tp."
            )
        self._check_ep()
        self._check_pp()
        self._check_cp()
        _check_positive_int("loss_chunk_tokens", self.loss_chunk_tokens, "(tokens per chunk, e.g. 1024) or None")
        if self.packed_attention is not None and not isinstance(self.packed_attention, bool):
            raise HfScaleConfigError(f"packed_attention={self.packed_attention!r} must be true, false or null.")
        if not isinstance(self.loss_labeled_only, bool):
            raise HfScaleConfigError(f"loss_labeled_only={self.loss_labeled_only!r} must be true or false.")
        _check_positive_int("ac_every", self.ac_every, "(1 = every block)", optional=False)
        if self.ac_every > 1 and self.activation_checkpointing != "full":
            raise HfScaleConfigError(
                f"ac_every={self.ac_every} only applies to activation_checkpointing='full' "
                f"(got {self.activation_checkpointing!r}); set both or drop ac_every."
            )
        sharded = self.strategy in ("fsdp", "zero2", "hsdp", AUTO)  # auto: the planner's choice is checked again
        if self.cpu_offload and not sharded:
            raise HfScaleConfigError(
                f"cpu_offload=True needs a sharded strategy (fsdp, zero2, hsdp), not "
                f"strategy={self.strategy!r}."
            )
        if self.strategy == "zero2" and self.reshard_after_forward:
            raise HfScaleConfigError(
                "strategy='zero2' keeps parameters gathered after forward; "
                "reshard_after_forward=True makes it fsdp: use strategy='fsdp' instead."
            )
        if self.reshard_after_forward is not None and not sharded:
            raise HfScaleConfigError(
                f"reshard_after_forward only applies to fsdp/zero2/hsdp, not "
                f"strategy={self.strategy!r}."
            )
        _check_positive_int("blocks_per_unit", self.blocks_per_unit, "(blocks per FSDP unit) or None (one)")
        if (self.blocks_per_unit or 1) > 1 and not sharded:
            raise HfScaleConfigError(
                f"blocks_per_unit={self.blocks_per_unit} groups FSDP units; strategy="
                f"{self.strategy!r} has none (DDP buckets gradients itself). Use fsdp, zero2 or "
                "hsdp, or drop blocks_per_unit."
            )
        _check_positive_int("fsdp_prefetch", self.fsdp_prefetch,
                            "(FSDP units prefetched ahead) or None (FSDP2's default)")
        if self.fsdp_prefetch is not None and not sharded:
            raise HfScaleConfigError(
                f"fsdp_prefetch={self.fsdp_prefetch} prefetches FSDP all-gathers; strategy="
                f"{self.strategy!r} gathers nothing. Use fsdp, zero2 or hsdp, or drop fsdp_prefetch."
            )
        if self.strategy in ("ddp", "zero1") and self.dp_shard not in (None, 1):
            raise HfScaleConfigError(
                f"strategy={self.strategy!r} replicates the model on every rank; dp_shard="
                f"{self.dp_shard} needs strategy 'fsdp', 'zero2' or 'hsdp'."
            )

    def _check_ep(self) -> None:
        _check_positive_int("ep", self.ep, "(experts split over ep ranks; 1 = no expert parallel)", optional=False)
        if self.ep == 1:
            return
        if self.strategy not in ("fsdp", "zero2", "hsdp", "ddp", AUTO):
            raise HfScaleConfigError(
                f"ep={self.ep} with strategy={self.strategy!r}: expert parallel carves its ranks out "
                "of the data-parallel ones: FSDP's dp_shard (the experts FSDP-sharded over the rest), "
                "or DDP's replicas (the experts FSDP-sharded over those holding the same ones). Use "
                "strategy='fsdp', 'zero2', 'hsdp' "
                "or 'ddp' with ep."
            )
        if self.strategy == "ddp" and self.mixed_precision == "fp16":
            raise HfScaleConfigError(
                f"ep={self.ep} with strategy='ddp' and mixed_precision='fp16': the GradScaler unscales "
                "every gradient in one call, and under ddp + ep the experts' are DTensors beside plain "
                "dense ones, which torch refuses to mix. Use mixed_precision='bf16', or strategy='fsdp' with ep."
            )

    def _check_pp(self) -> None:
        _check_positive_int("pp", self.pp, "(1 = no pipeline parallel)", optional=False)
        for name in ("pp_stages_per_rank", "pp_microbatches"):
            _check_positive_int(name, getattr(self, name), "or None (the default)")
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_stages_per_rank is not None:
            single = self.pp_schedule not in MULTI_STAGE_SCHEDULES
            if single and self.pp_stages_per_rank != 1:
                raise HfScaleConfigError(
                    f"pp_schedule={self.pp_schedule!r} runs one stage per rank, not "
                    f"pp_stages_per_rank={self.pp_stages_per_rank}: use 'interleaved_1f1b' or "
                    "'zero_bubble' for several stages per rank."
                )
            if self.pp_schedule == "zbv" and self.pp_stages_per_rank != 2:
                raise HfScaleConfigError(
                    f"pp_schedule='zbv' places exactly 2 stages on each rank (a V), not "
                    f"pp_stages_per_rank={self.pp_stages_per_rank}: drop the setting or use 'zero_bubble'."
                )
            if not single and self.pp_stages_per_rank < 2:
                raise HfScaleConfigError(
                    f"pp_schedule={self.pp_schedule!r} interleaves several stages per rank: "
                    f"pp_stages_per_rank must be >= 2 (got {self.pp_stages_per_rank}); use '1f1b' for one."
                )
        if self.pp > 1 and self.mixed_precision == "fp16":
            raise HfScaleConfigError(
                f"mixed_precision='fp16' with pp={self.pp}: each stage would scale its own loss and "
                "skip steps on its own overflows, so the stages could drift apart. Use 'bf16' (no loss "
                "scaling) under pipeline parallel."
            )
        if self.pp > 1 and self.cpu_offload:
            raise HfScaleConfigError(
                f"cpu_offload=True with pp={self.pp} is not supported yet (the tied-embedding gradient "
                "sum across stages runs on the device's process group). Drop cpu_offload, or shard "
                "over more ranks (dp_shard) or more stages."
            )
        m, pp = self.pp_microbatches, self.pp
        if m is not None and pp > 1:
            stages = pp * self.stages_per_rank
            if self.pp_schedule == "1f1b" and m < pp:
                raise HfScaleConfigError(
                    f"pp_microbatches={m} with pp_schedule='1f1b' and pp={pp}: 1F1B needs at least "
                    f"one microbatch per stage (>= {pp}); use {pp} or more, or 'gpipe'."
                )
            rounds = max(1, m // pp)
            if self.pp_schedule in ("interleaved_1f1b", "zero_bubble") and m % rounds:
                raise HfScaleConfigError(
                    f"pp_microbatches={m} with pp_schedule={self.pp_schedule!r} and pp={pp}: torch's "
                    f"interleaved schedules run rounds of pp microbatches, so m must be a multiple of "
                    f"m // pp = {rounds}; use a multiple of {pp} (e.g. {stages})."
                )
        if self.pp_split_points is not None and self.pp == 1:
            raise HfScaleConfigError("pp_split_points is set but pp=1: set pp, or drop pp_split_points.")
        _check_choice("pp_grad_sync", self.pp_grad_sync, PP_GRAD_SYNCS)
        if self.pp_grad_sync == "each":
            if self.pp == 1 or not (self.sharded or self.auto):
                raise HfScaleConfigError(
                    f"pp_grad_sync='each' with pp={self.pp} and strategy={self.strategy!r}: it reduce-scatters "
                    "a pipeline stage's gradients per microbatch, so it needs pp > 1 and strategy 'fsdp', "
                    "'zero2' or 'hsdp'. Drop pp_grad_sync, or set those."
                )
            if self.pp_schedule not in GRAD_SYNC_EACH_SCHEDULES:
                raise HfScaleConfigError(
                    f"pp_grad_sync='each' with pp_schedule={self.pp_schedule!r}: supported under "
                    f"{', '.join(map(repr, GRAD_SYNC_EACH_SCHEDULES))} (their microbatches run whole "
                    "backwards). Use one of those, or pp_grad_sync='last'."
                )

    def _check_cp(self) -> None:
        _check_positive_int("cp", self.cp, "(ranks a sequence is split over; 1 = no context parallel)", optional=False)
        _check_choice("cp_layout", self.cp_layout, CP_LAYOUTS)
        _check_choice("cp_attention", self.cp_attention, CP_ATTENTIONS)
        _check_choice("cp_exchange", self.cp_exchange, CP_EXCHANGES)
        if self.cp == 1:
            return
        others = [f"{name}={getattr(self, name)}" for name in ("tp", "pp", "ep") if getattr(self, name) > 1]
        if others:
            raise HfScaleConfigError(
                f"cp={self.cp} with {', '.join(others)}: not yet: context parallel composes with fsdp, zero2 "
                "and ddp (over dp x cp) only, so far. Drop one of them (e.g. cp with more data-parallel ranks "
                f"instead of {others[0].split('=')[0]})."
            )
        if self.strategy not in ("fsdp", "zero2", "ddp", AUTO):  # auto: the planner picks one of those
            why = {"hsdp": "not yet: hsdp with cp (FSDP over dp_shard x cp, replicated over dp_replicate) is untested",
                   "zero1": "not yet: ZeRO-1's optimizer shards over the data-parallel ranks only"}[self.strategy]
            raise HfScaleConfigError(
                f"cp={self.cp} with strategy={self.strategy!r}: {why}. Use strategy='fsdp', 'zero2' or 'ddp' with cp."
            )

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each pp rank (1 unless an interleaved schedule)."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def sharded(self) -> bool:
        """True when parameters are sharded with FSDP2 (fsdp, zero2, hsdp)."""
        return self.strategy in ("fsdp", "zero2", "hsdp")

    @property
    def auto(self) -> bool:
        """True when the planner chooses the layout (``strategy="auto"``)."""
        return self.strategy == AUTO

    def fixed_fields(self) -> dict[str, Any]:
        """The fields set away from their defaults (``strategy`` aside): what ``"auto"`` keeps."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "strategy" and getattr(self, f.name) != f.default}


def as_parallel_config(value: ParallelConfig | dict | None) -> ParallelConfig:
    """A ParallelConfig from itself, a dict of its fields, or None (the defaults)."""
    if value is None:
        return ParallelConfig()
    if isinstance(value, ParallelConfig):
        return value
    if isinstance(value, Mapping):
        return from_dict(ParallelConfig, dict(value))
    raise HfScaleConfigError(
        f"a parallel config must be a ParallelConfig or a dict, got {type(value).__name__}."
    )


def is_auto_request(config) -> bool:
    """``"auto"``, ``{"strategy": "auto", ...}`` or ``ParallelConfig(strategy="auto")``: a request
    for the planner's layout (:func:`hf_scale.api.resolve_parallel_config`)."""
    if isinstance(config, str):
        return config == "auto"
    if isinstance(config, ParallelConfig):
        return config.auto
    return isinstance(config, Mapping) and config.get("strategy") == "auto"


def _check_positive_int(name: str, value: Any, hint: str, optional: bool = True) -> None:
    """Refuse anything but an integer >= 1 (a bool is not one; None only where ``optional``),
    naming the field, the value and ``hint``: what the number means, or what None does."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HfScaleConfigError(f"{name}={value!r}: must be a positive integer {hint}.")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise HfScaleConfigError(f"{name}={value!r} is not one of {shown}.")


# ---------------------------------------------------------------- generic loading


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, recursing into nested dataclass fields.

    Raises :class:`HfScaleConfigError` naming the full key (``train.lr``) for an unknown key
    (with the closest known one) or a value of the wrong type.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise HfScaleConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            if SYNONYMS.get(key) in fields:
                close = [SYNONYMS[key]]
            hint = f" Did you mean '{close[0]}'?" if close else ""
            if cls.__name__ == "ParallelConfig" and key in ROUTING_KEYS:
                hint = f" {ROUTING_KEYS[key]}"
            raise HfScaleConfigError(
                f"unknown config key '{where}'.{hint} Known keys: {', '.join(fields)}."
            )
        kwargs[key] = _coerce(hints[key], value, where)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except HfScaleConfigError as e:
                errors.append(str(e))
        raise HfScaleConfigError(errors[0] if errors else f"{where}: bad value {value!r}.")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise HfScaleConfigError(f"{where}={value!r} is not one of {typing.get_args(tp)}.")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise HfScaleConfigError(f"{where}: expected a list, got {value!r}.")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return origin(items)
    if origin is dict or tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (
        not isinstance(value, tp) or (tp is int and isinstance(value, bool))
    ):
        raise HfScaleConfigError(
            f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}."
        )
    return value


def apply_overrides(data: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """Apply ``--a.b value`` (or ``--a.b=value``) flags to nested dict ``data``, in place.

    Values are parsed as YAML scalars, so ``--train.lr 1e-4`` gives a float and
    ``--parallel.mixed_precision null`` gives None.
    """
    import yaml

    args = list(argv)
    while args:
        flag = args.pop(0)
        if not flag.startswith("--"):
            raise HfScaleConfigError(f"expected a --section.field flag, got {flag!r}.")
        key, sep, raw = flag[2:].partition("=")
        if not sep:
            if not args:
                raise HfScaleConfigError(f"flag {flag} has no value.")
            raw = args.pop(0)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise HfScaleConfigError(f"--{key}: '{part}' is not a section.")
        try:
            node[leaf] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise HfScaleConfigError(
                f"--{key} {raw!r}: not a YAML value ({problem}); quote text, write lists as [a, b]."
            ) from None
    return data


def load_yaml(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    """Load dataclass ``cls`` from a YAML file, then apply ``--key value`` overrides."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise HfScaleConfigError(f"config file {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        said = "; ".join(s for s in (e.context, e.problem) if s)
        raise HfScaleConfigError(
            f"{where}: YAML syntax error: {said} (line {mark.line + 1}, column {mark.column + 1}). "
            "Fix the recipe there (indent with spaces, quote values containing ': ' or '#')."
            if mark else f"{where}: YAML syntax error: {said}. Fix the recipe."
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise HfScaleConfigError(f"{path}: not a readable YAML file ({' '.join(str(e).split())}).") from None
    return from_dict(cls, apply_overrides(data, overrides or []))
