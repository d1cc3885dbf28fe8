"""Save a parallelized model from every rank; report what each rank wrote and computed."""

from __future__ import annotations

import os

import torch

import hf_scale
from hf_scale.checkpoint import safetensors_io
from tests.distributed.training import full_params
from tests.tiny_models import slice_batch, tiny_batch, tiny_model


def save_cases(cases: list[dict], root: str) -> list[dict]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    written = {"bytes": 0}
    original = safetensors_io._write_my_bytes

    def counting(path, f, state, owners, r):
        for spec in f.tensors:
            block = safetensors_io._local_block(spec.name, state[spec.name], owners, r)
            if block is not None:
                written["bytes"] += block[0].numel() * block[0].element_size()
        return original(path, f, state, owners, r)

    safetensors_io._write_my_bytes = counting
    results = []
    for case in cases:
        written["bytes"] = 0
        model = hf_scale.parallelize(tiny_model(case["arch"], case["head"]), case["config"])
        optimizer = hf_scale.build_optimizer(model, lr=1e-2)
        batch = slice_batch(tiny_batch(case["head"], 2 * world), rank, world)
        model(**batch).loss.backward()  # one step, so saved weights differ from the init
        optimizer.step()
        folder = hf_scale.save_pretrained(model, os.path.join(root, case["id"]), max_shard_size=case.get("shard", "5GB"))
        with torch.no_grad():
            logits = model(**tiny_batch(case["head"], 2, seed=7)).logits
        params = full_params(model)
        results.append({
            "folder": str(folder), "logits": logits, "bytes_written": written["bytes"],
            "params": params if rank == 0 else None,
        })
    safetensors_io._write_my_bytes = original
    return results


def load_cases(folder: str, configs: list[dict]) -> list[dict]:
    """from_pretrained into each layout; the whole parameters (rank 0), local share, logits."""
    from torch.distributed.tensor import DTensor

    rank, _ = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    for config in configs:
        model = hf_scale.from_pretrained(folder, parallel=config)
        total = sum(p.numel() for p in model.parameters())
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        with torch.no_grad():
            logits = model(**tiny_batch("causal", 2, seed=7)).logits
        params = full_params(model)
        results.append({"params": params if rank == 0 else None, "share": local / total, "logits": logits,
                        "class": type(model).__name__})
    return results


def full_disk_on_one_rank(root: str) -> dict:
    """Rank 1's writes hit ENOSPC (rank 0's succeed): every rank must raise the same clear
    error instead of rank 0 waiting at a barrier for ever, and nothing may be left behind."""
    import errno

    from hf_scale import HfScaleCheckpointError

    rank = int(os.environ["RANK"])
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"strategy": "fsdp"})
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.pwrite = full if rank == 1 else real
    try:
        hf_scale.save_pretrained(model, os.path.join(root, "model"))
        outcome = "saved"
    except HfScaleCheckpointError as e:
        outcome = str(e)
    finally:
        os.pwrite = real
    torch.distributed.barrier()
    return {"outcome": outcome, "left": sorted(os.listdir(root))}


def refusal_cases(cases: list[dict]) -> list[dict]:
    """from_pretrained of each case on every rank, from this rank's folder (``folders[rank]``:
    a copy per rank stands in for a disk per node): what the rank raised (``kind`` None where it
    returned a model). A case where one rank raised and another did not leaves the ranks out
    of step: a later case then hangs (or fails) instead of reporting."""
    rank = int(os.environ["RANK"])
    out = []
    for case in cases:
        try:
            hf_scale.from_pretrained(case["folders"][rank], parallel=case["config"], verify_checksums=case["verify"])
            out.append({"kind": None, "message": ""})
        except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
            out.append({"kind": type(e).__name__, "message": str(e)})
    return out
