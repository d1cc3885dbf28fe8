"""Simulated scale: the real ``parallelize`` and training steps as rank r of N, in one process.

:func:`simulate` builds the model on fake CUDA tensors (``FakeTensorMode``: shapes, dtypes and
devices, no memory, no arithmetic), then runs, as rank ``rank`` of a ``world_size``-rank world:

1. ``hf_scale.parallelize`` itself, unchanged: :func:`hf_scale.distributed.init_distributed`
   reads the ranks from the environment a launcher would set, picks ``cuda:LOCAL_RANK`` through
   its usual device selection (:mod:`.fake_cuda` answers the CUDA runtime's questions) and
   starts torch's fake process group (``HF_SCALE_BACKEND=fake``: collectives return at once);
   the mesh is built for the N ranks, this rank's pipeline stages are kept. A layout that cannot
   run at that size raises here the error it raises on the cluster.
2. ``build_optimizer`` and ``steps`` training steps (``train_step``, AdamW's ``step``), the last
   one under torch's ``MemTracker``: the peak of tracked bytes on ``cuda:LOCAL_RANK``, by what
   holds them, in MemTracker's categories as ``scripts/bench_planner.py`` reads them (its
   per-module hooks off, which a pipeline stage's repeated forwards refuse): parameters (FSDP's
   shards), gradients (:func:`gradients_tagged`: unsharded, accumulated and reduced),
   optimizer state, activations (what forward makes and keeps), gathered (FSDP's gathered
   parameters and all-gather buffers: :func:`gathered_tagged`), buffers (the modules' own) and
   temporaries (the rest of what backward makes: activation gradients, recomputation,
   reduce-scatter inputs); :meth:`Simulation.categories` sets them beside the estimate's
   (buffers and temporaries together, as docs/planner.md's "Categories" defines them). Under pipeline parallel the rank's real
   schedule runs its microbatches (:mod:`.peers` stands in for the other stages' messages).
3. A placement check: the device of every parameter (a ``DTensor``'s local shard), buffer,
   gradient and optimizer state, and of the tensors each block and the model receive, against
   ``cuda:LOCAL_RANK`` (the host for what ``cpu_offload`` keeps there).

Beside it, the planner's :func:`~.estimate.estimate_memory` for the same layout and workload
(under pp, of the pipeline rank simulated: its stages, its in-flight microbatches, the head and
loss on the last), less the process overhead (``MemTracker`` sees tensors only, not the CUDA context).

Usage::

    from transformers import AutoConfig
    from hf_scale.layout_search.simulate import simulate
    config = AutoConfig.for_model("llama", hidden_size=4096, ...)
    result = simulate(config, world_size=64, rank=0, parallel=Layout("fsdp", dp_shard=32, tp=2, ...),
                      seq=4096, batch=1)
    print(result.format())
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ParallelConfig
from ..errors import HfScaleConfigError
from .estimate import Layout, MemoryEstimate, Workload, estimate_memory
from .fake_cuda import MAX_DEVICES, fake_cuda, fake_tensors
from .peers import expert_peers, pipeline_peers
from .profile import one_sequence
from .simulate_nf4 import assign_fake_nf4, layout_sharded, place_fake_nf4, quiet_storage_checks

GiB = 2**30
# MemTracker's categories -> the names printed here
CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries",
              # MemTracker's "Other" (what track_external gets that fits no category: nothing here)
              # holds FSDP's gathered parameters and all-gather buffers (gathered_tagged)
              "Other": "gathered"}


@dataclass
class Simulation:
    """One simulated rank: where it sits, its tracked peak by category, the planner's estimate, and
    the devices its tensors landed on."""

    rank: int
    world_size: int
    local_rank: int
    layout: Layout
    device: str  # the device hf_scale chose for this rank
    stages: tuple[int, ...]  # its pipeline stages (empty without pp)
    peak: dict[str, int]  # bytes at the tracked peak, by category, and "total"
    estimate: MemoryEstimate
    placement: dict[str, dict[str, int]]  # kind -> device -> tensor count
    misplaced: list[str] = field(default_factory=list)  # "kind name: device (expected ...)"
    assumed: list[str] = field(default_factory=list)  # what the peers were assumed to send (.peers)
    contradicted: list[str] = field(default_factory=list)  # where this rank's own messages differ from that
    seconds: float = 0.0

    @property
    def estimated(self) -> int:
        """The planner's device total less its process overhead: what MemTracker can see."""
        return self.estimate.device_total - self.estimate.overhead

    @property
    def ratio(self) -> float:
        """estimate / simulated peak."""
        return self.estimated / max(1, self.peak["total"])

    def categories(self) -> dict[str, dict[str, int]]:
        """The peak by category on both sides (docs/planner.md, "Categories"): ``{"simulated": ...,
        "estimate": ...}``, each params / grads / optimizer / activations / buffers (buffers and
        temporaries: gathered parameters, communication buffers, backward's temporaries, module
        buffers). Each side sums to its total."""
        p = self.peak
        simulated = {k: p[k] for k in ("params", "grads", "optimizer", "activations")}
        simulated["buffers"] = p["gathered"] + p["buffers"] + p["temporaries"]
        return {"simulated": simulated, "estimate": self.estimate.categories()}

    def format(self) -> str:
        unit, size = ("GiB", GiB) if self.peak["total"] >= GiB else ("MiB", 2**20)
        gib = lambda b: f"{b / size:.2f}"  # noqa: E731
        est = self.estimate
        estimate_parts = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                          "activations": est.activations + est.logits_loss, "buffers": est.comm_buffers,
                          "reference": est.reference}
        stages = f", stages {', '.join(map(str, self.stages))}" if self.stages else ""
        cats = self.categories()
        lines = [f"rank {self.rank} of {self.world_size} on {self.device}{stages}: {self.layout.describe()} "
                 f"({self.seconds:.1f} s)",
                 f"  simulated peak ({unit}): " + ", ".join(f"{k} {gib(v)}" for k, v in self.peak.items() if v or k == "total"),
                 f"  planner estimate ({unit}): " + ", ".join(f"{k} {gib(v)}" for k, v in estimate_parts.items() if v)
                 + f", total {gib(self.estimated)} (device total less {gib(est.overhead)} overhead)",
                 f"  estimate / simulated: {self.ratio:.3f}",
                 f"  by category, planner / simulation ({unit}): " + ", ".join(
                     f"{k} {gib(cats['estimate'][k])} / {gib(s)}" for k, s in cats["simulated"].items())]
        for kind, devices in self.placement.items():
            lines.append(f"  {kind}: " + ", ".join(f"{n} on {d}" for d, n in sorted(devices.items())))
        lines += [f"  MISPLACED {m}" for m in self.misplaced[:20]]
        lines += [f"  peers: {a}" for a in self.assumed]
        lines += [f"  CONTRADICTED: {c}" for c in self.contradicted]
        return "\n".join(lines)


