"""The planner on QLoRA runs (``quantize="nf4"``): the LoRA base weights the loader would quantize
are priced in NF4 bytes (held, sharded and gathered), one weight's dequantization workspace lies
beside a block's backward, and layouts the loader refuses for NF4 are never proposed. The bytes
are checked against a tiny model's real NF4 tensors (torchao, through hf_scale.quantize.nf4),
not against figures."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
peft = pytest.importorskip("peft")

from hf_scale.errors import HfScaleConfigError, HfScalePlanError
from hf_scale.layout_search.choose import choose
from hf_scale.layout_search.cost import Device, Link, step_cost
from hf_scale.layout_search.estimate import Layout, Workload, estimate_memory
from hf_scale.layout_search.profile import model_facts
from hf_scale.layout_search.quantized import dequant_workspace, nf4_share
from hf_scale.model_plans.quantize import NF4_STRATEGIES, NF4_TP_STRATEGIES
from hf_scale.quantize.nf4 import nf4_nbytes, quantize_whole

WORK = Workload(seq=16, batch=1, device="cuda")
LINK = Link(bandwidth=1e9, latency=0.0, overlap=0.0)
GPU = Device("gpu", flops_fp32=1e12, flops_low=2e12, mem_bandwidth=1e12, intra=LINK, inter=LINK)


def lora_llama(dtype, device="meta", seed=0):
    """A Llama whose Linear weights hold whole NF4 groups of 256 scalers at some slice counts and
    not at others: hidden 128 (q, o: 128 x 128 = 1 group, scaler block 128 at 2 slices; k, v:
    64 x 128 = half a group, 128 whole, 64 at 2 slices), MLP 256 (2 groups each: 256 at 1 and 2
    slices); LoRA on every Linear, adapters in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(seed)
    with torch.device(device):
        base = LlamaForCausalLM(config).to(dtype)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))


def slice_scaler_block(weight: torch.Tensor, parts: int) -> int | None:
    """The scaler block of a base weight's dim-0 slices (the test's own rule): the largest divisor up
    to 256 of a slice's 64-element block count; None where the slices are not whole blocks."""
    if weight.shape[0] % parts or (weight.numel() // parts) % 64:
        return None
    blocks = weight.numel() // parts // 64
    return max(n for n in range(1, 257) if blocks % n == 0)


def real_bytes(model, parts: int, gather_bytes: int | None = None) -> tuple[int, dict[str, tuple[int, int]]]:
    """Bytes of ``model``'s parameters with its LoRA base weights really quantized (those whose
    ``parts`` slices hold whole groups), and per NF4 weight (its NF4 bytes, its bytes gathered
    without NF4: in ``gather_bytes`` per element, else as stored)."""
    total, nf4 = 0, {}
    for name, p in model.named_parameters():
        if "base_layer.weight" in name and slice_scaler_block(p, parts):
            q = quantize_whole(p.detach(), slice_scaler_block(p, parts))
            nf4[name] = (nf4_nbytes(q), p.numel() * (gather_bytes or p.element_size()))
            total += nf4[name][0]
        else:
            total += p.numel() * p.element_size()
    return total, nf4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2])
def test_held_bytes_are_the_real_nf4_tensors(dtype, parts):
    """Per rank, the parameters' bytes are those of the real model quantized as the loader
    quantizes it (NF4 inner tensors, the rest as stored), over the shards."""
    model = lora_llama(dtype, device="cpu")
    facts = model_facts(model, quantize="nf4")
    total, nf4 = real_bytes(model, parts)
    assert len(nf4) == sum(1 for n, _ in model.named_parameters() if "base_layer.weight" in n)  # all, some below 256
    mem = estimate_memory(facts, Layout("fsdp", 1, parts), WORK)
    assert mem.params == pytest.approx(total / parts, abs=parts)
    assert mem.nf4_params == sum(b for b, _ in nf4.values()) // parts
    plain = estimate_memory(model_facts(model), Layout("fsdp", 1, parts), WORK)
    assert plain.params - mem.params == pytest.approx(sum(g - b for b, g in nf4.values()) / parts, abs=parts)


