import pytest


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    """Unit tests run as one process, even when pytest itself was started under torchrun."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
