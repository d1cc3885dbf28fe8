"""Pipeline parallel against one process of plain transformers: pp=2 under every schedule
(gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv) for tiny Llama (tied embeddings), GPT-2 (tied)
and GPT-NeoX (untied), OPT and Qwen2 under 1f1b, activation checkpointing per stage, bf16, set
microbatches and split points (2 ranks); pp=2 x fsdp2 and pp=2 x tp2 (4 ranks). Over 3 AdamW
steps on padded batches: the same losses, the same evaluation loss, and each rank's own
parameters (names unchanged) updated as the same names of the one-process model.

Tolerances are test_parity.py's: fp32 losses within 1e-5 relative; parameters by their update
(2e-4 of the reference update's norm, i.e. ~1e-5 of a weight's norm after 3 steps; 5e-4 with
tp, see TP_UPDATE_RTOL; Adam's bound for elements with a zero gradient); bf16 2e-2 / 0.5, and
bf16's updates must differ from fp32's.
Bad input fails with our error on every rank before any collective.

Ranks are spawned once per world size; each test reads one part of the result.
"""

from __future__ import annotations

import pytest

from tests.distributed import pp_checks
from tests.distributed.pp_checks import reference_run
from tests.distributed.test_parity import (
    FP32_RTOL,
    LOW_LOSS_RTOL,
    LOW_UPDATE_RTOL,
    NOISE_GRAD,
    UPDATE_RTOL,
    update_errors,
)
from tests.harness import run_ranks

# tensor parallel sums GPT-2's rowwise MLP output in another order; on these padded batches
# Adam turns that into update errors of up to 3.35e-4 (transformer.h.0.mlp.c_proj.weight with
# tp=2 alone, no pp; 2.78e-4 under pp=2 x tp=2), over UPDATE_RTOL. A step missed or wrongly
# weighted is 1 or ~1e-2 (see the data check at the end), so 5e-4 still tells them apart.
TP_UPDATE_RTOL = 5e-4
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
ALL_SCHEDULE_ARCHS = ("llama", "gpt2", "gpt_neox")


def _case(arch: str, name: str, **config) -> dict:
    return {"arch": arch, "config": {"pp": 2, **config}, "id": f"{arch}-{name}"}


# zbv last: a case that crashes inside a schedule can leave messages that derail the next ones
WORLD2 = [_case(a, s, pp_schedule=s) for s in SCHEDULES for a in ALL_SCHEDULE_ARCHS if s != "zbv"] + [
    _case("opt", "1f1b", pp_schedule="1f1b"),
    _case("qwen2", "1f1b", pp_schedule="1f1b"),
    _case("llama", "1f1b-mb8", pp_schedule="1f1b", pp_microbatches=8),  # one row per microbatch
    _case("llama", "gpipe-split1", pp_schedule="gpipe", pp_split_points=[1]),  # 1 + 3 blocks
    _case("gpt2", "interleaved-split", pp_schedule="interleaved_1f1b", pp_split_points=[1, 2, 3], pp_microbatches=8),
    _case("llama", "1f1b-full_ac", pp_schedule="1f1b", activation_checkpointing="full"),
    _case("llama", "interleaved-full_ac", pp_schedule="interleaved_1f1b", activation_checkpointing="full"),
    _case("gpt2", "1f1b-selective_ac", pp_schedule="1f1b", activation_checkpointing="selective"),
    _case("llama", "1f1b-bf16", pp_schedule="1f1b", mixed_precision="bf16"),
    _case("gpt2", "interleaved-bf16", pp_schedule="interleaved_1f1b", mixed_precision="bf16"),
    _case("llama", "1f1b-ddp", pp_schedule="1f1b", strategy="ddp"),  # one data-parallel rank: allowed
    {**_case("llama", "1f1b-accum2", pp_schedule="1f1b"), "accum": 2},  # tied sum once per train_step
] + [_case(a, "zbv", pp_schedule="zbv") for a in ALL_SCHEDULE_ARCHS] + [
    {**_case("llama", "zbv-accum2", pp_schedule="zbv"), "accum": 2},  # both tied ends on rank 0
]
WORLD4 = [
    _case("llama", "1f1b-fsdp2", pp_schedule="1f1b", strategy="fsdp"),
    _case("gpt2", "1f1b-fsdp2", pp_schedule="1f1b", strategy="fsdp"),
    _case("llama", "interleaved-fsdp2", pp_schedule="interleaved_1f1b", strategy="fsdp"),
    _case("llama", "1f1b-zero2", pp_schedule="1f1b", strategy="zero2"),
    _case("llama", "1f1b-tp2", pp_schedule="1f1b", tp=2),
    _case("gpt2", "1f1b-tp2", pp_schedule="1f1b", tp=2),
    _case("llama", "1f1b-fsdp2-full_ac-bf16", pp_schedule="1f1b", activation_checkpointing="full", mixed_precision="bf16"),
    _case("llama", "zbv-tp2", pp_schedule="zbv", tp=2),
    # per-microbatch gradient reduce-scatter (pp_grad_sync): 4 microbatches of one row per rank,
    # the gradient bytes held after each microbatch's backward measured; "last" beside it
    *[{**_case("llama", f"{s}-fsdp2-{m}", pp_schedule=s, strategy="fsdp", pp_microbatches=4, pp_grad_sync=m),
       "measure_grads": True} for s, m in (("1f1b", "each"), ("gpipe", "each"), ("1f1b", "last"))],
]

