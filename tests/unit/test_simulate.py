"""Simulated scale (issue 29): the real ``parallelize`` and training steps as rank r of N on fake
CUDA tensors, in this one process. Each layout's test checks the device of every parameter,
buffer, gradient, optimizer state and block input against ``cuda:LOCAL_RANK`` (the host for
what cpu_offload keeps there); no real computation runs."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from hf_scale.errors import HfScaleConfigError, HfScalePlanError
from hf_scale.layout_search.estimate import Layout
from hf_scale.layout_search.simulate import check_placement, simulate
from tests.tiny_models import tiny_config

SEQ, BATCH = 16, 2
# A torch built with CUDA lets only visible GPUs stand in for simulated ones (fake_cuda): these
# tests simulate nodes of 8 GPUs, as a CPU-only torch (here, CI) does without any.
pytestmark = pytest.mark.skipif(torch.cuda._is_compiled() and torch.cuda.device_count() < 8,
                                reason="a CUDA build of torch with fewer than 8 visible GPUs")


@pytest.fixture(scope="module")
def config():
    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    return config


def placed(result, layout: Layout, host: bool = False) -> None:
    """Every tensor of the simulated rank on its device, each kind seen, and a peak tracked."""
    device = f"cuda:{result.rank % 8}"
    assert result.device == device
    assert result.misplaced == []
    kinds = {"parameters", "gradients", "optimizer state", "block inputs"}
    assert kinds <= set(result.placement), result.placement
    for kind in kinds:
        expected = "cpu" if host and kind != "block inputs" else device
        assert set(result.placement[kind]) == {expected}, (kind, result.placement[kind])
    assert result.peak["total"] > 0 and result.peak["activations"] > 0
    assert result.layout == layout


LAYOUTS = {
    "fsdp": (Layout("fsdp", dp_shard=8), 8, 5),
    "fsdp_bf16_selective_chunked": (Layout("fsdp", dp_shard=8, precision="bf16", ac="selective",
                                           loss_chunk_tokens=8), 8, 0),
    "zero2_bf16": (Layout("zero2", dp_shard=8, precision="bf16"), 8, 7),
    "hsdp_full_ac": (Layout("hsdp", dp_replicate=2, dp_shard=8, ac="full"), 16, 9),
    "ddp_bf16": (Layout("ddp", dp_replicate=8, precision="bf16"), 8, 3),
    "zero1": (Layout("zero1", dp_replicate=8), 8, 1),
    "tp2": (Layout("fsdp", dp_shard=4, tp=2), 8, 6),
    "tp2_only": (Layout("fsdp", tp=2), 2, 1),
    "fsdp_2_blocks_per_unit_prefetch": (Layout("fsdp", dp_shard=4, blocks_per_unit=2, prefetch=2), 4, 2),
    "hsdp_tp_1024_ranks": (Layout("hsdp", dp_replicate=4, dp_shard=128, tp=2), 1024, 1023),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_runs_with_every_tensor_on_its_gpu(config, name):
    from hf_scale.layout_preview import meta_model

    layout, world, rank = LAYOUTS[name]
    result = simulate(config, world_size=world, rank=rank, parallel=layout, seq=SEQ, batch=BATCH)
    placed(result, layout)
    # every parameter once: the tied embedding and head stay one parameter, as in a real run
    assert sum(result.placement["parameters"].values()) == len(list(meta_model(config).parameters()))
    # the tracked bytes and the planner's estimate describe the same step (a loose band at this size,
    # where fixed costs dominate, and none for a 32-wide model over 512 shards, mostly padding; the
    # published shapes' comparison is scripts/simulate_published.py)
    assert world > 64 or 0.5 < result.ratio < 2.0, result.format()


def test_cpu_offload_keeps_shards_gradients_and_optimizer_state_on_the_host(config):
    layout = Layout("fsdp", dp_shard=8, cpu_offload=True)
    result = simulate(config, world_size=8, rank=2, parallel=layout, seq=SEQ, batch=BATCH)
    placed(result, layout, host=True)
    assert result.peak["params"] == 0 and result.peak["optimizer"] == 0  # none of them on the GPU


def test_gradient_accumulation_and_a_parallel_config(config):
    from hf_scale.config import ParallelConfig

    result = simulate(config, world_size=8, rank=0, parallel=ParallelConfig(strategy="fsdp", mixed_precision="bf16"),
                      seq=SEQ, batch=2)
    assert result.layout == Layout("fsdp", dp_shard=8, precision="bf16")
    placed(result, result.layout)


def test_micro_batches_run_as_separate_forwards_with_no_sync_accumulation(config):
    """batch 2 as 2 micro-batches of 1 (two forwards, gradients accumulated unsharded under
    no_sync, reduced once) against one forward of the 2 sequences: the micro-batches' activation
    peak is about half, and their gradient peak holds the unsharded fp32 accumulators (a
    reduce-scatter per micro-batch would hold only the shards). A simulation that ran the batch in
    one forward whatever the micro-batch, or dropped no_sync, fails here."""
    seq = 256  # activations well above the fixed costs
    peaks = {}
    for micro in (1, 2):
        layout = Layout("fsdp", dp_shard=8, micro_batch=micro)
        peaks[micro] = simulate(config, world_size=8, rank=0, parallel=layout, seq=seq, batch=2).peak
    assert peaks[1]["activations"] < 0.7 * peaks[2]["activations"], peaks
    # the accumulators: the whole model's fp32 gradients, ~8x this rank's fp32 parameter shards
    # (measured 92672 vs 14848 bytes; reduced each micro-batch instead, 12800: the shards)
    assert peaks[1]["grads"] > 3 * peaks[1]["params"], peaks


def test_lora_adapters(config):
    peft = pytest.importorskip("peft")
    from hf_scale.layout_preview import meta_model

    model = peft.get_peft_model(meta_model(config), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    dtypes = [p.dtype for p in model.parameters()]
    layout = Layout("fsdp", dp_shard=8, precision="bf16")
    result = simulate(model, world_size=8, rank=1, parallel=layout, seq=SEQ, batch=BATCH)
    placed(result, layout)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert sum(result.placement["gradients"].values()) == trainable  # frozen weights make none
    # the caller's model is left on the meta device: it simulates again, the same
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())
    assert [p.dtype for p in model.parameters()] == dtypes  # the planner's bf16 profile ran on a copy
    again = simulate(model, world_size=8, rank=1, parallel=layout, seq=SEQ, batch=BATCH)
    placed(again, layout)
    assert again.peak["total"] == result.peak["total"]


def test_a_layout_that_cannot_run_at_that_size_fails_as_on_the_cluster(config):
    with pytest.raises(HfScaleConfigError, match="does not divide WORLD_SIZE=8"):
        simulate(config, world_size=8, parallel={"strategy": "fsdp", "tp": 3}, seq=SEQ)
    with pytest.raises(HfScalePlanError, match="tp=4 does not divide the key/value heads"):  # 2 of them
        simulate(config, world_size=8, parallel=Layout("fsdp", dp_shard=2, tp=4), seq=SEQ)


def test_the_process_is_left_as_it_was(config):
    simulate(config, world_size=8, rank=0, parallel=Layout("fsdp", dp_shard=8), seq=SEQ, batch=1)
    assert not dist.is_initialized()
    assert not torch.cuda._is_compiled() or torch.cuda.is_available() == (torch.cuda.device_count() > 0)
    if not torch.cuda._is_compiled():
        assert not torch.cuda.is_available() and torch.accelerator.current_accelerator() is None
    assert "RANK" not in os.environ and "HF_SCALE_BACKEND" not in os.environ
    x = torch.ones(3, requires_grad=True)  # real tensors and autograd as before
    (x * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_the_placement_check_finds_a_tensor_off_its_gpu():
    from hf_scale.layout_search.fake_cuda import fake_cuda, fake_tensors

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with fake_cuda(8), fake_tensors():
        model[0].to_empty(device="cuda:3")
        model[1].to_empty(device="cpu")  # forgotten on the host
        optimizer = torch.optim.AdamW(model.parameters())
        grads = [("0.weight", torch.device("cuda:3")), ("1.weight", torch.device("cpu"))]
        placement, wrong = check_placement(model, optimizer, [("0", torch.device("cuda:2"))], grads,
                                           torch.device("cuda:3"), offload=False)
    assert placement["parameters"] == {"cuda:3": 2, "cpu": 2}
    assert sorted(w.split(":")[0] for w in wrong) == ["block inputs 0", "gradients 1.weight", "parameters 1.bias",
                                                      "parameters 1.weight"]


def test_more_gpus_per_node_than_the_fake_device_guard_knows(config):
    with pytest.raises(HfScaleConfigError, match="at most 8"):
        simulate(config, world_size=32, local_world_size=16, parallel=Layout("fsdp", dp_shard=32), seq=SEQ)


@pytest.fixture(scope="module")
def deep_config(config):
    deep = copy.deepcopy(config)
    deep.num_hidden_layers = 4  # 4 stages of one block; the embedding and head tied across stages
    return deep


def stage_parameters(model_config, layout: Layout, stages: tuple[int, ...]) -> int:
    """Parameters the pp rank of ``stages`` holds: its blocks', the embedding on the first stage,
    the final norm and the head on the last (a tied head is its own parameter there)."""
    from hf_scale.layout_preview import meta_model
    from hf_scale.model_plans import resolve_plan
    from hf_scale.model_plans.pp import pp_layout

    model = meta_model(model_config)
    config = layout.parallel_config()
    pl = pp_layout(model, resolve_plan(model, None), layout.pp, config.stages_per_rank, layout.pp_schedule == "zbv")
    blocks = {i for s in stages for i in pl.stage_blocks[s]}
    held = 0
    for name, _ in model.named_parameters(remove_duplicate=False):
        index = name.split(".")[2] if name.startswith("model.layers.") else None
        if index is not None:
            held += int(index) in blocks
        elif name.startswith("model.embed_tokens"):
            held += 0 in stages
        else:
            held += pl.num_stages - 1 in stages
    return held


PIPELINES = {  # layout, world, rank, batch: the first, a middle and the last stage
    "pp2_first": (Layout("fsdp", dp_shard=4, pp=2, micro_batch=2), 8, 0, 2),
    "pp2_last": (Layout("fsdp", dp_shard=4, pp=2, micro_batch=2), 8, 7, 2),
    "pp2_first_grads_each": (Layout("fsdp", dp_shard=4, pp=2, micro_batch=4, pp_microbatches=4,
                                    pp_grad_sync="each"), 8, 0, 4),
    "pp4_first_bf16_full_ac": (Layout("fsdp", dp_shard=2, pp=4, micro_batch=4, precision="bf16", ac="full"), 8, 1, 4),
    "pp4_middle": (Layout("fsdp", dp_shard=2, pp=4, micro_batch=4), 8, 2, 4),
    "pp4_last_tp2": (Layout("fsdp", pp=4, tp=2, micro_batch=4), 8, 7, 4),
    "pp2_gpipe_zero2_hsdp": (Layout("zero2", dp_replicate=2, dp_shard=2, pp=2, micro_batch=2, pp_schedule="gpipe"),
                             8, 5, 2),
    "pp2_interleaved": (Layout("fsdp", dp_shard=2, pp=2, micro_batch=4, pp_schedule="interleaved_1f1b"), 4, 3, 4),
    "pp2_zbv": (Layout("fsdp", dp_shard=2, pp=2, micro_batch=4, pp_schedule="zbv"), 4, 0, 4),
    "pp2_zero_bubble": (Layout("fsdp", dp_shard=2, pp=2, micro_batch=4, pp_schedule="zero_bubble"), 4, 0, 4),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_stages_run_their_schedule_with_every_tensor_on_its_gpu(deep_config, name):
    layout, world, rank, batch = PIPELINES[name]
    result = simulate(deep_config, world_size=world, rank=rank, parallel=layout, seq=SEQ, batch=batch)
    placed(result, layout)
    assert set(result.placement["stage inputs"]) == {result.device}  # what each stage receives
    stages = tuple(result.stages)
    per_rank = 2 if layout.pp_schedule in ("interleaved_1f1b", "zero_bubble", "zbv") else 1
    assert len(stages) == per_rank
    pp_rank = rank // (world // layout.pp)
    assert stages[0] == pp_rank, stages
    assert sum(result.placement["parameters"].values()) == stage_parameters(deep_config, layout, stages)
    for kind in ("params", "optimizer", "grads", "activations"):
        assert result.peak[kind] > 0, (kind, result.format())
    # the peers' activations were assumed (a stage after the first receives them), and a middle
    # stage, which also sends them on, sent what it was assumed to receive
    assert bool(result.assumed) == (max(stages) > 0), result.assumed
    assert result.contradicted == []
    # the estimate beside it is this stage's: the logits and loss only where the last stage runs
    assert (result.estimate.logits_loss > 0) == (layout.pp * per_rank - 1 in stages), result.format()
    assert 0.5 < result.ratio < 2.0, result.format()


def test_a_pipeline_keeps_its_schedules_in_flight_microbatches(deep_config):
    """Stage 0 holds every microbatch's activations under gpipe, at most pp of them under 1f1b."""
    held = {}
    for schedule in ("gpipe", "1f1b"):
        layout = Layout("fsdp", dp_shard=2, pp=2, micro_batch=8, pp_schedule=schedule, pp_microbatches=8, ac="full")
        result = simulate(deep_config, world_size=4, rank=0, parallel=layout, seq=512, batch=8)
        held[schedule] = result.peak["activations"]
    assert held["gpipe"] > held["1f1b"] * 1.5, held


