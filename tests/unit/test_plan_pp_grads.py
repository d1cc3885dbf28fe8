"""The planner prices a pipeline stage's gradient reduction both ways (``pp_grad_sync``) and
chooses by fit: Llama-3-70B at pp=4 x fsdp 16 on 64 x 80 GB (1F1B, bf16, full checkpointing, 4
and 8 microbatches of 4096 tokens), the layout of issue 42. Under torch's reduction after the
last microbatch every stage holds its gradients unsharded in fp32 (and its parameters gathered)
through the schedule: over 80 GB. Reduced after each microbatch they stay sharded: under 75 GiB,
for more reduce-scatters. The simulation of the same layouts (the real engine on fake CUDA) is
``scripts/simulate_published.py``'s pp=4 rows; :func:`test_simulation_holds_what_the_estimate_says`
checks the estimate against the figures it printed."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from hf_scale.cli import main
from hf_scale.layout_search import H100, Layout, Workload, choose, model_facts, parse_memory
from hf_scale.layout_search.choose import fitting_grad_sync
from hf_scale.layout_search.cost import step_cost
from hf_scale.layout_search.estimate import GiB, estimate_stages
from tests.unit.test_plan_cli import LLAMA3

SEQ = 4096
BUDGET = parse_memory("80GB")


@pytest.fixture(scope="module")
def facts():
    return model_facts(LlamaConfig(**LLAMA3["70b"]))


def pp4(m: int, sync: str) -> Layout:
    return Layout("fsdp", dp_shard=16, pp=4, precision="bf16", ac="full", micro_batch=m, pp_microbatches=m,
                  pp_grad_sync=sync)


@pytest.mark.parametrize("m", [4, 8])
def test_70b_pp4_fits_80gb_only_with_a_reduce_scatter_per_microbatch(facts, m):
    work = Workload(seq=SEQ, batch=m, device="cuda")
    last = [e.device_total / GiB for e in estimate_stages(facts, pp4(m, "last"), work)]
    each = [e.device_total / GiB for e in estimate_stages(facts, pp4(m, "each"), work)]
    assert min(last) > 100, last  # the unsharded fp32 gradients of a quarter of 70B: ~66 GiB alone
    assert max(each) <= 75, each
    assert fitting_grad_sync(facts, pp4(m, "last"), work, BUDGET).pp_grad_sync == "each"
    # the price: the stage's reduce-scatter (fp32) and all-gathers (bf16) m times a step, not once
    slow, fast = step_cost(facts, pp4(m, "each"), work, H100, 8), step_cost(facts, pp4(m, "last"), work, H100, 8)
    assert slow.comm_dp >= 0.9 * m * fast.comm_dp and slow.total > fast.total, (slow, fast)


def test_where_torchs_reduction_fits_it_is_kept(facts):
    """With memory to spare (here 200 GB a rank) the fewer collectives win."""
    work = Workload(seq=SEQ, batch=4, device="cuda")
    assert fitting_grad_sync(facts, pp4(4, "each"), work, parse_memory("200GB")).pp_grad_sync == "last"
    # and a schedule that splits its backward (zbv) keeps torch's whatever the memory
    zbv = Layout("fsdp", dp_shard=16, pp=4, precision="bf16", ac="full", micro_batch=8, pp_schedule="zbv")
    assert fitting_grad_sync(facts, zbv, work, BUDGET).pp_grad_sync == "last"


def test_the_chooser_takes_each_at_80gb_and_last_at_200gb(facts):
    work = Workload(seq=SEQ, batch=4, device="cuda")
    space = {"strategies": ("fsdp",), "acs": ("full",), "precisions": ("bf16",), "offloads": (False,), "chunks": (None,),
                 "tps": (1,), "pps": (4,), "micro_batches": (4,), "pp_schedules": ("1f1b",), "pp_microbatches": (4,)}
    best, ranked = choose(facts, work, 64, BUDGET, H100, 8, **space)
    assert {c.layout.pp_grad_sync for c in ranked} == {"last", "each"}
    assert best is not None and best.layout.pp_grad_sync == "each", best
    roomy, _ = choose(facts, work, 64, parse_memory("200GB"), H100, 8, **space)
    assert roomy.layout.pp_grad_sync == "last"


def simulated_peaks(m: int) -> tuple[float, float]:
    """MemTracker's peak (GiB) on the first and the last stage's rank (0 and 63) under
    pp_grad_sync=each with ``m`` microbatches, read from the rows scripts/simulate_published.py
    --parts pp wrote into docs/benchmarks.md (section simulate-pp): the script's output, not a copy."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "benchmarks.md").read_text()
    section = doc.split("<!-- bench:simulate-pp:start -->")[1].split("<!-- bench:simulate-pp:end -->")[0]
    peaks = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        # the peaks table's rows (the by-category table below it names the rank in its second cell)
        if len(cells) > 4 and "pp_grad_sync=each" in cells[0] and f"({m} x 4096" in cells[0] and cells[2].endswith(" of 64"):
            peaks[cells[2]] = float(cells[4])
    assert set(peaks) == {"0 of 64", "63 of 64"}, f"simulate-pp rows for m={m}: {sorted(peaks)}"
    return peaks["0 of 64"], peaks["63 of 64"]


@pytest.mark.parametrize("m", [4, 8])
def test_simulation_holds_what_the_estimate_says(facts, m):
    """The estimate (less its process overhead, which MemTracker does not see) within +-10% of
    the simulated peak of the same layout, on the first and the last stage."""
    work = Workload(seq=SEQ, batch=m, device="cuda")
    stages = estimate_stages(facts, pp4(m, "each"), work)
    for estimate, simulated in zip((stages[0], stages[-1]), simulated_peaks(m)):
        ratio = (estimate.device_total - estimate.overhead) / GiB / simulated
        assert 0.9 <= ratio <= 1.1, (m, ratio)


def test_plan_simulate_says_plainly_when_a_layout_does_not_fit(tmp_path, capsys, monkeypatch):
    """``hf-scale plan --simulate`` ends with a verdict line: the worst rank against the memory
    per rank, and what to try when it does not fit (tiny model, tiny budget)."""
    from tests.tiny_models import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = 4
    config.save_pretrained(tmp_path)
    args = ["plan", str(tmp_path / "config.json"), "--world-size", "4", "--pp", "2", "--simulate", "--seq", "32",
            "--batch", "2"]
    assert main([*args, "--gpu-memory", "1MiB", "--pp-grad-sync", "last"]) == 0
    out = capsys.readouterr().out
    assert "verdict: does not fit: " in out and "GiB on rank " in out and "try pp_grad_sync=each" in out, out
    assert main([*args, "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits: at most " in out and "<= 74.5 GiB" in out, out
