import os

# Tests never reach the Hub; everything they load is built locally or shipped by a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped (never passed) without one")


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the gpu mark): not run, not counted as passed")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
