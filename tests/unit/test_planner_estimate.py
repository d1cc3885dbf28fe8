"""The planner's memory estimator: hand-checkable parameter bytes per strategy, the activation
profile against a real CPU forward, and the published 16 bytes / parameter of mixed-precision AdamW."""

import pytest
import torch
import transformers as tf

from hf_scale.errors import HfScaleConfigError
from hf_scale.layout_search.estimate import Layout, Workload, estimate_memory
from hf_scale.layout_search.profile import measure_activations, model_facts
from hf_scale.layout_search.source import read_source
from tests.tiny_models import CAUSAL, tiny_batch, tiny_config, tiny_model

WORK = Workload(seq=16, batch=1)  # one micro-batch a step: no gradient accumulation
WORK2 = Workload(seq=16, batch=2)


@pytest.fixture(scope="module")
def tiny():
    return model_facts(tiny_config("llama"))


def test_tiny_parameter_counts(tiny):
    model = tiny_model("llama", CAUSAL)
    # tied embeddings: one tensor, counted once; 2 blocks; the root holds embedding + final norm
    assert tiny.params == sum(p.numel() for p in model.parameters())
    assert tiny.layers == 2 and sum(tiny.block_params) + tiny.root_params == tiny.params
    assert tiny.head_params == tiny.embedding_params == 128 * 32


@pytest.mark.parametrize("strategy, shard, params, grads, optimizer", [
    ("ddp", 1, 4, 4, 8),  # replicated: fp32 weights, fp32 gradients, two fp32 AdamW moments
    ("zero1", 1, 4, 4, 4),  # optimizer state over 2 ranks
    ("fsdp", 2, 2, 2, 4),  # everything over 2 ranks
    ("zero2", 2, 2, 2, 4),
])
def test_state_bytes_per_strategy(tiny, strategy, shard, params, grads, optimizer):
    replicate = 2 if strategy in ("ddp", "zero1") else 1
    mem = estimate_memory(tiny, Layout(strategy, replicate, shard), WORK)
    n = tiny.params
    assert (mem.params, mem.grads, mem.optimizer) == (params * n, grads * n, optimizer * n)
    if strategy in ("ddp", "zero1"):
        # DDP's gradient buckets, held from the first backward on; the gradients are views into them
        assert mem.comm_buffers == mem.bucket_grads == 4 * n
    else:
        assert mem.bucket_grads == 0
    # the peak: at backward's start (no gradients yet) or at its end (no activations left; the
    # tied weight's second gradient and, under FSDP, the root unit's unsharded fp32 gradient)
    fixed = mem.overhead + mem.params + mem.optimizer + mem.comm_buffers + mem.compute_copies
    root = tiny.root_params if strategy in ("fsdp", "zero2") else 0
    assert mem.grad_buffers == 4 * tiny.tied_params + 4 * root and tiny.tied_params == 128 * 32
    # a block's backward (FSDP's second unit): the first unit's reduce-scatter input and sharded
    # gradient, this unit's own unsharded gradients (fp32 here), the first unit's activations freed
    block = (mem.recompute + mem.prefetched + mem.reduce_buffer + mem.head_grad
             + mem.unit_grads - mem.unit_freed)
    # (none with the tiny model's two blocks: its second unit's backward is the step's last block
    # backward, the moment of ``first_block``; test_a_deeper_prefetch_keeps_more_units_gathered)
    assert mem.unit_grads == mem.unit_freed == 0
    assert mem.device_total == fixed + max(mem.activations + max(mem.logits_loss, block),
                                           mem.grads - mem.bucket_grads + mem.grad_buffers + mem.first_block)


def test_gradient_accumulation_keeps_gradients_through_backward(tiny):
    one = estimate_memory(tiny, Layout("fsdp", 1, 2, micro_batch=2), WORK2)
    acc = estimate_memory(tiny, Layout("fsdp", 1, 2, micro_batch=1), WORK2)
    # half the activations, but the gradients and FSDP's unsharded fp32 accumulators stay
    assert acc.activations * 2 == one.activations
    assert acc.comm_buffers - one.comm_buffers == 4 * tiny.params
    assert acc.device_total - acc.overhead - acc.params - acc.optimizer - acc.comm_buffers == (
        acc.activations + max(acc.logits_loss, acc.recompute + acc.prefetched + acc.reduce_buffer + acc.head_grad)
        + acc.grads)