def simulate(source, world_size: int, rank: int = 0, parallel: Layout | ParallelConfig | None = None, *,
             seq: int = 1024, batch: int = 1, local_world_size: int | None = None, steps: int = 2,
             task: str = "causal_lm", device: str = "cuda", reference: bool = False,
             quantize: str | None = None) -> Simulation:
    """Run ``parallelize`` and ``steps`` training steps as rank ``rank`` of ``world_size`` on fake
    CUDA devices (module doc); ``source`` is a transformers config or a model on the meta device
    (e.g. with peft adapters). ``parallel`` is a planner :class:`Layout` (its ``micro_batch``
    sequences per forward) or a ``ParallelConfig``; ``batch`` sequences per data-parallel rank
    per step; ``local_world_size`` GPUs per node (default ``min(8, world_size)``). ``device="cpu"``
    simulates CPU processes (gloo's placement: every tensor on the host), to compare with runs
    measured on this machine. ``reference``: preference training (sigmoid DPO) with a frozen
    reference held beside the policy (``preference.reference: model``), parallelized as
    :func:`hf_scale.train.model.load_reference` does; each forward then holds ``micro_batch`` rows
    (chosen and rejected interleaved: half as many pairs), the reference's no-grad forward first.
    ``quantize="nf4"``: QLoRA, ``source`` a LoRA model whose base weights the loader would hold in
    NF4 are held so (:mod:`.simulate_nf4`: placed, sharded and assigned as ``from_pretrained``
    does, from fake inner tensors), and the estimate prices them so."""
    import torch.distributed as dist

    from ..distributed import BACKEND_VAR, shutdown_distributed

    local = local_world_size or _gpus_per_node(world_size, device)
    layout = as_layout(parallel, world_size, max(1, world_size // local))
    if not 0 <= rank < world_size or world_size % local:
        raise HfScaleConfigError(
            f"rank={rank} of world_size={world_size} with {local} GPUs per node: the rank must be in "
            f"0..{world_size - 1} and the GPUs per node must divide the world size."
        )
    if dist.is_available() and dist.is_initialized():
        raise HfScaleConfigError(
            "simulate() starts its own (fake) process group, but one is already running in this process: "
            "simulate outside torchrun, or after hf_scale.shutdown_distributed()."
        )
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local),
           "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", BACKEND_VAR: "fake"}
    start = time.perf_counter()
    if quantize is not None and reference:
        raise HfScaleConfigError("simulate(quantize=..., reference=True): a QLoRA preference run with a held "
                                 "reference is not simulated; simulate the policy alone (reference=False).")
    facts = _facts(source, task, quantize)  # before the run: the model facts' meta forward runs outside fake mode
    meta = _meta_model(source, task)  # outside fake mode: its tensors are swapped for fake ones inside
    held = _meta_model(source, task) if reference else None  # the preference reference: a second copy
    if device not in ("cuda", "cpu"):
        raise HfScaleConfigError(f"device={device!r}: simulate 'cuda' (GPUs) or 'cpu' (CPU processes).")
    runtime = fake_cuda(local) if device == "cuda" else contextlib.nullcontext()
    # the batches are unpacked sequences (input_ids and labels): transformers' checks of their values
    # answered so (one_sequence), as for the planner's meta profile
    quiet = quiet_storage_checks() if quantize is not None else contextlib.nullcontext()
    with _environ(env), runtime, fake_tensors(), _symmetric_objects(), one_sequence(), quiet:
        try:
            result = _run(_fake_on_host(meta), layout, world_size, rank, local, seq, batch, steps,
                          _fake_on_host(held) if held is not None else None, quantize)
        finally:
            shutdown_distributed()
    # under pp, the estimate of the pipeline rank this rank ran (its first stage's index)
    pp_rank = result.stages[0] if result.stages else None
    stored = next(meta.parameters()).element_size() if reference else 0
    result.estimate = estimate_memory(facts, layout, Workload(seq=seq, batch=batch, device=device, reference=stored),
                                      pp_rank)
    result.seconds = time.perf_counter() - start
    return result


