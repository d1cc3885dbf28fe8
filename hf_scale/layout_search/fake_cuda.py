"""A stand-in CUDA runtime for simulations: ``cuda:i`` devices that exist only as fake tensors.

Under ``FakeTensorMode`` a tensor on ``device="cuda"`` holds no memory, but the code around it
still asks the CUDA runtime questions: ``torch.cuda.is_available()`` and ``device_count()`` (device
selection in :mod:`hf_scale.distributed`), ``current_device()``, ``Stream`` / ``Event`` /
``current_stream()`` (FSDP2 orders its collectives with them), ``is_bf16_supported()``,
``get_rng_state`` / ``set_rng_state`` (a pipeline schedule forks the random state). On a
torch built without CUDA the C++ side is missing too: autograd records each tensor's device
stream through a CUDA device guard and asks the CUDA hooks for the accelerator.

:func:`fake_cuda` answers all of them for ``count`` devices while it is entered, and restores
torch's own answers on exit:

- Python: the ``torch.cuda`` functions above, replaced by ones that record the current device
  and do nothing else (streams and events have nothing to order: no kernel runs);
- C++ (a torch without CUDA only): torch's own ``FakeGuardImpl`` registered as the CUDA device
  guard, and CUDA hooks that say CUDA is built, from a small library compiled once with the
  system's C++ compiler into ``~/.cache/hf_scale`` (about a second); autograd runs on the calling
  thread (``set_multithreading_enabled(False)``: no per-device worker threads); SiLU's and Mish's
  backward get a CUDA kernel (:data:`_FUSED_ON_GPU`), without which they are decomposed into
  temporaries no GPU makes. torch's fake guard
  knows 8 devices: ``count`` (the GPUs per node) is at most 8.

Usage::

    with fake_cuda(8), FakeTensorMode():
        x = torch.empty(4, 4, device="cuda:3", requires_grad=True)   # no memory, no GPU
        (x @ x).sum().backward()
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import HfScaleConfigError

MAX_DEVICES = 8  # c10::impl::kFakeGuardImplMaxDevices

_HOOKS_SOURCE = r"""
// hf_scale: a CUDA device guard and CUDA hooks for a torch built without CUDA, so that autograd
// runs on fake CUDA tensors (FakeTensorMode). Nothing here touches a GPU.
#include <new>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
const c10::impl::DeviceGuardImplInterface* saved_guard = nullptr;

struct SimulatedCUDAHooks : at::CUDAHooksInterface {
  bool isBuilt() const override { return true; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};
static_assert(sizeof(SimulatedCUDAHooks) == sizeof(at::CUDAHooksInterface), "same object size");
}  // namespace