def test_a_pipeline_batch_that_does_not_split_into_its_microbatches(deep_config):
    with pytest.raises(HfScaleConfigError, match="does not split into the pipeline's 2 microbatches"):
        simulate(deep_config, world_size=4, parallel=Layout("fsdp", dp_shard=2, pp=2), seq=SEQ, batch=1)


@pytest.fixture(scope="module")
def moe():
    from tests.distributed.moe_checks import moe_config

    config = moe_config("qwen3_moe", False)  # 2 MoE layers, hidden 64, top-2
    config.num_experts = 8
    config._attn_implementation = "sdpa"
    return config


EXPERTS = {  # bf16: torch's grouped matmul (transformers' experts kernel on CUDA) takes bf16 only
    "ep8": (Layout("fsdp", dp_shard=8, ep=8, precision="bf16"), 8, 3),
    "ep4_of_fsdp8": (Layout("fsdp", dp_shard=8, ep=4, precision="bf16"), 8, 6),
    "ep2_zero2_full_ac": (Layout("zero2", dp_shard=8, ep=2, precision="bf16", ac="full"), 8, 5),
    "tp2_ep4_of_fsdp4": (Layout("fsdp", dp_shard=4, tp=2, ep=4, precision="bf16"), 8, 3),
    "tp2": (Layout("fsdp", dp_shard=4, tp=2, precision="bf16"), 8, 6),
    # ddp with ep fewer than the replicas (experts FSDP-sharded over the other 2), hsdp (ep within a group)
    "ddp_ep4_of_8": (Layout("ddp", dp_replicate=8, ep=4, precision="bf16"), 8, 5),
    "hsdp2x4_ep4": (Layout("hsdp", dp_replicate=2, dp_shard=4, ep=4, precision="bf16"), 8, 7),
    # ep with pp: the pipeline's 2 microbatches of the batch of 2
    "pp2_ep2_of_fsdp4": (Layout("fsdp", dp_shard=4, pp=2, ep=2, precision="bf16", micro_batch=2), 8, 6),
}