@pytest.mark.parametrize("precision, gathered", [(None, None), ("bf16", 2)])
def test_gathered_unit_holds_nf4_bytes(precision, gathered):
    """FSDP's gathered root and largest unit hold their NF4 weights in NF4 bytes (never cast to
    the compute dtype): the buffers shrink by exactly what the real NF4 tensors save; so does
    zero2's every-block gather."""
    model = lora_llama(torch.float32, device="cpu")
    q, plain = model_facts(model, quantize="nf4"), model_facts(model)
    _, nf4 = real_bytes(model, 2, gathered)
    block = {n: v for n, v in nf4.items() if ".layers.0." in n}  # the blocks are equal: the first is the largest
    for strategy, saved in (("fsdp", block), ("zero2", nf4)):
        layout = Layout(strategy, 1, 2, precision=precision)
        drop = estimate_memory(plain, layout, WORK).comm_buffers - estimate_memory(q, layout, WORK).comm_buffers
        assert drop == pytest.approx(sum(g - b for b, g in saved.values()), abs=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_workspace_is_torchao_linears_peak(dtype):
    """The workspace priced for one NF4 matmul is what torchao's forward really holds at once
    dequantizing the weight (torch's MemTracker's peak of the bytes the forward makes), within 5%."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    weight = torch.randn(256, 512, dtype=dtype)
    q = quantize_whole(weight)
    x = torch.randn(2, 512, dtype=dtype)
    tracker = MemTracker()
    with tracker:
        torch.nn.functional.linear(x, q)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    share = nf4_share(model_facts(lora_llama(dtype), quantize="nf4"), 1)
    one = dequant_workspace(share, torch.empty((), dtype=dtype).element_size()) / share.largest
    assert peak / weight.numel() == pytest.approx(one, rel=0.05)


def test_workspace_joins_a_blocks_backward_not_the_logits():
    """The workspace lies beside a block's backward (the step's end, a recomputation), never
    beside the logits at backward's start, when no block runs; a run without NF4 has none."""
    from hf_scale.layout_search.estimate import MemoryEstimate

    def total(**parts):
        zero = {"params": 0, "grads": 0, "optimizer": 0, "activations": 10, "recompute": 0, "logits_loss": 0,
                "comm_buffers": 0, "compute_copies": 0, "overhead": 0}
        return MemoryEstimate(**{**zero, **parts}).device_total

    assert total(logits_loss=100, dequant=50) == 110  # under the logits' moment
    assert total(logits_loss=100, dequant=50, grads=80) == 130  # the late moment: gradients + workspace
    assert total(logits_loss=100, recompute=70, dequant=50) == 130  # beside a recomputation
    q = model_facts(lora_llama(torch.bfloat16), quantize="nf4")
    assert estimate_memory(q, Layout("fsdp", 1, 2), WORK).dequant > 0
    assert estimate_memory(model_facts(lora_llama(torch.bfloat16)), Layout("fsdp", 1, 2), WORK).dequant == 0


