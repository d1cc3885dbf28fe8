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


def test_a_stage_gathers_and_reduces_its_own_root(facts):
    """A stage's root unit holds its own stage's part of the model's root: the embeddings on the
    first stage, the final norm and the head on the last, nothing on the middle ones. Under
    pp_grad_sync=each that is what is gathered, reduced unsharded in fp32 at a microbatch's end,
    and (from the second microbatch on) held as the previous microbatch's reduce-scatter input."""
    from hf_scale.layout_search.estimate import stage_root_params

    layout = pp4(4, "each")
    roots = stage_root_params(facts, layout)
    norm = facts.root_params - facts.embedding_params - facts.head_params
    assert roots == [facts.embedding_params, 0, 0, norm + facts.head_params], roots
    first, middle, _, last = estimate_stages(facts, layout, Workload(seq=SEQ, batch=4, device="cuda"))
    unit = 2 * max(facts.block_params)  # one block gathered in bf16
    for e, root in ((first, roots[0]), (middle, 0), (last, roots[3])):
        assert e.comm_buffers == 2 * root + unit, (e.comm_buffers, root)
        assert e.grad_buffers == e.root_reduce == 4 * root
    # the top unit's backward holds the root's buffer; a middle stage's next unit the unit's own
    assert first.reduce_buffer == 0 and middle.reduce_buffer == 4 * max(facts.block_params)
    # the last stage returns the loss, not the logits: the loss's forward holds them all as
    # activations (no temporaries), beside a unit more gathered
    assert last.logits_temp == 0 < last.logits_loss and last._loss == last.logits_loss + last.prefetched > 0


def test_a_later_microbatch_runs_beside_the_sharded_gradients(facts):
    """pp_grad_sync=each, 1F1B, m=4, stage 0 (4 in flight at its first backward): the peak is the
    second microbatch's first unit backward (the simulation's, scripts/simulate_published.py's
    pp=4 rows): three microbatches in flight (each its 20 blocks' kept inputs and the stage
    output torch keeps), a gradient receive buffer per microbatch, every sharded gradient, the
    unit's own gradients unsharded in bf16 (not yet reduced), the previous root's fp32
    reduce-scatter input. The first backward holds one microbatch more, no gradient yet."""
    work = Workload(seq=SEQ, batch=4, device="cuda")
    first = estimate_stages(facts, pp4(4, "each"), work)[0]
    hidden = SEQ * facts.model.config.hidden_size * 2  # a bf16 boundary tensor
    one = 21 * hidden
    assert first.accumulating and first.sync_each
    assert (first.activations, first.first_microbatch) == (3 * one + 4 * hidden, one)
    assert first.unit_grads == 2 * max(facts.block_params) and first.unit_freed == 0
    cats = first.categories()
    assert cats["grads"] == first.grads + first.unit_grads
    assert cats["activations"] == first.activations
    # at m=8 1F1B refills to 4 in flight before each later backward: nothing first-only
    eight = estimate_stages(facts, pp4(8, "each"), Workload(seq=SEQ, batch=8, device="cuda"))[0]
    assert (eight.activations, eight.first_microbatch) == (4 * one + 8 * hidden, 0)


def test_a_last_sync_stage_is_gathered_whole_only_at_a_backward_end(facts):
    """pp_grad_sync=last: every parameter gathered and every gradient unsharded only from a
    microbatch's backward to the next forward (which reshards the units): on the last stage (one
    in flight) the peak is a backward's end with no microbatch left in flight (the activation
    receive buffers and the first block's kept input only; the simulation: 0.31 GiB), not the
    loss's forward beside the whole stage gathered."""
    work = Workload(seq=SEQ, batch=4, device="cuda")
    first, *_, last = estimate_stages(facts, pp4(4, "last"), work)
    hidden = SEQ * facts.model.config.hidden_size * 2
    for e in (first, last):
        assert not e.accumulating and e.sync_each and e.held_grads > 60 * GiB
    # beside a forward's loss only the stage root and one unit are gathered (bf16)
    assert first.regathered == first.comm_buffers - first.held_grads - 2 * (facts.embedding_params
                                                                            + max(facts.block_params))
    cats = last.categories()
    assert cats["activations"] == 4 * hidden + last.first_block_kept, cats
    assert cats["grads"] == last.held_grads + last.grads
    # stage 0 (m=4: 4 in flight, none after): the first microbatch's backward end beside the other three
    assert first.categories()["activations"] == 3 * 21 * hidden + 4 * hidden + first.first_block_kept
