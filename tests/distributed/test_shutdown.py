"""``shutdown_distributed`` stops every process group's threads before the process exits.

A group left alive past the end of ``main`` is torn down during interpreter teardown, as the
peers exit; a finished 2-process run then aborted about once in a hundred ("terminate called
without an active exception", seen in CI). Two things kept the groups alive after
``destroy_process_group``: DTensor's sharding caches (they hold the device meshes) and
``ZeroRedundancyOptimizer``'s module, imported after the group existed (it keeps
``dist.group.WORLD`` as a default argument; hf_scale's checkpoint code imports it).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")


def group_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def train_save_and_shut_down(root: str) -> dict:
    import hf_scale
    from hf_scale.distributed import shutdown_distributed
    from tests.tiny_models import CAUSAL, tiny_batch, tiny_model

    model = hf_scale.parallelize(tiny_model("llama", CAUSAL), {"strategy": "fsdp"})
    optimizer = hf_scale.build_optimizer(model, lr=1e-3)
    model(**tiny_batch(CAUSAL, 2)).loss.backward()
    hf_scale.clip_grad_norm_(model, 1.0)
    optimizer.step()
    hf_scale.save_state(model, optimizer, root=root, step=1)
    del model, optimizer
    running = group_threads()
    shutdown_distributed()
    return {"running": running, "after": group_threads(),
            "zero_module": "torch.distributed.optim.zero_redundancy_optimizer" in sys.modules}


def test_no_group_thread_outlives_shutdown(tmp_path):
    for rank, seen in enumerate(run_ranks(train_save_and_shut_down, 2, str(tmp_path), timeout=300)):
        assert seen["running"], f"rank {rank}: no gloo thread found while the group ran (the probe is blind)"
        assert seen["zero_module"], "the run no longer imports ZeroRedundancyOptimizer's module: update this test"
        assert seen["after"] == [], f"rank {rank}: {seen['after']} still run after shutdown_distributed"


EXITS_WITHOUT_SHUTDOWN = """
import atexit, os, sys
sys.path.insert(0, {root!r})
from tests.distributed.test_shutdown import group_threads

def report():  # registered before hf_scale's hook, so it runs after it (atexit is last-in first-out)
    with open(os.path.join({out!r}, f"rank{{os.environ['RANK']}}"), "w") as f:
        f.write(",".join(group_threads()) or "none")

atexit.register(report)
import torch, torch.distributed as dist
from hf_scale.distributed import init_distributed
init_distributed()
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert group_threads(), "no gloo thread while the group runs: the probe is blind"
"""


def test_a_script_that_never_shuts_down_has_its_group_stopped_at_exit(tmp_path):
    """A user's script that ends without ``shutdown_distributed``: hf_scale's atexit hook stops the
    gloo group before interpreter teardown (where a finished worker could abort)."""
    from pathlib import Path

    from tests.harness import finish_command, free_port, start_command

    script = tmp_path / "worker.py"
    script.write_text(EXITS_WITHOUT_SHUTDOWN.format(root=str(Path(__file__).resolve().parents[2]), out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(script)]
    finish_command(start_command(cmd), timeout=120)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["none", "none"]
