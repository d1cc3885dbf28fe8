"""What ``hf-scale plan SOURCE --gpus N --gpu-memory 80GB --seq S --batch B`` prints: every
candidate layout with its per-rank memory split and step time, why the others were rejected,
and the recommendation.

Usage::

    print(format_candidates(*plan_candidates(config, gpus=8, gpu_memory="80GB", seq=4096, batch=1)))
"""

from __future__ import annotations

from .choose import Candidate, choose, parse_memory
from .cost import H100, Device, Link
from .estimate import GiB, Workload
from .machine import cpu_device
from .profile import ModelFacts, model_facts

GPUS_PER_NODE = 8  # an H100 node (DGX / HGX): the NVLink domain
_PARTS = ("params", "grads", "optimizer", "activations", "logits_loss", "comm_buffers")


def plan_candidates(source, gpus: int, gpu_memory, seq: int, batch: int, nodes: int = 1,
                    device: Device | None = None, task: str = "causal_lm", quantize: str | None = None,
                    reference: int = 0, **space):
    """``(facts, best, ranked, budget, work)`` for ``source`` (a config or a model) on ``gpus``
    ranks of ``gpu_memory`` each; ``device`` defaults to H100 numbers, or this machine's
    calibration when ``gpus`` is None-like (0) and the plan is for CPU processes. ``quantize``:
    "nf4" for a QLoRA run (``source`` a model with its LoRA adapters). ``reference``: a held
    preference reference's bytes a parameter (:attr:`Workload.reference`)."""
    budget = parse_memory(gpu_memory)
    device_type = "cpu" if device is not None and device.name == "cpu" else "cuda"
    device = device or H100
    work = Workload(seq=seq, batch=batch, device=device_type, reference=reference)
    facts = source if isinstance(source, ModelFacts) else model_facts(source, task, quantize)
    best, ranked = choose(facts, work, gpus, budget, device, nodes, **space)
    return facts, best, ranked, budget, work


def format_candidates(facts: ModelFacts, best: Candidate, ranked: list[Candidate], budget: int, work: Workload,
                      top: int = 12, left_out: dict[str, int] | None = None) -> str:
    """The candidates as lines: fitting ones fastest first (at most ``top``), a count of the
    rejected ones by reason (``left_out``: layouts a recipe refused before any estimate, counted
    by the recipe's reason), and the recommendation."""
    world = best.layout.world_size
    trainable = f" ({facts.trainable_params / 1e6:,.2f}M trainable)" if facts.frozen else ""
    lines = [
        (f"auto-planner: {type(facts.model).__name__}, {facts.params / 1e6:,.1f}M parameters{trainable}, "
        f"{facts.layers} blocks; "
        f"{world} rank(s) of {budget / GiB:.1f} GiB ({work.device}); seq {work.seq} x batch {work.batch} per "
        f"data-parallel rank; {len(ranked)} layouts, {sum(c.fits for c in ranked)} fit"
        + (f"; a frozen preference reference held beside the policy ({work.reference} bytes a parameter, "
           "preference.reference: model) counted in each peak" if work.reference else "")),
        ("  memory per rank in GiB: params / grads / optimizer / activations / logits+loss / comm buffers"
         + (" / NF4 dequantization" if facts.quantize else "") + " = peak (host); step in seconds"),
    ]
    parts = _PARTS + (("dequant",) if facts.quantize else ())
    fits = [c for c in ranked if c.fits][:top]
    width = max(len(c.layout.describe()) for c in fits)
    for i, c in enumerate(fits):
        mem = c.memory
        split = " / ".join(f"{getattr(mem, p) / GiB:.2f}" for p in parts)
        host = f" (host {mem.host / GiB:.2f})" if mem.host else ""
        mark = "*" if c is best else " "
        lines.append(f" {mark}{i + 1:>3} {c.layout.describe():{width}}  {split} = {mem.device_total / GiB:.2f}{host}"
                     f"  step {c.cost.total:.3g}s  {c.cost.tokens_per_second:,.0f} tok/s")
    rejected: dict[str, int] = {}
    for c in ranked:
        if not c.fits:
            key = "does not fit the memory" if "GiB usable" in c.reason else c.reason.split(". ")[0]
            rejected[key] = rejected.get(key, 0) + 1
    for reason, n in (left_out or {}).items():
        key = f"the recipe refuses it: {reason}"
        rejected[key] = rejected.get(key, 0) + n
    if rejected:
        lines.append("rejected:")
        lines += [f"  {n:>4} x {reason}" for reason, n in sorted(rejected.items(), key=lambda kv: -kv[1])]
    lay = best.layout
    lines.append(f"recommended: {lay.describe()} -> parallel: strategy={lay.strategy}, dp_replicate={lay.dp_replicate}, "
                 f"dp_shard={lay.dp_shard}, tp={lay.tp}, pp={lay.pp}, activation_checkpointing={lay.ac}, "
                 f"mixed_precision={lay.precision}, cpu_offload={lay.cpu_offload}, loss_chunk_tokens="
                 f"{lay.loss_chunk_tokens}"
                 + (f", blocks_per_unit={lay.blocks_per_unit}" if lay.strategy in ("fsdp", "zero2", "hsdp") else "")
                 + (f", fsdp_prefetch={lay.prefetch}" if lay.prefetch else "")
                 + (f", ep={lay.ep}" if lay.ep > 1 else "")
                 + (f", cp={lay.cp}, cp_exchange={lay.cp_exchange}, cp_layout={lay.cp_layout}" if lay.cp > 1 else "")
                 + (f", pp_schedule={lay.pp_schedule}, pp_microbatches={lay.pp_microbatches}"
                    if lay.pp > 1 else "")
                 + (f", pp_grad_sync={lay.pp_grad_sync}" if lay.pp > 1 and lay.strategy in ("fsdp", "zero2", "hsdp")
                    else "")
                 + f"; micro-batch {lay.micro_batch} (grad_accum "
                 f"{max(1, work.batch // lay.micro_batch)})")
    return "\n".join(lines)


