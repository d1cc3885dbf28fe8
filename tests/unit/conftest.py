import pytest

from hf_scale.distributed import LAUNCHER_VARS


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    """Unit tests run as one process, even when pytest itself was started by torchrun or mpirun."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