def test_offload_moves_state_to_the_host(tiny):
    gpu = Workload(seq=16, batch=1, device="cuda")
    on, off = (estimate_memory(tiny, Layout("fsdp", 1, 2, cpu_offload=c), gpu) for c in (True, False))
    assert on.params == on.grads == on.optimizer == 0
    assert on.host == off.params + off.grads + off.optimizer
    assert on.device_total < off.device_total
    # on a CPU device the host memory is the device's: nothing moves, nothing is counted twice
    cpu_on, cpu_off = (estimate_memory(tiny, Layout("fsdp", 1, 2, cpu_offload=c), WORK) for c in (True, False))
    assert cpu_on == cpu_off


def test_tensor_parallel_loss_holds_the_local_logits_and_one_buffer(tiny):
    """The vocabulary-parallel loss keeps, at its peak, this rank's fp32 logits and the one
    buffer its exponentials and then its gradient are computed in: 8 bytes per local logit."""
    prof = tiny.profile(16, torch.float32, "sdpa")
    tp = estimate_memory(tiny, Layout("fsdp", 1, 1, tp=2), WORK)
    assert tp.logits_loss == 16 * 128 // 2 * 8 + prof.outside
    one = estimate_memory(tiny, Layout("fsdp", 1, 1), WORK)  # log-softmax + logits + their gradient
    assert one.logits_loss == 16 * 128 * 12 + prof.outside


def test_selective_checkpointing_keeps_every_matmul_output(tiny):
    """Selective checkpointing stores every matmul and attention output, also those backward
    does not need (q, k and o's and down's outputs): tiny llama, 16 tokens, fp32, by hand."""
    prof = tiny.profile(16, torch.float32, "sdpa")
    q = o = down = out = 16 * 32 * 4
    k = v = 16 * 16 * 4  # 2 key/value heads x 8
    gate = up = 16 * 64 * 4
    lse = 4 * 16 * 4
    assert prof.block_kept == q + k + v + o + gate + up + down + out + lse
    assert prof.block_kept_residual == o + down  # row-parallel outputs: partial sums, full width under tp
    assert prof.block_saved_kept < prof.block_kept
    # residual width, the same on every tp rank: the block's input, the two norms' inputs scaled
    # and outputs, the attention's residual sum, and the norms' per-token rsqrt
    assert prof.block_residual == 6 * 16 * 32 * 4 + 2 * 16 * 4
    sel = estimate_memory(tiny, Layout("fsdp", 1, 2, ac="selective"), WORK)
    assert sel.activations == tiny.layers * (prof.block_input + prof.block_kept)


def test_zero2_keeps_the_gathered_model(tiny):
    fsdp = estimate_memory(tiny, Layout("fsdp", 1, 2, precision="bf16"), WORK)
    zero2 = estimate_memory(tiny, Layout("zero2", 1, 2, precision="bf16"), WORK)
    # fsdp keeps the root and the last block gathered at backward's start; zero2 every block
    assert fsdp.comm_buffers == 2 * (tiny.root_params + max(tiny.block_params))
    assert zero2.comm_buffers == 2 * tiny.params


def test_blocks_per_unit_gathers_a_larger_unit(tiny):
    """Two blocks per FSDP unit: the root and both blocks are gathered at backward's start."""
    one = estimate_memory(tiny, Layout("fsdp", 1, 2, precision="bf16"), WORK)
    two = estimate_memory(tiny, Layout("fsdp", 1, 2, precision="bf16", blocks_per_unit=2), WORK)
    assert two.comm_buffers - one.comm_buffers == 2 * max(tiny.block_params)
    assert Layout("fsdp", 1, 2, blocks_per_unit=2).parallel_config().blocks_per_unit == 2
    assert Layout("ddp", 2, 1).parallel_config().blocks_per_unit is None