def test_refused_layouts_are_never_proposed():
    """With quantize set the chooser ranks fsdp / zero2 / hsdp / ddp without ep, and tp or pp only
    under fsdp / zero2, and says why the others were left out (the loader's own message)."""
    q = model_facts(lora_llama(torch.bfloat16), quantize="nf4")
    _, ranked = choose(q, WORK, 4, 80 * 2**30, GPU, strategies=("fsdp", "zero2", "zero1", "ddp", "hsdp"))
    fits = [c for c in ranked if c.fits]
    assert fits and all(c.layout.strategy in NF4_STRATEGIES and c.layout.ep == 1 for c in fits)
    assert all(c.layout.strategy in NF4_TP_STRATEGIES for c in fits if c.layout.tp > 1 or c.layout.pp > 1)
    assert any(c.layout.tp > 1 for c in fits)  # tensor parallel is proposed now
    refused = [c for c in ranked if not c.fits and "quantize='nf4'" in (c.reason or "")]
    assert {c.layout.strategy for c in refused} >= {"zero1"}
    with pytest.raises(HfScaleConfigError, match="tp=2 and strategy='hsdp'"):
        estimate_memory(q, Layout("hsdp", 2, 2, tp=2), WORK)
    with pytest.raises(HfScaleConfigError, match="pp=2 and strategy='ddp'"):
        estimate_memory(q, Layout("ddp", 2, 1, pp=2), WORK)


def test_tp_holds_one_tp_slice_of_each_nf4_weight():
    """Under tp the NF4 weights a rank holds are its tp slices (colwise rows, rowwise columns), each
    at the scaler block of the slice a rank holds: at tp=2 the MLP's 256 x 128 (256 blocks: 256),
    q / o 128 x 64 (128), k / v 32 x 128 (64); at tp=2 x 2 dim-0 parts each half that."""
    q = model_facts(lora_llama(torch.bfloat16), quantize="nf4")
    two = nf4_share(q, 1, tp=2)
    held = {"q": (8192, 128), "k": (4096, 64), "v": (4096, 64), "o": (8192, 128), "mlp": (3 * 16384, 256)}
    assert two.blocks == [sum(n for n, _ in held.values())] * 2 and two.largest == 16384
    assert two.nf4_bytes == int(2 * sum(n * (0.5 + 1 / 64 + 2 / (64 * b)) for n, b in held.values()))
    four = nf4_share(q, 2, tp=2)  # the elements a tp rank holds (FSDP divides them), at halved scaler blocks
    assert four.params == two.params
    assert four.nf4_bytes == int(2 * sum(n * (0.5 + 1 / 64 + 2 / (32 * b)) for n, b in held.values()))
    held = estimate_memory(q, Layout("fsdp", 1, 1, tp=2), WORK).nf4_params
    assert held == two.nf4_bytes



def test_pp_holds_its_stages_nf4_weights():
    """Under pp a rank holds its stages' NF4 weights: the estimate's NF4 bytes are the busiest
    pp rank's share of the pp=1 run's (one of the 2 blocks, and half-ish of the rest)."""
    from hf_scale.layout_search.estimate import pp_share

    q = model_facts(lora_llama(torch.bfloat16), quantize="nf4")
    whole = estimate_memory(q, Layout("fsdp", 1, 1), WORK).nf4_params
    staged = Layout("fsdp", 1, 1, pp=2, micro_batch=2)
    held = estimate_memory(q, staged, WORK).nf4_params
    assert 0.49 < pp_share(q, staged) < 0.51 and held == int(whole * pp_share(q, staged))


def test_step_gathers_nf4_bytes_and_pays_the_dequantization():
    """FSDP gathers fewer bytes than the same run with its base in bf16; the dequantization adds
    time per matmul pass (a recomputing forward is a third pass)."""
    model = lora_llama(torch.bfloat16)
    q, plain = model_facts(model, quantize="nf4"), model_facts(model)
    layout = Layout("fsdp", 1, 2, precision="bf16")
    cq, cp = step_cost(q, layout, WORK, GPU), step_cost(plain, layout, WORK, GPU)
    assert cq.comm_dp < cp.comm_dp and cp.dequant == 0 < cq.dequant
    full = step_cost(q, Layout("fsdp", 1, 2, precision="bf16", ac="full"), WORK, GPU)
    assert full.dequant == pytest.approx(1.5 * cq.dequant)
    assert cq.total == pytest.approx(sum(v for k, v in cq.as_dict().items()
                                         if k not in ("tokens_per_step", "total", "tokens_per_second")))