@pytest.mark.parametrize("name", EXPERTS)
def test_expert_parallel_runs_on_balanced_routing(moe, name):
    layout, world, rank = EXPERTS[name]
    result = simulate(moe, world_size=world, rank=rank, parallel=layout, seq=SEQ, batch=layout.micro_batch)
    placed(result, layout)
    # (token, expert) pairs per rank and MoE layer (a pipeline microbatch's)
    tokens = SEQ * moe.num_experts_per_tok * layout.micro_batch // max(1, layout.pp)
    per_rank = tokens // layout.ep
    assumed = (f"ep={layout.ep}: balanced routing assumed: {tokens} (token, expert) pairs per rank "
               f"and layer, {per_rank} sent to and received from each ep rank")
    # (a pipeline's later stage also assumes what it receives)
    assert [a for a in result.assumed if "stage" not in a] == ([assumed] if layout.ep > 1 else []), result.assumed
    for kind in ("params", "optimizer", "grads", "activations"):
        assert result.peak[kind] > 0, (kind, result.format())
    assert 0.5 < result.ratio < 2.0, result.format()


def test_tp_on_fake_tensors_skips_the_probe_forward_and_says_so(moe, monkeypatch):
    """transformers' tp plan for a MoE model whose configuration lacks some of its modules is pruned,
    and a pruned plan is checked by one forward of a sharded copy: fake tensors have no values to
    compare, so the simulation skips the check (as the meta device does) and logs it on rank 0."""
    import logging

    from hf_scale import log, orchestrate

    def refuse(*args, **kwargs):
        raise AssertionError("the tp probe forward ran on fake tensors")

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    monkeypatch.setattr(orchestrate, "check_tp_forward", refuse)
    monkeypatch.setattr(log, "_said", set())
    log.logger.addHandler(handler)
    try:
        layout = Layout("fsdp", dp_shard=4, tp=2, ep=4, precision="bf16")
        result = simulate(moe, world_size=8, rank=0, parallel=layout, seq=SEQ, batch=1)
    finally:
        log.logger.removeHandler(handler)
    placed(result, layout)
    assert "tensor parallel: the inferred plan is not checked (the model is on fake tensors: a simulation)" in said


