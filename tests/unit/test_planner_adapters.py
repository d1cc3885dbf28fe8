"""The planner on adapter runs: a peft ``PeftModel`` (LoRA) or a model with frozen parameters.
Frozen weights are counted as weights only (no gradient, no AdamW state), in their stored dtype;
backward skips their weight gradients; ``strategy: auto`` plans such a model."""

import pytest
import torch

from hf_scale.layout_search.cost import Device, Link, flops_per_token, step_cost
from hf_scale.layout_search.estimate import Layout, Workload, estimate_memory
from hf_scale.layout_search.profile import model_facts
from tests.tiny_models import CAUSAL, tiny_config, tiny_model

peft = pytest.importorskip("peft")

WORK = Workload(seq=16, batch=1, device="cuda")
LINK = Link(bandwidth=1e9, latency=1e-5, overlap=0.0)
GPU = Device("gpu", flops_fp32=1e12, flops_low=2e12, mem_bandwidth=1e12, intra=LINK, inter=LINK)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def lora_model(device: str = "meta", dtype=torch.bfloat16):
    """The tiny Llama (tied head) in ``dtype`` with LoRA on q and v (adapters in fp32: peft's default)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        base = AutoModelForCausalLM.from_config(tiny_config("llama")).to(dtype)
    return peft.get_peft_model(base, peft.LoraConfig(**LORA))


@pytest.fixture(scope="module")
def adapter():
    return model_facts(lora_model())


@pytest.fixture(scope="module")
def full():
    """The same model (adapters included) with every parameter trained."""
    model = lora_model()
    for p in model.parameters():
        p.requires_grad_(True)
    return model_facts(model)


def test_peft_model_is_read_as_the_model_it_wraps(adapter):
    model = lora_model()
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert type(adapter.model).__name__ == "LlamaForCausalLM"  # what hf_scale parallelizes
    assert adapter.trainable_params == lora and adapter.frozen_params == adapter.params - lora
    assert adapter.frozen.element_bytes == 2  # the bf16 base, as stored
    # every block holds one q and one v adapter; the root (embedding = tied head, final norm) is frozen
    per_block = lora // adapter.layers
    assert [b - f for b, f in zip(adapter.block_params, adapter.frozen.blocks)] == [per_block] * adapter.layers
    assert adapter.frozen.root == adapter.root_params and adapter.frozen.head and adapter.tied_trainable == 0
    assert adapter.trainable_tensors == 4 * adapter.layers  # lora_A and lora_B of q and v per block


@pytest.mark.parametrize("strategy, replicate, shard", [("fsdp", 1, 2), ("ddp", 2, 1), ("zero1", 2, 1)])
def test_adapter_estimate_drops_the_frozen_weights_state(adapter, full, strategy, replicate, shard):
    """Against the full fine-tune of the same model: the frozen weights keep 2 bytes (bf16) instead
    of 4 (the fp32 master) and lose their 4 bytes of gradient and 8 of AdamW moments."""
    layout = Layout(strategy, replicate, shard)
    lora, whole = estimate_memory(adapter, layout, WORK), estimate_memory(full, layout, WORK)
    frozen, train = adapter.frozen_params, adapter.trainable_params
    n = shard  # fsdp shards all three; ddp replicates them; zero1 shards the optimizer state only
    opt_n = replicate if strategy == "zero1" else n
    assert (lora.params, lora.grads, lora.optimizer) == ((4 * train + 2 * frozen) // n, 4 * train // n,
                                                         8 * train // opt_n)
    assert whole.params - lora.params == pytest.approx(2 * frozen / n, abs=1)
    assert whole.grads - lora.grads == pytest.approx(4 * frozen / n, abs=1)
    assert whole.optimizer - lora.optimizer == pytest.approx(8 * frozen / opt_n, abs=1)
    if strategy != "fsdp":  # DDP's buckets hold the trainable gradients only
        assert lora.comm_buffers == 4 * train
    assert lora.grad_buffers == 0  # the root (tied head included) is frozen: no unsharded or second gradient
    assert lora.device_total < whole.device_total


def test_a_frozen_parameter_has_no_gradient_or_optimizer_bytes():
    """One frozen fp32 weight in an otherwise trained model: its 4 bytes stay, its gradient (4)
    and AdamW state (8) go; frozen, the tied embedding makes no second gradient at backward's end."""
    model = tiny_model("llama", CAUSAL)
    trained = model_facts(model)
    weight = model.model.layers[0].mlp.down_proj.weight
    weight.requires_grad_(False)
    one = model_facts(model)
    assert next(one.model.parameters()).is_meta and weight.device.type == "cpu"  # copied to meta, untouched
    assert one.frozen_params == weight.numel() and one.frozen.blocks == [weight.numel(), 0]
    for layout in (Layout("ddp", 2, 1), Layout("fsdp", 1, 1)):
        a, b = estimate_memory(trained, layout, WORK), estimate_memory(one, layout, WORK)
        assert a.params == b.params  # fp32 as stored: the same 4 bytes
        assert a.grads - b.grads == 4 * weight.numel() and a.optimizer - b.optimizer == 8 * weight.numel()
    model.get_input_embeddings().weight.requires_grad_(False)
    tied = model_facts(model)
    a, b = estimate_memory(trained, Layout(), WORK), estimate_memory(tied, Layout(), WORK)
    assert a.grad_buffers - b.grad_buffers == 4 * trained.tied_params


