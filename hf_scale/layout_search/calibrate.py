"""Measure this machine once for the cost model: the fixed cost of a block's ops (a tiny llama),
achieved training FLOP/s of small llamas' forward + backward (hidden 576, SmolLM2's width, in
fp32 and bf16; hidden 256 in fp32: narrow matmuls run slower) alone and with every core running
one (cores share caches, memory bandwidth and clock), memory bandwidth (a large copy), and,
between 2 local gloo processes and again between 4: all-reduce, all-gather and
reduce-scatter bus bandwidth (gloo's all-gather and reduce-scatter run at a fraction of its
all-reduce's), latency, and what FSDP2 costs per unit, DDP per step and tensor parallel per
sharded module beyond their model's compute (hooks, copies, DTensor's dispatch, small
collectives). About two minutes (bf16 on a CPU is slow); noisy on
a busy machine (the result is cached: :func:`hf_scale.layout_search.machine.cpu_device`, ``refresh=True``
to redo it).
"""

from __future__ import annotations

import logging
import os
import time

import torch


def _best(fn, reps: int, pick=min) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def _llama(hidden: int, layers: int, vocab: int = 8192, kv_groups: int = 1):
    import transformers as tf

    heads = max(1, hidden // 64)
    return tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 32 * 32 or 64,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // kv_groups), vocab_size=vocab, tie_word_embeddings=True)


def training_seconds(config, dtype: torch.dtype, seq: int, batch: int, pick=min, barrier=None,
                     ac: str | None = None) -> float:
    """One training forward + backward of ``config``'s model (random weights): the best of 3
    (``pick=_median``: their median, for rates a long run sustains). ``barrier``: processes
    measuring side by side start timing together (after one untimed step each). ``ac``: the
    blocks checkpointed as hf_scale does ("full" or "selective")."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    if ac:
        from ..model_plans import resolve_plan, wrap_units
        from ..parallel import apply_ac

        model.config.use_cache = False  # as parallelize sets it: a recomputed block would grow the cache
        apply_ac(wrap_units(model, resolve_plan(model)), ac)
    ids = torch.randint(0, config.vocab_size, (batch, seq))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    if barrier is not None:
        step()
        barrier.wait()
    return _best(step, 3, pick)


def block_overhead() -> dict:
    """Seconds per block (embedding + head + loss counted as one more) of a step whose FLOPs are
    negligible: the fixed cost of a block's ops on this machine (dispatch, autograd, allocation);
    and what checkpointing adds per block beyond that: full checkpointing beyond the recomputed
    forward (a third of the block's ops) the cost model charges, selective checkpointing all of it
    (its recomputed ops are the cheap ones: on a tiny model, their dispatch is their cost)."""
    config = _llama(32, 4, vocab=64)
    blocks = config.num_hidden_layers
    plain = training_seconds(config, torch.float32, 8, 1)
    per_block = plain / (blocks + 1)
    full = training_seconds(config, torch.float32, 8, 1, ac="full")
    selective = training_seconds(config, torch.float32, 8, 1, ac="selective")
    return {"block_overhead_s": per_block,
            "full_ac_overhead_s": max(0.0, (full - plain - blocks * per_block / 3) / blocks),
            "selective_ac_overhead_s": max(0.0, (selective - plain) / blocks)}


def training_flops(dtype: torch.dtype, hidden: int = 576, seq: int = 256, batch: int = 2,
                   overhead: float = 0.0, layers: int = 2, vocab: int = 8192, kv_groups: int = 1,
                   barrier=None) -> float:
    """FLOP/s of a small llama's training forward + backward at width ``hidden`` (the planner's
    FLOPs per token), less the fixed per-block ``overhead``; the median of 3 runs."""
    from .cost import flops_per_token
    from .profile import model_facts

    config = _llama(hidden, layers, vocab, kv_groups)
    seconds = training_seconds(config, dtype, seq, batch, _median, barrier) - overhead * (config.num_hidden_layers + 1)
    return batch * seq * flops_per_token(model_facts(config), seq) / max(seconds, 1e-9)


def memory_bandwidth() -> float:
    a, b = torch.empty(16 * 2**20), torch.ones(16 * 2**20)
    return 2 * a.nbytes / _best(lambda: a.copy_(b), 5)


def _tiny_blocks(layers: int = 8, width: int = 16):
    """Blocks of about a transformer block's tensor count (9-10: 4 Linear + a norm), tiny."""
    from torch import nn

    torch.manual_seed(0)
    def block():
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                             nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    return nn.Sequential(*[block() for _ in range(layers)])


def _wrapper_overheads(x, world: int = 2) -> tuple[float, float, float, float]:
    """Seconds per FSDP unit per step and per DDP step beyond the model's own compute: the
    wrappers' hooks, copies and the latency of their collectives on tensors too small to cost
    bandwidth (a stack of tiny Linear blocks, as hf_scale wraps blocks); and the seconds per
    parameter tensor of hf_scale's AdamW step (and ``zero_grad``), on plain tensors and on FSDP's
    ``DTensor`` shards (their memory traffic negligible here)."""
    import copy

    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _tiny_blocks()
    mesh = init_device_mesh("cpu", (world,))
    local = copy.deepcopy(model)
    sharded = copy.deepcopy(model)
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    ddp = replicate(copy.deepcopy(model), device_mesh=mesh)

    def step(m):
        return lambda: m(x).sum().backward()

    base = _best(step(local), 20)
    units = len(model) + 1
    fsdp_unit, ddp_step = (_best(step(sharded), 20) - base) / units, _best(step(ddp), 20) - base
    return fsdp_unit, ddp_step, _optimizer_tensor(local, x), _optimizer_tensor(sharded, x)


def _optimizer_tensor(model, x) -> float:
    from ..parallel.optim import build_optimizer

    optimizer = build_optimizer(model, lr=1e-5)
    model(x).sum().backward()

    def update():
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay for the next update

    return _best(update, 20) / len(list(model.parameters()))


def _tp_overhead(world: int) -> tuple[float, int]:
    """Seconds per step that tensor parallel over ``world`` ranks adds to a tiny llama whose
    FLOPs are negligible (hf_scale's own tp plan and vocabulary-parallel loss: DTensor's dispatch,
    the modules' input / output hooks, their all-reduces), and its count of sharded modules."""
    import copy

    import transformers as tf

    from ..config import ParallelConfig
    from ..log import logger
    from ..orchestrate import apply_parallelism
    from .profile import model_facts

    torch.manual_seed(0)
    plain = tf.AutoModelForCausalLM.from_config(_llama(256, 2, vocab=64, kv_groups=1))  # 4 heads: tp 2 and 4
    level = logger.level
    logger.setLevel(logging.WARNING)  # parallelize's layout line is not the calibration's to print
    try:
        sharded = apply_parallelism(copy.deepcopy(plain), ParallelConfig(tp=world))
    finally:
        logger.setLevel(level)
    ids = torch.randint(0, 64, (1, 8))

    def step(m):
        return lambda: m(input_ids=ids, labels=ids).loss.backward()

    col, row, root = model_facts(plain.config).tp_modules()
    modules = plain.config.num_hidden_layers * (col + row) + root
    return _best(step(sharded), 20) - _best(step(plain), 20), modules


def collectives_rank(rank: int, world: int, _arg: float = 0.0) -> dict | None:
    """A helper process's part of :func:`collectives` (its gloo group started); rank 0 returns
    the figures."""
    import torch.distributed as dist

    n = 4 * 2**20  # floats: 16 MB, about one SmolLM2 block in fp32
    big, small = torch.ones(n), torch.ones(1)
    part, whole = torch.ones(n // world), torch.empty(n)
    bw = _best(lambda: dist.all_reduce(big), 3)
    gather = _best(lambda: dist.all_gather_into_tensor(whole, part), 3)
    scatter = _best(lambda: dist.reduce_scatter_tensor(part, big), 3)
    lat = _best(lambda: [dist.all_reduce(small) for _ in range(20)], 2) / 20
    fsdp_unit, ddp, tensor, dtensor = _wrapper_overheads(torch.ones(4, 16), world)
    tp_step, tp_modules = _tp_overhead(world)
    # the cost model charges each collective's latency itself: 2 all-gathers + 1 reduce-scatter
    # per FSDP unit, one all-reduce per DDP bucket, one per tp module
    fsdp_unit, ddp, tp_module = fsdp_unit - 3 * lat, ddp - lat, tp_step / tp_modules - lat
    if rank != 0:
        return None
    ring = big.nbytes * (world - 1) / world  # ring bus bytes per rank: 2(n-1)/n for all-reduce, (n-1)/n else
    return {"allreduce_bus_bytes_per_s": 2 * ring / bw, "allreduce_latency_s": lat,
            "allgather_bus_bytes_per_s": ring / gather, "reducescatter_bus_bytes_per_s": ring / scatter,
            "fsdp_unit_overhead_s": max(0.0, fsdp_unit), "ddp_overhead_s": max(0.0, ddp),
            "tp_module_overhead_s": max(0.0, tp_module), "optimizer_tensor_s": tensor,
            "optimizer_dtensor_s": dtensor}


def collectives(world: int = 2) -> dict:
    """gloo between ``world`` local processes: all-reduce, all-gather and reduce-scatter bus
    bandwidth, the latency of a tiny all-reduce, and FSDP's / DDP's / tp's own cost per unit /
    step / module. Measured in helper processes (:mod:`hf_scale.layout_search.helpers`)."""
    from .helpers import run_helpers

    return run_helpers(__spec__.name, "collectives", world, HELPER_TIMEOUT_S, f"the {world}-process gloo measurement")[0]


# Seconds the calibration waits for one measurement's helper processes (each takes 5-60 s).
HELPER_TIMEOUT_S = 300


# SmolLM2's block shape (grouped key/value heads) and vocabulary, 4 blocks, 256 tokens: the rate a
# real model's step sustains (a 2-block, 8k-vocabulary model ran ~20% faster per FLOP)
_SMOLLM2_SHAPE = {"seq": 256, "batch": 1, "layers": 4, "vocab": 49152, "kv_groups": 3}


def busy_rank(rank: int, world: int, overhead: float) -> dict:
    """A helper process's part of :func:`busy_flops`: its rate, timed while the others compute."""
    import types

    import torch.distributed as dist

    barrier = types.SimpleNamespace(wait=dist.barrier)  # training_seconds calls barrier.wait()
    return {"flops": training_flops(torch.float32, overhead=overhead, barrier=barrier, **_SMOLLM2_SHAPE)}


def busy_flops(overhead: float, processes: int) -> float:
    """fp32 FLOP/s of one process while ``processes`` run the same training step side by side,
    one thread each (every core busy, as under torchrun with a rank per core): shared caches,
    memory bandwidth and clock can make it lower than one process alone's. The median process's
    rate."""
    from .helpers import run_helpers

    rates = run_helpers(__spec__.name, "busy", processes, 2 * HELPER_TIMEOUT_S, f"{processes} processes computing at once",
                        overhead)
    return _median([r["flops"] for r in rates])


def calibrate() -> dict:
    """The numbers :func:`hf_scale.layout_search.machine.cpu_device` reads; compute with one thread, as each
    torchrun rank runs (``OMP_NUM_THREADS=1``). ``load_before``, the 1-minute load average
    before measuring (other work on the machine, not this measurement's own processes), lets a later
    run tell a calibration taken on a busy machine (:func:`hf_scale.layout_search.machine.busy_calibration`)."""
    load_before = os.getloadavg()[0]
    links = collectives()
    # again at 4 processes: more ranks per collective and, on a machine of 2 or 3 cores, more ranks
    # than cores (per-unit costs and latencies grow faster than the compute's share shrinks)
    links["world4"] = collectives(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    overheads = block_overhead()
    overhead = overheads["block_overhead_s"]
    result = {
        **overheads,
        "flops_fp32": training_flops(torch.float32, overhead=overhead, **_SMOLLM2_SHAPE),
        "flops_fp32_h256": training_flops(torch.float32, hidden=256, overhead=overhead, **_SMOLLM2_SHAPE),
        "flops_bf16": training_flops(torch.bfloat16, overhead=overhead),
        "mem_bandwidth": memory_bandwidth(),
        **links,
        "threads": 1,
        "cpus": os.cpu_count(),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before,
        "load_average": os.getloadavg()[0],
    }
    cores = os.cpu_count() or 1
    if cores > 1:  # per core with every core computing (8 at most), against one process alone (just measured)
        result["flops_busy_ratio"] = busy_flops(overhead, min(cores, 8)) / result["flops_fp32"]
    torch.set_num_threads(threads)
    return result


if __name__ == "__main__":  # a helper process of collectives() or busy_flops()
    from hf_scale.layout_search.helpers import serve

    serve({"collectives": collectives_rank, "busy": busy_rank})
