"""The auto-planner's estimates for published shapes, beside the figures the literature gives.

Run (a few minutes: Llama-3 8B and 70B built on the meta device, no weights, no GPU)::

    python scripts/plan_published.py
    python scripts/plan_published.py --write docs/benchmarks.md

For Llama-3 8B on 8 GPUs and Llama-3 70B on 64 GPUs of 80 GB (fsdp, bf16 compute with fp32
master weights, seq 4096, one sequence per rank), it prints per rank:

* model states (parameters + gradients + AdamW moments) against ZeRO's ``16 x params / N``
  (Rajbhandari et al., "ZeRO", SC'20, section 3.1 and Table 1: mixed-precision Adam keeps 16
  bytes per parameter, ZeRO-3 divides them by the data-parallel degree). hf_scale's 16 bytes are
  4 (fp32 master parameter) + 4 (fp32 gradient) + 8 (two fp32 moments): the same total, another
  split (FSDP2 all-gathers a bf16 copy only for compute);
* activations per block without checkpointing against Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models" (MLSys'23), eq. 1: ``s b h (34 + 5 a s / h)`` bytes
  per layer for a GPT block in 16 bits. That formula is for a GPT-3 block (4h MLP, GELU, dropout
  after attention and MLP, attention scores stored); a Llama block has no dropout, a SwiGLU MLP
  of width ``intermediate_size``, grouped key/value heads and flash attention (no ``a s^2``
  scores: the ``5as/h`` term drops, leaving ``34 s b h``), so the planner's count (saved tensors of
  the block's own forward on the meta device) is expected to differ, and the table shows by how
  much against both;
* with full checkpointing, what a block keeps: its input, ``2 s b h`` bytes in bf16 (the same
  paper, section 4.1);
* the layout the planner recommends for that shape (H100 numbers: a stand-in, not a measurement).

Then a published measurement of a whole adapter run against the planner's estimate of the same
run under hf_scale: torchtune's Llama 3.1 70B LoRA on 8 x A100 80GB, 27.6 GiB peak memory per
GPU (pytorch/torchtune ``README.md``, "Memory and training speed", added in 30b8519 on
2024-09-24 and unchanged since: batch size 2 without gradient accumulation, a dataset packed to
2048 tokens, torch compile on). The run's recipe is ``recipes/configs/llama3_1/70B_lora.yaml``
as of that commit: LoRA rank 16, alpha 32, dropout 0 on ``q_proj``, ``k_proj`` and ``v_proj``
(today's file targets ``q_proj``, ``v_proj``, ``output_proj`` and the MLP: printed as a note),
bf16 weights, activation checkpointing of every layer, ``CEWithChunkedOutputLoss`` (8 chunks of
the sequence); ``lora_finetune_distributed`` shards every layer and the root with FSDP2. The
same run for the planner: Llama-3.1-70B built on the meta device in bf16, LoRA injected by
peft's ``get_peft_model`` (its adapters in fp32, the master copy hf_scale trains), fsdp over 8
ranks, bf16 compute, full checkpointing, micro-batch 2 x 2048 tokens, and hf_scale's chunked
loss at torchtune's chunk size (2 x 256 = 512 tokens; torchtune keeps every chunk's saved
tensors, hf_scale recomputes one chunk at a time: the unchunked loss is printed too). torch's
memory statistics, which torchtune reports, leave out the CUDA context: the ratio compares them
with the estimate less the process overhead (``OVERHEAD``), as ``bench_planner.py`` compares
``MemTracker``'s tracked bytes; the device total's ratio is printed beside it.

Beside it, the same table's QLoRA row: Llama 3.1 8B, QLoRA, 1x 4090, 7.4 GiB peak (the README at
0031bfb, the same settings: batch size 2, packed to 2048 tokens, torch compile on), whose recipe
is ``recipes/configs/llama3_1/8B_qlora_single_device.yaml`` (read at 0b3e04a; the commit the
figure was measured at is not stated): LoRA rank 8, alpha 16, dropout 0 on ``q_proj``,
``k_proj``, ``v_proj``, ``output_proj`` and the MLP (not the head), their base weights in NF4
(torchao), bf16, activation checkpointing, ``CEWithChunkedOutputLoss``. The planner's run: the
same LoRA by peft on Llama-3.1-8B in bf16 with ``quantize="nf4"`` (every targeted base weight
is NF4 on one rank), one rank, bf16 compute, full checkpointing, 2 x 2048 tokens, the loss in
chunks of 512 tokens. Known differences: torchtune trains its adapters in bf16 (hf_scale in
fp32 with fp32 AdamW state: 0.12 GiB more here), and under torch compile its dequantization
fuses (the planner prices torchao's eager one: int64 codes and three copies in the compute
dtype of the largest weight, 0.77 GiB for the 14336 x 4096 MLP weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_write_arg, check_doc, markdown_table, write_doc

LLAMA3 = {  # config.json of meta-llama/Meta-Llama-3-8B and -70B
    "Llama-3-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192},
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "max_position_embeddings": 8192},
}
CASES = [("Llama-3-8B", 8), ("Llama-3-70B", 64)]
# config.json of meta-llama/Llama-3.1-70B: Llama-3-70B's shapes with llama3 rope scaling to 128k positions
LLAMA31_70B = LLAMA3["Llama-3-70B"] | {
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}
TORCHTUNE_GIB = 27.6  # torchtune README (30b8519): Llama 3.1 70B, LoRA, 8x A100, peak memory per GPU
TORCHTUNE_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj"]}
# the config file today (9d20413): attention q, v, output and the MLP
TORCHTUNE_LORA_NOW = TORCHTUNE_LORA | {
    "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TT_SEQ, TT_BATCH, TT_GPUS, TT_CHUNK = 2048, 2, 8, 512
# config.json of meta-llama/Llama-3.1-8B: Llama-3-8B's shapes with Llama 3.1's rope scaling
LLAMA31_8B = LLAMA3["Llama-3-8B"] | {k: LLAMA31_70B[k] for k in ("max_position_embeddings", "rope_theta",
                                                                  "rms_norm_eps", "rope_scaling")}
TORCHTUNE_QLORA_GIB = 7.4  # torchtune README (0031bfb): Llama 3.1 8B, QLoRA, 1x 4090, peak memory
TORCHTUNE_QLORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,  # 8B_qlora_single_device.yaml
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
GiB = 2**30
SEQ, BATCH = 4096, 1
GB = 1e9


def rows() -> tuple[list[list[str]], list[str]]:
    import torch
    import transformers

    from hf_scale.layout_search import (
        H100,
        Layout,
        Workload,
        choose,
        estimate_memory,
        model_facts,
        parse_memory,
    )

    cells, notes = [], []
    for name, gpus in CASES:
        config = transformers.LlamaConfig(**LLAMA3[name])
        config._attn_implementation = "sdpa"
        facts = model_facts(config)
        work = Workload(seq=SEQ, batch=BATCH, device="cuda")
        plain = estimate_memory(facts, Layout("fsdp", 1, gpus, precision="bf16"), work)
        full = estimate_memory(facts, Layout("fsdp", 1, gpus, precision="bf16", ac="full"), work)
        states = plain.params + plain.grads + plain.optimizer
        zero3 = 16 * facts.params / gpus
        h, a = config.hidden_size, config.num_attention_heads
        profile = facts.profile(SEQ, torch.bfloat16, "sdpa")
        korthikanti = SEQ * BATCH * h * (34 + 5 * a * SEQ / h)
        no_scores = SEQ * BATCH * h * 34  # flash attention keeps no a x s x s scores, softmax or dropout mask
        kept = 2 * SEQ * BATCH * h
        nodes = max(1, gpus // 8)
        best, _ = choose(facts, work, gpus, parse_memory("80GB"), H100, nodes, precisions=("bf16",))
        cells.append([
            f"{name}, {gpus} GPUs", f"{states / zero3:.3f}", f"{profile.block_bytes / korthikanti:.2f}",
            f"{profile.block_bytes / no_scores:.2f}",
            f"{profile.block_input / kept:.2f}", f"{facts.params / 1e9:.2f}B", f"{states / GB:.2f}",
            f"{zero3 / GB:.2f}",
            f"{profile.block_bytes / GB:.3f}", f"{korthikanti / GB:.3f}", f"{profile.block_input / GB:.4f}",
            f"{kept / GB:.4f}", f"{full.device_total / GB:.1f}", best.layout.describe(),
        ])
        notes.append(f"{name} on {gpus} GPUs ({nodes} node(s) of 8): recommended {best.layout.describe()}, "
                     f"{best.memory.device_total / GB:.1f} GB per rank estimated, "
                     f"{best.cost.tokens_per_second:,.0f} tokens/s estimated on H100 stand-in numbers")
    return cells, notes


def lora_facts(lora: dict, shape: dict = LLAMA31_70B, quantize: str | None = None):
    """Llama-3.1-70B (or ``shape``) on the meta device in bf16 with LoRA injected by peft; the
    planner's facts (``quantize="nf4"``: its LoRA base weights in NF4)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from hf_scale.layout_search import model_facts

    config = transformers.LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return model_facts(get_peft_model(base, LoraConfig(**lora)), quantize=quantize)


