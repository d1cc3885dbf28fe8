"""Convert a pickle (``pytorch_model*.bin``) checkpoint to safetensors, loading with
``weights_only=True`` so no code in the file can run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import HfScaleCheckpointError

PICKLE_INDEX = "pytorch_model.bin.index.json"


def convert_pickle_checkpoint(folder: str | Path, max_shard_size: int | str = "5GB") -> Path:
    """Write ``model*.safetensors`` (+ index) beside the ``.bin`` weights in ``folder``.

    Each ``.bin`` file is read with ``torch.load(weights_only=True)``: tensors only; a file that
    needs arbitrary unpickling is refused. Tensors sharing storage are written once.
    """
    from safetensors.torch import save_file

    from .shard_layout import INDEX_FILE, TensorSpec, index_json, plan_files

    folder = Path(folder)
    if (folder / PICKLE_INDEX).exists():
        files = sorted(set(json.loads((folder / PICKLE_INDEX).read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.bin"))
    if not files:
        raise HfScaleCheckpointError(f"{folder} holds no pytorch_model*.bin files to convert.")
    state: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for name in files:
        try:
            part = torch.load(folder / name, map_location="cpu", weights_only=True)
        except Exception as e:
            raise HfScaleCheckpointError(
                f"{name} cannot be loaded with weights_only=True ({type(e).__name__}); it may run "
                "code when unpickled, so it is refused."
            ) from None
        for key, tensor in part.items():
            ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if ident not in seen:  # tied weights: keep the first name
                seen[ident] = key
                state[key] = tensor.contiguous()
    layout = plan_files([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()], max_shard_size)
    for f in layout:
        save_file({t.name: state[t.name] for t in f.tensors}, folder / f.name, metadata={"format": "pt"})
    if len(layout) > 1:
        (folder / INDEX_FILE).write_text(json.dumps(index_json(layout), indent=2, sort_keys=True) + "\n")
    return folder