def test_expert_parallel_holds_its_share_of_the_experts(moe):
    """ep=8 keeps 1/8 of every expert's weights per ep rank before FSDP: with ep over all 8 ranks the
    experts are not sharded further, and the rank holds as many expert bytes as fsdp over 8 does."""
    from hf_scale.layout_preview import meta_model

    experts = sum(p.numel() for n, p in meta_model(moe).named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in meta_model(moe).parameters())
    bf16 = {ep: simulate(moe, world_size=8, rank=0, parallel=Layout("fsdp", dp_shard=8, ep=ep, precision="bf16"),
                         seq=SEQ, batch=1) for ep in (1, 8)}
    # the fp32 shards: every parameter over 8 ranks either way (ep's experts over ep, the rest over fsdp)
    assert abs(bf16[8].peak["params"] - bf16[1].peak["params"]) <= 4 * 8 * 64, (bf16[8].peak, bf16[1].peak)
    assert experts > total / 2  # the comparison above is dominated by the experts


def test_a_nested_fake_cuda_leaves_the_enclosing_one_in_place():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_scale.layout_search.fake_cuda import fake_cuda

    with fake_cuda(2):
        with fake_cuda(2):
            pass
        with FakeTensorMode():  # autograd on fake CUDA still has its device guard
            x = torch.empty(4, 4, device="cuda:1", requires_grad=True)
            (x @ x).sum().backward()
            assert x.grad.device == torch.device("cuda", 1)