// on = 1: install (0 when installed, 1 when CUDA was already built); on = 0: restore torch's own.
extern "C" int hf_scale_simulated_cuda(int on) {
  auto* hooks = const_cast<at::CUDAHooksInterface*>(&at::detail::getCUDAHooks());
  constexpr auto cuda = static_cast<size_t>(c10::DeviceType::CUDA);
  if (on) {
    if (hooks->isBuilt()) return 1;
    saved_guard = c10::impl::device_guard_impl_registry[cuda].load();
    c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, &guard);
    hooks->~CUDAHooksInterface();
    new (hooks) SimulatedCUDAHooks();
  } else if (dynamic_cast<SimulatedCUDAHooks*>(hooks) != nullptr) {
    hooks->~CUDAHooksInterface();
    new (hooks) at::CUDAHooksInterface();
    c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, saved_guard);
  }
  return 0;
}
"""


class _Event:
    """``torch.cuda.Event`` with nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None):
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream:
    """``torch.cuda.Stream`` with nothing to order."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device, self.priority = device, priority

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _Runtime:
    """The answers of ``count`` fake devices; ``index`` is the current one."""

    def __init__(self, count: int) -> None:
        self.count, self.index, self.stream = count, 0, _Stream()
        self.guarded = False  # whether the C++ device guard is ours (a torch without CUDA)

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        self.index = 0 if index is None else index
        if self.guarded or not _real_gpu():  # the C++ fake guard's current device too (DTensor asks it)
            try:
                torch.accelerator.set_device_index(self.index)
            except RuntimeError:  # a CUDA build before FakeTensorMode installs its fake guard
                pass

    def functions(self) -> dict:
        return {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.index,
            "set_device": self.set_device,
            "is_initialized": lambda: True,
            "Stream": _Stream,
            "Event": _Event,
            "stream": lambda stream=None: contextlib.nullcontext(stream),
            "current_stream": lambda device=None: self.stream,
            "default_stream": lambda device=None: self.stream,
            "synchronize": lambda device=None: None,
            "is_bf16_supported": lambda *a, **k: True,
            "get_device_name": lambda device=None: "simulated GPU",
            "get_device_capability": lambda device=None: (9, 0),
            # no kernel draws random numbers: a state to save and restore (torch.random.fork_rng)
            "get_rng_state": lambda device="cuda": b"",
            "set_rng_state": lambda new_state, device="cuda": None,
        }


@contextlib.contextmanager
def fake_cuda(count: int) -> Iterator[None]:
    """``count`` fake CUDA devices while entered (see the module doc); torch's answers after."""
    if not 1 <= count <= MAX_DEVICES:
        raise HfScaleConfigError(
            f"a simulated node has {count} GPUs: between 1 and {MAX_DEVICES} (torch's fake device "
            "guard knows 8). Simulate with local_world_size (GPUs per node) of at most 8."
        )
    if torch.cuda._is_compiled() and torch.cuda.device_count() < count:
        # FakeTensorMode touches each CUDA device it sees (init_gpu_context allocates on it) and
        # autograd goes through the real device guard: only GPUs that exist can stand in.
        visible = torch.cuda.device_count()
        raise HfScaleConfigError(
            f"this torch is built with CUDA, so a simulated node of {count} GPUs needs {count} visible GPUs "
            f"(torch's fake tensors use the real CUDA device guard); this process sees {visible}. "
            + (f"Simulate with local_world_size={visible} or fewer GPUs per node (the memory per rank "
               "does not change), " if visible else "Make a GPU visible, ")
            + "or run the simulation with a CPU-only build of torch, which needs no GPU."
        )
    runtime = _Runtime(count)
    replaced = runtime.functions()
    saved = {name: getattr(torch.cuda, name) for name in replaced}
    library = None if torch.cuda._is_compiled() else _hooks_library()
    # 0: installed here; 1: already in place (an enclosing fake_cuda), which this one leaves there
    installed = library is not None and library.hf_scale_simulated_cuda(1) == 0
    runtime.guarded = installed
    fused = _fused_backwards() if installed else None
    try:
        for name, fn in replaced.items():
            setattr(torch.cuda, name, fn)
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        if fused is not None:
            fused._destroy()
        if installed:
            library.hf_scale_simulated_cuda(0)


# Ops whose CUDA kernel a torch built without CUDA lacks, where the dispatcher then takes their
# CompositeImplicitAutograd decomposition: SiLU's backward becomes sigmoid, 1 - sigmoid, three
# products and a sum, each a temporary of the MLP's width (at 105k tokens of Llama-3-8B, 3-4 of
# 2.8 GiB beside a block's backward) that a GPU's fused kernel never makes. Found by asking the
# dispatcher which aten ops have a CPU kernel and that decomposition but no CUDA kernel (the third,
# native_channel_shuffle, has no backward).
_FUSED_ON_GPU = ("silu_backward", "mish_backward")