def test_a_deeper_prefetch_keeps_more_units_gathered(tiny):
    """In the second block unit's backward FSDP2 has gathered the next unit (its default prefetch,
    and an explicit prefetch of one unit); each unit deeper one more block in the compute dtype, as
    far as the rank has blocks left: the tiny model's 2 blocks leave none after the second."""
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    deep = model_facts(config)
    default, one, two = (estimate_memory(deep, Layout("fsdp", 1, 2, precision="bf16", prefetch=p), WORK)
                         for p in (None, 1, 2))
    block = 2 * max(deep.block_params)
    assert one.comm_buffers == two.comm_buffers == default.comm_buffers
    assert default.prefetched == one.prefetched == block and two.prefetched == 2 * block
    assert estimate_memory(tiny, Layout("fsdp", 1, 2, precision="bf16", prefetch=2), WORK).prefetched == 0
    # the previous unit's reduce-scatter input (fp32) and the head's unsharded gradient (bf16) beside it
    assert default.reduce_buffer == 2 * block and default.head_grad == 2 * deep.head_params
    # and this unit's own gradients (bf16, unsharded: made before its reduce-scatter copies them)
    # beside the first unit's sharded fp32 gradient (4 bytes over 2 ranks), its kept activations freed
    assert default.unit_grads == block + block and default.unit_freed == default.first_block_kept > 0
    cats = default.categories()
    assert sum(cats.values()) == default.device_total - default.overhead
    # from the last block's backward on, after the logits are freed: beside the recomputation
    full = estimate_memory(tiny, Layout("fsdp", 1, 2, precision="bf16", prefetch=2, ac="full"), WORK)
    later = full.activations + full.recompute + full.prefetched + full.reduce_buffer + full.head_grad
    assert (full.device_total - (full.overhead + full.params + full.optimizer + full.comm_buffers
                                 + full.compute_copies)) == max(full.activations + full.logits_loss, later,
                                                                full.grads + full.grad_buffers + full.first_block)
    assert Layout("fsdp", 1, 2, prefetch=2).parallel_config().fsdp_prefetch == 2
    assert Layout("fsdp", 1, 2).parallel_config().fsdp_prefetch is None


def test_first_blocks_backward_holds_its_activations_beside_the_later_gradients(tiny):
    """The step's last block backward (the first block's) rebuilds that block under full
    checkpointing while every later block's gradient exists: its kept input and its
    recomputation, less its own gradients (made only then). Tiny llama, 16 tokens, fp32."""
    prof = tiny.profile(16, torch.float32, "sdpa")
    for shard in (1, 2):
        full = estimate_memory(tiny, Layout("fsdp", 1, shard, ac="full"), WORK)
        assert full.recompute == prof.block_bytes + 2 * prof.block_largest  # and its backward's workspace
        assert full.activations == tiny.layers * prof.block_input
        own = 4 * max(tiny.block_params) // shard  # this rank's share of the first block's gradients
        assert full.first_block == prof.block_input + prof.block_bytes + 2 * prof.block_largest - own > 0
        fixed = full.overhead + full.params + full.optimizer + full.comm_buffers + full.compute_copies
        assert full.device_total == fixed + full.grads + full.grad_buffers + full.first_block  # here the peak
    # without checkpointing the block's own saved activations and its backward's workspace, less
    # its gradients (here more than its activations alone)
    none = estimate_memory(tiny, Layout("fsdp", 1, 1), WORK)
    own = 4 * max(tiny.block_params)
    assert prof.block_bytes < own and none.first_block == prof.block_bytes + 2 * prof.block_largest - own
    # under gradient accumulation the gradients are already beside the activations in backward
    acc = estimate_memory(tiny, Layout("fsdp", 1, 2, micro_batch=1, ac="full"), WORK2)
    fixed = acc.overhead + acc.params + acc.optimizer + acc.comm_buffers + acc.compute_copies
    assert acc.device_total == fixed + acc.activations + max(
        acc.logits_loss, acc.recompute + acc.prefetched + acc.reduce_buffer + acc.head_grad) + acc.grads


