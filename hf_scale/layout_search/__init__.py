"""The auto-planner (application layer, issue 14): per-rank memory and step-time estimates from a
model's config alone, and the fastest layout that fits.

- :mod:`.profile`: the model on the meta device; parameter counts per part and the activations
  one forward saves (counted, not guessed); :mod:`.frozen`: which parameters train (adapter
  runs: a peft ``PeftModel`` is read as the transformers model it wraps).
- :mod:`.experts`: a mixture of experts' routed experts (top-k of E active per token) and what
  expert parallel (``Layout.ep``) changes: gathered experts, all-to-all buffers and time.
- :mod:`.estimate`: bytes per rank by what holds them (parameters, gradients, optimizer state,
  activations, logits and loss, communication buffers, process overhead) for one layout.
- :mod:`.cost`: step time (compute, collectives over links, bubble, optimizer) on a device;
  :mod:`.calibrate` measures this machine once (in :mod:`.helpers`' processes), :mod:`.machine`
  caches and reads it.
- :mod:`.choose`: every layout for a world size, rejected with reasons or ranked; the winner.
- :mod:`.report` (``hf-scale plan --gpus``) and :mod:`.auto` (``parallelize(model, "auto")``,
  the one entry point from the library).

Usage::

    from hf_scale.layout_search import model_facts, choose, Workload, parse_memory, H100
    best, ranked = choose(model_facts(config), Workload(seq=4096, batch=1, device="cuda"), 8,
                          parse_memory("80GB"), H100)
"""

from .choose import Candidate, choose, parse_memory
from .cost import H100, INFINIBAND, NVLINK, Device, Link, step_cost
from .estimate import Layout, MemoryEstimate, Workload, estimate_memory
from .machine import cpu_device
from .profile import model_facts

__all__ = ["H100", "INFINIBAND", "NVLINK", "Candidate", "Device", "Layout", "Link", "MemoryEstimate", "Workload",
           "choose", "cpu_device", "estimate_memory", "model_facts", "parse_memory", "step_cost"]
