"""Other libraries' log lines hf_scale drops because they say nothing a user can act on."""

from __future__ import annotations

import logging


def test_torchao_kernel_load_warnings_are_dropped_and_nothing_else(caplog):
    """torchao (the qlora extra) warns once per optional CUDA kernel file it cannot load against
    the CPU build of torch, on every ``from_pretrained`` (transformers imports it), and torch
    says its Enum registrations are deprecated; hf_scale drops exactly those lines and keeps
    the libraries' other warnings."""
    import hf_scale.log  # noqa: F401  (installs the filter)

    log = logging.getLogger("torchao")
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load /venv/lib/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                    "Could not load this library")
        log.warning("Failed to load the model weights")
        log.warning("Skipping import of cpp extensions")
        pytree = logging.getLogger("torch.utils._pytree")
        pytree.warning("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                       "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses "
                       "is deprecated")
        pytree.warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load the model weights",
                                                         "Skipping import of cpp extensions",
                                                         "another pytree warning"]