@pytest.mark.skipif(torch.cuda._is_compiled(), reason="a CUDA build has the GPU's kernels")
def test_silu_backward_on_fake_cuda_is_the_gpu_s_one_kernel():
    """A torch without CUDA has no CUDA kernel for SiLU's backward, and the dispatcher then takes
    its decomposition (sigmoid, 1 - sigmoid, three products and a sum: temporaries of the MLP's
    width that a GPU's fused kernel never makes, 3-4 of 2.8 GiB beside Llama-3-8B's block backward
    at 105k tokens): under fake CUDA it is the one op, and the kernel is gone after."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_scale.layout_search.fake_cuda import fake_cuda

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with fake_cuda(1), FakeTensorMode():
        x = torch.empty(4, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = torch.nn.functional.silu(x)
        with Ops() as ops:
            y.sum().backward()
    assert "silu_backward" in ops.names and "sigmoid" not in ops.names, ops.names
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::silu_backward", "CUDA")


def test_gathered_parameters_are_buffers_and_categories_agree_with_the_estimate():
    """FSDP's gathered parameters count as buffers / temporaries in the simulation, as in the
    planner's estimate (docs/planner.md, "Categories"): zero2 keeps every block gathered between
    forward and backward, so the simulated buffers hold all the parameters in bf16 and the
    activations none of them. A Llama of 20M parameters, where padding and fixed costs are small:
    the held state and the activations agree by category (the buffers: the loss's second fp32
    gradient is not estimated, scripts/simulate_published.py prints the published shapes')."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                      tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    result = simulate(config, world_size=8, rank=0, parallel=Layout("zero2", dp_shard=8, precision="bf16"),
                      seq=1024, batch=1)
    cats = result.categories()
    sim, est = cats["simulated"], cats["estimate"]
    assert sum(sim.values()) == result.peak["total"] and sum(est.values()) == result.estimated
    params = result.estimate.params // 4 * 8  # every parameter (fp32 shards over 8 ranks)
    assert result.peak["gathered"] >= 2 * params == result.estimate.comm_buffers  # every one gathered, in bf16
    assert sim["grads"] == est["grads"] == 0  # the peak at the loss's backward: none made yet
    for k in ("params", "optimizer"):
        assert abs(est[k] / sim[k] - 1) < 0.01, (k, cats)
    assert abs(est["activations"] / sim["activations"] - 1) < 0.15, cats
