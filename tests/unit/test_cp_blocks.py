"""The mask-free block attention of context parallel (hf_scale/parallel/cp_blocks.py) in one
process (a cp group of one rank: the blocks, their log-sum-exp merge and the backward from the
merged output, without the exchange): output and gradients equal torch's causal SDPA on the
whole sequence, grouped-query heads included, for the chunk layouts cp uses. The exchange over
2 and 4 ranks: tests/distributed/test_cp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_scale.parallel.cp import chunks_held
from hf_scale.parallel.cp_blocks import _order, block_attention, plan_pieces, supported


@pytest.fixture(scope="module")
def group(one_process_group):
    return one_process_group


def _inputs(heads: int, kv_heads: int, length: int = 24, dim: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    # [batch, seq, heads, dim] underneath, as transformers' projections lay them out
    q = torch.randn(2, length, heads, dim, generator=g, dtype=dtype).transpose(1, 2) * 2
    k = torch.randn(2, length, kv_heads, dim, generator=g, dtype=dtype).transpose(1, 2) * 2
    v = torch.randn(2, length, kv_heads, dim, generator=g, dtype=dtype).transpose(1, 2)
    return [t.detach().requires_grad_() for t in (q, k, v)]


STARTS = [[0, 5, 6, 17], [0, 12, 13]]  # per row: documents of 5, 1, 11, 7 and 12, 1, 11 tokens


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("chunks", [[[0]], [[0, 1]], [[0, 1, 2, 3]], [[2, 0, 3, 1]]], ids=["one", "two", "four",
                                                                                            "shuffled"])
@pytest.mark.parametrize("starts", [None, STARTS], ids=["rows", "packed"])
def test_blocks_equal_causal_sdpa(group, heads, kv_heads, chunks, starts):
    """Chunks in any local order: each attends to every earlier chunk and causally to itself,
    within its document (packed rows: documents that cross chunk boundaries, start at one, or
    hold a single token)."""
    q, k, v = _inputs(heads, kv_heads)
    length, chunk = q.shape[2], q.shape[2] // len(chunks[0])
    index = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks[0]])  # local order
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    for row, row_starts in enumerate(starts or []):
        docs = torch.zeros(length, dtype=torch.long)
        docs[row_starts[1:]] = 1
        docs = docs.cumsum(0)
        mask[row, 0] &= docs[:, None] == docs[None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4, enable_gqa=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    want = [ref.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    q2, k2, v2 = (t.detach()[:, :, index].requires_grad_() for t in (q, k, v))
    out = block_attention(q2, k2, v2, group, chunks, chunk, plan_pieces(chunks[0], chunk, starts), 0.4)
    out.backward(grad[:, :, index])
    for name, got, ref_t in zip(("output", "dq", "dk", "dv"), (out, q2.grad, k2.grad, v2.grad), want):
        want_t = ref_t[:, :, index]
        err = float((got.detach() - want_t).norm() / want_t.norm())
        assert err < 1e-5, f"{name}: differs by {err:.2e} of its norm"


def test_recomputed_forward_leaves_its_keys_for_the_backward(group):
    """Under activation checkpointing the forward recomputed in the backward stashes the K / V
    it gathered and the backward takes them (no third gather); outside it nothing is stashed."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _inputs(4, 2)
    stash: dict = {}
    taken = []

    class Watch(dict):
        def pop(self, key, default=None):
            taken.append(key in self)
            return super().pop(key, default)

    stash = Watch()
    out = checkpoint(lambda a, b, c: block_attention(a, b, c, group, [[0, 1]], 12, plan_pieces([0, 1], 12, None), 0.3,
                                                     stash, "layer"),
                     q, k, v, use_reentrant=False)
    assert not stash
    out.sum().backward()
    assert taken == [True] and not stash
    ref = F.scaled_dot_product_attention(*(t.detach().requires_grad_() for t in (q, k, v)), is_causal=True,
                                         scale=0.3, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5)


def test_pieces_of_a_packed_chunk():
    """Chunk 1 of 12 tokens (global 12-23), documents starting at 0, 5, 6, 17: the run 12-16
    continues the document of 6 (its keys 6-11 visible), 17-23 starts one."""
    pieces = plan_pieces([1], 12, [[0, 5, 6, 17]])
    assert [(p.local, p.past, p.diag) for p in pieces] == [
        (slice(0, 5), slice(6, 12), slice(12, 17)), (slice(5, 12), None, slice(17, 24))]
    assert [(p.local, p.past) for p in plan_pieces([3, 0], 6, None)] == [(slice(0, 6), slice(0, 18)),
                                                                           (slice(6, 12), None)]


def test_order_and_layouts():
    assert [list(map(int, t)) for t in _order(chunks_held(2, "head_tail"))] == [[0, 1, 1, 0], [0, 0, 1, 1]]
    assert chunks_held(2, "contiguous") == [[0], [1]]
    q, k, v = _inputs(4, 2)
    assert supported(q, k, v)
    assert not supported(q, k, v[..., :4])  # key and value head sizes differ: masked attention


def test_bf16_blocks_close_to_fp32(group):
    q, k, v = _inputs(4, 2, dtype=torch.bfloat16)
    out = block_attention(q, k, v, group, [[0, 1]], 12, plan_pieces([0, 1], 12, STARTS), 0.35)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[:1, :, a:b].detach().float() for t in (q, k, v)), is_causal=True,
                                                    scale=0.35, enable_gqa=True)
                     for a, b in zip(STARTS[0], [*STARTS[0][1:], 24])], dim=2)
    assert out.dtype == torch.bfloat16
    assert float((out[:1].detach().float() - ref).abs().max()) < 3e-2
    out.float().sum().backward()
    assert k.grad.dtype == torch.bfloat16 and torch.isfinite(k.grad).all()