# name -> (function of pp_checks, args, kwargs): each returns this rank's error message
PP2 = {"pp": 2}
BAD2 = {
    "too_many_stages": ("bad_input", ("llama", "causal", {"pp": 2, "pp_schedule": "interleaved_1f1b"}), {"layers": 2}),
    "microbatches": ("bad_input", ("llama", "causal", {"pp": 2, "pp_microbatches": 3}), {"step": {}}),
    "split_out_of_range": ("bad_input", ("llama", "causal", {"pp": 2, "pp_split_points": [4]}), {}),
    "split_zero": ("bad_input", ("llama", "causal", {"pp": 2, "pp_split_points": [0]}), {}),
    "split_not_increasing": ("bad_input", ("llama", "causal", {"pp": 2, "pp_schedule": "interleaved_1f1b",
                                                               "pp_split_points": [2, 1, 3]}), {}),
    "split_count": ("bad_input", ("llama", "causal", {"pp": 2, "pp_split_points": [1, 2]}), {}),
    "unknown_schedule": ("bad_input", ("llama", "causal", {"pp": 2, "pp_schedule": "zb1p"}), {}),
    "encoder": ("bad_input", ("bert", "seqcls", PP2), {}),
    "seq2seq": ("bad_input", ("t5", "seq2seq", PP2), {}),
    "classifier": ("bad_input", ("llama", "seqcls", PP2), {}),
    "no_labels": ("bad_input", ("llama", "causal", PP2), {"step": {"drop": ["labels"]}}),
    "batch_by_global_rank": ("bad_input", ("llama", "causal", PP2), {"step": {"by_rank": True}}),
    "forward": ("forward_refused", ("llama", PP2), {}),
    "position_ids": ("position_ids_check", ("llama", PP2), {}),
}
BAD4 = {
    "ddp_dp2": ("bad_input", ("llama", "causal", {"pp": 2, "strategy": "ddp"}), {}),
    "zero1_dp2": ("bad_input", ("llama", "causal", {"pp": 2, "strategy": "zero1"}), {}),
    "microbatches_per_rank": ("bad_input", ("llama", "causal", {"pp": 2, "strategy": "fsdp", "pp_microbatches": 8}),
                              {"step": {"batch": 4}}),
}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(pp_checks.world_checks, 2, WORLD2, BAD2, timeout=900)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(pp_checks.world_checks, 4, WORLD4, BAD4, timeout=900)


_REFERENCES: dict = {}


def _reference(arch: str) -> dict:
    if arch not in _REFERENCES:
        _REFERENCES[arch] = reference_run(arch)
    return _REFERENCES[arch]