def _fused_backwards():
    """A CUDA kernel for each of :data:`_FUSED_ON_GPU`, registered while fake CUDA is entered on a
    torch without CUDA, so that the dispatcher reaches the fake tensor mode, whose meta kernel makes
    the one output the GPU's kernel makes (the kernel itself never runs on fake tensors)."""
    library = torch.library.Library("aten", "IMPL")
    for name in _FUSED_ON_GPU:
        library.impl(name, lambda grad, x: torch.empty_like(grad), "CUDA")
    return library


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """``FakeTensorMode`` (every new tensor fake), with three of its gaps filled while entered:

    - ``DeviceMesh``: a mesh is a small tensor of ranks that it reads back (``tolist``), which a
      fake tensor cannot give (torch's own fake-process-group tests build their meshes outside
      the mode): its methods that build or slice one, its ``mesh`` tensor, and DTensor's offset
      of a rank's shard, which computes on it, run with the mode set aside;
    - ``param.data = moved`` (FSDP2 moves a module's states so): a fake tensor keeps its old
      device unless told; the setter also tells it;
    - ``torch.tensor(data, device="cuda")`` is made on the host, then made fake, when no GPU is
      really there (the mode asks ``torch.cuda.is_available()``, which :func:`fake_cuda` answers);
    - ``aten._pin_memory`` (FSDP's CPU offload pins its host shards) has no fake kernel: a fake
      host tensor stands for the pinned one;
    - DDP checks that every rank's parameters have the same shapes by reading their data in C++
      (``_verify_param_shape_across_processes``): one simulated rank has no peers to compare
      with, and no data; the check is skipped. DDP's C++ all-reduce reads the fake process
      group's result, which has none: each DDP gets a comm hook that returns the bucket as
      reduced (what an all-reduce in place leaves, without the arithmetic), and keeps its first
      buckets (their rebuild in forward order agrees on the order by a broadcast of real data:
      the same buckets, another order), and logs no runtime statistics (they time CUDA events);
    - ``F.scaled_dot_product_attention`` on a fake CUDA tensor would take the math path (the
      kernel choice asks the device), saving the ``T x T`` scores no GPU keeps: it runs torch's
      fused kernels' own ops instead, as a GPU picks them (flash attention for fp16 / bf16
      without a mask, memory-efficient attention otherwise), so what they save for backward is
      what the GPU's kernels save (grouped key/value heads are repeated first, as the efficient
      kernel needs); a ``torch.nn.attention.bias.CausalBias`` (context parallel's lower-right
      causal blocks) takes the kernels' own causal modes, as torch's dispatch of it does;
    - the mode's dispatch cache (one for the process) keeps each output's device: ``"cuda"``
      without an index resolves to the current device, another one in the next simulation; it
      is emptied on entry and exit;
    - ``nn.Module.to`` swaps a fake parameter for its moved copy (``swap_tensors``), which refuses
      a tensor the mode remembers by a weak reference: the mode forgets both first.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.distributed import device_mesh

    def real(fn):
        def run(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return run

    data = torch._C.TensorBase.data

    def set_data(self, value):
        data.__set__(self, value)
        if isinstance(value, FakeTensor):
            self.fake_device = value.fake_device

    swap = torch.utils.swap_tensors

    def swap_forgotten(t1, t2):
        for t in (t1, t2):
            mode = getattr(t, "fake_mode", None)
            if mode is not None:
                memo = mode.fake_tensor_converter.meta_converter.tensor_memo
                for key in [k for k, v in memo.items() if v is t]:
                    del memo[key]
        return swap(t1, t2)

    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    from torch.nn.parallel import distributed as ddp

    def pin_memory(fake_mode, func, tensor, *args, **kwargs):
        with in_kernel_invocation_manager(fake_mode):
            pinned = torch.empty_like(tensor)
        return FakeTensor(fake_mode, pinned, torch.device("cpu"))

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not (isinstance(q, FakeTensor) and q.device.type == "cuda"):
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        return _fused_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)

    pin_op = torch.ops.aten._pin_memory.default
    saved_pin = fake_impls.op_implementations_dict.get(pin_op)
    saved_verify = ddp._verify_param_shape_across_processes
    ddp_init = ddp.DistributedDataParallel.__init__

    def ddp_with_hook(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, _reduced_in_place)
        self.reducer = _KeptBuckets(self.reducer)
        self.logger = _NoRuntimeStats(self.logger)
    from torch.distributed.tensor import _utils as dtensor_utils

    mesh = device_mesh.DeviceMesh
    saved = {name: vars(mesh)[name] for name in _MESH_METHODS if name in vars(mesh)}
    saved_utils = {name: getattr(dtensor_utils, name) for name in _DTENSOR_OFFSETS if hasattr(dtensor_utils, name)}
    saved_init = device_mesh.init_device_mesh
    try:
        for name, fn in saved.items():
            setattr(mesh, name, property(real(fn.fget)) if isinstance(fn, property) else real(fn))
        device_mesh.init_device_mesh = real(saved_init)
        for name, fn in saved_utils.items():
            setattr(dtensor_utils, name, real(fn))
        FakeTensor.data = property(data.__get__, set_data)
        torch.utils.swap_tensors = swap_forgotten
        torch.nn.functional.scaled_dot_product_attention = fused_sdpa
        fake_impls.op_implementations_dict[pin_op] = pin_memory
        ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
        ddp.DistributedDataParallel.__init__ = ddp_with_hook
        FakeTensorMode.cache.clear()
        with _SimulatedFakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        FakeTensorMode.cache.clear()
        for name, fn in saved.items():
            setattr(mesh, name, fn)
        device_mesh.init_device_mesh = saved_init
        for name, fn in saved_utils.items():
            setattr(dtensor_utils, name, fn)
        del FakeTensor.data
        torch.utils.swap_tensors = swap
        torch.nn.functional.scaled_dot_product_attention = sdpa
        ddp._verify_param_shape_across_processes = saved_verify
        ddp.DistributedDataParallel.__init__ = ddp_init
        if saved_pin is None:
            fake_impls.op_implementations_dict.pop(pin_op, None)
        else:
            fake_impls.op_implementations_dict[pin_op] = saved_pin


class _KeptBuckets:
    """A DDP reducer that keeps its first buckets (see :func:`fake_tensors`)."""

    def __init__(self, reducer) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


class _NoRuntimeStats:
    """A DDP logger without runtime statistics (see :func:`fake_tensors`)."""

    def __init__(self, logger) -> None:
        self._logger = logger

    def set_runtime_stats_and_log(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._logger, name)


def _reduced_in_place(state, bucket):
    """A DDP comm hook: the bucket's gradients as an all-reduce in place leaves them (no peers)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _fused_attention(q, k, v, mask, dropout_p: float, is_causal: bool, scale):
    """SDPA through the fused kernel a GPU picks (see :func:`fake_tensors`)."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if k.shape[-3] != q.shape[-3]:  # grouped key/value heads
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    if isinstance(mask, CausalBias):  # no mask tensor: the kernels' own causal modes, as torch dispatches it
        lower_right = mask.variant == CausalVariant.LOWER_RIGHT and mask.seq_len_q != mask.seq_len_kv
        if not lower_right:
            mask, is_causal = None, True
        elif q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:  # flash: causal is lower right
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, scale=scale)[0]
        else:  # the memory-efficient kernel's lower-right mask type
            return torch.ops.aten._efficient_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, dropout_p,
                int(mask.variant), q.requires_grad, scale=scale)[0].transpose(1, 2)
    if mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if mask is not None and mask.dtype == torch.bool:  # the efficient kernel adds a float bias
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, q.requires_grad, dropout_p, is_causal, scale=scale)[0]


def _real_gpu() -> bool:
    """Whether this process can really reach a GPU (whatever :func:`fake_cuda` answers)."""
    return torch.cuda._is_compiled() and torch._C._cuda_getDeviceCount() > 0


class _SimulatedFakeTensorMode:
    """Made on first use: ``FakeTensorMode`` that decides device initialisation by the real GPUs."""

    def __new__(cls, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensorMode

        class SimulatedFakeTensorMode(FakeTensorMode):
            @property
            def avoid_device_init(self) -> bool:
                return not _real_gpu()

        return SimulatedFakeTensorMode(**kwargs)


_MESH_METHODS = ("__init__", "__getitem__", "_flatten", "_unflatten", "get_coordinate", "get_local_rank", "size", "mesh")
_DTENSOR_OFFSETS = ("compute_local_shape_and_global_offset", "_compute_local_shape_and_global_offset")
_LOADED: dict[str, ctypes.CDLL] = {}


def _hooks_library() -> ctypes.CDLL:
    """The compiled hooks (:data:`_HOOKS_SOURCE`), built once per torch version into the cache."""
    key = hashlib.sha256((_HOOKS_SOURCE + torch.__version__).encode()).hexdigest()[:16]
    if key in _LOADED:
        return _LOADED[key]
    cache = Path(os.environ.get("HF_SCALE_CACHE", Path.home() / ".cache" / "hf_scale")) / "fake_cuda"
    target = cache / f"fake_cuda_{key}.so"
    if not target.exists():
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise HfScaleConfigError(
                "simulating CUDA devices on a torch built without CUDA needs a C++ compiler (c++ or g++, "
                "or $CXX) to build a 30-line CUDA device guard once: install one (e.g. apt-get install g++), "
                "or simulate with a CUDA build of torch."
            )
        cache.mkdir(parents=True, exist_ok=True)
        root = Path(torch.__file__).parent
        source = cache / f"fake_cuda_{key}.cpp"
        source.write_text(_HOOKS_SOURCE)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        cmd = [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{root / 'include'}", str(source),
               f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}", "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise HfScaleConfigError(
                f"building the simulated CUDA device guard failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
            )
        partial.replace(target)
    _LOADED[key] = ctypes.CDLL(str(target))
    return _LOADED[key]
