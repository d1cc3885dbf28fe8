"""Measure this machine once for the cost model: achieved training FLOP/s (fp32 and bf16) of a
small llama's forward + backward (SmolLM2's block shape), memory bandwidth (a large copy), and gloo all-reduce bus
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


def training_flops(dtype: torch.dtype, seq: int = 256, batch: int = 2) -> float:
    """FLOP/s of a small llama's training forward + backward (the planner's FLOPs per token)."""
    import transformers as tf

    from .cost import flops_per_token
    from .profile import model_facts

    # SmolLM2-135M's block shape (the models benchmarked here), 2 blocks, a small vocabulary
    config = tf.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                            num_key_value_heads=3, vocab_size=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    ids = torch.randint(0, 8192, (batch, seq))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    seconds = _best(step, 3)
    return batch * seq * flops_per_token(model_facts(config), seq) / seconds


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
    result = {
        "flops_fp32": training_flops(torch.float32),
        "flops_bf16": training_flops(torch.bfloat16),
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
