"""The all-gather's attention without a mask on any device (hf_scale/parallel/cp_prefix.py) in
one process: each rank's query chunks against the prefix of the whole sequence's keys, lower-right
causal, equal (output and gradients) to the masked path's SDPA under the global causal mask of
that rank, for both layouts at cp=2 and 4 and grouped-query heads; and on fake CUDA (the
simulation's kernels) no tensor of ``chunk x prefix`` scores or mask is made. The exchange over
2 and 4 ranks: tests/distributed/test_cp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_scale.parallel.cp import chunk_indices, chunks_held
from torch.nn.attention.bias import CausalVariant

from hf_scale.parallel.cp_prefix import lower_right, lower_right_bias, prefix_attention

LENGTH = 32


def _inputs(heads: int, kv_heads: int, dim: int = 8):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, LENGTH, dim, generator=g) * 2
    k = torch.randn(2, kv_heads, LENGTH, dim, generator=g) * 2
    v = torch.randn(2, kv_heads, LENGTH, dim, generator=g)
    return q, k, v


def _attend(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("layout", ["head_tail", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_prefix_equals_the_masked_path(heads, kv_heads, layout, cp):
    """Every rank's chunks: output, dq and the whole sequence's dk / dv equal SDPA under the mask
    the masked path builds from global indices (key <= query) over all gathered keys."""
    q, k, v = _inputs(heads, kv_heads)
    held = chunks_held(cp, layout)
    chunk = LENGTH // (cp * len(held[0]))
    for rank in range(cp):
        index = chunk_indices(LENGTH, cp, rank, layout)
        mask = index[:, None] >= torch.arange(LENGTH)[None, :]  # [S/cp, S]: the masked path's, global order
        grad = torch.randn(2, heads, index.numel(), 8, generator=torch.Generator().manual_seed(rank))
        want = _attend(lambda a, b, c: F.scaled_dot_product_attention(a[:, :, index], b, c, attn_mask=mask, scale=0.3,
                                                                       enable_gqa=True), q, k, v, grad)
        got = _attend(lambda a, b, c: prefix_attention(a[:, :, index], b, c, held[rank], chunk, 0.3), q, k, v, grad)
        for name, g_t, w_t in zip(("output", "dq", "dk", "dv"), got, want):
            err = float((g_t - w_t).norm() / w_t.norm())
            assert err < 1e-5, f"rank {rank} {name}: differs by {err:.2e} of its norm"


def test_lower_right_sees_the_prefix_and_its_own_triangle():
    """The last 3 positions of 5: query i sees keys 0 .. i + 2 (the first the keys 0..2, not 0)."""
    q, k, v = _inputs(2, 2)
    q, k, v = q[:, :, :3], k[:, :, :5], v[:, :, :5]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(lower_right(q, k, v, None), want)


def test_the_bias_holds_no_memory():
    """torch's causal_lower_right(65536, 131072) would allocate a [2, 65536, 131072] float32 host
    tensor (64 GiB of address space); the bias cp uses holds nothing and reads the same."""
    bias = lower_right_bias(65536, 131072)
    assert torch.Tensor.untyped_storage(bias).nbytes() == 0
    assert (bias.variant, bias.seq_len_q, bias.seq_len_kv) == (CausalVariant.LOWER_RIGHT, 65536, 131072)


def test_on_fake_cuda_no_chunk_by_prefix_tensor_is_made():
    """The simulation's kernels (flash for bf16, the efficient kernel for fp32) take the lower-right
    bias without a mask: no tensor made in forward or backward has the ``chunk x prefix`` scores'
    size, and the output is this rank's queries'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_scale.layout_search.fake_cuda import fake_cuda, fake_tensors

    chunk, length = 64, 256  # head_tail at cp=2: chunks 0 and 3 of 4, prefixes of 64 and 256 keys

    class Scores(TorchDispatchMode):
        """The shapes of tensors shaped like scores or a mask: their last two dims both a length
        (the head size is 16: keys and values have 16 last)."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and min(t.shape[-2:]) >= chunk:
                    self.seen.append((str(func), tuple(t.shape)))
            return out

    for dtype in (torch.bfloat16, torch.float32):
        with fake_cuda(1), fake_tensors():
            q = torch.randn(1, 4, 2 * chunk, 16, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(1, 2, length, 16, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(1, 2, length, 16, device="cuda", dtype=dtype, requires_grad=True)
            with Scores() as scores:
                out = prefix_attention(q, k, v, [0, 3], chunk, None)
                out.sum().backward()
            assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape
            assert scores.seen == [], (dtype, scores.seen[:3])
