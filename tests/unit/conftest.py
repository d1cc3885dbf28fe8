import pytest

from hf_scale.distributed import LAUNCHER_VARS


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    """Unit tests run as one process, even when pytest itself was started by torchrun or mpirun."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def one_process_group():
    """A one-rank gloo process group for the module's tests (collectives on a world of 1), torn
    down after them; skipped where a group is already up in this process."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
