"""Context parallel at world 2 and 4 (see tests/distributed/test_cp.py): runs on the ranks, and
the one-process reference the parent computes."""

from __future__ import annotations

import contextlib
import copy
import os
import traceback

import torch
import transformers as tf
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import hf_scale
from hf_scale.parallel.cp import ContextParallel
from hf_scale.parallel.optim import parameter_groups
from hf_scale.parallel.saved_bytes import SavedBytes
from hf_scale.train.dp import DataParallel
from tests.tiny_models import slice_batch

VOCAB, BATCH, SEQ, STEPS, LR, WEIGHT_DECAY, MAX_NORM = 128, 4, 16, 3, 1e-3, 0.1, 1.0
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
               initializer_range=0.2)  # sharp attention: a wrong mask shows
CONFIGS = {  # sliding windows shorter than the sequence; gemma2 soft-caps its attention logits
    "llama": lambda: tf.LlamaConfig(**_COMMON),
    "qwen3": lambda: tf.Qwen3Config(**_COMMON, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**_COMMON, sliding_window=5),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: tf.Phi3Config(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=1),
    "gemma2": lambda: tf.Gemma2Config(**_COMMON, head_dim=8, sliding_window=6, attn_logit_softcapping=2.0),
}


def cp_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)


def cp_batches(packed: bool, seq: int = SEQ, steps: int = STEPS) -> list[dict]:
    """Rows with masked prompts (each row's first 0-5 labels -100); ``packed``: 3 documents per
    row, position_ids restarting at each, no mask, each document's first label -100."""
    g = torch.Generator().manual_seed(7 + seq)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (BATCH, seq), generator=g)
        labels = ids.clone()
        for r in range(BATCH):
            labels[r, : int(torch.randint(0, 6, (1,), generator=g))] = -100
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            positions = torch.empty_like(ids)
            for r in range(BATCH):
                cuts = sorted(torch.randperm(seq - 2, generator=g)[:2].add(1).tolist())
                for a, b in zip([0, *cuts], [*cuts, seq]):
                    positions[r, a:b] = torch.arange(b - a)
                    labels[r, a] = -100
            batch["position_ids"] = positions
        out.append(batch)
    return out