def test_quantize_needs_adapters():
    from transformers import LlamaConfig

    with pytest.raises(HfScalePlanError, match="no LoRA adapters"):
        model_facts(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                num_attention_heads=4, vocab_size=128), quantize="nf4")


def test_plan_of_a_qlora_recipe_shows_the_nf4_base(tmp_path, capsys):
    """``hf-scale plan`` of the QLoRA quickstart (on a tiny Llama whose MLP weights hold whole NF4
    groups of 256 scalers at 2 slices and whose attention weights take smaller ones) says which base weights are NF4 and
    the recipe layout's estimate, instead of a full fine-tune's training state; the LoRA
    quickstart has no NF4 line."""
    from pathlib import Path

    from hf_scale.cli import main
    from tests.tiny_models import CAUSAL, save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL, hidden_size=128, intermediate_size=256)
    configs = Path(__file__).resolve().parents[2] / "configs"
    assert main(["plan", str(configs / "quickstart-qlora.yaml"), "--model.name_or_path", folder]) == 0
    out = capsys.readouterr().out
    layers = 2  # every block: gate, up, down at scaler block 256; q, k, v, o at smaller ones (less than a group)
    assert f"{7 * layers} of {7 * layers} LoRA base weights in NF4 over 2 slice(s)" in out
    assert "stay in float32" not in out and "NF4 dequantization" in out and "(NF4 base" in out
    assert "AdamW state ~" not in out  # the full fine-tune's line
    # --gpus: the QLoRA run ranked (not a full fine-tune of the base), NF4's refusals among the rejected
    assert main(["plan", str(configs / "quickstart-qlora.yaml"), "--model.name_or_path", folder, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "M trainable)" in out and "/ NF4 dequantization = peak" in out and "x quantize='nf4' with" in out
    assert main(["plan", str(configs / "quickstart-lora.yaml"), "--model.name_or_path", folder]) == 0
    out = capsys.readouterr().out
    assert "LoRA (peft.r=" in out and "NF4" not in out and "per rank, estimated for fsdp 1x2x1x1" in out


def test_plan_simulate_of_a_qlora_recipe_runs_its_nf4_base(tmp_path, capsys):
    """``plan --simulate`` of the QLoRA quickstart (a tiny Llama whose MLP weights hold whole NF4
    groups at 2 slices) simulates the QLoRA run: the recipe's layout with its NF4 base, and with
    ``--gpus`` the recommended layout of the QLoRA candidates; ``--model.quantize null`` the same
    LoRA run on a base in model.dtype, whose parameters take more."""
    import re
    from pathlib import Path

    from hf_scale.cli import main
    from tests.tiny_models import CAUSAL, save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "m", "llama", CAUSAL, hidden_size=128, intermediate_size=256)
    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart-qlora.yaml")
    common = [recipe, "--model.name_or_path", folder, "--simulate", "--seq", "16", "--simulate-ranks", "0"]

    def simulated_params(out: str) -> float:
        line = next(line for line in out.splitlines() if "simulated peak" in line)
        assert "optimizer" in line and "estimate / simulated" in out  # the LoRA run: adapters' AdamW state
        return float(re.search(r"params ([0-9.]+)", line).group(1))

    assert main(["plan", *common]) == 0
    out = capsys.readouterr().out
    assert "14 of 14 LoRA base weights in NF4 over 2 slice(s)" in out  # the run's report, not a full fine-tune's
    assert "AdamW state ~" not in out
    nf4 = simulated_params(out)  # held in NF4: below the null run's (not the log's "once" line: order-dependent)
    assert main(["plan", *common, "--model.quantize", "null"]) == 0
    assert simulated_params(capsys.readouterr().out) > 1.2 * nf4
    assert main(["plan", *common, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "M trainable)" in out and "/ NF4 dequantization = peak" in out and "x quantize='nf4' with" in out
    assert "rank 0 of 2 on cuda:0" in out and "placement: every tensor on its rank's device" in out
