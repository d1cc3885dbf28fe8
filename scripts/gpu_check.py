"""The GPU path, checked on one CUDA device (issue 11, item 4).

On one GPU (world 1), ``hf_scale.parallelize`` with bf16 mixed precision, with full and with
selective activation checkpointing, and with ``loss_chunk_tokens``, trains SmolLM2-135M for a few
AdamW steps; each leg's losses must equal plain transformers' (the same model under
``torch.autocast(bf16)``, same batches, same AdamW) within bf16 tolerance, and its peak CUDA
memory is printed beside plain transformers'. Then ``save_pretrained`` / ``from_pretrained``
must round-trip the trained weights bit for bit, and plain ``AutoModelForCausalLM`` must load them.

Usage::

    python scripts/gpu_check.py                       # on a machine with a CUDA GPU
    python scripts/gpu_check.py --write docs/benchmarks.md
    python scripts/gpu_check.py --device cpu --model tiny --steps 2   # the script's own logic, here
    python scripts/gpu_check.py --model smollm2-random   # SmolLM2-135M's architecture, random
                                                         # weights: a GPU machine without the weights

After each leg it also checks placement: every parameter, gradient, optimizer state and buffer
of the trained model is on the device the run chose (``cuda:0`` here).

``--simulate`` also runs each hf_scale leg through ``hf_scale.layout_search.simulate`` (the same
layout as rank 0 of 1 on fake CUDA tensors: no GPU memory used) and prints its tracked peak
beside the leg's measured ``torch.cuda.max_memory_allocated``: the simulation checked against a
real device (issue 29), within +-10% to pass.

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time

import torch
from bench_common import add_write_arg, check_doc, markdown_table, write_doc

LEGS = {
    "hf_scale bf16": {"mixed_precision": "bf16"},
    "hf_scale bf16 + full AC": {"mixed_precision": "bf16", "activation_checkpointing": "full"},
    "hf_scale bf16 + selective AC": {"mixed_precision": "bf16", "activation_checkpointing": "selective"},
    "hf_scale bf16 + full AC + chunked loss": {"mixed_precision": "bf16", "activation_checkpointing": "full",
                                               "loss_chunk_tokens": 128},
}
RTOL = 2e-2  # bf16 keeps 8 bits of mantissa: per-step losses of two bf16 runs agree to ~1e-2
TEXT = ("The quick brown fox jumps over the lazy dog. Distributed training splits a model over many "
        "devices so that each one holds only a part of the weights, gradients and optimizer state. ")


def load(model_name: str, seq: int = 256):
    """(model in fp32 on the CPU, a batch of token ids) for SmolLM2 or a tiny Llama."""
    if model_name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
        return LlamaForCausalLM(config), torch.randint(0, 256, (4, seq))
    if model_name == "smollm2-random":  # SmolLM2-135M-Instruct's published config, random weights
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                             max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                             tie_word_embeddings=True)
        return LlamaForCausalLM(config), torch.randint(0, 49152, (4, seq))
    from hf_scale.zoo import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    ids = tokenizer(TEXT * 20, return_tensors="pt").input_ids[:, :1024]
    return model, ids.reshape(4, -1)


def peak_memory(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def train(model, batch, device, steps: int, plain: bool) -> list[float]:
    """``steps`` AdamW steps on ``batch``; the loss of each. ``plain``: transformers as users run
    it (torch AdamW, ``torch.autocast``); else hf_scale's optimizer (its autocast is in the model)."""
    import hf_scale

    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if plain
                 else hf_scale.build_optimizer(model, lr=1e-4))
    model.placement_probe = optimizer  # read by misplaced(); the attribute dies with the model
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)  # first: the last step's gradients stay for misplaced()
        with torch.autocast(device.type, torch.bfloat16, enabled=plain):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def misplaced(model, device: torch.device) -> list[str]:
    """Names of the parameters, gradients, optimizer states and buffers not on ``device`` (the
    local shard of a DTensor is what the device holds)."""

    def where(tensor):
        local = getattr(tensor, "_local_tensor", tensor)
        return local.device

    want = device if device.type == "cpu" else torch.device(device.type, device.index or 0)
    bad = []
    for name, param in model.named_parameters():
        if where(param) != want:
            bad.append(f"parameter {name} on {where(param)}")
        if param.grad is not None and where(param.grad) != want:
            bad.append(f"gradient of {name} on {where(param.grad)}")
    for name, buffer in model.named_buffers():
        if where(buffer) != want:
            bad.append(f"buffer {name} on {where(buffer)}")
    optimizer = getattr(model, "placement_probe", None)
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and where(value) != want:
                bad.append(f"optimizer state {key!r} on {where(value)}")
    return bad