def _labeled(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def reference(arch: str, packed: bool, seq: int = SEQ) -> dict:
    """One process, plain transformers and AdamW on the whole batches."""
    model = cp_model(arch)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    losses, norms, grads = [], [], None
    grad_min = {n: torch.full_like(p, float("inf")) for n, p in model.named_parameters()}
    for batch in cp_batches(packed, seq):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            grad_min[n] = torch.minimum(grad_min[n], p.grad.abs())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "grads": grads, "initial": initial, "grad_min": grad_min,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def cp_run(case: dict) -> dict:
    """3 AdamW steps of ``case`` through hf_scale.train_step, each data-parallel rank its rows,
    weighted by their label tokens as the fine-tuning loop weighs them; the loss every rank of a
    cp group returned, hf_scale.eval_step's loss before each step, the first step's gradients and
    the final parameters (whole)."""
    model = hf_scale.parallelize(cp_model(case["arch"]), copy.deepcopy(case["config"]))
    state, dp = hf_scale.get_state(model), DataParallel.of(model)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms, grads, returned, evaluated = [], [], None, [], []
    for batch in cp_batches(case.get("packed", False), case.get("seq", SEQ)):
        local = slice_batch(batch, dp.rank, dp.degree)
        share = _labeled(local) / _labeled(batch)
        evaluated.append(float(dp.all_reduce(hf_scale.eval_step(model, local).double() * share)))
        loss = hf_scale.train_step(model, local, loss_scale=share * dp.degree)
        returned.append(float(loss))
        if grads is None:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        norms.append(float(hf_scale.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(dp.all_reduce(torch.tensor(float(loss) * share, dtype=torch.float64))))
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "returned": returned,
            "evaluated": evaluated, "calls": dict(ContextParallel.of(model).calls),
            "dp": (state.dp_rank, state.dp_degree, dp.degree), "cp": state.cp_degree}


def comm_counts(arch: str = "llama", config: dict | None = None, packed: bool = True) -> dict:
    """Collectives of one training forward and its backward (after a first forward, whose batch
    check over the group is not counted): the K/V all-gathers and their reduce-scatters, their
    calls and bytes, and the K/V bytes of the whole sequence per layer they should move."""
    model = hf_scale.parallelize(cp_model(arch), config or {"strategy": "fsdp", "cp": 2})
    batch = cp_batches(packed=packed)[0]
    model(**batch).loss.backward()
    model.zero_grad()
    cp = ContextParallel.of(model)
    before = dict(cp.calls)
    out = {}
    with CollectiveCounter() as comm:
        loss = model(**batch).loss
    out["forward"], out["forward_bytes"] = comm.counts, comm.bytes
    with CollectiveCounter() as comm:
        loss.backward()
    out["backward"], out["backward_bytes"] = comm.counts, comm.bytes
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    out["layers"] = c.num_hidden_layers
    element = 2 if (config or {}).get("mixed_precision") else 4  # the compute dtype's bytes
    out["kv_bytes"] = BATCH * c.num_key_value_heads * SEQ * 2 * head_dim * element  # K and V, whole sequence
    out["q_bytes"] = BATCH * c.num_attention_heads * SEQ * head_dim * 4  # the queries (and the output)
    out["blocks"] = cp.calls["blocks"] - before["blocks"]
    out["prefix"] = cp.calls["prefix"] - before["prefix"]
    out["alltoall"] = cp.calls["alltoall"] - before["alltoall"]
    return out


class CollectiveCounter(TorchDispatchMode):
    """Calls of each collective op (``c10d.allreduce_``, ``c10d_functional.all_gather_into_tensor``),
    as CommDebugMode counts them, without its module tracker (which breaks on checkpointed blocks)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}  # the bytes of each collective's larger side (gathered / scattered)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        out = func(*args, **(kwargs or {}))
        if namespace in ("c10d", "_c10d_functional"):
            name = f"{namespace.lstrip('_')}.{func.__name__.split('.')[0]}"
            self.counts[name] = self.counts.get(name, 0) + 1
            sizes = [t.numel() * t.element_size() for t in (args[0], out) if isinstance(t, torch.Tensor)]
            self.bytes[name] = self.bytes.get(name, 0) + max(sizes, default=0)
        return out


def refusals() -> dict:
    """The errors a cp=2 model gives for batches it cannot split, or models it cannot take."""
    out = {}
    model = hf_scale.parallelize(cp_model("llama"), {"strategy": "fsdp", "cp": 2})
    batch = cp_batches(packed=False)[0]
    rank = torch.distributed.get_rank()
    attempts = {
        "padding_mask": lambda: model(**batch, attention_mask=torch.ones_like(batch["input_ids"]).tril(4)[:, :SEQ]),
        "packed_with_mask": lambda: model(**cp_batches(packed=True)[0],
                                          attention_mask=torch.ones_like(batch["input_ids"])),
        "generate": lambda: model.generate(batch["input_ids"][:1, :4], max_new_tokens=2),
        "different_batches": lambda: hf_scale.parallelize(cp_model("llama"), {"strategy": "fsdp", "cp": 2})(
            **cp_batches(packed=False)[rank]),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except hf_scale.HfScaleConfigError as e:
            out[name] = str(e)
    three_heads = tf.LlamaConfig(**{**_COMMON, "hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3})
    for name, model, config in (
            ("seqcls", lambda: tf.AutoModelForSequenceClassification.from_config(CONFIGS["llama"]()), {"cp": 2}),
            ("alltoall_heads", lambda: tf.LlamaForCausalLM(three_heads), {"cp": 2, "cp_exchange": "alltoall"})):
        try:
            hf_scale.parallelize(model(), config)
            out[name] = "no error"
        except hf_scale.HfScaleConfigError as e:
            out[name] = str(e)
    return out


def run_cp_cases(cases: list[dict]) -> list[dict]:
    """Every case in one process group; a case's error is its result. ``no_blocks``: the CPU's
    block kernels refused (``cp_blocks.supported`` False), so that plain causal layers take the
    path a GPU takes (``cp_prefix``: each query chunk against its keys' prefix)."""
    import time
    from unittest import mock

    out = []
    for case in cases:
        started = time.perf_counter()
        blocks = mock.patch("hf_scale.parallel.cp_blocks.supported", lambda *a: False) if case.get(
            "no_blocks") else contextlib.nullcontext()
        try:
            kind = case.get("kind", "parity")
            with blocks:
                out.append(cp_run(case) if kind == "parity" else comm_counts(**case.get("args", {}))
                           if kind == "comm" else refusals())
        except Exception:  # noqa: BLE001 - reported per case, the group goes on
            out.append({"error": traceback.format_exc()})
        out[-1]["seconds"] = time.perf_counter() - started
    return out


# ------------------------------------------------------------------ memory: bytes saved for backward

MEMORY_MODEL = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, use_cache=False)


def memory_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**MEMORY_MODEL)).float()


def memory_batch(seq: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(2, VOCAB, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def saved_bytes_one_process(seq: int) -> dict:
    """What one process saves for backward on the whole sequence (plain transformers, SDPA)."""
    model = memory_model()
    with SavedBytes(model) as saved:
        loss = model(**memory_batch(seq)).loss
    loss.backward()
    return {"bytes": saved.total, "loss": float(loss.detach())}


def saved_bytes_cp(seq: int, attention: str = "auto", layout: str = "head_tail", exchange: str = "allgather") -> dict:
    """What each rank of a cp group (the whole world, DDP) saves for backward on the sequence."""
    model = hf_scale.parallelize(memory_model(), {"strategy": "ddp", "cp": int(os.environ["WORLD_SIZE"]),
                                                  "cp_attention": attention, "cp_layout": layout,
                                                  "cp_exchange": exchange})
    batch = memory_batch(seq)
    model(**batch).loss.backward()  # the batch check over the group, outside the count
    model.zero_grad()
    with SavedBytes(model) as saved:
        loss = model(**batch).loss
    loss.backward()
    return {"bytes": saved.total, "calls": dict(ContextParallel.of(model).calls), "loss": float(loss)}


def run_memory_cases(cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        try:
            out.append(saved_bytes_cp(**case))
        except Exception:  # noqa: BLE001 - reported per case
            out.append({"error": traceback.format_exc()})
    return out