def default_nodes(gpus: int, nodes: int | None) -> int:
    """Nodes of 8 GPUs unless told: 64 GPUs are 8 NVLink domains joined by InfiniBand, not one."""
    return nodes or max(1, -(-gpus // GPUS_PER_NODE))


def with_links(device: Device, intra_gbps: float | None = None, inter_gbps: float | None = None,
               latency_us: float | None = None) -> Device:
    """``device`` with the bus bandwidth per rank (GB/s) within a node and between nodes, and the
    latency per collective (microseconds), replaced where given (``hf-scale plan --intra-gbps``)."""
    from dataclasses import replace

    def link(old: Link, gbps: float | None) -> Link:
        if gbps:  # one bandwidth for every collective (a measured all-gather / reduce-scatter is dropped)
            old = replace(old, bandwidth=gbps * 1e9, gather_bandwidth=None, scatter_bandwidth=None)
        return replace(old, latency=latency_us * 1e-6 if latency_us is not None else old.latency)

    return replace(device, intra=link(device.intra, intra_gbps), inter=link(device.inter, inter_gbps))


def pinned_space(fixed: dict | None, world: int, nodes: int) -> dict:
    """The search narrowed to ``fixed`` (``{"tp": 2, "ep": 4, "strategy": "fsdp"}``: what the
    command line gave); a degree that cannot divide ``world`` raises, saying so."""
    if not fixed:
        return {}
    from .auto import search_space

    space, _ = search_space(fixed, world, nodes)
    if fixed.get("strategy") not in (None, "auto"):
        space["strategies"] = (fixed["strategy"],)
    return space


def plan_text(config, job=None, *, gpus: int | None = None, gpu_memory: str | None = None, seq: int | None = None,
              batch: int | None = None, nodes: int | None = None, world_size: int | None = None, task: str = "causal_lm",
              links: dict | None = None, fixed: dict | None = None) -> str:
    """``hf-scale plan``'s candidate table. With ``gpus``: that many GPUs of ``gpu_memory`` (80GB by
    default) with H100 numbers. Without: this machine's CPU processes (the recipe's world size, or
    ``world_size``), each with the RAM divided among them, at the calibrated speed. ``seq`` and
    ``batch`` default to the recipe's ``data.max_seq_len`` and ``train.batch_size x grad_accum``.
    ``fixed``: fields the search must keep (the command line's ``--tp 2 --ep 4 --strategy fsdp``).
    A recipe that trains LoRA adapters is planned as that run (:func:`recipe_source`): its frozen
    base, its adapters, and under ``model.quantize: nf4`` its NF4 base weights."""
    import psutil

    seq = seq or (job.data.max_seq_len if job else 1024)
    rows, reference = job.planner_rows() if job else (1, 0)  # preference: 2 rows a pair, a held reference
    batch = batch or rows
    if gpus:
        world, nodes, device = gpus, default_nodes(gpus, nodes), with_links(H100, **(links or {}))
        memory = gpu_memory or "80GB"
    else:
        world = world_size or (job.launch.nproc_per_node * job.launch.nnodes if job else 1)
        nodes, device = nodes or 1, with_links(cpu_device(), **(links or {}))
        memory = gpu_memory or psutil.virtual_memory().total // max(1, world // nodes)
    space, left_out = {}, {}
    if job is not None and job.parallel.auto:
        # the search hf-scale finetune runs: fixed fields, micro-batch, and only the layouts the
        # recipe accepts (JobConfig.refuses)
        from .auto import search_space

        def recipe_accepts(layout, parallel) -> bool:
            why = job.refuses(parallel)
            if why:
                left_out.setdefault(why, set()).add(layout)
            return why is None

        space, _ = search_space({**job.parallel.fixed_fields(), **(fixed or {})}, world, nodes,
                                rows // job.train.grad_accum, recipe_accepts)
    else:
        space = pinned_space(fixed, world, nodes)
    source, quantize = recipe_source(config, job)
    return format_candidates(*plan_candidates(source, world, memory, seq, batch, nodes, device, task=task,
                                              quantize=quantize, reference=reference, **space),
                             left_out={why: len(layouts) for why, layouts in left_out.items()})


def recipe_source(config, job=None):
    """``(source, quantize)`` the planner reads for a recipe: its model on the meta device with
    its LoRA adapters and its ``model.quantize`` when it trains adapters (as ``hf-scale finetune``'s
    ``strategy: auto`` plans it), else ``config`` (a full fine-tune) and None."""
    if job is None or not job.peft.enabled:
        return config, None
    from ..train.model import meta_model

    return meta_model(job.model, job.peft), job.model.quantize