def test_real_peft_model_is_planned_on_meta_untouched(adapter):
    model = lora_model("cpu")
    facts = model_facts(model)
    assert (facts.params, facts.frozen, facts.block_params) == (adapter.params, adapter.frozen, adapter.block_params)
    assert next(model.parameters()).device.type == "cpu" and next(facts.model.parameters()).is_meta
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in facts.model.parameters()]


def test_adapter_step_skips_frozen_weight_gradients(adapter, full):
    attention = 12 * adapter.layers * adapter.hidden * 16
    trainable = adapter.trainable_params  # every adapter is a matmul weight; the tied head is frozen
    assert adapter.trainable_matmul_params == trainable
    assert flops_per_token(adapter, 16) == 4 * adapter.matmul_params + 2 * trainable + attention
    assert flops_per_token(full, 16) == 6 * full.matmul_params + attention
    # ddp all-reduces fp32 gradients: the trainable ones only; AdamW steps them only
    layout = Layout("ddp", 2, 1)
    lora, whole = step_cost(adapter, layout, WORK, GPU), step_cost(full, layout, WORK, GPU)
    ring = 2 * (2 - 1) / 2 * 4 / LINK.bandwidth
    assert lora.comm_dp == pytest.approx(trainable * ring + LINK.latency)
    assert whole.comm_dp == pytest.approx(full.params * ring + LINK.latency)
    assert lora.optimizer == pytest.approx(28 * trainable / GPU.mem_bandwidth)
    # fsdp still all-gathers the frozen weights (twice, as stored: bf16) and reduce-scatters the trainable
    sharded = step_cost(adapter, Layout("fsdp", 1, 2), WORK, GPU)
    moved = 2 * (2 * (adapter.params - trainable) + 4 * trainable) / 2 + 4 * trainable / 2
    units = adapter.layers + 1
    assert sharded.comm_dp == pytest.approx(moved / LINK.bandwidth + 3 * units * LINK.latency)


def test_auto_plans_a_peft_model(tmp_path, monkeypatch):
    """``auto_config`` and, in one process, ``resolve_auto`` take a PeftModel on meta."""
    from hf_scale.config import ParallelConfig
    from hf_scale.layout_search import auto as auto_module
    from tests.harness import stand_in_calibration

    model = lora_model()
    config, best = auto_module.auto_config(model, world_size=2, budget=2**30, device_type="cuda", seq=16)
    assert isinstance(config, ParallelConfig) and best.fits
    assert best.memory.grads <= 4 * model_facts(model).trainable_params
    monkeypatch.setenv("XDG_CACHE_HOME", stand_in_calibration(tmp_path)["XDG_CACHE_HOME"])
    resolved = auto_module.resolve_auto(model, "auto", seq=16)
    assert isinstance(resolved, ParallelConfig) and not resolved.auto


def test_candidate_table_names_the_trainable_parameters(adapter):
    from hf_scale.layout_search.ranking import format_candidates, plan_candidates

    facts, best, ranked, budget, work = plan_candidates(adapter, 2, "1GiB", 16, 1)
    header = format_candidates(facts, best, ranked, budget, work).splitlines()[0]
    assert f"({adapter.trainable_params / 1e6:,.2f}M trainable), 2 blocks" in header
