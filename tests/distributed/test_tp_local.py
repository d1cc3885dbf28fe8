"""no_grad forwards of a tensor-parallel model take the plain-tensor inference path
(hf_scale.parallel.tp_local) and give the logits of the DTensor path and of one process; forwards
with gradients stay on DTensor. Two ranks, one spawn."""

import pytest

from tests.distributed import tp_local_checks
from tests.harness import run_ranks


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(tp_local_checks.worker, 2, timeout=600)


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3_mha", "olmo2_bias"])
def test_inference_runs_on_local_shards_with_the_same_logits(tp2, arch):
    for facts in tp2:
        got = facts[arch]
        assert got["local_calls"] == got["calls"] > 0, got  # every sharded module, locally
        assert got["local_vs_one_process"] < 1e-5, got
        assert got["single_vs_one_process"] < 1e-5, got
        assert got["dtensor_vs_one_process"] < 1e-5, got
        assert got["local_calls_with_grad"] == 0, got