def check_pp_parity(case: dict, results: list[dict]) -> None:
    """``results``: this case's result on every rank (rank order)."""
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
    ref = _reference(case["arch"])
    low = case["config"].get("mixed_precision") is not None
    loss_tol, update_tol = (LOW_LOSS_RTOL, LOW_UPDATE_RTOL) if low else (FP32_RTOL, UPDATE_RTOL)
    if not low and case["config"].get("tp", 1) > 1:
        update_tol = TP_UPDATE_RTOL
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], ref["losses"], strict=True)):
            assert abs(got - want) <= loss_tol * abs(want), f"rank {rank} step {step}: loss {got} vs one process {want}"
        got, want = result["eval_loss"], ref["eval_loss"]
        assert abs(got - want) <= loss_tol * abs(want), f"rank {rank}: eval loss {got} vs one process {want}"
    by_slice: dict[int, list] = {}
    for result in results:  # train_step returns the same value on every rank of a pipeline
        by_slice.setdefault(result["dp_rank"], []).append(result["raw_losses"])
    for dp_rank, raw in by_slice.items():
        assert all(r == raw[0] for r in raw), f"data-parallel slice {dp_rank}: ranks returned {raw}"
    worst = check_stage_parameters(ref, results, update_tol)
    if low:  # the tiny models' losses hardly move in bf16 (near-uniform logits); updates do
        assert worst > UPDATE_RTOL, f"mixed precision had no effect: updates within {worst:.1e} of fp32's"


def check_stage_parameters(ref: dict, results: list[dict], update_tol: float) -> float:
    """Each rank holds exactly its stages' blocks, names unchanged; together the ranks hold
    every parameter; each one's update is the one-process update of the same name. Returns
    the largest update error."""
    noise = NOISE_GRAD * max(ref["norms"])
    unique = set(ref["params"]) - set(ref["tie_targets"])  # a tied head is the embedding
    held: set[str] = set()
    worst = 0.0
    for rank, result in enumerate(results):
        params = result["params"]
        unknown = set(params) - set(ref["params"])
        assert not unknown, f"rank {rank} holds parameters the model does not name: {sorted(unknown)[:5]}"
        mine = {b for s in result["stages"] for b in result["stage_blocks"][s]}
        assert result["held_blocks"] == sorted(mine), f"rank {rank} holds blocks {result['held_blocks']}, its stages {mine}"
        for name in params:
            block = _block_index(name)
            assert block is None or block in mine, f"rank {rank} holds {name}, not of its stages' blocks {sorted(mine)}"
        sub = {key: {n: ref[key][n] for n in params} for key in ("params", "initial", "grad_max")}
        for name, rel in update_errors(sub, params, noise).items():
            assert rel <= update_tol, f"rank {rank} {name}: its update differs from one process's by {rel:.2e} of its norm"
            worst = max(worst, rel)
        held |= set(params)
    assert unique <= held, f"no rank holds {sorted(unique - held)}"
    return worst


