"""What ``hf-scale plan RECIPE`` adds for a recipe that trains LoRA adapters (QLoRA included):
the trainable share, which base weights are held in NF4 and their bytes, and the planner's
per-rank estimate of the recipe's own layout, in place of the full fine-tune's training state.

Usage::

    print("\\n".join(adapter_lines(job, world_size=2)))
"""

from __future__ import annotations

from .estimate import GiB, Workload, estimate_memory
from .profile import model_facts
from .quantized import nf4_chosen, nf4_share

MB = 1e6


def adapter_lines(job, world_size: int, num_nodes: int = 1) -> list[str]:
    """Lines for ``job`` (a ``JobConfig`` with ``peft`` enabled) on ``world_size`` ranks."""
    from ..train.model import meta_model
    from .simulate import as_layout

    facts = model_facts(meta_model(job.model, job.peft), job.model.task, job.model.quantize)
    frozen_dtype = job.model.dtype or "float32"
    what = f"peft.r={job.peft.r}" if job.peft.r is not None else f"peft.adapter={job.peft.adapter}"
    lines = [f"LoRA ({what}): {facts.trainable_params / 1e6:,.2f}M of {facts.params / 1e6:,.1f}M parameters train "
             f"(fp32 weights + gradients + AdamW state); the base is frozen in {frozen_dtype}"]
    auto = job.parallel.auto
    layout = None if auto else as_layout(job.parallel, world_size, num_nodes, micro_batch=job.train.batch_size)
    parts = 1 if layout is None or layout.strategy not in ("fsdp", "zero2", "hsdp") or world_size == 1 \
        else layout.dp_shard
    if facts.quantize:
        tp = layout.tp if layout is not None else 1
        share = nf4_share(facts, parts, tp)
        chosen, kept = nf4_chosen(facts, parts, tp)
        line = (f"QLoRA (model.quantize: {facts.quantize}): {len(chosen)} of {len(chosen) + len(kept)} LoRA base "
                f"weights in NF4 over {parts} slice(s){f' of each tp={tp} slice' if tp > 1 else ''} each, "
                f"{share.params / 1e6:,.1f}M parameters{' per tp rank' if tp > 1 else ''}: "
                f"{share.nf4_bytes / MB:,.1f} MB at {8 * share.bytes_per_element:.3f} bits a parameter (codes, "
                f"scalers, factors), where {frozen_dtype} took {share.plain_bytes / MB:,.1f} MB")
        if kept:
            name, why = next(iter(kept.items()))
            line += (f"; {len(kept)} stay in {frozen_dtype} (their slices cannot hold whole 64-element NF4 blocks, e.g. "
                     f"{name}: {why})")
        lines.append(line)
    if layout is None:
        lines.append("per rank: parallel.strategy is auto: `hf-scale plan RECIPE --candidates` (this machine) or "
                     "--gpus N ranks the layouts the run would choose from")
        return lines
    work = Workload(seq=job.data.max_seq_len, batch=job.train.batch_size * job.train.grad_accum, device="cuda")
    mem = estimate_memory(facts, layout, work)
    nf4 = f" (NF4 base {mem.nf4_params / GiB:.2f})" if facts.quantize else ""
    dequant = f" / NF4 dequantization {mem.dequant / GiB:.2f}" if facts.quantize else ""
    lines.append(
        f"per rank, estimated for {layout.describe()} (seq {work.seq} x batch {work.batch}, GiB): params "
        f"{mem.params / GiB:.2f}{nf4} / grads {mem.grads / GiB:.2f} / optimizer {mem.optimizer / GiB:.2f} / "
        f"activations {mem.activations / GiB:.2f} / logits+loss {mem.logits_loss / GiB:.2f} / gathered + buffers "
        f"{mem.comm_buffers / GiB:.2f}{dequant} = peak {mem.device_total / GiB:.2f} on a GPU (its "
        f"{mem.overhead / GiB:.2f} process overhead included)" + (f", host {mem.host / GiB:.2f}" if mem.host else ""))
    return lines
