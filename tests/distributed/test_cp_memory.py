"""Context parallel memory: the activation bytes each rank saves for backward (a
``saved_tensors_hooks`` counter, parameters left out) at cp=2 and cp=4 against one process on the
same 1024-token sequence (a 4-layer Llama, grouped-query heads). With the attention in blocks
(cp_blocks: K / V gathered per layer and freed, no mask) everything a rank saves is its S/cp
part: the issue's bounds, 0.55x at cp=2 and 0.30x at cp=4, hold, and so does 1/cp within 2% (measured:
0.500x and 0.250x). The masked attention (cp_attention
"masked": the gathered K / V saved per layer) saves more, which is what the blocks remove. The
all-to-all exchange (cp_exchange "alltoall") is held to the same bounds.
See tests/distributed/cp_checks.py (SavedBytes)."""

from __future__ import annotations

import pytest

from tests.distributed.cp_checks import run_memory_cases, saved_bytes_one_process
from tests.harness import run_ranks

SEQ = 1024
CASES = [dict(seq=SEQ), dict(seq=SEQ, attention="masked"), dict(seq=SEQ, layout="contiguous"),
         dict(seq=SEQ, exchange="alltoall")]
BOUND = {2: 0.55, 4: 0.30}


@pytest.fixture(scope="module")
def one_process():
    return saved_bytes_one_process(SEQ)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def measured(request):
    results = run_ranks(run_memory_cases, request.param, CASES, timeout=600)
    return request.param, results


def test_saved_activations_fall_as_one_over_cp(measured, one_process):
    cp, ranks = measured
    for rank, cases in enumerate(ranks):
        blocks, masked, contiguous, alltoall = cases
        for case in cases:
            assert "error" not in case, case.get("error")
            assert abs(case["loss"] - one_process["loss"]) <= 1e-5 * one_process["loss"], (case, one_process)
        assert blocks["calls"]["masked"] == 0 and masked["calls"]["blocks"] == 0, (blocks, masked)
        assert alltoall["calls"]["alltoall"] > 0 == alltoall["calls"]["blocks"] + alltoall["calls"]["masked"], alltoall
        print(f"cp={cp} rank {rank}: saved for backward vs one process "
              + ", ".join(f"{n} {c['bytes'] / one_process['bytes']:.3f}x"
                          for n, c in (("blocks head_tail", blocks), ("blocks contiguous", contiguous),
                                       ("masked", masked), ("alltoall", alltoall))))
        for name, case in (("head_tail", blocks), ("contiguous", contiguous)):
            ratio = case["bytes"] / one_process["bytes"]
            assert ratio <= BOUND[cp], f"rank {rank} ({name}) saves {ratio:.3f}x of one process at cp={cp}"
            # sharper than the bound: nothing of the whole sequence's size is saved (the
            # gathered K / V of this model's 2 key heads kept for backward would add ~9% of 1/cp)
            assert ratio <= 1.02 / cp, f"rank {rank} ({name}) saves {ratio:.3f}x of one process, not 1/{cp}"
        # the all-to-all saves its heads' share of the whole sequence (the same bytes as every head
        # of S/cp) and, unlike the blocks, the output twice (in global order for the attention's
        # backward, in this rank's order for o_proj's): measured 0.523x at cp=2, 0.273x at cp=4
        ratio = alltoall["bytes"] / one_process["bytes"]
        assert ratio <= BOUND[cp] and ratio <= 1.1 / cp, f"rank {rank} (alltoall) saves {ratio:.3f}x at cp={cp}"
        # the masked path keeps the whole sequence's K / V per layer: more than the blocks
        assert masked["bytes"] > blocks["bytes"] * 1.1, (masked["bytes"], blocks["bytes"])