def _gpus_per_node(world_size: int, device: str) -> int:
    """The default GPUs per node: 8 (or fewer dividing the world). A torch built with CUDA lets
    only its visible GPUs stand in (:func:`.fake_cuda.fake_cuda`), so at most as many."""
    most = min(MAX_DEVICES, world_size)
    if device == "cuda" and torch.cuda._is_compiled():
        most = min(most, max(torch.cuda.device_count(), 1))
    return max(d for d in range(1, most + 1) if world_size % d == 0)


def as_layout(parallel: Layout | ParallelConfig | None, world_size: int, num_nodes: int = 1,
              micro_batch: int = 1) -> Layout:
    """The planner's :class:`Layout` of ``parallel`` for ``world_size`` ranks on ``num_nodes``
    nodes (its degrees resolved as ``parallelize`` resolves them: hsdp replicates over the nodes),
    ``micro_batch`` sequences per forward (a pipeline splits them into its microbatches)."""
    from ..mesh import ParallelDims

    if isinstance(parallel, Layout):
        if parallel.world_size != world_size:
            raise HfScaleConfigError(
                f"layout {parallel.describe()} has {parallel.world_size} ranks, but world_size={world_size}: "
                "give degrees whose product is the world size."
            )
        return parallel
    config = parallel if isinstance(parallel, ParallelConfig) else ParallelConfig(**(parallel or {}))
    dims = ParallelDims.resolve(config, world_size, num_nodes)
    return Layout(strategy=config.strategy, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp,
                  pp=dims.pp, micro_batch=micro_batch, ac=config.activation_checkpointing, precision=config.mixed_precision,
                  cpu_offload=config.cpu_offload, loss_chunk_tokens=config.loss_chunk_tokens,
                  pp_schedule=config.pp_schedule, pp_microbatches=config.pp_microbatches,
                  blocks_per_unit=config.blocks_per_unit or 1, prefetch=config.fsdp_prefetch, ep=dims.ep,
                  # "auto" decides on the device's free memory, which fake CUDA has not: torch's
                  # "last" here (``choose.fitting_grad_sync`` decides it by the estimate instead)
                  pp_grad_sync="last" if config.pp_grad_sync == "auto" else config.pp_grad_sync,
                  cp=dims.cp, cp_exchange=config.cp_exchange, cp_layout=config.cp_layout)


