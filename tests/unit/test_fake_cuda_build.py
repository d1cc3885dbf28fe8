"""On a torch built with CUDA, simulated GPUs go through the real CUDA device guard: simulate
uses at most the visible GPUs per node by default, and a node of more is refused with what to do
(seen on an H100 machine: 'invalid device ordinal' for cuda:7, 'No CUDA GPUs are available'
with none visible). Checked here by making this CPU-only torch answer as a CUDA build would."""

import pytest
import torch

from hf_scale.errors import HfScaleConfigError
from hf_scale.layout_search import simulate as simulate_module
from hf_scale.layout_search.fake_cuda import fake_cuda


@pytest.fixture
def cuda_build(monkeypatch):
    def visible(count):
        monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return visible


def test_default_gpus_per_node_are_the_visible_ones(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    assert simulate_module._gpus_per_node(64, "cuda") == 8  # a CPU-only torch: 8 fake GPUs per node
    assert simulate_module._gpus_per_node(4, "cuda") == 4
    cuda_build(3)
    assert simulate_module._gpus_per_node(64, "cuda") == 2  # 3 visible: the largest divisor of 64 within them
    assert simulate_module._gpus_per_node(6, "cuda") == 3
    assert simulate_module._gpus_per_node(64, "cpu") == 8  # simulated CPU processes need no GPU
    cuda_build(0)
    assert simulate_module._gpus_per_node(64, "cuda") == 1


def test_more_simulated_gpus_than_visible_ones_are_refused(cuda_build):
    cuda_build(1)
    with pytest.raises(HfScaleConfigError, match="needs 8 visible GPUs.*sees 1.*local_world_size=1"):
        with fake_cuda(8):
            pass
    cuda_build(0)
    with pytest.raises(HfScaleConfigError, match="sees 0. Make a GPU visible.*CPU-only build"):
        with fake_cuda(1):
            pass