def _block_index(name: str) -> int | None:
    """The block index in a parameter name (``model.layers.3.mlp...`` -> 3), else None."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[c["id"] for c in WORLD2])
def test_pp2_parity(index, world2):
    check_pp_parity(WORLD2[index], [r["parity"][index] for r in world2])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[c["id"] for c in WORLD4])
def test_pp2_4ranks_parity(index, world4):
    check_pp_parity(WORLD4[index], [r["parity"][index] for r in world4])


def _index(cases: list[dict], case_id: str) -> int:
    return next(i for i, c in enumerate(cases) if c["id"] == case_id)


def test_stages_split_the_blocks_and_the_tied_head(world2):
    """Loop layout (1f1b): rank 0 has the embedding and blocks 0-1, rank 1 blocks 2-3 and the
    head (its own parameter, named lm_head.weight). V layout (zbv): rank 0 runs stages 0 and 3,
    so it holds the embedding AND the head, untied there (its own copy)."""
    one = [r["parity"][_index(WORLD2, "llama-1f1b")] for r in world2]
    assert [r["stages"] for r in one] == [[0], [1]]
    assert [r["held_blocks"] for r in one] == [[0, 1], [2, 3]]
    assert "model.embed_tokens.weight" in one[0]["params"] and "lm_head.weight" not in one[0]["params"]
    assert "lm_head.weight" in one[1]["params"] and "model.embed_tokens.weight" not in one[1]["params"]
    v = [r["parity"][_index(WORLD2, "llama-zbv")] for r in world2]
    assert [r["stages"] for r in v] == [[0, 3], [1, 2]]
    assert [r["held_blocks"] for r in v] == [[0, 3], [1, 2]]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(v[0]["params"])
    assert not v[0]["head_is_embedding"], "rank 0 of zbv holds one parameter for the head and the embedding"
    loop = [r["parity"][_index(WORLD2, "llama-interleaved_1f1b")] for r in world2]
    assert [r["stages"] for r in loop] == [[0, 2], [1, 3]]
    split = [r["parity"][_index(WORLD2, "llama-gpipe-split1")] for r in world2]
    assert [r["held_blocks"] for r in split] == [[0], [1, 2, 3]]


def test_pp_fsdp_shards_within_a_stage(world4):
    """pp=2 x fsdp2: the two ranks of a stage hold the same blocks and see different data."""
    results = [r["parity"][_index(WORLD4, "llama-1f1b-fsdp2")] for r in world4]
    by_stage: dict[int, list] = {}
    for r in results:
        by_stage.setdefault(r["pp_rank"], []).append(r)
    assert sorted(by_stage) == [0, 1]
    for ranks in by_stage.values():
        assert sorted(r["dp_rank"] for r in ranks) == [0, 1]
        assert ranks[0]["held_blocks"] == ranks[1]["held_blocks"]
        assert ranks[0]["raw_losses"] != ranks[1]["raw_losses"], "both data-parallel ranks trained on the same slice"


@pytest.mark.parametrize("schedule", ("1f1b", "gpipe"))
def test_pp_grad_sync_each_keeps_gradients_sharded(schedule, world4):
    """pp=2 x fsdp2, 4 microbatches: with pp_grad_sync='each' the gradient bytes a rank holds
    after every microbatch's backward (unsharded and sharded) are at most 1/dp + 5% of its
    stage's fp32 gradient bytes and every FSDP unit is resharded; with 'last' (torch's) the whole
    stage's gradients are held unsharded from the first microbatch on, and units stay gathered,
    which the same measures see (under 1F1B). Parity: test_pp2_4ranks_parity."""
    for mode in ("each", "last") if schedule == "1f1b" else ("each",):
        results = [r["parity"][_index(WORLD4, f"llama-{schedule}-fsdp2-{mode}")] for r in world4]
        for rank, result in enumerate(results):
            assert "error" not in result, f"rank {rank}: {result.get('error')}"
            assert result["grad_sync"] == mode
            ratios = result["grad_ratios"]
            assert len(ratios) >= 4 * 3, f"rank {rank}: {len(ratios)} microbatch backwards measured"
            gathered = result["gathered_units"]
            if mode == "each":
                assert max(ratios) <= 1 / 2 + 0.05, f"rank {rank} {mode}: held {max(ratios):.3f} of the stage's gradients"
                assert max(gathered) == 0, f"rank {rank} {mode}: FSDP units left gathered after a backward: {gathered}"
            else:
                assert max(ratios) >= 0.95, f"rank {rank} {mode}: held only {max(ratios):.3f} of the stage's gradients"
                assert min(gathered) > 0, f"rank {rank} {mode}: no FSDP unit kept gathered: {gathered}"


def test_pp_grad_sync_auto_keeps_torchs_default_on_the_cpu(world4):
    """'auto' (the default) picks 'each' only on a CUDA device short of memory: 'last' here."""
    for result in (r["parity"][_index(WORLD4, "llama-1f1b-fsdp2")] for r in world4):
        assert result["grad_sync"] == "last"


EXPECTED2 = {  # error -> words its message must hold
    "too_many_stages": ("HfScaleConfigError", "4 stages", "2 blocks"),
    "microbatches": ("HfScaleConfigError", "pp_microbatches=3", "8"),
    "split_out_of_range": ("HfScaleConfigError", "pp_split_points=[4]", "4 blocks"),
    "split_zero": ("HfScaleConfigError", "pp_split_points=[0]", "increasing"),
    "split_not_increasing": ("HfScaleConfigError", "pp_split_points=[2, 1, 3]", "increasing"),
    "split_count": ("HfScaleConfigError", "pp_split_points=[1, 2]", "1 split point"),
    "unknown_schedule": ("HfScaleConfigError", "'zb1p'", "'gpipe'", "'1f1b'", "'interleaved_1f1b'", "'zero_bubble'", "'zbv'"),
    "encoder": ("HfScaleConfigError", "BertForSequenceClassification", "not supported yet"),
    "seq2seq": ("HfScaleConfigError", "T5ForConditionalGeneration", "not supported yet"),
    "classifier": ("HfScaleConfigError", "LlamaForSequenceClassification", "not supported yet"),
    "no_labels": ("HfScaleConfigError", "labels"),
    "batch_by_global_rank": ("HfScaleConfigError", "different batches", "dp_rank"),
    "forward": ("HfScaleConfigError", "train_step", "eval_step"),
}
EXPECTED4 = {
    "ddp_dp2": ("HfScaleConfigError", "strategy='ddp'", "pp=2", "'fsdp'"),
    "zero1_dp2": ("HfScaleConfigError", "strategy='zero1'", "pp=2", "'fsdp'"),
    "microbatches_per_rank": ("HfScaleConfigError", "pp_microbatches=8", "4"),
}


def test_position_ids_reach_every_stage(world2):
    """Llama at pp=2 with arbitrary position ids: the pipeline's loss is one process's with them,
    which differs from one process's without them (so the check can tell). Every stage's blocks
    apply rotary embeddings at those positions: a stage that dropped them would use 0..S-1."""
    for result in world2:
        losses = result["position_ids"]
        assert losses["pp"] == pytest.approx(losses["reference"], rel=FP32_RTOL), losses
        # measured 6.7e-4 relative (q/k sharpened 30x): a stage that dropped the positions would
        # shift the loss by a share of that, far above the 1e-5 the pipeline is held to
        assert abs(losses["reference"] - losses["reference_without"]) > 20 * FP32_RTOL * losses["reference"]


@pytest.mark.parametrize("key", sorted(EXPECTED2))
def test_bad_input_2ranks(key, world2):
    """Every rank raises our error (a rank that went on into a collective would hang the spawn)."""
    for rank, result in enumerate(world2):
        for word in EXPECTED2[key]:
            assert word in result[key], f"rank {rank} {key}: {word!r} not in {result[key]!r}"


@pytest.mark.parametrize("key", sorted(EXPECTED4))
def test_bad_input_4ranks(key, world4):
    for rank, result in enumerate(world4):
        for word in EXPECTED4[key]:
            assert word in result[key], f"rank {rank} {key}: {word!r} not in {result[key]!r}"


# ---------------------------------------------------------------- the checks themselves (one process)

def test_the_batches_make_the_attention_mask_and_the_token_weighting_matter():
    """Without the mask the one-process losses move by far more than the tolerance (a stage
    that dropped it would fail), and the gradient of a loss averaged per microbatch (2
    microbatches) differs from that of the mean over the batch's label tokens by far more than
    the update tolerance (a schedule that averaged microbatch means would fail)."""
    import torch

    ref, unmasked = _reference("llama"), reference_run("llama", use_mask=False)
    assert max(abs(a - b) / a for a, b in zip(ref["losses"], unmasked["losses"])) > 100 * FP32_RTOL
    model = pp_checks.pp_model("llama")
    batch = pp_checks.batches()[0]
    halves = [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    assert pp_checks.label_tokens(halves[0]) > 1.2 * pp_checks.label_tokens(halves[1])
    grads = []
    for loss_of in (lambda: model(**batch).loss, lambda: sum(model(**h).loss for h in halves) / 2):
        model.zero_grad()
        loss_of().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) > 100 * UPDATE_RTOL


def _fake_results(ref: dict, moved: bool = True) -> list[dict]:
    """What two pp ranks of a 1f1b Llama would report if they matched the reference exactly."""
    source = ref["params"] if moved else ref["initial"]
    split = [[0, 1], [2, 3]]
    results = []
    for rank, blocks in enumerate(split):
        names = [n for n in source if _block_index(n) in blocks or (_block_index(n) is None and ("embed" in n) == (rank == 0))]
        results.append({"params": {n: source[n].numpy() for n in names}, "stages": [rank], "stage_blocks": split,
                        "held_blocks": blocks})
    return results


def test_parameter_check_passes_the_reference_and_fails_stale_or_misplaced_parameters():
    ref = _reference("llama")
    check_stage_parameters(ref, _fake_results(ref), UPDATE_RTOL)
    with pytest.raises(AssertionError, match="its update differs"):
        check_stage_parameters(ref, _fake_results(ref, moved=False), LOW_UPDATE_RTOL)
    wrong = _fake_results(ref)
    wrong[0]["params"]["model.layers.3.mlp.up_proj.weight"] = ref["params"]["model.layers.3.mlp.up_proj.weight"].numpy()
    with pytest.raises(AssertionError, match="not of its stages' blocks"):
        check_stage_parameters(ref, wrong, UPDATE_RTOL)
    missing = _fake_results(ref)
    del missing[1]["params"]["model.norm.weight"]
    with pytest.raises(AssertionError, match="no rank holds"):
        check_stage_parameters(ref, missing, UPDATE_RTOL)