def _run(model: nn.Module, layout: Layout, world_size: int, rank: int, local: int, seq: int, batch: int,
         steps: int, reference: nn.Module | None = None, quantize: str | None = None) -> Simulation:
    """``model`` (fake tensors on the host, as ``from_pretrained`` leaves it) parallelized and trained;
    with ``reference`` (the same, a second copy), preference steps against it held beside; with
    ``quantize``, its NF4 base placed and assigned around ``parallelize`` as the loader does."""
    from ..api import parallelize
    from ..parallel.optim import build_optimizer, no_sync
    from ..parallel_state import get_state

    config = layout.parallel_config()
    place_fake_nf4(model, config, world_size, quantize)
    model = parallelize(model, config)
    state = get_state(model)
    device = state.env.device
    if quantize is not None and layout_sharded(config):
        assign_fake_nf4(model, state)
    optimizer = build_optimizer(model, lr=1e-5)
    inputs = _record_inputs(model, state)
    micro = max(1, min(layout.micro_batch, batch))  # under pp: one pipeline step's sequences
    vocab = model.config.vocab_size
    if state.pipeline is not None and micro % state.pipeline.microbatches:
        raise HfScaleConfigError(
            f"micro_batch={micro} (of batch={batch}) does not split into the pipeline's "
            f"{state.pipeline.microbatches} microbatches: give a micro-batch that is a multiple of them."
        )

    forward = model.train_step
    if reference is not None:
        reference, forward = _preference(reference, layout, device, model, micro)

    def step(grads: list | None = None) -> None:
        for i in range(batch // micro):
            ids = torch.randint(vocab, (micro, seq), device=device)
            last = i == batch // micro - 1
            with no_sync(model, enabled=not last) if batch > micro else contextlib.nullcontext():
                forward({"input_ids": ids, "labels": ids})
        if grads is not None:
            grads += [(n, _local(p.grad).device) for n, p in model.named_parameters() if p.grad is not None]
        _tag_gradients(tracker, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    # tracked from the first step on, so that what the first step builds and keeps (DDP's gradient
    # buckets, made by its lazy initialisation in the first forward; AdamW's state) is counted;
    # the peak is the last step's
    tracker = device_tracker()
    tracker.track_external(model, optimizer, *inner_optimizers(optimizer), *([reference] if reference else []))
    grads: list[tuple[str, torch.device]] = []
    roots = [model, *(state.pipeline.stage_modules if state.pipeline is not None else ())]
    with contextlib.ExitStack() as stack:  # what the other ranks would send (.peers)
        logs = []
        if state.pipeline is not None:
            logs.append(stack.enter_context(pipeline_peers(micro // state.pipeline.microbatches, seq)))
        if layout.ep > 1:
            logs.append(stack.enter_context(expert_peers()))
        with tracker:
            for _ in range(max(0, steps - 1)):
                step()
            tracker.restart_peak()
            with gradients_tagged(tracker, roots), gathered_tagged(tracker, [*roots, *([reference] if reference else [])]):
                step(grads)  # after a first step: FSDP's unsharded parameters exist
    snap = tracker.get_tracker_snapshot("peak").get(device, {})
    peak = {name: 0 for name in CATEGORIES.values()}
    for key, value in snap.items():
        name = CATEGORIES.get(str(getattr(key, "value", key)))
        if name is not None:
            peak[name] += value
    peak["total"] = snap.get("Total", sum(peak.values()))
    placement, misplaced = check_placement(model, optimizer, inputs, grads, device, layout.cpu_offload)
    stages = tuple(getattr(state.pipeline, "stages", ()) or ()) if state.pipeline is not None else ()
    return Simulation(rank=rank, world_size=world_size, local_rank=rank % local, layout=layout, device=str(device),
                      stages=stages, peak=peak, estimate=None, placement=placement, misplaced=misplaced,
                      assumed=[a for log in logs for a in log.assumed],
                      contradicted=[m for log in logs for m in log.mismatches])


def _tag_gradients(tracker, model: nn.Module) -> None:
    """Each gradient's storage counted as gradients from its first backward on: under ddp they are
    views into DDP's buckets (``gradient_as_bucket_view``), made by its first forward and kept
    (MemTracker would count them where they were made, as activations, and at the next step's
    forward peak the gradients are None but the buckets are there)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    for p in model.parameters():
        if p.grad is not None:
            tracker._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)


def _preference(reference: nn.Module, layout: Layout, device, model: nn.Module, rows: int):
    """``reference`` parallelized as a held preference reference is (frozen, eval mode), and the
    step of one micro-batch: the reference's no-grad forward (the loop's own function), then the
    policy's forward and backward on the same rows. That one is ``train_step``'s causal-LM loss: the
    same logits and log-softmax as the DPO loss's per-token log-probs, whose per-pair reductions
    (a few floats) read tensor values that fake tensors do not have."""
    from ..api import parallelize
    from ..parallel.preference_reference import frozen_reference_logps
    from ..train.model import reference_layout

    if rows % 2:
        raise HfScaleConfigError(f"micro_batch={rows}: a preference forward holds chosen and rejected rows "
                                 "interleaved, an even number: give an even micro-batch.")
    reference.requires_grad_(False)
    config = reference_layout(layout.parallel_config())
    reference = (reference.to(device) if config is None else parallelize(reference, config)).eval()

    def forward(batch: dict) -> None:
        frozen_reference_logps(reference, batch)
        model.train_step(batch)

    return reference, forward


def _fake_on_host(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device) as fake tensors on the host, as ``from_pretrained`` leaves a
    model before ``parallelize``; a parameter used by several modules (tied embeddings) stays one
    (``to_empty`` under the fake mode gives each use its own)."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                uses.setdefault(id(p), []).append((module, name))
    model.to_empty(device="cpu")
    for (first, first_name), *others in uses.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    return model


def _meta_model(source, task: str) -> nn.Module:
    """``source``: a config (its model built on the meta device), or a model on the meta device."""
    from ..layout_preview import meta_model

    # a copy of the config: parallelize may change the model's (activation checkpointing turns off its cache)
    # a module source is copied (cheap on meta): the simulation turns its tensors fake and parallelizes
    # it, and the caller may simulate it again (simulate_ranks: one run per rank)
    model = copy.deepcopy(source) if isinstance(source, nn.Module) else meta_model(copy.deepcopy(source), task)
    if any(not p.is_meta for p in model.parameters()):
        raise HfScaleConfigError(
            f"simulate() needs a config or a model on the meta device; this {type(model).__name__} holds real "
            "weights: give its .config, or build it under torch.device('meta')."
        )
    return model


def _record_inputs(model: nn.Module, state) -> list[tuple[str, torch.device]]:
    """A pre-forward hook on the model and each block: the device of every tensor they receive."""
    from ..model_plans.adapters import adapter_host

    seen: list[tuple[str, torch.device]] = []
    names = {id(m): n for n, m in model.named_modules()}

    def hook(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                seen.append((names.get(id(module), "model") or "model", value.device))

    host = adapter_host(model)
    targets = [host]
    if state.pipeline is not None:  # the model itself runs no forward: each stage's inputs instead
        targets = list(state.pipeline.stage_modules)
        names.update({id(m): f"stage {s}" for s, m in zip(state.pipeline.stages, targets)})
    for module in [*targets, *_blocks(host, state.plan)]:
        module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _blocks(model: nn.Module, plan) -> list[nn.Module]:
    """The plan's blocks after ``parallelize``: FSDP2 renamed their classes (``FSDP`` + the name),
    which ``wrap_units`` looks for."""
    from torch.distributed.fsdp import FSDPModule

    wanted, blocks, inside = set(plan.wrap_modules), [], set()
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, FSDPModule) and name.startswith("FSDP"):
            name = name[len("FSDP"):]
        if id(module) not in inside and name in wanted and module is not model:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def check_placement(model: nn.Module, optimizer, inputs, grads, device: torch.device,
                    offload: bool) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Devices of parameters, buffers, gradients, optimizer state and block inputs: counts per
    kind and device, and each tensor not where it belongs (``device``; the host for the shards,
    gradients and optimizer state ``cpu_offload`` keeps there)."""
    counts: dict[str, Counter] = {k: Counter() for k in ("parameters", "buffers", "gradients", "optimizer state",
                                                          "block inputs", "stage inputs")}
    wrong: list[str] = []
    host = torch.device("cpu")

    def check(kind: str, name: str, actual: torch.device, expected: torch.device) -> None:
        counts[kind][str(actual)] += 1
        if actual != expected:
            wrong.append(f"{kind} {name}: {actual} (expected {expected})")

    sharded = _sharded(model)
    for name, p in model.named_parameters():
        check("parameters", name, _local(p).device, host if offload and sharded else device)
    for name, b in model.named_buffers():
        check("buffers", name, b.device, device)
    for name, actual in grads:
        check("gradients", name, actual, host if offload and sharded else device)
    for index, state in enumerate(_optimizer_states(optimizer)):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                check("optimizer state", f"#{index}.{key}", _local(value).device, host if offload and sharded else device)
    for name, actual in inputs:
        check("stage inputs" if name.startswith("stage ") else "block inputs", name, actual, device)
    return {k: dict(v) for k, v in counts.items() if v}, wrong


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_states(optimizer) -> Iterator[dict]:
    for opt in (optimizer, *inner_optimizers(optimizer)):
        yield from opt.state.values()


def inner_optimizers(optimizer) -> list:
    """ZeroRedundancyOptimizer keeps its state in an inner optimizer the tracker must be told of."""
    inner = getattr(optimizer, "optim", None)
    return [inner] if inner is not None and inner is not optimizer else []


def device_tracker():
    """torch's ``MemTracker`` without its per-module statistics (they refuse a module that runs
    several forwards in one step, a pipeline stage's microbatches), nor the module tracker's
    gradient hooks behind them (a pipeline stage's shape inference takes ``autograd.grad`` of its
    inputs, leaf tensors, which those hooks refuse): whether a tensor is made in backward is
    asked of autograd (``ModTracker.is_bw``), as before. ``scripts/bench_planner.py`` measures
    with it too."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class NoModuleHooks(ModTracker):
        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

    class DeviceTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = NoModuleHooks()

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

        def restart_peak(self) -> None:
            """The peak from now on (what ``__enter__`` does)."""
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

    return DeviceTracker()


@contextlib.contextmanager
def gradients_tagged(tracker, roots: list[nn.Module]) -> Iterator[None]:
    """The gradients in ``tracker``'s own category while entered (MemTracker counts what backward
    makes as temporaries): each gradient autograd accumulates into a parameter (FSDP2's unsharded
    parameters, or the parameters themselves without FSDP: DDP's gradients are views of its
    buckets, which count as gradients then), FSDP2's fp32 accumulation of unsharded gradients
    (``unsharded_accumulated_grad``: gradient accumulation, a pipeline's microbatches) and the
    sharded gradient its reduce-scatter makes (``sharded_param.grad``). What remains in
    temporaries is backward's own: activation gradients, recomputation, reduce-scatter buffers.
    FSDP's unsharded parameters are made by its first forward: enter after a first step."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def tag(t: torch.Tensor | None) -> None:
        if t is not None:
            tracker._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

    leaves = {id(p): p for root in roots for p in root.parameters()}
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    leaves.update({id(fp._unsharded_param): fp._unsharded_param for fp in group.fsdp_params
                                   if hasattr(fp, "_unsharded_param")})
    handles = [p.register_post_accumulate_grad_hook(lambda p: tag(p.grad)) for p in leaves.values() if p.requires_grad]
    post_backward = FSDPParamGroup.post_backward

    def tagged(self, *args, **kwargs):
        result = post_backward(self, *args, **kwargs)
        for fp in self.fsdp_params:
            tag(fp.unsharded_accumulated_grad)
            tag(fp.sharded_param.grad)
        return result

    FSDPParamGroup.post_backward = tagged
    try:
        yield
    finally:
        FSDPParamGroup.post_backward = post_backward
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def gathered_tagged(tracker, roots: list[nn.Module]) -> Iterator[None]:
    """FSDP's gathered parameters in a category of their own while entered (MemTracker's "Other",
    unused otherwise, printed as "gathered"; MemTracker would count them where their storage was
    first made, as activations in the first forward): each unsharded parameter's
    storage (``all_gather_outputs``, resized to nothing when resharded and back when gathered
    again; an all-gather extension's inner tensors) and each flat all-gather buffer
    (``foreach_all_gather``'s output, held from the all-gather until its copy-out). With the
    temporaries they are the category "buffers / temporaries" that the planner's estimate counts
    its gathered units and communication buffers in (``MemoryEstimate.categories``).
    FSDP's unsharded parameters are made by its first forward: enter after a first step."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def tag(t: torch.Tensor) -> None:
        tracker._update_and_maybe_create_winfos(t, _MemRefType.OTH)

    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        for t in (*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())):
                            tag(t)
    all_gather = _fsdp_param_group.foreach_all_gather

    def tagged(*args, **kwargs):
        result = all_gather(*args, **kwargs)
        if result is not None:
            tag(result.all_gather_output)
        return result

    _fsdp_param_group.foreach_all_gather = tagged
    try:
        yield
    finally:
        _fsdp_param_group.foreach_all_gather = all_gather


def _facts(source, task: str, quantize: str | None = None):
    from .profile import model_facts

    return model_facts(source, task, quantize)


@contextlib.contextmanager
def _symmetric_objects() -> Iterator[None]:
    """Object collectives as if every rank held what this one holds: the fake process group moves
    no data, and a gathered list of pickled objects would be unreadable. (``parallelize`` gathers
    such facts to fail on every rank alike; one simulated rank sees its own.)"""
    import torch.distributed as dist

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        pass  # the source's objects: this rank's

    replaced = {"all_gather_object": all_gather_object, "gather_object": gather_object,
                "broadcast_object_list": broadcast_object_list}
    saved = {name: getattr(dist, name) for name in replaced}
    try:
        for name, fn in replaced.items():
            setattr(dist, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """The launcher's variables for the simulated rank while entered; the process's own after."""
    from ..distributed import LAUNCHER_VARS

    saved = {k: os.environ.get(k) for k in (*LAUNCHER_VARS, *values)}
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def simulate_ranks(source, layout: Layout, seq: int, batch: int, ranks: list[int] | None = None,
                   task: str = "causal_lm", local_world_size: int | None = None,
                   reference: bool = False, quantize: str | None = None) -> list[Simulation]:
    """:func:`simulate` of ``layout`` as each of ``ranks`` (default: the first and the last rank,
    which hold the first and last pipeline stage and the shortest shard of an uneven split);
    ``reference``: preference steps with a held reference; ``quantize``: QLoRA (:func:`simulate`)."""
    world = layout.world_size
    ranks = sorted(set(ranks if ranks is not None else (0, world - 1)))
    return [simulate(source, world, r, layout, seq=seq, batch=batch, task=task, local_world_size=local_world_size,
                     reference=reference, quantize=quantize)
            for r in ranks]


def format_simulations(results: list[Simulation], budget: int | None = None) -> str:
    """``hf-scale plan --simulate``'s lines: each simulated rank, and whether their peaks differ."""
    if not results:
        return ""
    lines = [f"simulated on fake CUDA devices (no GPU; torch's fake process group, {results[0].world_size} ranks): "
             "MemTracker's peak of tensor bytes in one training step, beside the planner's estimate less its "
             "process overhead"]
    for r in results:
        lines.append(r.format())
        if budget:
            lines.append(f"  {'fits' if r.peak['total'] + r.estimate.overhead <= budget else 'DOES NOT FIT'} in "
                         f"{budget / GiB:.1f} GiB with the {r.estimate.overhead / GiB:.2f} GiB process overhead")
    totals = {r.rank: r.peak["total"] for r in results}
    if len(set(totals.values())) > 1:
        lines.append("ranks differ: " + ", ".join(f"rank {k} {v / GiB:.2f} GiB" for k, v in totals.items()))
    misplaced = sum(len(r.misplaced) for r in results)
    lines.append(f"placement: {'every tensor on its rank' + chr(39) + 's device' if not misplaced else f'{misplaced} tensor(s) MISPLACED'}")
    if budget:
        lines.append(fit_verdict(results, budget))
    return "\n".join(lines)


def fit_verdict(results: list[Simulation], budget: int) -> str:
    """One plain line: whether the simulated ranks fit ``budget`` bytes each (their tracked peak
    plus the process overhead), and if not, the worst rank and what to try."""
    worst = max(results, key=lambda r: r.peak["total"] + r.estimate.overhead)
    need = worst.peak["total"] + worst.estimate.overhead
    if need <= budget:
        return f"verdict: fits: at most {need / GiB:.1f} GiB per rank (rank {worst.rank}) <= {budget / GiB:.1f} GiB"
    lay = worst.layout
    tries = []
    if lay.pp > 1 and lay.pp_grad_sync != "each" and lay.strategy in ("fsdp", "zero2", "hsdp") and lay.dp > 1:
        tries.append("pp_grad_sync=each (gradients sharded through the pipeline schedule; gpipe / 1f1b)")
    if lay.ac != "full":
        tries.append("activation_checkpointing=full")
    tries.append("more ranks to shard over, or fewer sequences per step")
    return (f"verdict: does not fit: {need / GiB:.1f} GiB on rank {worst.rank} > {budget / GiB:.1f} GiB; "
            f"try {', or '.join(tries)}")
