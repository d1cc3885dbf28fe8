"""The order of operations behind ``parallelize``, one named step each, torchtitan's order.

:func:`apply_parallelism` reads as that order: plan -> process group -> mesh (degrees, tensor
and pipeline layouts) -> this rank's pipeline stages -> loss -> tensor parallel -> context
parallel -> packed documents' attention -> device -> no KV cache in training forwards -> activation checkpointing -> data
parallel (FSDP2 / DDP over dp x cp, or
autocast alone) -> pipeline schedule -> state. Each step is a small function with explicit arguments; the engine's
``apply_*`` functions (:mod:`hf_scale.parallel`) do the work. ``config`` is a resolved
:class:`ParallelConfig` here: ``"auto"`` is :func:`hf_scale.api.parallelize`'s to resolve, so
the planner's calibration can apply a layout without importing the planner again.

Usage::

    model = apply_parallelism(model, ParallelConfig(strategy="fsdp", tp=2))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import ParallelConfig
from .distributed import DistEnv, init_distributed
from .errors import HfScaleConfigError, HfScalePlanError
from .log import log_rank0
from .mesh import ParallelDims, build_mesh
from .model_plans import ModelPlan, fp32_modules, resolve_plan, wrap_units
from .model_plans.adapters import adapter_host
from .model_plans.ep import ExpertsLayout, check_ep, experts_layout
from .model_plans.from_hf import PRUNED, with_inferred_tp
from .model_plans.pp import PipelineLayout, pp_layout
from .model_plans.tp import TPLayout, tp_layout
from .parallel import apply_ac, apply_autocast, apply_chunked_loss, apply_ddp, apply_fsdp, apply_tp
from .parallel.cp import apply_cp
from .parallel.cp_alltoall import check_heads
from .parallel.cp_check import check_cp_model
from .parallel.ep import apply_experts, unsplit_parameters
from .parallel.fsdp import shard_experts
from .parallel.loss import is_fake
from .parallel.packed_attention import apply_packed_attention
from .parallel.pp import is_stand_in, prune_to_stages, stage_module
from .parallel.pp_grads import choose_grad_sync, sync_each_microbatch
from .parallel.pp_schedule import Pipeline, tie_group, tied_across_stages
from .parallel.step import eval_step, train_step
from .parallel.tp_check import check_tp_forward
from .parallel_state import STATE_ATTR, ParallelState, get_state
from .ranks import gather

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Topology:
    """How this run splits the model: degrees and mesh (None in one process), the tensor-parallel
    styles and the pipeline's stages (None when that degree is 1), and this rank's stages."""

    dims: ParallelDims | None = None
    mesh: Any = None
    tp: TPLayout | None = None
    pp: PipelineLayout | None = None
    stages: tuple[int, ...] = ()
    experts: ExpertsLayout | None = None  # a mixture-of-experts model under ep or tp
    experts_mesh: Any = None  # the experts' weights: over ep, tp or ep x tp
    experts_dp_mesh: Any = None  # the ranks that hold the same experts (FSDP shards them there)

    @property
    def holds_head(self) -> bool:
        """Whether this rank holds the output head (every rank but a pipeline's non-last stages)."""
        return self.pp is None or self.pp.num_stages - 1 in self.stages


def apply_parallelism(model: nn.Module, config: ParallelConfig, plan: ModelPlan | Mapping | None = None) -> nn.Module:
    """Apply ``config`` to ``model`` in place, in the order above; returns ``model``.

    A peft wrapper (``PeftModel``) is seen through: the steps apply to the transformers model
    inside (:func:`adapter_host`), whose names the plans use, and both carry the state."""
    check_not_parallelized(model)
    outer, model = model, adapter_host(model)
    check_not_parallelized(model)
    resolved = resolve_plan(model, plan)
    env = init_distributed(config.timeout_seconds)
    dtype = precision_dtype(config, env)
    topology = build_topology(model, resolved, config, env)
    resolved, topology = check_inferred_tp(model, resolved, topology, env)
    topology = keep_own_stages(model, topology)
    check_stages_train(model, topology)
    units = wrap_units(model, resolved)
    keep_fp32 = fp32_modules(model, resolved) if dtype is not None else []
    apply_loss(model, config, topology)
    apply_tensor_parallel(model, topology, resolved)
    apply_expert_parallel(model, topology)
    apply_context_parallel(model, topology, config)
    apply_document_attention(model, topology, config)
    move_to_device(model, config, topology, env)
    disable_kv_cache(model)
    apply_checkpointing(model, units, config)
    roots = apply_data_parallel(model, topology, units, keep_fp32, dtype, config, env)
    pipeline = attach_pipeline(model, topology, roots, resolved, config, env)
    log_layout(config, topology, env, units, resolved, pipeline.grad_sync if pipeline is not None else None)
    state = ParallelState(config, resolved, env, topology.dims, topology.mesh, pipeline)
    attach_state(model, state)
    return attach_state(outer, state)


def check_not_parallelized(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise HfScaleConfigError(f"parallelize() needs a torch.nn.Module, got {type(model).__name__}.")
    state = get_state(model)
    if state is not None:
        raise HfScaleConfigError(
            f"parallelize() was already applied to this {type(model).__name__} "
            f"(strategy={state.config.strategy!r}). Call it once, on a model that has not been parallelized."
        )


def precision_dtype(config: ParallelConfig, env: DistEnv) -> torch.dtype | None:
    """The compute dtype of ``mixed_precision`` (None: fp32), refused where the device lacks it."""
    dtype = DTYPES[config.mixed_precision]
    if dtype is torch.bfloat16 and env.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise HfScaleConfigError(
            f"mixed_precision='bf16' but {torch.cuda.get_device_name(env.device)} has no bf16 "
            "support: use mixed_precision='fp16' (with a GradScaler) or None."
        )
    return dtype


def build_topology(model: nn.Module, plan: ModelPlan, config: ParallelConfig, env: DistEnv) -> Topology:
    """Degrees, layouts and mesh. Every check runs before the mesh's first collective, so a bad
    layout fails on every rank alike; in one process, tp or pp > 1 asks for torchrun."""
    if env.world_size == 1:
        if config.tp > 1 or config.pp > 1 or config.ep > 1 or config.cp > 1:
            need = config.tp * config.pp * config.ep * config.cp
            degrees = " x ".join(f"{n}={v}" for n, v in (("tp", config.tp), ("ep", config.ep), ("pp", config.pp),
                                                         ("cp", config.cp)) if v > 1)
            raise HfScaleConfigError(
                f"{degrees} needs {need} processes (or a multiple): start the script with torchrun "
                f"--nproc_per_node {need} (found one process, no torchrun environment)."
            )
        return Topology()
    experts = experts_layout(model, plan) if config.ep > 1 or config.tp > 1 else None
    if config.ep > 1:  # the model's experts first: an ep they refuse is not worth fitting to the ranks
        check_ep(experts, model, plan, config.ep)
    if config.cp > 1:  # an architecture cp cannot split, refused on every rank before the mesh
        check_cp_model(model)
        if config.cp_exchange == "alltoall":
            check_heads(model.config, config.cp)
    dims = ParallelDims.resolve(config, env.world_size, env.num_nodes)
    pp = None
    if dims.pp_enabled:
        pp = pp_layout(model, plan, dims.pp, config.stages_per_rank, config.pp_schedule == "zbv",
                       config.pp_split_points)
    tp = tp_layout(model, plan, dims.tp, experts) if dims.tp_enabled else None
    if experts is not None and not experts.is_moe:
        experts = None
    mesh = build_mesh(dims, env.device.type)
    experts_mesh, experts_dp_mesh = dims.expert_meshes(mesh) if experts is not None else (None, None)
    return Topology(dims, mesh, tp, pp, experts=experts, experts_mesh=experts_mesh, experts_dp_mesh=experts_dp_mesh)


def check_inferred_tp(model: nn.Module, plan: ModelPlan, topology: Topology, env: DistEnv) -> tuple[ModelPlan, Topology]:
    """A tp plan inferred from the model's modules is a guess: one forward of a sharded copy on a
    probe batch must equal the unsharded copy's, block by block, or the next guess is tried;
    when none holds the model is refused (on every rank), naming what differed."""
    declared = plan.source.get("tp_plan") == PRUNED
    if topology.tp is None or not (declared or plan.source.get("tp_plan") == "inferred"):
        return plan, topology
    first, candidate = None, 0
    while plan is not None:
        target, layout = _probe_target(model, plan, topology, candidate)
        if target is None:
            return plan, topology
        names = {id(m): n for n, m in target.named_modules()}
        blocks = [names[id(u)] for u in wrap_units(target, plan)]
        differs = check_tp_forward(target, topology.mesh["tp"], layout.styles, layout.local_attrs,
                                   _present_ties(target, plan.tied_weights), blocks, env.device, layout.params)
        if differs is None:
            return plan.replace(source={**plan.source, "tp_plan": f"{plan.source['tp_plan']}, checked"}), topology
        first, candidate = first or differs, candidate + 1
        plan = None if declared else with_inferred_tp(model, plan, candidate)
        if plan is not None:
            topology = dataclasses.replace(topology, tp=tp_layout(model, plan, topology.dims.tp))
    if declared:
        raise HfScalePlanError(
            f"transformers' tensor-parallel plan for {type(model).__name__} names modules this configuration "
            f"lacks; without them it does not hold: on a probe batch, {first}. Pass plan={{'tp_plan': {{...}}}} "
            "for this configuration, or train without tp."
        )
    raise HfScalePlanError(
        f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', '?')!r}) has no tensor-parallel "
        f"plan from transformers or hf_scale's registry, and the plan inferred from its modules does not hold: "
        f"on a probe batch, {first}. Pass plan={{'tp_plan': {{...}}}} (hf-scale plan prints the inferred one), "
        "or train without tp."
    )


def _probe_target(model: nn.Module, plan: ModelPlan, topology: Topology,
                  candidate: int = 0) -> tuple[nn.Module | None, TPLayout | None]:
    """What the tp check runs (None: none, logged): the model itself; on the meta device
    (``from_pretrained``: the weights are not there yet) the same architecture built tiny from its
    config, with the same random weights on every rank (:mod:`.model_plans.shrink`), and an
    inferred plan inferred again there (its ``candidate``-th guess: styles that carry a width,
    ``colwise_replicated_kv:K``, take the small one). The plan is checked for its styles on these
    module classes; the real sizes' divisibility was checked by ``tp_layout``."""
    params = list(model.parameters())
    if any(is_fake(p) for p in params):  # a simulation (layout_search.simulate): nothing to run on
        log_rank0("tensor parallel: the inferred plan is not checked (the model is on fake tensors: a simulation)",
                  once=True)
        return None, None
    if not any(p.is_meta for p in params):
        return model, topology.tp
    from .model_plans.shrink import shrunk_config

    tp, why = topology.dims.tp, None
    try:
        small_config = shrunk_config(model.config, heads=2 * tp, kv_heads=tp)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            small = type(model)._from_config(small_config)
    except Exception as e:  # noqa: BLE001 - an architecture that does not build small: say so, unchecked
        small, why = None, f"{type(model).__name__} did not build at a small size to check it on: {type(e).__name__}: {e}"
    if small is not None:
        small_plan = with_inferred_tp(small, plan, candidate) if plan.source.get("tp_plan") == "inferred" else plan
        try:
            if small_plan is None:
                raise HfScalePlanError(f"no {candidate}-th guess is inferred at the small size")
            return small, tp_layout(small, small_plan, tp)
        except HfScalePlanError as e:
            why = f"the plan does not apply to {type(model).__name__} at a small size: {e}"
    log_rank0(f"tensor parallel: the inferred plan is not checked (the model is on the meta device, and "
              f"{str(why).strip()[:300]})", once=True)
    return None, None


def keep_own_stages(model: nn.Module, topology: Topology) -> Topology:
    """Under pipeline parallel, this rank keeps only its stages' modules from here on."""
    if topology.pp is None:
        return topology
    stages = topology.pp.stages_of(topology.dims.pp_rank(topology.mesh))
    prune_to_stages(model, topology.pp, stages)
    return dataclasses.replace(topology, stages=tuple(stages))


def check_stages_train(model: nn.Module, topology: Topology) -> None:
    """Collective under pipeline parallel: a stage whose weights are all frozen (LoRA targets
    that miss its blocks) while others train would get no optimizer and no gradient sync on its
    ranks only; refused on every rank, naming the stages."""
    if topology.pp is None:
        return
    held = gather([(list(topology.stages), any(p.requires_grad for p in model.parameters()))])
    idle = sorted({s for stages, trains in held if not trains for s in stages})
    if idle and any(trains for _, trains in held):
        raise HfScaleConfigError(
            f"pipeline stage(s) {idle} hold no trainable parameter (every weight there is frozen, e.g. "
            "LoRA target_modules or layers_to_transform that miss their blocks): give every stage "
            "something to train, or move the cut with pp_split_points."
        )


def apply_loss(model: nn.Module, config: ParallelConfig, topology: Topology) -> None:
    """Chunked / labeled-only loss when asked; under tp with a vocabulary-sharded head, the loss
    on the vocabulary shards (a model whose forward does not allow it gathers the logits)."""
    if not topology.holds_head:
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config.loss_chunk_tokens or config.loss_labeled_only:
        try:
            apply_chunked_loss(model, head, config.loss_chunk_tokens, labeled_only=config.loss_labeled_only)
        except ValueError as e:
            raise HfScaleConfigError(str(e)) from None
    elif topology.tp is not None and _vocab_sharded(model, head, topology.tp):
        try:
            apply_chunked_loss(model, head, None)
        except ValueError as e:
            log_rank0(f"tensor parallel: the loss gathers the full logits ({e})", once=True)


def apply_tensor_parallel(model: nn.Module, topology: Topology, plan: ModelPlan) -> None:
    """The tp styles of the modules this rank holds, over the mesh's ``tp`` dimension."""
    if topology.tp is None:
        return
    present = {name for name, m in model.named_modules() if not is_stand_in(m)}
    apply_tp(
        model,
        topology.mesh["tp"],
        {n: style for n, style in topology.tp.styles.items() if n in present},
        {n: attrs for n, attrs in topology.tp.local_attrs.items() if n in present},
        _present_ties(model, plan.tied_weights, topology.pp),
        {n: dim for n, dim in topology.tp.params.items() if n.rpartition(".")[0] in present},
    )


def apply_expert_parallel(model: nn.Module, topology: Topology) -> None:
    """A mixture-of-experts model's experts: under ep each ep rank keeps its experts (1/ep of
    each expert-indexed weight) and exchanges tokens with the others by all-to-all; under tp
    each expert's intermediate size is split over the tp ranks."""
    if topology.experts is None:
        return
    split = topology.tp.experts if topology.tp is not None else None
    present = {name for name, m in model.named_modules() if not is_stand_in(m)}
    held = {n: p for n, p in topology.experts.modules.items() if n in present}  # this rank's pipeline stages
    apply_experts(model, held, topology.experts_mesh, topology.dims.ep_enabled, split)


def apply_context_parallel(model: nn.Module, topology: Topology, config: ParallelConfig) -> None:
    """Under cp, each sequence split over the cp ranks: the attention function, the split of the
    batch and the loss over the group (:mod:`hf_scale.parallel.cp`)."""
    if topology.dims is None or not topology.dims.cp_enabled:
        return
    apply_cp(model, topology.dims.cp_mesh(topology.mesh), config.cp_layout, config.cp_attention,
             config.cp_exchange)


def apply_document_attention(model: nn.Module, topology: Topology, config: ParallelConfig) -> None:
    """``packed_attention``: packed documents attended one at a time
    (:mod:`hf_scale.parallel.packed_attention`); cp keeps documents apart itself."""
    if not config.packed_attention or (topology.dims is not None and topology.dims.cp_enabled):
        return
    if apply_packed_attention(model):
        log_rank0("packed_attention: packed documents attended one at a time (one causal SDPA call each)", once=True)
    else:
        log_rank0(f"packed_attention: {type(model).__name__} uses attention "
                  f"'{getattr(model.config, '_attn_implementation', None)}', not sdpa: packed documents keep "
                  "their block-diagonal mask", once=True)


def move_to_device(model: nn.Module, config: ParallelConfig, topology: Topology, env: DistEnv) -> None:
    """Put this rank's model on its GPU, unless FSDP will (it moves unit by unit, never holding
    the whole model there). After tensor parallel, so each GPU receives its shards only."""
    dims = topology.dims
    fsdp_moves = dims is not None and dims.dp_cp_degree > 1 and config.sharded
    if env.device.type != "cpu" and not fsdp_moves and not any(p.is_meta for p in model.parameters()):
        model.to(env.device)


def disable_kv_cache(model: nn.Module) -> None:
    """Turn off the KV cache in training forwards, on every sub-config (T5's decoder has its own).

    With a cache, transformers does not look for packed documents in ``position_ids`` (it keeps
    them apart only when the forward has no attention mask and no cache): a model whose config
    says ``use_cache: true`` (SmolLM2, most Hub models) let packed documents attend to each other.
    A cache filled during a checkpointed forward changes what the recomputation does (T5 reads
    cross-attention keys back from it), and it keeps every layer's keys and values alive,
    undoing what checkpointing frees. ``generate`` still uses its generation config's cache.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


def apply_checkpointing(model: nn.Module, units: list[nn.Module], config: ParallelConfig) -> None:
    """Activation checkpointing on the blocks (the KV cache is off: :func:`disable_kv_cache`)."""
    if not config.activation_checkpointing:
        return
    count = apply_ac(units, config.activation_checkpointing, config.ac_every)
    log_rank0(f"activation checkpointing ({config.activation_checkpointing}) on {count} of {len(units)} blocks")


def apply_data_parallel(model: nn.Module, topology: Topology, units: list[nn.Module], keep_fp32: list[nn.Module],
                        dtype: torch.dtype | None, config: ParallelConfig, env: DistEnv) -> list[nn.Module]:
    """FSDP2 (fsdp / zero2 / hsdp) or DDP (ddp / zero1) on each root over the data-parallel
    mesh (times cp under context parallel: each cp rank holds the gradients of its part of the
    sequences, the loss's backward makes their mean over dp x cp the right one), or autocast alone
    (one process, or tp / pp without data parallel). Under pipeline parallel each stage is its
    own root (FSDP unit, autocast scope); returns the roots."""
    roots = [model]
    if topology.pp is not None:
        roots = [stage_module(model, topology.pp, s) for s in topology.stages]
    dims = topology.dims
    for root in roots:
        inside = {id(m) for m in root.modules()}
        fp32 = [m for m in keep_fp32 if id(m) in inside]
        if dims is None or dims.dp_cp_degree == 1:
            if dtype is not None:
                apply_autocast(root, dtype, env.device.type, fp32)
        elif config.sharded:
            experts = _experts_modules(model, root, topology)
            apply_fsdp(root, dims.dp_cp_mesh(topology.mesh), [u for u in units if id(u) in inside],
                       experts=experts, experts_mesh=topology.experts_dp_mesh, data_ranks=dims.dp_degree,
                       param_dtype=dtype,
                       reshard_after_forward=config.strategy != "zero2" and config.reshard_after_forward is not False,
                       cpu_offload=config.cpu_offload, fp32_modules=fp32,
                       blocks_per_unit=config.blocks_per_unit or 1, prefetch=config.fsdp_prefetch)
        else:
            experts = _experts_modules(model, root, topology)
            _check_all_split(root, experts, dims.ep)
            # each rank's experts its own (ep = the replicas), else FSDP-sharded over the replicas
            # holding the same ones; DDP all-reduces the rest
            shard_experts(experts, topology.experts_dp_mesh, dims.dp_degree)
            apply_ddp(root, dims.dp_cp_mesh(topology.mesh), ignored=experts)
            if dtype is not None:
                apply_autocast(root, dtype, env.device.type, fp32)
    return roots


def attach_pipeline(model: nn.Module, topology: Topology, roots: list[nn.Module], plan: ModelPlan,
                    config: ParallelConfig, env: DistEnv) -> Pipeline | None:
    """The schedule runner for this rank's stages; ``model`` itself can no longer run forward."""
    if topology.pp is None:
        return None
    layout, dims, mesh = topology.pp, topology.dims, topology.mesh
    ties = tied_across_stages(layout, plan.tied_weights)
    group = tie_group(mesh, layout, dims.pp) if ties else None
    pipeline = Pipeline(model, layout, list(topology.stages), roots, mesh["pp"].get_group(), env.device,
                        config.pp_schedule, config.pp_microbatches, group, ties)
    pipeline.grad_sync = choose_grad_sync(config.pp_grad_sync, roots, env.device)
    if pipeline.grad_sync == "each":  # per-microbatch reduce-scatter: gradients stay sharded
        for root in roots:
            sync_each_microbatch(root)
    held = ", ".join(str(s) for s in topology.stages)

    def refuse(module, args, kwargs):
        raise HfScaleConfigError(
            f"this rank holds pipeline stage(s) {held} of {layout.num_stages}, not the whole "
            f"{type(module).__name__}: train with model.train_step(batch) and evaluate with "
            "model.eval_step(batch) (generate needs pp=1: save, then load without pp)."
        )

    model.register_forward_pre_hook(refuse, with_kwargs=True)
    return pipeline


def log_layout(config: ParallelConfig, topology: Topology, env: DistEnv, units: list[nn.Module],
               plan: ModelPlan, pp_grad_sync: str | None = None) -> None:
    """One line (rank 0) saying what was applied."""
    if topology.dims is None:
        log_rank0("running in one process (no torchrun environment): only activation checkpointing, "
                  "mixed precision, chunked loss and packed attention apply", once=True)
        return
    per_unit = config.blocks_per_unit or 1
    log_rank0(
        f"{config.strategy} over {topology.dims.describe()} on {env.device.type} ({env.backend}); "
        f"{len(units)} blocks of {', '.join(plan.wrap_modules)}"
        + (f" ({per_unit} per FSDP unit)" if per_unit > 1 else "")
        + (f"; FSDP prefetch {config.fsdp_prefetch} ahead" if config.fsdp_prefetch and config.sharded else "")
        + (f"; tp plan from {plan.source.get('tp_plan', '?')}" if topology.tp is not None else "")
        + f"; precision {config.mixed_precision or 'fp32'}"
        + (f"; pipeline {config.pp_schedule}, stages {_describe(topology.pp)}" if topology.pp is not None else "")
        + (f", gradients reduced {pp_grad_sync}" if pp_grad_sync else "")
        + (f"; sequences split over cp={config.cp} ({config.cp_layout})" if topology.dims.cp_enabled else "")
    )


def attach_state(model: nn.Module, state: ParallelState) -> nn.Module:
    """Record what was applied on the model, and give it ``train_step`` / ``eval_step``."""
    setattr(model, STATE_ATTR, state)
    model.train_step = functools.partial(train_step, model)
    model.eval_step = functools.partial(eval_step, model)
    return model


def _check_all_split(root: nn.Module, experts: list[nn.Module], ep: int) -> None:
    """Under ddp + ep DDP leaves each experts module out whole: refuse one holding a parameter
    that ep did not split (a plain tensor), whose gradient nothing would average over the ranks."""
    names = {id(m): n for n, m in root.named_modules()}
    plain = [f"{names[id(m)]}.{n}" for m in experts for n in unsplit_parameters(m)]
    if plain:
        raise HfScaleConfigError(
            f"strategy='ddp' with ep={ep}: DDP leaves the experts modules to expert parallel, but "
            f"{', '.join(plain[:3])}{' ...' if len(plain) > 3 else ''} is not split per expert, so its "
            "gradient would never be averaged over the ranks. Use strategy='fsdp' or 'zero2' with ep "
            "(FSDP shards and reduces such parameters)."
        )


def _experts_modules(model: nn.Module, root: nn.Module, topology: Topology) -> list[nn.Module]:
    """The experts modules under ep inside ``root`` (the model, or under pp one of this rank's
    stages): units of their own (:func:`~.parallel.fsdp.shard_experts`: FSDP over the ranks
    holding the same experts, or left whole with a dividing hook where no other rank does), out of
    the dense weights' FSDP units or DDP."""
    if topology.experts is None or not topology.dims.ep_enabled:
        return []
    inside = {id(m) for m in root.modules()}
    present = dict(model.named_modules())  # under pp: this rank's stages' blocks only
    modules = (present[name] for name in topology.experts.modules if name in present)
    return [m for m in modules if id(m) in inside and not is_stand_in(m)]


def _describe(layout: PipelineLayout) -> str:
    return " | ".join(f"{b[0]}-{b[-1]}" for b in layout.stage_blocks)


def _present_ties(model: nn.Module, ties, layout: PipelineLayout | None = None) -> tuple:
    """The ties tensor parallel must restore: both ends held here and in one pipeline stage (a
    V schedule's rank holds the embedding and its own copy of the head: they stay two)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    split = set(tied_across_stages(layout, ties)) if layout is not None else set()
    return tuple((t, s) for t, s in ties if t in names and s in names and (t, s) not in split)


def _vocab_sharded(model: nn.Module, head, layout: TPLayout) -> bool:
    names = {id(m): n for n, m in model.named_modules()}
    return isinstance(head, nn.Linear) and layout.styles.get(names.get(id(head), "")) == "colwise_gather_output"
