"""glibc gives freed blocks back once :func:`release_freed_memory` has fixed its mmap threshold
(in a fresh process: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A freed 16 MiB block raises glibc's threshold to 16 MiB: 1 MiB blocks then come from the heap
# (mapped bytes unchanged) unless the threshold is fixed again. Prints the mapped bytes the
# twenty 1 MiB blocks added, and the function's answer.
PROBE = """
import ctypes, importlib.util, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
done = module.release_freed_memory()
before = libc.mallinfo2().hblkhd
blocks = [libc.malloc(1 << 20) for _ in range(20)]
print(libc.mallinfo2().hblkhd - before, done)
"""


def _probe(env: dict | None = None) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "hf_scale/host_memory.py")],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    return int(out[0]), out[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_are_unmapped():
    mapped, done = _probe({"PATH": "/usr/bin:/bin"})
    assert done == "True" and mapped >= 20 << 20  # each 1 MiB block its own mapping


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_users_threshold_stands():
    mapped, done = _probe({"PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": str(32 << 20)})
    assert done == "False" and mapped < 1 << 20  # the heap serves them, as the user asked


class _Stop(Exception):
    """Ends loop.run right after its first lines (no model, no data)."""


@pytest.mark.parametrize("device,calls", [("cpu", 1), ("meta", 0)])
def test_the_training_loop_fixes_the_threshold_on_cpu_only(monkeypatch, device, calls):
    """hf_scale.train.loop.run calls release_freed_memory first thing when the model lives in host
    memory (the CPU), and not on an accelerator (whose tensors glibc does not hold)."""
    from types import SimpleNamespace

    import torch

    from hf_scale.train import loop

    seen = []
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device(device))
    monkeypatch.setattr(loop, "init_distributed", lambda timeout: env)
    monkeypatch.setattr(loop, "release_freed_memory", lambda: seen.append("called") or True)

    def stop(job):
        raise _Stop

    monkeypatch.setattr(loop, "_with_auto_layout", stop)
    job = SimpleNamespace(parallel=SimpleNamespace(timeout_seconds=60, auto=True))
    with pytest.raises(_Stop):
        loop.run(job)
    assert len(seen) == calls


# 20 MiB of 1 MiB blocks from the heap (a freed 16 MiB block raised the threshold; below glibc's
# raised trim threshold, so free() alone keeps them), written to, freed behind a small live block:
# resident until trim_heap. Prints the resident MiB trim_heap gave back, and its answer.
TRIM_PROBE = """
import ctypes, importlib.util, os, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
blocks = [libc.malloc(1 << 20) for _ in range(20)]
pin = libc.malloc(64)
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks:
    libc.free(b)
before = resident()
done = module.trim_heap()
print((before - resident()) >> 20, done)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_trim_heap_gives_freed_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(ROOT / "hf_scale/host_memory.py")],
                         capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out[1] == "True" and int(out[0]) >= 15  # of the 20 MiB freed
