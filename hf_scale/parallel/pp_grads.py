"""When a pipeline stage under FSDP2 reduces its gradients: after the last microbatch, or each.

torch's ``PipelineStage`` (``backward_maybe_with_nosync``) turns an FSDP stage's gradient
reduction and its reshard-after-backward off before every microbatch's backward, and reduces
once after the last (``perform_reduce_grad``). Until then the stage keeps every parameter
gathered and every gradient unsharded (in fp32: FSDP2 accumulates in ``reduce_dtype``), the
whole stage's on every data-parallel rank: 68.5 GiB of gradients on a Llama-3-70B stage at
pp=4, more than the sharded model, optimizer and activations together.

``"each"`` (:func:`sync_each_microbatch`) turns both back on for every microbatch, after torch
turned them off and before any of the stage's gradients are made: a hook on the stage's output
runs first in that microbatch's backward. FSDP2's own post-backward hooks then reduce-scatter
each unit's gradients as its backward ends and reshard it; the reduced shard is added into the
sharded gradient (``foreach_reduce``: ``sharded_param.grad._local_tensor += new_sharded_grad``),
each microbatch's divided by the data-parallel degree as a whole step's would be, so the
microbatches' sum is the step's gradient. ``is_last_backward`` stays torch's (off until
``perform_reduce_grad``, which finds nothing left to reduce and finalizes). Memory: the
stage's gradients stay sharded, one unit's unsharded at a time; cost: one reduce-scatter of the
stage per microbatch instead of one per step, and (parameters resharded after each backward)
one more all-gather of the stage per microbatch.

:func:`choose_grad_sync` resolves ``"auto"`` (the rule in ``ParallelConfig.pp_grad_sync``).

Usage::

    mode = choose_grad_sync(config.pp_grad_sync, stage_roots, device)
    if mode == "each":
        handles = [sync_each_microbatch(root) for root in stage_roots]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# "auto" picks "each" when the unsharded fp32 gradients exceed this share of the free device
# memory (the rest is left to the optimizer state, the activations and the gathered units)
AUTO_FREE_SHARE = 0.5


def sync_each_microbatch(stage: nn.Module):
    """Make an FSDP stage root reduce-scatter and reshard after every microbatch's backward
    (module doc); returns the hook's handle (``remove()`` restores torch's default). A stage
    that is no FSDP module (no data parallel) is left alone (returns None)."""
    if not isinstance(stage, FSDPModule):
        return None

    def on_output(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_turn_sync_on(module))
        return output

    return stage.register_forward_hook(on_output)


def _turn_sync_on(stage: FSDPModule):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        stage.set_requires_gradient_sync(True)
        stage.set_reshard_after_backward(True)
        return grad

    return hook


def unsharded_grad_bytes(stage: nn.Module) -> int:
    """Bytes of the stage's trainable parameters' gradients if held whole in fp32: what
    ``"last"`` keeps through the schedule."""
    total = 0
    for param in stage.parameters():
        if param.requires_grad:
            total += param.numel() * 4  # a DTensor's numel is the whole parameter's
    return total


def choose_grad_sync(mode: str, stages: list[nn.Module], device: torch.device,
                     group: dist.ProcessGroup | None = None) -> str:
    """``mode`` itself unless ``"auto"``; then ``"each"`` where, on a CUDA device, the stages'
    unsharded fp32 gradients exceed ``AUTO_FREE_SHARE`` of the free device memory on any rank
    (one all-reduce over ``group``: every rank of every stage takes the same mode), else
    ``"last"`` (always on the CPU: no collective). Call on every rank."""
    if mode != "auto":
        return mode
    if device.type != "cuda" or not any(isinstance(s, FSDPModule) for s in stages):
        return "last"
    need = sum(unsharded_grad_bytes(s) for s in stages)
    free, _total = torch.cuda.mem_get_info(device)
    flag = torch.tensor([1.0 if need > AUTO_FREE_SHARE * free else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return "each" if flag.item() > 0 else "last"
