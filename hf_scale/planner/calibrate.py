"""Measure this machine once for the cost model: the fixed cost of a block's ops (a tiny llama),
achieved training FLOP/s of small llamas' forward + backward (hidden 576, SmolLM2's width, in
fp32 and bf16; hidden 256 in fp32: narrow matmuls run slower), memory bandwidth (a large copy), and gloo all-reduce bus
bandwidth and latency between 2 local processes. Seconds, not minutes; noisy on a busy machine
(the result is cached: :func:`hf_scale.planner.cost.cpu_device`, ``refresh=True`` to redo it).
"""

from __future__ import annotations

import os
import socket
import time

import torch


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _llama(hidden: int, layers: int, vocab: int = 8192):
    import transformers as tf

    heads = max(1, hidden // 64)
    return tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 32 * 32 or 64,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          vocab_size=vocab, tie_word_embeddings=True)


def training_seconds(config, dtype: torch.dtype, seq: int, batch: int) -> float:
    """Best-of-3 time of one training forward + backward of ``config``'s model (random weights)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return _best(lambda: model(input_ids=ids, labels=ids).loss.backward(), 3)


def block_overhead() -> float:
    """Seconds per block (embedding + head + loss counted as one more) of a step whose FLOPs are
    negligible: the fixed cost of a block's ops on this machine (dispatch, autograd, allocation)."""
    config = _llama(32, 4, vocab=64)
    return training_seconds(config, torch.float32, 8, 1) / (config.num_hidden_layers + 1)


def training_flops(dtype: torch.dtype, hidden: int = 576, seq: int = 256, batch: int = 2,
                   overhead: float = 0.0) -> float:
    """FLOP/s of a small llama's training forward + backward at width ``hidden`` (the planner's
    FLOPs per token), less the fixed per-block ``overhead``."""
    from .cost import flops_per_token
    from .profile import model_facts

    config = _llama(hidden, 2)
    seconds = training_seconds(config, dtype, seq, batch) - overhead * (config.num_hidden_layers + 1)
    return batch * seq * flops_per_token(model_facts(config), seq) / max(seconds, 1e-9)


def memory_bandwidth() -> float:
    a, b = torch.empty(16 * 2**20), torch.ones(16 * 2**20)
    return 2 * a.nbytes / _best(lambda: a.copy_(b), 5)


def _allreduce_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    big, small = torch.ones(4 * 2**20), torch.ones(1)
    bw = _best(lambda: dist.all_reduce(big), 3)
    lat = _best(lambda: [dist.all_reduce(small) for _ in range(20)], 2) / 20
    if rank == 0:
        queue.put((big.nbytes * 2 * (2 - 1) / 2 / bw, lat))  # ring bus bytes: 2(n-1)/n
    dist.destroy_process_group()


def allreduce_link() -> tuple[float, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join()
    return result


def calibrate() -> dict:
    """The numbers :func:`hf_scale.planner.cost.cpu_device` reads; compute with one thread, as each
    torchrun rank runs (``OMP_NUM_THREADS=1``)."""
    bus, latency = allreduce_link()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    overhead = block_overhead()
    result = {
        "block_overhead_s": overhead,
        "flops_fp32": training_flops(torch.float32, overhead=overhead),
        "flops_fp32_h256": training_flops(torch.float32, hidden=256, overhead=overhead),
        "flops_bf16": training_flops(torch.bfloat16, overhead=overhead),
        "mem_bandwidth": memory_bandwidth(),
        "allreduce_bus_bytes_per_s": bus,
        "allreduce_latency_s": latency,
        "threads": 1,
        "cpus": os.cpu_count(),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg()[0],
    }
    torch.set_num_threads(threads)
    return result