def simulated_row(name: str, config: dict, model_config, shape: tuple, measured: float, failures: list) -> list:
    """One leg of ``--simulate``: its simulated peak beside the measured one (MiB)."""
    import dataclasses

    from hf_scale.config import ParallelConfig
    from hf_scale.layout_search.simulate import as_layout, simulate

    layout = dataclasses.replace(as_layout(ParallelConfig(**config), 1), micro_batch=shape[0])
    sim = simulate(model_config, world_size=1, rank=0, parallel=layout, seq=shape[1], batch=shape[0])
    mib = {k: v / 2**20 for k, v in sim.peak.items()}
    ratio = mib["total"] / measured if measured == measured else float("nan")  # nan: measured on the CPU
    ok = 0.9 <= ratio <= 1.1
    if measured == measured and not ok:
        failures.append(f"{name}: simulated peak {mib['total']:.0f} MiB vs measured {measured:.0f} MiB ({ratio:.2f}x)")
    parts = " / ".join(f"{mib.get(k, 0):.0f}" for k in ("params", "grads", "optimizer", "activations", "temporaries"))
    verdict = "-" if measured != measured else ("PASS" if ok else "FAIL") + " (need 0.90-1.10x)"
    return [name, f"{ratio:.3f}", f"{mib['total']:.0f}", f"{measured:.0f}", parts, verdict]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-random", "tiny"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256, help="tokens per row of the random batch (tiny, smollm2-random)")
    parser.add_argument("--simulate", action="store_true",
                        help="also simulate each hf_scale leg on fake CUDA tensors and compare its peak with the measured one")
    add_write_arg(parser, "gpu")
    args = parser.parse_args()
    check_doc(args)
    import hf_scale

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (use --device cpu to run its logic here)")
        return 1
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    base, batch = load(args.model, args.seq)
    batch = batch.to(device)
    rows, failures, sim_rows = [], [], []

    def leg(model, plain: bool):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        losses = train(model, batch, device, args.steps, plain)
        return losses, peak_memory(device), time.perf_counter() - start

    train(copy.deepcopy(base).to(device), batch, device, 1, plain=True)  # warm-up: CUDA context, kernels
    reference, ref_mem, ref_time = leg(copy.deepcopy(base).to(device), plain=True)
    rows.append(["plain transformers + autocast bf16", "1.00x", "-", " ".join(f"{x:.4f}" for x in reference),
                 f"{ref_mem:.0f}", f"{ref_time:.1f}"])
    trained = None
    for name, config in LEGS.items():
        trained = model = None  # the last leg's model, gradients and optimizer state must not count in this leg's peak
        gc.collect()
        model = hf_scale.parallelize(copy.deepcopy(base), config)
        if device.type == "cuda" and next(model.parameters()).device != device:
            failures.append(f"{name}: parallelize left the model on {next(model.parameters()).device}")
        losses, mem, took = leg(model, plain=False)
        wrong = misplaced(model, device)
        if wrong:
            failures.append(f"{name}: {len(wrong)} tensors off {device}: {wrong[:4]}")
        del model.placement_probe  # the optimizer, with its state
        model.zero_grad(set_to_none=True)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        if diff > RTOL:
            failures.append(f"{name}: losses {losses} vs transformers {reference} (max rel diff {diff:.3g} > {RTOL})")
        rows.append([name, f"{mem / ref_mem:.2f}x" if device.type == "cuda" else "-", f"{diff:.2e}",
                     " ".join(f"{x:.4f}" for x in losses), f"{mem:.0f}", f"{took:.1f}"])
        if args.simulate:
            sim_rows.append(simulated_row(name, config, base.config, tuple(batch.shape), mem, failures))
        trained = model
    with tempfile.TemporaryDirectory() as tmp:
        hf_scale.save_pretrained(trained, tmp)
        loaded = hf_scale.from_pretrained(tmp)  # the default layout, in one process on the device
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(tmp)
        want = {k: v.detach().cpu() for k, v in trained.state_dict().items()}
        for what, other in (("hf_scale.from_pretrained", loaded), ("AutoModelForCausalLM", plain)):
            got = {k: v.detach().cpu() for k, v in other.state_dict().items()}
            bad = [k for k in want if k in got and not torch.equal(want[k], got[k])]
            missing = sorted(set(want) - set(got))
            if bad or missing:
                failures.append(f"round trip through {what}: {len(bad)} tensors differ, missing {missing[:3]}")
    header = ["leg", "peak memory vs transformers", "max rel loss diff", "losses", "peak MiB", "s"]
    table = markdown_table(header, rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (logic check, not the GPU path)"
    verdict = (f"{args.model} on {name}, {args.steps} AdamW steps, batch {tuple(batch.shape)}: "
               + ("all checks passed (losses within "
                  f"{RTOL} of plain transformers, save/load round trip bit-identical)" if not failures
                  else "FAILED: " + "; ".join(failures)))
    if sim_rows:
        sim_header = ["leg", "simulated / measured peak", "simulated peak MiB", "measured peak MiB",
                      "simulated: params / grads / optimizer / activations / temporaries (MiB)", "verdict"]
        table += ("\n\nThe same legs simulated on fake CUDA tensors (`hf_scale.layout_search.simulate`, rank 0 of "
                  "1, MemTracker's peak of the second step) against the peak measured above:\n\n"
                  + markdown_table(sim_header, sim_rows))
    print(table)
    print(verdict)
    write_doc(args, f"{table}\n\n{verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