def test_a_block_backward_holds_two_gradients_of_its_widest_activation(tiny):
    """Beside what a block saved (or recomputed), its backward makes the gradients of its widest
    activation, the MLP's: its product's gradient and one factor's (the simulation's peak at
    Llama-3-8B, 105k tokens a rank: two of 105472 x 14336 in bf16, 5.6 GiB, in the MLP's backward).
    Two tensors of the block's largest saved one, with or without checkpointing. Tiny llama, 16
    tokens, fp32: the MLP's width is 64."""
    prof = tiny.profile(16, torch.float32, "sdpa")
    assert prof.block_largest == 16 * 64 * 4 and not prof.block_largest_residual
    for ac, rebuilt in ((None, 0), ("full", prof.block_bytes)):
        mem = estimate_memory(tiny, Layout("fsdp", 1, 2, ac=ac), WORK)
        assert mem.recompute == rebuilt + 2 * prof.block_largest, ac


def test_activations_order(tiny):
    get = lambda **kw: estimate_memory(tiny, Layout("fsdp", 1, 2, **kw), WORK)
    none, sel, full = get(), get(ac="selective"), get(ac="full")
    assert full.activations < sel.activations < none.activations
    workspace = none.recompute  # the backward's gradients beside a block, checkpointed or not
    assert full.recompute - workspace == none.activations // 2  # one of the 2 blocks again
    assert get(loss_chunk_tokens=4).logits_loss < none.logits_loss
    eager = estimate_memory(tiny, Layout("fsdp", 1, 2), Workload(seq=16, batch=2, attn="eager"))
    assert eager.activations > none.activations  # the T x T scores
    double = estimate_memory(tiny, Layout("fsdp", 1, 2, micro_batch=2), WORK2)
    assert double.activations == 2 * none.activations


def _saved_bytes_real(model, batch) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return sum(seen.values())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_profile_matches_a_real_cpu_forward(attn):
    """The meta forward's saved bytes (blocks + outside + logits) equal a real CPU forward's."""
    config = tiny_config("llama")
    config._attn_implementation = attn
    model = tiny_model("llama", CAUSAL)
    model.config._attn_implementation = attn
    model.train()
    batch = tiny_batch(CAUSAL, 1, seq=16)
    batch.pop("attention_mask")  # no mask: the causal kernel path, as in packed training
    real = _saved_bytes_real(model, batch)
    facts = model_facts(config)
    prof = measure_activations(facts, 16, torch.float32, attn)
    predicted = facts.layers * prof.block_bytes + prof.logits + prof.outside
    assert predicted == pytest.approx(real, rel=0.02), (predicted, real)


def test_llama3_8b_sixteen_bytes_per_parameter_sharded_over_8():
    """Mixed-precision AdamW: fp32 master (4) + fp32 gradient (4) + two fp32 moments (8) = 16 bytes
    per parameter (ZeRO paper's K=12 + 4 for the gradient in fp32 kept by FSDP2), over 8 ranks."""
    config = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                            tie_word_embeddings=False)
    facts = model_facts(config)
    assert facts.params == 8_030_261_248  # Llama-3-8B
    mem = estimate_memory(facts, Layout("fsdp", 1, 8, precision="bf16", ac="full"), Workload(seq=1024, batch=1))
    assert mem.params + mem.grads + mem.optimizer == 16 * facts.params // 8
    # FSDP's buffers: the root (embeddings + head, 1.05B) and the last block (218M) gathered in bf16
    block = max(facts.block_params)
    assert facts.root_params == 2 * 128256 * 4096 + 4096 and block == 218_112_000
    assert mem.comm_buffers == (facts.root_params + block) * 2


