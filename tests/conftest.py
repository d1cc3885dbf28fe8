import os

# Tests never reach the Hub; everything they load is built locally or shipped by a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped (never passed) without one")
    # The suite runs on the CPU (gloo), on a GPU machine too: its inputs are built on the CPU, and
    # `parallelize` in one process would move the model to cuda:0. Only `pytest -m gpu` (the
    # tests that need CUDA) sees the GPUs. Set before anything asks torch for a device.
    markexpr = config.option.markexpr or ""
    if "gpu" not in markexpr or "not gpu" in markexpr:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the gpu mark): not run, not counted as passed")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    import sys

    harness = sys.modules.get("tests.harness")
    if harness is not None:
        harness.close_pools()  # the pooled ranks of each world size
