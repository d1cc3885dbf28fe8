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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_write_arg, check_doc, markdown_table, write_doc

LLAMA3 = {  # config.json of meta-llama/Meta-Llama-3-8B and -70B
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}
CASES = [("Llama-3-8B", 8), ("Llama-3-70B", 64)]
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
    body = (f"fsdp over N GPUs, bf16 compute (fp32 master weights), seq {SEQ} x batch {BATCH} per rank, sdpa.\n\n"
            + markdown_table(header, cells) + "\n\n```\n" + "\n".join(notes) + "\n```\n")
    print(body)
    write_doc(args, body)


if __name__ == "__main__":
    main()