def _published_row(name: str, chunk, mem, published_gib: float, facts, layout: str) -> list[str]:
    """One row beside a published peak: the estimate less and with its overhead, over it and in GiB."""
    tracked = mem.device_total - mem.overhead
    return [name + ("" if chunk else " (hf_scale loss unchunked)"),
            f"{tracked / GiB / published_gib:.3f}", f"{mem.device_total / GiB / published_gib:.3f}",
            f"{published_gib:.1f}", f"{tracked / GiB:.2f}", f"{mem.device_total / GiB:.2f}",
            f"{facts.trainable_params / 1e6:.1f}M of {facts.params / 1e9:.2f}B", layout]


def torchtune_rows() -> tuple[list[list[str]], list[str]]:
    """torchtune's published 70B LoRA peak against the planner's estimate (see the module doc)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return [["torchtune Llama 3.1 70B LoRA, 8x A100", "needs peft (pip install peft)"]], []
    from hf_scale.layout_search import H100, Layout, Workload, choose, estimate_memory, parse_memory

    work = Workload(seq=TT_SEQ, batch=TT_BATCH, device="cuda")
    cells, notes = [], []
    facts = lora_facts(TORCHTUNE_LORA)
    for chunk in (TT_CHUNK, None):
        layout = Layout("fsdp", 1, TT_GPUS, precision="bf16", ac="full", micro_batch=TT_BATCH, loss_chunk_tokens=chunk)
        mem = estimate_memory(facts, layout, work)
        cells.append(_published_row("torchtune Llama 3.1 70B LoRA, 8x A100", chunk, mem, TORCHTUNE_GIB, facts,
                                    layout.describe()))
        parts = ("params", "optimizer", "comm_buffers", "activations", "logits_loss", "recompute", "grads")
        notes.append(f"{layout.describe()}: " + ", ".join(f"{k} {getattr(mem, k) / GiB:.3f}" for k in parts)
                     + f", overhead {mem.overhead / GiB:.2f} GiB")
    best, _ = choose(facts, work, TT_GPUS, parse_memory("80GB"), H100, precisions=("bf16",))
    notes.append(f"strategy auto for this LoRA run on 8 x 80 GB: {best.layout.describe()}, "
                 f"{best.memory.device_total / GiB:.2f} GiB per rank, {best.cost.tokens_per_second:,.0f} tokens/s "
                 "estimated on H100 stand-in numbers")
    now = lora_facts(TORCHTUNE_LORA_NOW)
    layout = Layout("fsdp", 1, TT_GPUS, precision="bf16", ac="full", micro_batch=TT_BATCH, loss_chunk_tokens=TT_CHUNK)
    mem = estimate_memory(now, layout, work)
    notes.append(f"today's 70B_lora.yaml targets ({', '.join(TORCHTUNE_LORA_NOW['target_modules'])}; "
                 f"{now.trainable_params / 1e6:.1f}M trainable): {(mem.device_total - mem.overhead) / GiB:.2f} GiB "
                 "less the overhead (not what the README measured)")
    qlora = lora_facts(TORCHTUNE_QLORA, LLAMA31_8B, "nf4")
    for chunk in (TT_CHUNK, None):
        layout = Layout("fsdp", 1, 1, precision="bf16", ac="full", micro_batch=TT_BATCH, loss_chunk_tokens=chunk)
        mem = estimate_memory(qlora, layout, work)
        cells.append(_published_row("torchtune Llama 3.1 8B QLoRA, 1x 4090", chunk, mem, TORCHTUNE_QLORA_GIB, qlora,
                                    layout.describe() + " nf4"))
        parts = ("params", "nf4_params", "dequant", "optimizer", "activations", "logits_loss", "recompute", "grads")
        notes.append(f"{layout.describe()} nf4: " + ", ".join(f"{k} {getattr(mem, k) / GiB:.3f}" for k in parts)
                     + f", overhead {mem.overhead / GiB:.2f} GiB")
    return cells, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_write_arg(parser, "planner-published")
    args = parser.parse_args()
    check_doc(args)
    cells, notes = rows()
    header = ["shape", "model states / ZeRO-3's 16P/N", "block activations / Korthikanti eq. 1",
              "block activations / eq. 1 without the scores (34sbh)",
              "full-AC block input / 2sbh", "parameters", "model states (GB/rank)", "16P/N (GB)",
              "block activations (GB)", "Korthikanti eq. 1 (GB)", "full-AC kept (GB)", "2sbh (GB)",
              "fsdp bf16 full AC peak (GB/rank)", "recommended (80 GB H100s)"]
    lora_cells, lora_notes = torchtune_rows()
    lora_header = ["published run", "estimate less overhead / published", "device total / published",
                   "published (GiB/GPU)", "estimate less overhead (GiB)", "device total (GiB)", "trainable",
                   "hf_scale layout"]
    body = (f"fsdp over N GPUs, bf16 compute (fp32 master weights), seq {SEQ} x batch {BATCH} per rank, sdpa.\n\n"
            + markdown_table(header, cells) + "\n\n```\n" + "\n".join(notes) + "\n```\n\n"
            + f"Adapter run: seq {TT_SEQ} x batch {TT_BATCH} per rank, bf16 frozen base (its LoRA base weights in NF4 on the QLoRA rows), fp32 adapters "
            "(see the script's docstring for the sources).\n\n"
            + markdown_table(lora_header, lora_cells) + "\n\n```\n" + "\n".join(lora_notes) + "\n```\n")
    print(body)
    write_doc(args, body)


if __name__ == "__main__":
    main()