def test_read_source_config_json(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    config, job = read_source(str(tmp_path / "config.json"))
    assert config.model_type == "llama" and job is None
    with pytest.raises(HfScaleConfigError, match="local Hugging Face cache"):
        read_source("no-such-org/no-such-model-xyz")


def test_pipeline_busiest_rank(tiny):
    """pp=2 over 2 blocks, 1F1B, 2 microbatches of 1 sequence: rank 0 holds 2 in flight of its block
    (each with the stage output torch keeps for its backward) and a gradient receive buffer per
    microbatch, the last rank 1 in flight, an activation receive buffer per microbatch and the
    logits; the estimate is the busier of the two."""
    mem = estimate_memory(tiny, Layout("fsdp", 1, 1, pp=2, micro_batch=2), WORK2)
    prof = tiny.profile(16, torch.float32, "sdpa")
    one = estimate_memory(tiny, Layout("fsdp", 1, 1, micro_batch=1), Workload(seq=16, batch=1))
    hidden = prof.block_input  # a stage boundary tensor
    rank0, last = 2 * (prof.block_bytes + hidden) + 2 * hidden, prof.block_bytes + 2 * hidden + one.logits_loss
    # at its first backward; the later one finds the first microbatch's freed
    assert mem.activations + mem.first_microbatch + mem.logits_loss == max(rank0, last)
    assert mem.first_microbatch == prof.block_bytes + hidden


def test_pipeline_estimate_per_stage(tiny):
    """The same pp=2 layout stage by stage: rank 0 holds the embedding and 2 microbatches in flight of
    its block, no logits; rank 1 one microbatch, the final norm, and the logits and loss; the
    planner's estimate (no rank named) is the busier of the two."""
    from hf_scale.layout_search.estimate import estimate_stages, pp_rank_params

    layout = Layout("fsdp", 1, 1, pp=2, micro_batch=2)
    first, last = estimate_stages(tiny, layout, WORK2)
    prof = tiny.profile(16, torch.float32, "sdpa")
    hidden = prof.block_input
    assert (first.activations + first.first_microbatch, first.logits_loss) == (2 * (prof.block_bytes + hidden)
                                                                            + 2 * hidden, 0)
    assert last.activations == prof.block_bytes + 2 * hidden and last.logits_loss > 0
    assert last.first_microbatch == 0  # one in flight: the later microbatches' backward finds as many
    counts = pp_rank_params(tiny, layout)  # the tied embedding and head counted on both ends
    assert (first.params, last.params) == (4 * counts[0], 4 * counts[1])
    busiest = estimate_memory(tiny, layout, WORK2)
    assert busiest.device_total == max(first.device_total, last.device_total)
    assert busiest in (first, last)


def test_models_the_planner_cannot_estimate():
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    from hf_scale.errors import HfScalePlanError

    class NoConfig(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

    class NoBlocks(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.a = nn.Linear(4, 4)

    with pytest.raises(HfScalePlanError, match="no transformers config"):
        model_facts(NoConfig())
    with pytest.raises(HfScalePlanError, match="repeated blocks"):
        model_facts(NoBlocks(PretrainedConfig()))


def test_interleaved_schedules_hold_torchs_warmup_plus_one():
    """Interleaved 1F1B, pp=2, 2 stages per rank (rank 0: stages 0 and 2, rank 1: 1 and 3), 4
    microbatches (2 per round): rank 0 runs 4 warm-up forwards (2 of stage 0, 2 of stage 2) and
    one more of stage 0 before its first backward; rank 1 runs 2 (stage 1), then one of stage 3.
    Zero bubble grows the warm-up by 1 per hop, not 2."""
    from types import SimpleNamespace

    from hf_scale.layout_search.estimate import _interleaved_inflight

    blocks = ((0, 1, 2), (3, 4), (5, 6), (7,))  # uneven stages: 3, 2, 2 and 1 blocks
    pl = SimpleNamespace(stage_blocks=blocks, stages_of=lambda r: [r, r + 2])
    # rank 0: 3 x stage 0 (3 blocks) + 2 x stage 2 (2 blocks) over its 5 blocks
    assert _interleaved_inflight(pl, 0, 4, 2, 2) == pytest.approx((3 * 3 + 2 * 2) / 5)
    # rank 1: 2 x stage 1 (2 blocks) + 1 x stage 3 (1 block) over its 3 blocks
    assert _interleaved_inflight(pl, 1, 4, 2, 2) == pytest.approx((2 * 2 + 1) / 3)
    # zero bubble: rank 0 warms up 3 (stage 0, 0, 2), then one more of stage 2
    assert _interleaved_inflight(pl, 0, 4, 2, 1) == pytest.approx((2 * 3 + 2 * 2) / 5)
    # never more than every microbatch of every stage
    assert _interleaved_inflight(pl, 0, 1, 2, 2) == pytest.approx(1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt2", "gpt_neox"])
def test_profile_of_a_cache_off_model(arch):
    """``use_cache: False`` (what training scripts set) made transformers look for packed
    documents in the meta ``position_ids`` (no cache, no attention mask) and fail on
    ``Tensor.item()``; GPT-2's padding warning read the meta ``input_ids`` the same way. The
    profile has the cache-on model's block inputs and logits (inside a block the two differ by
    which copies of k and v attention saves: the cache's, or views of a fused projection), and
    the patched checks are the originals again afterwards."""
    from transformers import PreTrainedModel, masking_utils

    before = masking_utils.find_packed_sequence_indices, PreTrainedModel.warn_if_padding_and_no_attention_mask
    cached, uncached = tiny_config(arch), tiny_config(arch)
    uncached.use_cache = False
    profiles = [measure_activations(model_facts(c), 32, torch.float32, "sdpa") for c in (cached, uncached)]
    assert profiles[1].block_bytes > 0
    for field in ("block_input", "logits", "outside"):
        assert getattr(profiles[0], field) == getattr(profiles[1], field), field
    assert (masking_utils.find_packed_sequence_indices, PreTrainedModel.warn_if_padding_and_no_attention_mask) == before
    packed = torch.tensor([[0, 1, 2, 0, 1]])  # real tensors keep transformers' detection
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1]]


def test_profile_refuses_a_forward_that_reads_its_inputs_clearly(monkeypatch):
    """Any other read of a meta value is one clear planner error, not torch's RuntimeError."""
    from hf_scale.errors import HfScalePlanError

    facts = model_facts(tiny_config("llama"))
    forward = type(facts.model.model.layers[0]).forward

    def reads_a_value(self, hidden_states, *args, **kwargs):
        if hidden_states.sum() > 0:  # data-dependent control flow
            pass
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(type(facts.model.model.layers[0]), "forward", reads_a_value)
    with pytest.raises(HfScalePlanError, match="reads a value of its inputs.*strategy: fsdp"):
        measure_activations(facts, 32, torch.float32, "sdpa")


@pytest.mark.parametrize("layout, work", [
    (Layout("ddp", 2, 1, precision="bf16"), WORK),  # DDP's buckets: gradients all along
    (Layout("zero2", 1, 2, precision="bf16"), Workload(seq=256, batch=1)),  # every block gathered; the loss's peak
    (Layout("fsdp", 1, 2, ac="full", loss_chunk_tokens=8), WORK),
    (Layout("fsdp", 1, 2, ac="selective", tp=2), WORK),
    (Layout("fsdp", 1, 2), WORK2),  # no_sync's unsharded accumulators: gradients
    (Layout("fsdp", 1, 2, pp=2, micro_batch=2), WORK2),  # a stage's unsharded gradients: gradients
    (Layout("fsdp", 1, 2, pp=2, micro_batch=2, pp_grad_sync="each"), WORK2),
])
def test_categories_split_the_peak_as_the_simulation_does(tiny, layout, work):
    """The estimate's peak in the simulation's five categories (docs/planner.md, "Categories"):
    they add up to the device total less the overhead; the parameters and optimizer state are
    the held ones; gathered copies and communication buffers are buffers, gradient storage held
    in the buffers (DDP's buckets, no_sync's and a pipeline stage's unsharded gradients) gradients."""
    mem = estimate_memory(tiny, layout, work)
    cats = mem.categories()
    assert set(cats) == {"params", "grads", "optimizer", "activations", "buffers"}
    assert sum(cats.values()) == mem.device_total - mem.overhead, (cats, mem)
    assert (cats["params"], cats["optimizer"]) == (mem.params, mem.optimizer)
    assert cats["grads"] >= mem.held_grads and cats["buffers"] >= mem.comm_buffers - mem.held_grads
    if layout.strategy == "ddp":
        assert mem.held_grads == mem.comm_buffers == mem.bucket_grads > 0
    elif work.batch > layout.micro_batch or (layout.pp > 1 and layout.pp_grad_sync == "last"):
        assert 0 < mem.held_grads < mem.comm_buffers  # the unsharded gradients beside the gathered parameters
    else:
        assert mem.held_grads == 0
    if layout.strategy == "zero2":  # the peak at the loss's backward: its fp32 gradient a temporary
        assert cats["grads"] == 0
        assert cats["activations"] == mem.activations + mem.logits_loss - mem.logits_temp
        assert cats["buffers"] == mem.comm_buffers + mem.logits_temp > mem.comm_buffers

